// Runs the per-rank graphs of a DistributedPlan in one process, in lock step: local ops with
// the ATen kernels, collectives computed directly from the ranks' tensors. The harness that
// checks sharded graphs against one rank without any comm backend; also the helpers that cut
// a full tensor into a rank's shard and put shards back together.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "spmdx/exec/executor.h"
#include "spmdx/sharding/distribute.h"

namespace spmdx::exec {

/// The rank's local piece of `full`: Shard takes torch.chunk pieces (mesh dims applied in
/// order, nested), Replicate the whole, Partial(sum) the whole on coordinate 0 of that mesh dim
/// and zeros elsewhere (Partial(avg|max|min): the whole).
at::Tensor shard_tensor(const at::Tensor& full, const sharding::Placements& placements, const sharding::DeviceMesh& mesh,
                        const std::vector<std::int64_t>& coordinate);

/// The full tensor from every rank's local tensor (by rank): Shard concatenates, Replicate
/// takes coordinate 0, Partial reduces.
at::Tensor assemble_tensor(const std::vector<at::Tensor>& local_by_rank, const sharding::Placements& placements,
                           const sharding::DeviceMesh& mesh);

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
