#include "spmdx/sharding/parallelize.h"

#include <algorithm>
#include <stdexcept>

#include "spmdx/ir/graph.h"
#include "spmdx/ir/tensor_meta.h"
#include "spmdx/text.h"

namespace spmdx::sharding {
namespace {


std::string nearest(const std::string& name, const StrategyInput& in) {
  std::vector<std::pair<std::size_t, std::string>> all;
  for (const auto* list : {&in.parameters, &in.inputs}) {
    for (const auto& t : *list) all.emplace_back(edit_distance(name, t.name), t.name);
  }
  std::sort(all.begin(), all.end());
  std::string out;
  for (std::size_t i = 0; i < all.size() && i < 3; ++i) out += (i ? ", " : "") + all[i].second;
  return out;
}

// "strategy 'fsdp' (plugin fsdp 0.2.0, /path/libfsdp.so)": who answered, for messages.
std::string who(PluginRegistry& registry, const std::string& name) {
  const PluginInfo& plugin = registry.strategy_plugin(name);
  return "strategy '" + name + "' (plugin " + plugin.name + " " + plugin.version + ", " + plugin.path.string() + ")";
}

// What a strategy plugin returned for one tensor on the mesh dim it decides, checked at the
// host boundary: a plugin's Shard(5) on a 2-D weight would otherwise fail deep in the
// propagation with an index error that names no plugin, tensor or mesh dim.
void check_placement(const std::string& by, const TensorInfo& t, const DeviceMesh& mesh, int i, const Placement& p) {
  const auto rank = static_cast<int>(t.shape.size());
  if (p.is_replicate() || (p.is_shard() && p.dim() >= 0 && p.dim() < rank)) return;
  const std::string allowed = rank == 0 ? "Replicate() only (a scalar has no dim to shard)"
                                        : "Replicate() or Shard(dim) with dim in 0.." + std::to_string(rank - 1);
  const std::string what = p.is_partial() ? p.repr() + ", a pending reduction (the core makes those; a strategy places a whole tensor)"
                                          : p.repr() + " on a " + std::to_string(rank) + "-D tensor";
  throw std::invalid_argument(by + " placed '" + t.name + "' (shape " + ir::shape_str(t.shape) + ") " + what + " on mesh dim " + std::to_string(i) + " '" +
                              mesh.dims()[static_cast<std::size_t>(i)].name + "' (size " + std::to_string(mesh.size(i)) + "); allowed there: " +
                              allowed + ". Fix the strategy plugin, or bind another strategy to that dim ([parallelism.strategies])");
}

}  // namespace

DeviceMesh make_mesh(const ParallelDims& d, std::int64_t world_size) {
  std::vector<MeshDim> dims;
  const bool carved = d.ep > 1 && d.ep < d.dp_shard;
  if (carved && d.dp_shard % d.ep != 0) {
    throw std::invalid_argument("expert_parallel_degree (" + std::to_string(d.ep) + ") must divide data_parallel_shard_degree (" + std::to_string(d.dp_shard) + ")");
  }
  for (const auto& [name, size] : {std::pair<std::string, std::int64_t>{"dp_replicate", d.dp_replicate}, {"efsdp", carved ? d.dp_shard / d.ep : 1},
                                   {"dp_shard", carved ? d.ep : d.dp_shard}, {"cp", d.cp}, {"tp", d.tp}}) {
    if (size < 1) throw std::invalid_argument("parallelism degree " + name + " is " + std::to_string(size) + ", must be >= 1");
    if (size > 1) dims.push_back({name, size});
  }
  if (dims.empty()) dims.push_back({"dp_replicate", 1});
  std::int64_t product = 1;
  for (const auto& m : dims) product *= m.size;
  if (product != world_size) {
    throw std::invalid_argument("data_parallel_replicate_degree (" + std::to_string(d.dp_replicate) + ") x data_parallel_shard_degree (" +
                                std::to_string(d.dp_shard) + ") x " + (d.cp > 1 ? "context_parallel_degree (" + std::to_string(d.cp) + ") x " : std::string()) +
                                "tensor_parallel_degree (" + std::to_string(d.tp) + ") = " +
                                std::to_string(product) + ", but world_size is " + std::to_string(world_size) +
                                ": make their product equal the number of ranks");
  }
  return DeviceMesh(dims, world_size);
}

namespace {

// Ops a parameter or the logits pass through unchanged in kind (mixed precision's cast, a tied
// table's transpose, the logits flattened for the loss).
bool passes_through(const std::string& op) { return op == "cast" || op == "reshape" || op == "transpose" || op == "permute"; }

// Whether `v` is the logits: read by the loss (cross_entropy, or loss parallelism's row
// statistics and pick) or returned as "logits", maybe through passes_through ops.
bool is_logits(const ir::Graph& graph, const ir::Value* v) {
  for (const auto& [name, out] : graph.outputs()) {
    if (out == v && name == "logits") return true;
  }
  for (const ir::Use& use : v->uses()) {
    const std::string& op = use.user->op();
    if (op == "cross_entropy" || op == "amax_rows" || op == "sum_exp_rows" || op == "pick") return true;
    if (passes_through(op) && is_logits(graph, use.user->output(0))) return true;
  }
  return false;
}

// The role `v` (a parameter, or a value passed through from one) gets from its readers; the
// strongest wins: embedding, output, norm, linear.
int role_rank(TensorRole r) {
  switch (r) {
    case TensorRole::embedding: return 4;
    case TensorRole::output: return 3;
    case TensorRole::norm: return 2;
    case TensorRole::linear: return 1;
    default: return 0;
  }
}

TensorRole role_of(const ir::Graph& graph, const ir::Value* v) {
  TensorRole best = TensorRole::unknown;
  auto take = [&](TensorRole r) {
    if (role_rank(r) > role_rank(best)) best = r;
  };
  for (const ir::Use& use : v->uses()) {
    const std::string& op = use.user->op();
    if (passes_through(op)) take(role_of(graph, use.user->output(0)));
    else if (op == "embedding" && use.input_index == 0) take(TensorRole::embedding);
    else if (op == "rms_norm" || op == "layer_norm") take(TensorRole::norm);
    else if (op == "linear" || op == "matmul") take(is_logits(graph, use.user->output(0)) ? TensorRole::output : TensorRole::linear);
  }
  return best;
}

}  // namespace

std::map<std::string, TensorRole> parameter_roles(const ir::Graph& graph, const std::vector<std::string>& parameters) {
  std::map<std::string, TensorRole> out;
  for (const auto& name : parameters) {
    const ir::Value* v = graph.find_input(name);
    out[name] = v == nullptr ? TensorRole::unknown : role_of(graph, v);
  }
  return out;
}

std::string strategy_for(const std::string& mesh_dim) {
  if (mesh_dim == "dp_replicate" || mesh_dim == "dp") return "data_parallel";
  if (mesh_dim == "dp_shard" || mesh_dim == "efsdp") return "fsdp";
  if (mesh_dim == "tp") return "tensor_parallel";
  throw std::invalid_argument("no strategy decides mesh dim '" + mesh_dim + "' (known: dp_replicate, dp_shard, efsdp, tp)");
}

std::map<std::string, Placements> parallelize(PluginRegistry& registry, const DeviceMesh& mesh, const StrategyInput& in,
                                              const std::map<std::string, std::string>& strategies,
                                              const std::map<std::string, Options>& options, std::vector<std::string>* decided_by) {
  if (decided_by != nullptr) decided_by->clear();
  auto decided = [&](int i, const std::string& what) {
    if (decided_by != nullptr) {
      decided_by->push_back("mesh dim " + mesh.dims()[static_cast<std::size_t>(i)].name + " (" + std::to_string(mesh.size(i)) + "): " + what);
    }
  };
  std::map<std::string, Placements> out;
  std::map<std::string, const TensorInfo*> infos;
  for (const auto* list : {&in.parameters, &in.inputs}) {
    for (const auto& t : *list) {
      out[t.name] = Placements(static_cast<std::size_t>(mesh.ndim()), Placement::replicate());
      infos[t.name] = &t;
    }
  }
  StrategyInput with_mesh = in;
  with_mesh.mesh = mesh.dims();
  for (int i = 0; i < mesh.ndim(); ++i) {
    if (mesh.size(i) == 1) {
      decided(i, "one rank, nothing to place");
      continue;
    }
    const std::string& dim = mesh.dims()[static_cast<std::size_t>(i)].name;
    if (dim == "cp") {  // context parallelism: everything Replicate; propagation shards the sequence (context_parallel_values)
      decided(i, "spmdx itself (context parallelism: parameters and inputs Replicate, the sequence split by the core)");
      continue;
    }
    const auto chosen = strategies.find(dim);
    PluginSpec spec = parse_plugin_spec(chosen != strategies.end() ? chosen->second : strategy_for(dim), "[parallelism.strategies] " + dim);
    const std::string& name = spec.name;
    if (const auto opts = options.find(name); opts != options.end()) spec.options.insert(opts->second.begin(), opts->second.end());  // the spec's own win
    with_mesh.mesh_dim = i;
    const PlacementMap placed = registry.make_strategy(name, spec.options)->place(with_mesh);
    const std::string by = who(registry, name);
    decided(i, by);
    for (const auto& [tensor, pl] : placed) {
      auto it = out.find(tensor);
      if (it == out.end()) {
        throw std::invalid_argument("strategy '" + name + "' places '" + tensor + "', which is neither a parameter nor an input; nearest: " +
                                    nearest(tensor, in));
      }
      if (static_cast<int>(pl.size()) != mesh.ndim()) {
        throw std::invalid_argument(by + " gave " + std::to_string(pl.size()) + " placements for '" + tensor + "' on the mesh " +
                                    mesh.str() + " of " + std::to_string(mesh.ndim()) + " dims, deciding mesh dim " + std::to_string(i) + " '" + dim +
                                    "': give one Placement per mesh dim (StrategyInput::mesh)");
      }
      const Placement& p = pl[static_cast<std::size_t>(i)];
      check_placement(by, *infos.at(tensor), mesh, i, p);
      it->second[static_cast<std::size_t>(i)] = p;
    }
  }
  // Two mesh dims sharding one tensor dim nest (the outer dim's shard is a block of the inner
  // dim's shards), so using the tensor whole along the outer dim takes an all_gather on both
  // and a re-chunk. FSDP's shard of a TP-sharded parameter moves to another tensor dim when
  // there is one (DTensor solves the same with _StridedShard): one all_gather then.
  for (const auto& t : in.parameters) {
    Placements& pl = out.at(t.name);
    for (int i = 0; i < mesh.ndim(); ++i) {
      const Placement p = pl[static_cast<std::size_t>(i)];
      if (!p.is_shard() || mesh.dims()[static_cast<std::size_t>(i)].name != "dp_shard") continue;
      bool nested = false;
      for (int j = 0; j < mesh.ndim(); ++j) nested |= j != i && pl[static_cast<std::size_t>(j)].is_shard() && pl[static_cast<std::size_t>(j)].dim() == p.dim();
      if (!nested) continue;
      for (int e = 0; e < static_cast<int>(t.shape.size()); ++e) {
        bool taken = false;
        for (const auto& q : pl) taken |= q.is_shard() && q.dim() == e;
        if (!taken && t.shape[static_cast<std::size_t>(e)] >= mesh.size(i)) {
          pl[static_cast<std::size_t>(i)] = Placement::shard(e);
          break;
        }
      }
    }
  }
  return out;
}

std::map<std::string, Placements> use_placements(const DeviceMesh& mesh, const std::map<std::string, Placements>& params) {
  std::map<std::string, Placements> out;
  for (const auto& [name, pl] : params) {
    Placements use = pl;
    for (int i = 0; i < mesh.ndim(); ++i) {
      const std::string& dim = mesh.dims()[static_cast<std::size_t>(i)].name;
      if (dim == "dp_shard" || dim == "efsdp" || dim == "dp_replicate" || dim == "dp") use[static_cast<std::size_t>(i)] = Placement::replicate();
    }
    out[name] = use;
  }
  return out;
}

}  // namespace spmdx::sharding
