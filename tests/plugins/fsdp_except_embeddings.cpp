// fsdp_except_embeddings: a third party's strategy, written against interfaces/ alone (the
// 40-line plugin of issue 44): FSDP, except that the parameters of the roles in option `keep`
// stay whole. It places by TensorInfo::role, never by a parameter's name, so it serves
// torchtitan's and Hugging Face's names alike.
//   [parallelism.strategies] dp_shard = "fsdp_except_embeddings"                  (keep=embedding,output)
//   --parallelism.strategies.dp_shard "fsdp_except_embeddings:keep=embedding"
//   --parallelism.strategies.dp_shard "fsdp_except_embeddings:keep="            (fsdp itself)
#include <spmdx/plugin.h>

#include <set>
#include <sstream>
#include <stdexcept>

namespace {

using spmdx::TensorRole;

std::set<TensorRole> roles_of(const std::string& list) {
  std::set<TensorRole> out;
  std::stringstream items(list);
  for (std::string item; std::getline(items, item, ',');) {
    bool found = false;
    for (auto r : {TensorRole::unknown, TensorRole::embedding, TensorRole::output, TensorRole::norm, TensorRole::linear}) {
      if (item == spmdx::to_string(r)) out.insert(r), found = true;
    }
    if (!found) throw std::invalid_argument("fsdp_except_embeddings: keep=" + list + ": '" + item + "' is no parameter role (embedding, output, norm, linear, unknown)");
  }
  return out;
}

class FsdpExcept final : public spmdx::Strategy {
 public:
  explicit FsdpExcept(std::set<TensorRole> keep) : keep_(std::move(keep)) {}

  spmdx::PlacementMap place(const spmdx::StrategyInput& in) const override {
    const auto dim = static_cast<std::size_t>(in.mesh_dim);
    const std::int64_t k = in.mesh.at(dim).size;
    spmdx::PlacementMap out;  // a tensor left out is Replicate
    auto shard0 = [&](const std::string& name) {
      out[name] = std::vector<spmdx::Placement>(in.mesh.size(), spmdx::Placement::replicate());
      out[name][dim] = spmdx::Placement::shard(0);
    };
    for (const auto& p : in.parameters) {
      if (keep_.count(p.role) == 0 && !p.shape.empty() && p.shape[0] >= k) shard0(p.name);  // as fsdp: fewer rows than ranks stay whole
    }
    for (const auto& t : in.inputs) {
      if (t.shape.empty() || t.shape[0] % k != 0) throw std::invalid_argument("fsdp_except_embeddings: the batch of '" + t.name + "' does not split over " + in.mesh[dim].name);
      shard0(t.name);
    }
    return out;
  }

 private:
  std::set<TensorRole> keep_;
};

void register_it(spmdx::Registrar& r) {
  r.add_strategy("fsdp_except_embeddings", [](const spmdx::Options& options) {
    for (const auto& [key, value] : options) {
      if (key != "keep") throw std::invalid_argument("fsdp_except_embeddings: no option '" + key + "'; it takes keep=<roles, comma-separated>");
    }
    const auto keep = options.find("keep");
    return std::make_unique<FsdpExcept>(roles_of(keep == options.end() ? "embedding,output" : keep->second));
  });
}

}  // namespace

SPMDX_PLUGIN("fsdp_except_embeddings", strategy, "0.1.0", "FSDP except the parameters of the roles in option keep (embedding,output)", register_it)
