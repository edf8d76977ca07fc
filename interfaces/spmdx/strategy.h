// Sharding strategy plugins: decide the placements of parameters and inputs on a DeviceMesh.
//
// A strategy only decides where parameters and batch inputs live; the core propagates
// placements through every other value of the train-step graph and inserts collectives
// (docs/DESIGN.md: PlacementStrategy -> sharding propagation -> Rewriter).
// Plain C++20: part of the plugin ABI.
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

/// What a tensor is to the model, so that a strategy places by kind instead of matching names
/// (ABI 4.0). The host finds a parameter's role from the forward op that reads it, whatever
/// the model calls it (torchtitan's "tok_embeddings.weight", Hugging Face's
/// "model.embed_tokens.weight", an imported program's "p_embed_weight").
enum class TensorRole : std::uint32_t {
  unknown = 0,          ///< a parameter of none of the kinds below (a bias added by hand, a scale)
  embedding = 1,        ///< read by an embedding lookup (token or position table); a table the
                        ///< output projection reads too (tied weights) is `embedding`
  output = 2,           ///< the output projection's weight or bias: the linear that makes the logits
  norm = 3,             ///< a normalization's weight or bias (rms_norm, layer_norm)
  linear = 4,           ///< any other linear layer's (matmul's) weight or bias
  optimizer_state = 5,  ///< an optimizer state tensor (AdamW's exp_avg, exp_avg_sq). Not passed
                        ///< today: the host places each parameter's state as the parameter
  input = 6,            ///< a batch input (tokens, labels)
};

/// "unknown", "embedding", "output", "norm", "linear", "optimizer_state", "input"; "?" for a
/// value outside the enum.
inline const char* to_string(TensorRole role) noexcept {
  switch (role) {
    case TensorRole::unknown: return "unknown";
    case TensorRole::embedding: return "embedding";
    case TensorRole::output: return "output";
    case TensorRole::norm: return "norm";
    case TensorRole::linear: return "linear";
    case TensorRole::optimizer_state: return "optimizer_state";
    case TensorRole::input: return "input";
  }
  return "?";
}

/// A named tensor the strategy places: a parameter ("layers.0.attention.wq.weight") or a
/// batch input ("tokens"), with its global shape in elements and its role.
struct TensorInfo {
  std::string name;
  std::vector<std::int64_t> shape;
  TensorRole role = TensorRole::unknown;  ///< ABI 4.0
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

/// A strategy plugin registers a factory (plugin.h's Registrar::add_strategy) that takes
/// Options: the config binds a strategy to a mesh dim as "name" or "name:key=value;key=value"
/// ([parallelism.strategies] dp_shard = "fsdp_except_embeddings:keep=embedding"), and the
/// factory gets those keys. A factory throws std::invalid_argument for a key it does not take
/// or a value it cannot use, naming the key and what it takes.
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
