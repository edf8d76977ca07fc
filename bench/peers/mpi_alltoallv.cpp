// Open MPI's MPI_Alltoallv on floats with even splits (each rank sends BYTES / N to every rank,
// itself included), timed as spmdx bench comm times its all_to_all_v (average over iterations
// after a warm-up), for bench/comm_peers.sh OP=all_to_all_v. Expert parallelism's dispatch is this
// exchange with split sizes learnt at run time (spmdx exchanges the counts first; here every
// rank knows them, which favours MPI). Prints "BYTES busbw_GBps" (nccl-tests' all_to_all bus
// bandwidth: BYTES / time x (N - 1) / N).
// Usage: mpirun -np N bench_mpi_alltoallv BYTES [ITERS]
#include <cstdio>
#include <vector>

#include "mpi_bench.h"

int main(int argc, char** argv) {
  const MpiBench b(argc, argv);
  const int n = b.ranks, each = static_cast<int>(b.bytes / 4 / static_cast<std::size_t>(n));
  std::vector<float> in(static_cast<std::size_t>(each) * static_cast<std::size_t>(n), 1.0f), out(in.size());
  std::vector<int> counts(static_cast<std::size_t>(n), each), displs(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) displs[static_cast<std::size_t>(i)] = i * each;
  const double seconds = b.seconds_per_call([&] {
    MPI_Alltoallv(in.data(), counts.data(), displs.data(), MPI_FLOAT, out.data(), counts.data(), displs.data(), MPI_FLOAT, MPI_COMM_WORLD);
  });
  if (b.rank == 0) std::printf("%zu %.3f\n", b.bytes, static_cast<double>(each) * 4.0 * n / seconds / 1e9 * (n - 1) / n);
  return 0;
}
