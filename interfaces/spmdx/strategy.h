// Sharding strategy plugins: decide the placements of parameters and inputs on a DeviceMesh.
//
// A strategy only decides where parameters and batch inputs live; the core propagates
// placements through every other value of the train-step graph and inserts collectives
// (docs/DESIGN.md: PlacementStrategy -> sharding propagation -> Rewriter).
// Plain C++17: part of the plugin ABI.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "spmdx/placement.h"

namespace spmdx {

/// One dimension of a DeviceMesh: its name ("dp_replicate", "dp_shard", "tp", ...) and size
/// in ranks. The mesh is row-major: the last dim varies fastest across ranks.
struct MeshDim {
  std::string name;
  std::int64_t size = 1;
};

/// A named tensor the strategy places: a parameter ("layers.0.attention.wq.weight") or a
/// batch input ("tokens"), with its global shape in elements.
struct TensorInfo {
  std::string name;
  std::vector<std::int64_t> shape;
};

struct StrategyInput {
  std::vector<MeshDim> mesh;
  std::vector<TensorInfo> parameters;
  std::vector<TensorInfo> inputs;
  /// The index in `mesh` of the dim this strategy decides. The host binds one strategy to
  /// each mesh dim of size > 1 (the config's [parallelism.strategies], e.g. tp =
  /// "tensor_parallel"; defaults: dp_replicate data_parallel, dp_shard fsdp, tp
  /// tensor_parallel), calls place() once per such dim, and keeps from each tensor's
  /// placements only the entry at mesh_dim. A strategy decides by this index, never by a
  /// dim's name.
  int mesh_dim = 0;
};

/// Tensor name -> one Placement per mesh dim, in the order of StrategyInput::mesh.
using PlacementMap = std::map<std::string, std::vector<Placement>>;

class Strategy {
 public:
  virtual ~Strategy() = default;

  /// Placements for the parameters and inputs of `in`; a tensor left out of the result is
  /// Replicate on every mesh dim. Pure: the same input gives the same map.
  /// Throws std::invalid_argument naming the tensor, the mesh dim and what to change when the
  /// mesh cannot hold the tensors this way (for example a dim that must split evenly).
  virtual PlacementMap place(const StrategyInput& in) const = 0;
};

}  // namespace spmdx
