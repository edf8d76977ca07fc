// tensor_parallel: Megatron-LM tensor parallelism (Shoeybi et al. 2019) on the "tp" mesh dim,
// by torchtitan's parameter names. Column-parallel (weight [out, in] Shard(0)): attention
// wq, wk, wv, feed_forward w1, w3, mlp w1, the output layer. Row-parallel (Shard(1)):
// attention wo, feed_forward w2. The token embedding is sharded on its embedding dim
// (Shard(1)). Norm weights and batch inputs are replicated. Other mesh dims are left to other
// strategies.
#include <spmdx/plugin.h>

#include <stdexcept>

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

class TensorParallel final : public spmdx::Strategy {
 public:
  spmdx::PlacementMap place(const spmdx::StrategyInput& in) const override {
    int tp = -1;
    for (std::size_t i = 0; i < in.mesh.size(); ++i) {
      if (in.mesh[i].name == "tp") tp = static_cast<int>(i);
    }
    if (tp < 0) throw std::invalid_argument("tensor_parallel needs a mesh dim named tp (tensor_parallel_degree)");
    const std::int64_t k = in.mesh[static_cast<std::size_t>(tp)].size;
    spmdx::PlacementMap out;
    for (const auto& p : in.parameters) {
      std::vector<spmdx::Placement> pl(in.mesh.size(), spmdx::Placement::replicate());
      int dim = -1;
      for (const char* col : {"attention.wq.weight", "attention.wk.weight", "attention.wv.weight", "feed_forward.w1.weight",
                              "feed_forward.w3.weight"}) {
        if (ends_with(p.name, col)) dim = 0;
      }
      if (p.name == "w1.weight" || p.name == "output.weight") dim = 0;
      if (ends_with(p.name, "attention.wo.weight") || ends_with(p.name, "feed_forward.w2.weight")) dim = 1;
      if (p.name == "tok_embeddings.weight") dim = 1;
      if (dim >= 0) {
        if (static_cast<std::int64_t>(p.shape.size()) <= dim || p.shape[static_cast<std::size_t>(dim)] % k != 0) {
          throw std::invalid_argument("tensor_parallel: parameter '" + p.name + "' dim " + std::to_string(dim) + " (" +
                                      (static_cast<std::int64_t>(p.shape.size()) > dim ? std::to_string(p.shape[static_cast<std::size_t>(dim)]) : std::string("none")) +
                                      ") does not split evenly over tp=" + std::to_string(k) + ": pick a tensor_parallel_degree that divides it");
        }
        pl[static_cast<std::size_t>(tp)] = spmdx::Placement::shard(dim);
      }
      out[p.name] = pl;
    }
    return out;
  }
};

void register_tp(spmdx::Registrar& r) {
  r.add_strategy("tensor_parallel", [](const spmdx::Options&) { return std::make_unique<TensorParallel>(); });
}

}  // namespace

SPMDX_PLUGIN("tensor_parallel", strategy, "0.1.0",
             "Megatron tensor parallel on tp: q/k/v, w1, w3 column-parallel; wo, w2 row-parallel; embedding sharded",
             register_tp)
