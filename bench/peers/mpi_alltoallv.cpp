// Open MPI's MPI_Alltoallv on floats with even splits (each rank sends BYTES / N to every rank,
// itself included), timed as spmdx bench comm times its all_to_all_v (average over iterations
// after a warm-up), for bench/comm_peers.sh OP=all_to_all_v. Expert parallelism's dispatch is this
// exchange with split sizes learnt at run time (spmdx exchanges the counts first; here every
// rank knows them, which favours MPI). Prints "BYTES busbw_GBps" (nccl-tests' all_to_all bus
// bandwidth: BYTES / time x (N - 1) / N).
// Usage: mpirun -np N bench_mpi_alltoallv BYTES [ITERS]
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
  const int each = static_cast<int>(bytes / 4 / static_cast<std::size_t>(n));
  std::vector<float> in(static_cast<std::size_t>(each) * static_cast<std::size_t>(n), 1.0f), out(in.size());
  std::vector<int> counts(static_cast<std::size_t>(n), each), displs(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) displs[static_cast<std::size_t>(i)] = i * each;
  auto exchange = [&] {
    MPI_Alltoallv(in.data(), counts.data(), displs.data(), MPI_FLOAT, out.data(), counts.data(), displs.data(), MPI_FLOAT, MPI_COMM_WORLD);
  };
  for (int i = 0; i < 3; ++i) exchange();
  MPI_Barrier(MPI_COMM_WORLD);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) exchange();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
  if (rank == 0) std::printf("%zu %.3f\n", bytes, static_cast<double>(each) * 4.0 * n / seconds / 1e9 * (n - 1) / n);
  MPI_Finalize();
  return 0;
}
