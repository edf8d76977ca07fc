// Runs the per-rank graphs of a DistributedPlan in one process, in lock step: local ops with
// the ATen kernels, collectives computed directly from the ranks' tensors. The harness that
// checks sharded graphs against one rank without any comm backend.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "spmdx/exec/executor.h"
#include "spmdx/exec/shards.h"
#include "spmdx/sharding/rewriter.h"

namespace spmdx::exec {

class SimulatedRun {
 public:
  /// One graph per rank, as rank_graph() makes them. Throws std::invalid_argument when the
  /// graphs' op sequences differ, or an op has no kernel.
  SimulatedRun(const sharding::DeviceMesh& mesh, std::vector<ir::Graph> graphs);

  /// One input map per rank; returns one output map per rank.
  std::vector<TensorMap> run(const std::vector<TensorMap>& inputs);

  const ir::Graph& graph(std::int64_t rank) const { return graphs_.at(static_cast<std::size_t>(rank)); }

 private:
  sharding::DeviceMesh mesh_;
  std::vector<ir::Graph> graphs_;
};

}  // namespace spmdx::exec
