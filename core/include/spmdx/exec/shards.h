// Shards: cutting a full tensor into a rank's piece by its placements on a DeviceMesh, and
// putting the pieces of every rank back together (DTensor's distribute_tensor and
// full_tensor). Used to start a run, to reshard checkpoints and by the simulated harness.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "spmdx/sharding/redistribute.h"

namespace spmdx::exec {

/// The rank's local piece of `full`: Shard takes torch.chunk pieces (mesh dims applied in
/// order, nested), Replicate the whole, Partial(sum) the whole on coordinate 0 of that mesh dim
/// and zeros elsewhere (Partial(avg|max|min): the whole). A shard is contiguous and owns its
/// storage (a copy, not a view that would keep `full`'s bytes alive); Replicate returns `full`.
at::Tensor shard_tensor(const at::Tensor& full, const sharding::Placements& placements, const sharding::DeviceMesh& mesh,
                        const std::vector<std::int64_t>& coordinate);

/// The full tensor from every rank's local tensor (by rank): Shard concatenates, Replicate
/// takes coordinate 0, Partial reduces.
at::Tensor assemble_tensor(const std::vector<at::Tensor>& local_by_rank, const sharding::Placements& placements,
                           const sharding::DeviceMesh& mesh);

/// The elementwise reduction of `xs` (all one shape) by "sum", "avg", "max", "min" or "prod",
/// as a Partial's reduce op; a new tensor. Throws std::invalid_argument for another op.
at::Tensor reduce_tensors(const std::vector<at::Tensor>& xs, const std::string& op);

/// Where chunk `index` starts: the sum of sizes[0 .. index).
std::int64_t chunk_offset(const std::vector<std::int64_t>& sizes, std::int64_t index);

}  // namespace spmdx::exec
