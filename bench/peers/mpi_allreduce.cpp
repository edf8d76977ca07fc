// Open MPI's MPI_Allreduce on float sums, timed as spmdx bench comm times its own (average over
// iterations after a warm-up, in place), for bench/comm_peers.sh. Prints "BYTES busbw_GBps".
// Usage: mpirun -np N bench_mpi_allreduce BYTES [ITERS]
#include <cstdio>
#include <vector>

#include "mpi_bench.h"

int main(int argc, char** argv) {
  const MpiBench b(argc, argv);
  std::vector<float> buf(b.bytes / 4, 1.0f);
  const double seconds = b.seconds_per_call([&] { MPI_Allreduce(MPI_IN_PLACE, buf.data(), static_cast<int>(buf.size()), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); });
  if (b.rank == 0) std::printf("%zu %.3f\n", b.bytes, static_cast<double>(b.bytes) / seconds / 1e9 * 2.0 * (b.ranks - 1) / b.ranks);
  return 0;
}
