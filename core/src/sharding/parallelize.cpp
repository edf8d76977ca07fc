#include "spmdx/sharding/parallelize.h"

#include <algorithm>

#include "spmdx/text.h"
#include <stdexcept>

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

}  // namespace

DeviceMesh make_mesh(const ParallelDims& d, std::int64_t world_size) {
  std::vector<MeshDim> dims;
  for (const auto& [name, size] : {std::pair<std::string, std::int64_t>{"dp_replicate", d.dp_replicate}, {"dp_shard", d.dp_shard}, {"cp", d.cp}, {"tp", d.tp}}) {
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

std::string strategy_for(const std::string& mesh_dim) {
  if (mesh_dim == "dp_replicate" || mesh_dim == "dp") return "data_parallel";
  if (mesh_dim == "dp_shard") return "fsdp";
  if (mesh_dim == "tp") return "tensor_parallel";
  throw std::invalid_argument("no strategy decides mesh dim '" + mesh_dim + "' (known: dp_replicate, dp_shard, tp)");
}

std::map<std::string, Placements> parallelize(PluginRegistry& registry, const DeviceMesh& mesh, const StrategyInput& in,
                                              const std::map<std::string, std::string>& strategies,
                                              const std::map<std::string, Options>& options) {
  std::map<std::string, Placements> out;
  for (const auto* list : {&in.parameters, &in.inputs}) {
    for (const auto& t : *list) out[t.name] = Placements(static_cast<std::size_t>(mesh.ndim()), Placement::replicate());
  }
  StrategyInput with_mesh = in;
  with_mesh.mesh = mesh.dims();
  for (int i = 0; i < mesh.ndim(); ++i) {
    if (mesh.size(i) == 1) continue;
    const std::string& dim = mesh.dims()[static_cast<std::size_t>(i)].name;
    if (dim == "cp") continue;  // context parallelism: everything Replicate; propagation shards the sequence (context_parallel_values)
    const auto chosen = strategies.find(dim);
    const std::string name = chosen != strategies.end() ? chosen->second : strategy_for(dim);
    const auto opts = options.find(name);
    with_mesh.mesh_dim = i;
    const PlacementMap placed = registry.make_strategy(name, opts == options.end() ? Options{} : opts->second)->place(with_mesh);
    for (const auto& [tensor, pl] : placed) {
      auto it = out.find(tensor);
      if (it == out.end()) {
        throw std::invalid_argument("strategy '" + name + "' places '" + tensor + "', which is neither a parameter nor an input; nearest: " +
                                    nearest(tensor, in));
      }
      if (static_cast<int>(pl.size()) != mesh.ndim()) {
        throw std::invalid_argument("strategy '" + name + "' gave " + std::to_string(pl.size()) + " placements for '" + tensor +
                                    "' on a mesh of " + std::to_string(mesh.ndim()) + " dims");
      }
      it->second[static_cast<std::size_t>(i)] = pl[static_cast<std::size_t>(i)];
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
      if (dim == "dp_shard" || dim == "dp_replicate" || dim == "dp") use[static_cast<std::size_t>(i)] = Placement::replicate();
    }
    out[name] = use;
  }
  return out;
}

}  // namespace spmdx::sharding
