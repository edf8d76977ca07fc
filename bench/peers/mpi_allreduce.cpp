// Open MPI's MPI_Allreduce on float sums, timed as spmdx bench comm times its own (average over
// iterations after a warm-up, in place), for bench/comm_peers.sh. Prints "BYTES busbw_GBps".
// Usage: mpirun -np N bench_mpi_allreduce BYTES [ITERS]
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, n = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  const std::size_t bytes = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : (64u << 20);
  const int iters = argc > 2 ? std::atoi(argv[2]) : 10;
  std::vector<float> buf(bytes / 4, 1.0f);
  for (int i = 0; i < 3; ++i) MPI_Allreduce(MPI_IN_PLACE, buf.data(), static_cast<int>(buf.size()), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  MPI_Barrier(MPI_COMM_WORLD);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) MPI_Allreduce(MPI_IN_PLACE, buf.data(), static_cast<int>(buf.size()), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
  if (rank == 0) std::printf("%zu %.3f\n", bytes, static_cast<double>(bytes) / seconds / 1e9 * 2.0 * (n - 1) / n);
  MPI_Finalize();
  return 0;
}
