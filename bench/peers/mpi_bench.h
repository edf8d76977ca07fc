// What bench/comm_peers.sh's Open MPI peers share: MPI_Init and the arguments (BYTES [ITERS]),
// and the timing spmdx bench comm uses for its own collectives (3 warm-up calls, a barrier,
// then the average over ITERS calls).
#pragma once

#include <mpi.h>

#include <chrono>
#include <cstdlib>

struct MpiBench {
  int rank = 0, ranks = 1;
  std::size_t bytes = 64u << 20;
  int iters = 10;

  MpiBench(int& argc, char**& argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &ranks);
    if (argc > 1) bytes = std::strtoull(argv[1], nullptr, 10);
    if (argc > 2) iters = std::atoi(argv[2]);
  }
  ~MpiBench() { MPI_Finalize(); }
  MpiBench(const MpiBench&) = delete;
  MpiBench& operator=(const MpiBench&) = delete;

  // Seconds per call of `collective`, after the warm-up.
  template <typename F>
  double seconds_per_call(F collective) const {
    for (int i = 0; i < 3; ++i) collective();
    MPI_Barrier(MPI_COMM_WORLD);
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) collective();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
  }
};
