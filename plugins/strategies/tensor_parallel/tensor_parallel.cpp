// tensor_parallel: Megatron-LM tensor parallelism (Shoeybi et al. 2019) on the mesh dim the host
// binds it to (StrategyInput::mesh_dim; "tp" by default),
// by a plan over parameter names, as DTensor's parallelize_module takes one (ColwiseParallel,
// RowwiseParallel) and torchtitan's parallelize plans write it.
//
// Options (the config's [parallelism.tp_plan]): parameter glob -> style. A glob matches a
// whole parameter name, `*` any run of characters (dots too), `?` one. Styles:
//   colwise    Linear weight [out, in] Shard(0), its bias [out] Shard(0)  (ColwiseParallel)
//   rowwise    Linear weight [out, in] Shard(1), its bias Replicate       (RowwiseParallel)
//   replicate  Replicate
//   shard(d)   Shard(d): an embedding table [num, dim] is shard(1) (ColwiseParallel on
//              nn.Embedding shards the embedding dim)
// Of the globs that match a parameter, the longest (the most specific) decides it; a glob that
// matches nothing is an error, as is a dim that does not split evenly. Without options the built-in plan covers torchtitan's Llama names (attention
// wq, wk, wv, feed_forward w1, w3 and output colwise; wo, w2 rowwise; tok_embeddings shard(1)),
// Hugging Face's Llama names (q_proj, k_proj, v_proj, gate_proj, up_proj, lm_head colwise;
// o_proj, down_proj rowwise; embed_tokens shard(1)), Phi-3's fused qkv_proj and gate_up_proj
// (colwise), GPT-2's Conv1D (c_attn, c_fc column-parallel as shard(1), biases shard(0); c_proj
// row-parallel as shard(0); the wte and wpe tables shard(1)) and the built-in mlp. Norm weights and
// batch inputs are replicated; other mesh dims are left to other strategies.
#include <spmdx/plugin.h>

#include <stdexcept>
#include <utility>
#include <vector>

namespace {

// fnmatch without FNM_PATHNAME: '*' matches any run, '?' one character.
bool glob_match(const char* p, const char* s) {
  for (; *p != '\0'; ++p, ++s) {
    if (*p == '*') {
      for (const char* t = s;; ++t) {
        if (glob_match(p + 1, t)) return true;
        if (*t == '\0') return false;
      }
    }
    if (*s == '\0' || (*p != '?' && *p != *s)) return false;
  }
  return *s == '\0';
}

using Plan = std::vector<std::pair<std::string, std::string>>;  // glob -> style

const Plan& builtin_plan() {
  static const Plan plan = {
      // torchtitan's Llama 3 and the built-in mlp
      {"*attention.wq.weight", "colwise"}, {"*attention.wk.weight", "colwise"}, {"*attention.wv.weight", "colwise"},
      {"*attention.wo.weight", "rowwise"}, {"*feed_forward.w1.weight", "colwise"}, {"*feed_forward.w3.weight", "colwise"},
      {"*feed_forward.w2.weight", "rowwise"}, {"w1.weight", "colwise"}, {"output.weight", "colwise"}, {"tok_embeddings.weight", "shard(1)"},
      // Hugging Face's Llama
      {"*self_attn.q_proj.weight", "colwise"}, {"*self_attn.k_proj.weight", "colwise"}, {"*self_attn.v_proj.weight", "colwise"},
      {"*self_attn.o_proj.weight", "rowwise"}, {"*mlp.gate_proj.weight", "colwise"}, {"*mlp.up_proj.weight", "colwise"},
      {"*mlp.down_proj.weight", "rowwise"}, {"*lm_head.weight", "colwise"}, {"*embed_tokens.weight", "shard(1)"},
      // Hugging Face's fused projections (Phi-3: qkv_proj, gate_up_proj; q/k/v split after the shard)
      {"*self_attn.qkv_proj.weight", "colwise"}, {"*mlp.gate_up_proj.weight", "colwise"},
      // Hugging Face's GPT-2: Conv1D weights are [in, out], so column-parallel is shard(1) of the
      // weight and shard(0) of its bias, row-parallel shard(0) (Megatron's split)
      {"*attn.c_attn.weight", "shard(1)"}, {"*attn.c_attn.bias", "shard(0)"}, {"*attn.c_proj.weight", "shard(0)"},
      {"*mlp.c_fc.weight", "shard(1)"}, {"*mlp.c_fc.bias", "shard(0)"}, {"*mlp.c_proj.weight", "shard(0)"},
      {"*transformer.wte.weight", "shard(1)"}, {"*transformer.wpe.weight", "shard(1)"}};  // token (tied to lm_head) and position tables
  return plan;
}

class TensorParallel final : public spmdx::Strategy {
 public:
  explicit TensorParallel(const spmdx::Options& options) {
    for (const auto& [glob, style] : options) {
      parse(glob, style, 1);  // checks the style now: a bad plan fails before any rank starts
      plan_.emplace_back(glob, style);
    }
  }

  spmdx::PlacementMap place(const spmdx::StrategyInput& in) const override {
    const int tp = in.mesh_dim;  // "tp" unless the config binds this strategy to another dim
    if (tp < 0 || tp >= static_cast<int>(in.mesh.size())) throw std::invalid_argument("tensor_parallel: mesh_dim " + std::to_string(tp) + " is not a dim of the mesh");
    const std::int64_t k = in.mesh[static_cast<std::size_t>(tp)].size;
    const bool given = !plan_.empty();
    const Plan& plan = given ? plan_ : builtin_plan();
    std::vector<bool> used(plan.size(), false);
    spmdx::PlacementMap out;
    bool any_sharded = false;
    for (const auto& p : in.parameters) {
      std::vector<spmdx::Placement> pl(in.mesh.size(), spmdx::Placement::replicate());
      std::size_t best = plan.size();
      for (std::size_t g = 0; g < plan.size(); ++g) {
        if (!glob_match(plan[g].first.c_str(), p.name.c_str())) continue;
        used[g] = true;
        if (best == plan.size() || plan[g].first.size() > plan[best].first.size()) best = g;
      }
      for (std::size_t g = best; g < plan.size(); g = plan.size()) {
        const int dim = parse(plan[g].first, plan[g].second, p.shape.size());
        if (dim >= 0) {
          if (static_cast<std::size_t>(dim) >= p.shape.size()) {
            throw std::invalid_argument("tensor_parallel: [parallelism.tp_plan] \"" + plan[g].first + "\" = \"" + plan[g].second + "\" shards dim " +
                                        std::to_string(dim) + " of parameter '" + p.name + "', which has " + std::to_string(p.shape.size()) + " dims");
          }
          if (p.shape[static_cast<std::size_t>(dim)] % k != 0) {
            throw std::invalid_argument("tensor_parallel: parameter '" + p.name + "' dim " + std::to_string(dim) + " (" + std::to_string(p.shape[static_cast<std::size_t>(dim)]) +
                                        ") does not split evenly over " + in.mesh[static_cast<std::size_t>(tp)].name + "=" + std::to_string(k) + ": pick a tensor_parallel_degree that divides it");
          }
          pl[static_cast<std::size_t>(tp)] = spmdx::Placement::shard(dim);
          any_sharded = true;
        }
      }
      out[p.name] = pl;
    }
    if (given) {
      for (std::size_t g = 0; g < plan.size(); ++g) {
        if (!used[g]) {
          std::string some;
          for (std::size_t i = 0; i < in.parameters.size() && i < 4; ++i) some += (i ? ", " : "") + in.parameters[i].name;
          throw std::invalid_argument("tensor_parallel: [parallelism.tp_plan] \"" + plan[g].first + "\" matches no parameter (they are named like " + some +
                                      "; `spmdx import MODEL.pt2` lists them all)");
        }
      }
    } else if (!any_sharded && !in.parameters.empty()) {
      throw std::invalid_argument("tensor_parallel: no parameter has a name of the built-in plan (torchtitan's or Hugging Face's Llama, e.g. '" + in.parameters[0].name +
                                  "' is not one): give the plan as [parallelism.tp_plan], parameter glob = \"colwise\" | \"rowwise\" | \"replicate\" | \"shard(d)\"");
    }
    return out;
  }

 private:
  // The tensor dim a style shards for a parameter of `rank` dims, -1 for Replicate.
  static int parse(const std::string& glob, const std::string& style, std::size_t rank) {
    if (style == "colwise") return 0;
    if (style == "rowwise") return rank >= 2 ? 1 : -1;  // a row-parallel bias is added after the reduction: replicated
    if (style == "replicate") return -1;
    if (style.size() > 7 && style.compare(0, 6, "shard(") == 0 && style.back() == ')') {
      const std::string d = style.substr(6, style.size() - 7);
      if (!d.empty() && d.find_first_not_of("0123456789") == std::string::npos) return std::stoi(d);
    }
    throw std::invalid_argument("tensor_parallel: [parallelism.tp_plan] \"" + glob + "\" = \"" + style +
                                "\": the style must be \"colwise\", \"rowwise\", \"replicate\" or \"shard(d)\"");
  }

  Plan plan_;
};

void register_tp(spmdx::Registrar& r) {
  r.add_strategy("tensor_parallel", [](const spmdx::Options& options) { return std::make_unique<TensorParallel>(options); });
}

}  // namespace

SPMDX_PLUGIN("tensor_parallel", strategy, "0.3.0",
             "Megatron tensor parallel on its mesh dim (tp) by a plan of parameter globs ([parallelism.tp_plan]); built in: torchtitan's and Hugging Face's Llama names",
             register_tp)
