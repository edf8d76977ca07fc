// From torchtitan's parallelism degrees to a DeviceMesh and the placements of every parameter
// and input, by asking one strategy plugin per mesh dim:
//   dp_replicate (data_parallel_replicate_degree) -> data_parallel   (DDP)
//   dp_shard     (data_parallel_shard_degree)     -> fsdp            (FSDP2 / ZeRO-3)
//   tp           (tensor_parallel_degree)         -> tensor_parallel (Megatron)
// Each strategy decides its own mesh dim; the core propagates the rest (propagate.h).
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "spmdx/core/registry.h"
#include "spmdx/sharding/mesh.h"
#include "spmdx/sharding/redistribute.h"

namespace spmdx::sharding {

struct ParallelDims {
  std::int64_t dp_replicate = 1;
  std::int64_t dp_shard = 1;
  std::int64_t tp = 1;
  std::int64_t cp = 1;  ///< context parallelism (train/context_parallel.h): placed by the core, no plugin; the mesh puts it before tp
};

/// The mesh [dp_replicate, dp_shard, cp, tp] (torchtitan's order), row-major (tp innermost: neighbouring ranks, the
/// fast local path), keeping the dims of size > 1 ("dp_replicate" of size 1 when all are 1).
/// Throws std::invalid_argument when a degree is < 1 or their product is not world_size.
DeviceMesh make_mesh(const ParallelDims& dims, std::int64_t world_size);

/// The strategy plugin that decides each mesh dim (by the names above); throws
/// std::invalid_argument for a dim of another name.
std::string strategy_for(const std::string& mesh_dim);

/// Runs each mesh dim's strategy (loaded through `registry`) on `in` and takes, for every
/// tensor and mesh dim, the placement that dim's strategy gave. `strategies` names another
/// strategy plugin for a mesh dim (a third party's, say); `options` gives a strategy its
/// options by strategy name (tensor_parallel's plan). Throws std::invalid_argument when a
/// strategy places a tensor that is not in `in` (the message lists the nearest names),
/// PluginError for an unknown strategy, and whatever a strategy throws.
std::map<std::string, Placements> parallelize(PluginRegistry& registry, const DeviceMesh& mesh, const StrategyInput& in,
                                              const std::map<std::string, std::string>& strategies = {},
                                              const std::map<std::string, Options>& options = {});

/// The placements parameters are used in (propagate()'s `use`), one entry per parameter:
/// Replicate on the data-parallel mesh dims (dp_replicate, dp_shard), where a shard is for
/// storage only (FSDP gathers a parameter before use and frees it after); unchanged on the
/// others (tp shards are computed on).
std::map<std::string, Placements> use_placements(const DeviceMesh& mesh, const std::map<std::string, Placements>& params);

}  // namespace spmdx::sharding
