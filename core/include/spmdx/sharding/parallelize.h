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
#include <vector>

#include "spmdx/core/registry.h"
#include "spmdx/sharding/mesh.h"
#include "spmdx/sharding/redistribute.h"

namespace spmdx::sharding {

struct ParallelDims {
  std::int64_t dp_replicate = 1;
  std::int64_t dp_shard = 1;
  std::int64_t tp = 1;
  std::int64_t cp = 1;  ///< context parallelism (train/context_parallel.h): placed by the core, no plugin; the mesh puts it before tp
  /// Expert parallelism carved from dp_shard (torchtitan's ep with efsdp = dp_shard / ep > 1):
  /// when 1 < ep < dp_shard the mesh holds dp_shard as two dims, "efsdp" (dp_shard / ep, outer)
  /// and "dp_shard" (ep, inner), the experts Shard(0) over the inner and FSDP-sharded over the
  /// outer, the dense parameters FSDP-sharded over both. 1 (or dp_shard): one dp_shard dim.
  std::int64_t ep = 1;
};

/// The mesh [dp_replicate, dp_shard, cp, tp] (torchtitan's order; dp_shard as [efsdp, dp_shard]
/// when ParallelDims::ep carves expert parallelism from part of it), row-major (tp innermost: neighbouring ranks, the
/// fast local path), keeping the dims of size > 1 ("dp_replicate" of size 1 when all are 1).
/// Throws std::invalid_argument when a degree is < 1 or their product is not world_size.
DeviceMesh make_mesh(const ParallelDims& dims, std::int64_t world_size);

/// Each parameter's role (TensorRole, for StrategyInput's TensorInfo) from the ops of `graph`
/// that read it, through casts, reshapes and transposes: an embedding lookup's table
/// `embedding`; the weight or bias of the linear (matmul) whose result is the logits (read by
/// the loss, or the graph output "logits") `output`; a normalization's `norm`; another
/// linear's `linear`; else `unknown`. A table an embedding and the output both read (tied
/// weights) is `embedding`. Parameters not in the graph are `unknown`.
std::map<std::string, TensorRole> parameter_roles(const ir::Graph& graph, const std::vector<std::string>& parameters);

/// The strategy plugin that decides each mesh dim (by the names above); throws
/// std::invalid_argument for a dim of another name.
std::string strategy_for(const std::string& mesh_dim);

/// Runs each mesh dim's strategy (loaded through `registry`) on `in` and takes, for every
/// tensor and mesh dim, the placement that dim's strategy gave. `strategies` names another
/// strategy plugin for a mesh dim (a third party's, say), as "name" or with options
/// "name:key=value;key=value" (parse_plugin_spec); `options` gives a strategy more options by
/// strategy name (tensor_parallel's plan), under those of the spec. Throws std::invalid_argument when a
/// strategy places a tensor that is not in `in` (the message lists the nearest names),
/// PluginError for an unknown strategy, and whatever a strategy throws.
/// Every answer is checked at this boundary: one Placement per mesh dim, and on the dim the
/// strategy decides Replicate or Shard(d) of a dim the tensor has; anything else throws
/// std::invalid_argument naming the strategy and its plugin (name, version, file), the tensor
/// and the mesh dim, and what is allowed there.
/// `decided_by`, when given, gets one line per mesh dim saying who placed it:
/// "mesh dim tp (2): strategy 'tensor_parallel' (plugin tensor_parallel 0.3.0, /path/libspmdx_tensor_parallel.so)".
std::map<std::string, Placements> parallelize(PluginRegistry& registry, const DeviceMesh& mesh, const StrategyInput& in,
                                              const std::map<std::string, std::string>& strategies = {},
                                              const std::map<std::string, Options>& options = {},
                                              std::vector<std::string>* decided_by = nullptr);

/// The placements parameters are used in (propagate()'s `use`), one entry per parameter:
/// Replicate on the data-parallel mesh dims (dp_replicate, dp_shard), where a shard is for
/// storage only (FSDP gathers a parameter before use and frees it after); unchanged on the
/// others (tp shards are computed on).
std::map<std::string, Placements> use_placements(const DeviceMesh& mesh, const std::map<std::string, Placements>& params);

}  // namespace spmdx::sharding
