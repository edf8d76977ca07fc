// `spmdx bench comm`: one rank's part of a collective benchmark in the style of nccl-tests
// (Jeaugey et al., NVIDIA): for each size, the average time of an operation, its algorithm
// bandwidth (bytes / time) and bus bandwidth (algbw times the factor that makes it comparable
// to the link's speed: all_reduce 2(n-1)/n, all_gather, reduce_scatter and all_to_all
// (n-1)/n, broadcast 1), out-of-place and in-place, with every result checked.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "spmdx/comm.h"

namespace spmdx::comm {

struct BenchOptions {
  std::string op = "all_reduce";  ///< all_reduce | all_gather | reduce_scatter | all_to_all | broadcast
  std::uint64_t min_bytes = 8;
  std::uint64_t max_bytes = 64ull << 20;
  int iters = 20;
  int warmup = 5;
  double timeout_seconds = 300;
  /// When not null, rank 0 appends each size's (bytes of the full result, out-of-place
  /// seconds per operation): what `spmdx bench comm --calibrate` fits alpha and beta to.
  std::vector<std::pair<double, double>>* times = nullptr;
};

/// Runs the sweep on this rank (every rank calls it with the same options); rank 0 prints the
/// table to stdout. Returns the number of wrong results (0 when all were right). Throws
/// std::invalid_argument for an unknown op, and CommError when a collective fails.
std::int64_t run_comm_bench(CommBackend& backend, int rank, int world_size, const BenchOptions& options);


}  // namespace spmdx::comm
