// The rule table. Notation: R = Replicate, S(d) = Shard(d), P = Partial(sum). A rule is valid
// when running the op on each rank's local inputs gives each rank's local output.
#include "spmdx/sharding/rules.h"
#include "spmdx/sharding/spec.h"

#include <functional>
#include <map>
#include <set>
#include <stdexcept>
#include <string>

namespace spmdx::sharding {
namespace {

using ir::Node;
using Strategies = std::vector<OpStrategy>;

const Placement R = Placement::replicate();
const Placement P = Placement::partial(ReduceOp::sum);
Placement S(std::int64_t d) { return Placement::shard(static_cast<int>(d)); }

std::int64_t wrap(std::int64_t d, std::size_t rank) { return d < 0 ? d + static_cast<std::int64_t>(rank) : d; }

OpStrategy all(const Placement& p, std::size_t n_in, std::size_t n_out) {
  return {std::vector<Placement>(n_in, p), std::vector<Placement>(n_out, p)};
}

// Elementwise with broadcasting. `linear_in`: the inputs the op is linear in, for Partial.
}  // namespace

namespace rule {

Strategies pointwise(const std::vector<Shape>& in, const std::vector<Shape>& out, std::int64_t k,
                     const std::vector<std::vector<bool>>& partial_patterns) {
  Strategies s{all(R, in.size(), out.size())};
  const Shape& o = out[0];
  for (std::size_t d = 0; d < o.size(); ++d) {
    if (o[d] < k) continue;
    OpStrategy st{{}, std::vector<Placement>(out.size(), S(static_cast<std::int64_t>(d)))};
    for (const Shape& x : in) {
      const auto aligned = static_cast<std::int64_t>(d) - static_cast<std::int64_t>(o.size() - x.size());
      if (aligned < 0 || x[static_cast<std::size_t>(aligned)] == 1) st.inputs.push_back(R);
      else st.inputs.push_back(S(aligned));
    }
    s.push_back(st);
  }
  for (const auto& pattern : partial_patterns) {  // true: Partial input, false: Replicate
    OpStrategy st{{}, std::vector<Placement>(out.size(), P)};
    for (bool p : pattern) st.inputs.push_back(p ? P : R);
    s.push_back(st);
  }
  return s;
}

Rule nonlinear() {
  return [](const Node&, const auto& in, const auto& out, std::int64_t k) { return pointwise(in, out, k, {}); };
}
Rule linear_unary() {
  return [](const Node&, const auto& in, const auto& out, std::int64_t k) { return pointwise(in, out, k, {{true}}); };
}
// (grad, saved) -> grad_in, linear in grad.
Rule linear_in_first() {
  return [](const Node&, const auto& in, const auto& out, std::int64_t k) {
    std::vector<bool> pattern(in.size(), false);
    pattern[0] = true;
    return pointwise(in, out, k, {pattern});
  };
}

// Strategies that shard dim d of every input and output alike, for each d not in `avoid`.
Strategies same_dim(const std::vector<Shape>& in, const std::vector<Shape>& out, std::int64_t k, const std::set<std::int64_t>& avoid,
                    std::size_t rank) {
  Strategies s{all(R, in.size(), out.size())};
  for (std::size_t d = 0; d < rank; ++d) {
    if (avoid.count(static_cast<std::int64_t>(d)) || out[0][d] < k) continue;
    s.push_back(all(S(static_cast<std::int64_t>(d)), in.size(), out.size()));
  }
  return s;
}

}  // namespace rule

namespace {

using namespace rule;

// Whether attention's query rows (`rows` of them as this mesh dim sees q) may be split k ways:
// evenly, and for a load-balanced sequence (chunks > 1) in whole pieces.
bool query_rows_split(const Node& n, std::int64_t rows, std::int64_t k) {
  if (rows < k) return false;
  const std::int64_t chunks = n.attr_int("chunks");
  if (chunks == 1) return true;
  const std::int64_t piece = n.input(n.op() == "sdpa" ? 1 : 2)->meta().shape[2] / chunks;
  return rows % k == 0 && (rows / k) % piece == 0;
}

const std::map<std::string, Rule>& rules() {
  static const std::map<std::string, Rule> table = [] {
    std::map<std::string, Rule> r;
    r["add"] = r["sub"] = [](const Node&, const auto& in, const auto& out, std::int64_t k) {
      return pointwise(in, out, k, {{true, true}});
    };
    r["mul"] = [](const Node&, const auto& in, const auto& out, std::int64_t k) {
      return pointwise(in, out, k, {{true, false}, {false, true}});
    };
    r["div"] = [](const Node&, const auto& in, const auto& out, std::int64_t k) { return pointwise(in, out, k, {{true, false}}); };
    for (const char* op : {"add_scalar", "pow_scalar",
                           "rdiv_scalar", "clamp_max_scalar", "rpow_scalar", "ones_like"}) {
      r[op] = nonlinear();
    }
    // cast is linear up to rounding: a Partial sum stays one (as DTensor's to(dtype)).
    for (const char* op : {"mul_scalar", "zeros_like", "cast"}) r[op] = linear_unary();
    for (const char* op : {"relu_backward", "silu_backward", "gelu_backward"}) r[op] = linear_in_first();

    auto reduction = [](bool mean) {
      return [mean](const Node& n, const std::vector<Shape>& in, const std::vector<Shape>& out, std::int64_t k) {
        Strategies s{all(R, 1, 1)};
        const Shape& x = in[0];
        std::set<std::int64_t> reduced;
        for (auto d : n.attr_ints("dims")) reduced.insert(wrap(d, x.size()));
        if (reduced.empty()) {
          for (std::size_t d = 0; d < x.size(); ++d) reduced.insert(static_cast<std::int64_t>(d));
        }
        const bool keep = n.attr_bool("keepdim");
        std::int64_t out_dim = 0;
        for (std::size_t d = 0; d < x.size(); ++d) {
          const bool is_reduced = reduced.count(static_cast<std::int64_t>(d)) > 0;
          if (x[d] >= k) {
            if (!is_reduced) s.push_back({{S(static_cast<std::int64_t>(d))}, {S(out_dim)}});
            else if (!mean) s.push_back({{S(static_cast<std::int64_t>(d))}, {P}});
            else if (x[d] % k == 0) s.push_back({{S(static_cast<std::int64_t>(d))}, {Placement::partial(ReduceOp::avg)}});
          }
          if (!is_reduced || keep) ++out_dim;
        }
        (void)out;
        s.push_back({{P}, {P}});
        return s;
      };
    };
    r["sum"] = reduction(false);
    r["mean"] = reduction(true);
    auto softmax_rule = [](const Node& n, const std::vector<Shape>& in, const std::vector<Shape>& out, std::int64_t k) {
      return same_dim(in, out, k, {wrap(n.attr_int("dim"), in[0].size())}, in[0].size());
    };
    r["softmax"] = r["log_softmax"] = softmax_rule;
    r["softmax_backward"] = r["log_softmax_backward"] = [softmax_rule](const Node& n, const auto& in, const auto& out, std::int64_t k) {
      Strategies s = softmax_rule(n, in, out, k);
      s.push_back({{P, R}, {P}});
      return s;
    };
    r["matmul"] = [](const Node&, const std::vector<Shape>& in, const std::vector<Shape>& out, std::int64_t k) {
      const Shape &a = in[0], &b = in[1], &o = out[0];
      const auto ra = static_cast<std::int64_t>(a.size()), rb = static_cast<std::int64_t>(b.size()), ro = static_cast<std::int64_t>(o.size());
      Strategies s{all(R, 2, 1)};
      for (std::int64_t d = 0; d < ro - 2; ++d) {  // batch dims
        if (o[static_cast<std::size_t>(d)] < k) continue;
        auto align = [&](const Shape& x, std::int64_t rx) -> Placement {
          const std::int64_t ad = d - (ro - rx);
          return ad < 0 || x[static_cast<std::size_t>(ad)] == 1 ? R : S(ad);
        };
        s.push_back({{align(a, ra), align(b, rb)}, {S(d)}});
      }
      if (a[static_cast<std::size_t>(ra - 2)] >= k) s.push_back({{S(ra - 2), R}, {S(ro - 2)}});
      if (b[static_cast<std::size_t>(rb - 1)] >= k) s.push_back({{R, S(rb - 1)}, {S(ro - 1)}});
      if (a[static_cast<std::size_t>(ra - 1)] >= k) s.push_back({{S(ra - 1), S(rb - 2)}, {P}});
      s.push_back({{P, R}, {P}});
      s.push_back({{R, P}, {P}});
      return s;
    };
    r["linear"] = [](const Node&, const std::vector<Shape>& in, const std::vector<Shape>& out, std::int64_t k) {
      const Shape &x = in[0], &w = in[1];
      const auto rx = static_cast<std::int64_t>(x.size());
      Strategies s{all(R, 2, 1)};
      for (std::int64_t d = 0; d < rx - 1; ++d) {
        if (x[static_cast<std::size_t>(d)] >= k) s.push_back({{S(d), R}, {S(d)}});
      }
      if (w[0] >= k) s.push_back({{R, S(0)}, {S(rx - 1)}});                     // column parallel
      if (w[1] >= k) s.push_back({{S(rx - 1), S(1)}, {P}});                     // row parallel
      s.push_back({{P, R}, {P}});
      (void)out;
      return s;
    };
    r["sum_to"] = [](const Node&, const std::vector<Shape>& in, const std::vector<Shape>& out, std::int64_t k) {
      Strategies s{all(R, 1, 1)};
      const Shape &x = in[0], &o = out[0];
      for (std::size_t d = 0; d < x.size(); ++d) {
        if (x[d] < k) continue;
        const auto od = static_cast<std::int64_t>(d) - static_cast<std::int64_t>(x.size() - o.size());
        if (od >= 0 && o[static_cast<std::size_t>(od)] == x[d]) s.push_back({{S(static_cast<std::int64_t>(d))}, {S(od)}});
        else s.push_back({{S(static_cast<std::int64_t>(d))}, {P}});  // summed away
      }
      s.push_back({{P}, {P}});
      return s;
    };
    // Norms over the last dim: shard any other dim; weights replicated; weight grads partial.
    r["rms_norm"] = r["layer_norm"] = [](const Node&, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t k) {
      Strategies s{all(R, in.size(), 1)};
      for (std::size_t d = 0; d + 1 < in[0].size(); ++d) {
        if (in[0][d] < k) continue;
        OpStrategy st{std::vector<Placement>(in.size(), R), {S(static_cast<std::int64_t>(d))}};
        st.inputs[0] = S(static_cast<std::int64_t>(d));
        s.push_back(st);
      }
      return s;
    };
    r["rms_norm_backward"] = r["layer_norm_backward"] = [](const Node&, const std::vector<Shape>& in, const std::vector<Shape>& out, std::int64_t k) {
      Strategies s{all(R, in.size(), out.size())};
      for (std::size_t d = 0; d + 1 < in[1].size(); ++d) {
        if (in[1][d] < k) continue;
        OpStrategy st{std::vector<Placement>(in.size(), R), std::vector<Placement>(out.size(), P)};
        st.inputs[0] = st.inputs[1] = st.outputs[0] = S(static_cast<std::int64_t>(d));
        s.push_back(st);
      }
      OpStrategy partial{std::vector<Placement>(in.size(), R), std::vector<Placement>(out.size(), P)};
      partial.inputs[0] = P;  // linear in the incoming gradient
      s.push_back(partial);
      return s;
    };
    // Attention: batch or heads sharded alike on q, k, v (and out, logsumexp). Or the query
    // rows (context parallelism, Llama 3's all-gather attention: Dubey et al. 2024, 3.3.2)
    // with k and v whole: each rank attends its rows to every key it may see (local_attrs
    // gives the kernel its rows' q_offset), and in the backward its dk, dv are partial sums.
    r["sdpa"] = [](const Node& n, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t k) {
      Strategies s{all(R, 3, 2)};
      for (std::int64_t d : {0, 1}) {
        if (in[0][static_cast<std::size_t>(d)] >= k) s.push_back(all(S(d), 3, 2));
      }
      if (query_rows_split(n, in[0][2], k)) s.push_back({{S(2), R, R}, {S(2), S(2)}});
      return s;
    };
    r["sdpa_backward"] = [](const Node& n, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t k) {
      Strategies s{all(R, 6, 3)};
      for (std::int64_t d : {0, 1}) {
        if (in[1][static_cast<std::size_t>(d)] >= k) s.push_back(all(S(d), 6, 3));
      }
      if (query_rows_split(n, in[1][2], k)) s.push_back({{S(2), S(2), R, R, S(2), S(2)}, {S(2), P, P}});
      return s;
    };
    // g^T x summed over the leading dims: a leading dim split alike gives partial sums; g's
    // last dim split gives rows of the result, x's its columns.
    r["linear_weight_grad"] = [](const Node&, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t k) {
      const std::size_t last = in[0].size() - 1;
      Strategies s{all(R, 2, 1)};
      for (std::size_t d = 0; d < last; ++d) {
        if (in[0][d] >= k) s.push_back({{S(static_cast<std::int64_t>(d)), S(static_cast<std::int64_t>(d))}, {P}});
      }
      if (in[0][last] >= k) s.push_back({{S(static_cast<std::int64_t>(last)), R}, {S(0)}});
      if (in[1][last] >= k) s.push_back({{R, S(static_cast<std::int64_t>(last))}, {S(1)}});
      s.push_back({{P, R}, {P}});
      s.push_back({{R, P}, {P}});
      return s;
    };
    // Sums over tokens split across ranks are partial sums; a mean is not (kept replicated).
    r["cross_entropy"] = [](const Node& n, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t k) {
      Strategies s{all(R, 2, 1)};
      if (n.attr_string("reduction") == "sum" && in[0][0] >= k) s.push_back({{S(0), S(0)}, {P}});
      return s;
    };
    r["cross_entropy_backward"] = [](const Node& n, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t k) {
      Strategies s{all(R, 3, 1)};
      if (n.attr_string("reduction") == "sum") {
        if (in[1][0] >= k) s.push_back({{R, S(0), S(0)}, {S(0)}});
        s.push_back({{P, R, R}, {P}});
      }
      return s;
    };
    // Vocabulary-parallel cross entropy: the classes split across ranks give partial maxima,
    // partial sums of exp and partial picks (a rank's pick is 0 where the target is another's).
    r["amax_rows"] = [](const Node&, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t k) {
      Strategies s{all(R, 1, 1)};
      if (in[0][0] >= k) s.push_back({{S(0)}, {S(0)}});
      if (in[0][1] >= k) s.push_back({{S(1)}, {Placement::partial(ReduceOp::max)}});
      return s;
    };
    r["sum_exp_rows"] = [](const Node&, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t k) {
      Strategies s{all(R, 2, 1)};
      if (in[0][0] >= k) s.push_back({{S(0), S(0)}, {S(0)}});
      if (in[0][1] >= k) s.push_back({{S(1), R}, {P}});
      return s;
    };
    r["sum_exp_rows_backward"] = [](const Node&, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t k) {
      Strategies s{all(R, 3, 1)};
      if (in[1][1] >= k) s.push_back({{R, S(1), R}, {S(1)}});  // first: at equal cost, the columns the logits have
      if (in[1][0] >= k) s.push_back({{S(0), S(0), S(0)}, {S(0)}});
      s.push_back({{P, R, R}, {P}});
      return s;
    };
    r["pick"] = [](const Node&, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t k) {
      Strategies s{all(R, 2, 1)};
      if (in[0][0] >= k) s.push_back({{S(0), S(0)}, {S(0)}});
      if (in[0][1] >= k) s.push_back({{S(1), R}, {P}});
      s.push_back({{P, R}, {P}});
      return s;
    };
    r["pick_backward"] = [](const Node&, const std::vector<Shape>& in, const std::vector<Shape>& out, std::int64_t k) {
      Strategies s{all(R, 2, 1)};
      if (out[0][1] >= k) s.push_back({{R, R}, {S(1)}});  // first: at equal cost, the columns the logits' gradient has
      if (in[0][0] >= k) s.push_back({{S(0), S(0)}, {S(0)}});
      s.push_back({{P, R}, {P}});
      return s;
    };
    r["valid_rows"] = [](const Node&, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t k) {
      Strategies s{all(R, 1, 1)};
      if (in[0][0] >= k) s.push_back({{S(0)}, {S(0)}});
      return s;
    };
    r["count_valid"] = [](const Node&, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t k) {
      Strategies s{all(R, 1, 1)};
      for (std::size_t d = 0; d < in[0].size(); ++d) {
        if (in[0][d] >= k) s.push_back({{S(static_cast<std::int64_t>(d))}, {P}});
      }
      return s;
    };
    r["adamw"] = [](const Node&, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t k) {
      Strategies s{all(R, in.size(), 3)};
      for (std::size_t d = 0; d < in[0].size(); ++d) {
        if (in[0][d] < k) continue;
        const Placement sd = S(static_cast<std::int64_t>(d));
        std::vector<Placement> inputs{sd, sd, sd, sd};
        inputs.resize(in.size(), R);  // lr, step, found_inf: replicated scalars
        s.push_back({inputs, {sd, sd, sd}});
      }
      return s;
    };
    // Any non-finite element of a replicated value (the global gradient norm).
    r["found_inf"] = [](const Node&, const std::vector<Shape>&, const std::vector<Shape>&, std::int64_t) { return Strategies{all(R, 1, 1)}; };
    return r;
  }();
  return table;
}

}  // namespace

namespace {

struct Defined {
  Rule rule;
  LocalAttrsFn local_attrs;
};

// The rules core/src/ops/ defines next to each op's record (at load time: function-local).
std::map<std::string, Defined>& defined() {
  static std::map<std::string, Defined> table;
  return table;
}

}  // namespace

void define_rules(const std::string& op, Rule rule, LocalAttrsFn local_attrs) {
  if (!defined().emplace(op, Defined{std::move(rule), std::move(local_attrs)}).second) throw std::invalid_argument("sharding rules for op '" + op + "' defined twice");
}

std::vector<OpStrategy> op_strategies(const ir::Node& node, const std::vector<Shape>& in, const std::vector<Shape>& out,
                                      std::int64_t k) {
  if (auto d = defined().find(node.op()); d != defined().end()) return d->second.rule(node, in, out, k);
  auto it = rules().find(node.op());
  if (it == rules().end()) throw ir::IrError("no sharding rule for op '" + node.op() + "' (node %" + std::to_string(node.id()) + ")");
  return it->second(node, in, out, k);
}

}  // namespace spmdx::sharding

namespace spmdx::sharding {

ir::Attributes local_attrs(const ir::Node& node, const std::vector<Shape>& local_out, std::int64_t column_offset) {
  if (auto d = defined().find(node.op()); d != defined().end() && d->second.local_attrs) return d->second.local_attrs(node, local_out, column_offset);
  ir::Attributes a = node.attrs();
  const std::string& op = node.op();
  if (op == "sum_to") a["shape"] = local_out.at(0);
  if (op == "pick_backward") a["num_classes"] = local_out.at(0).at(1);
  if (op == "pick" || op == "pick_backward") a["offset"] = node.attr_int("offset") + column_offset;
  if (op == "sdpa" || op == "sdpa_backward") a["q_offset"] = node.attr_int("q_offset") + column_offset;
  return a;
}

std::int64_t column_offset_of(const ir::Node& node, const DeviceMesh& mesh, const std::vector<Placement>& logits, const std::vector<std::int64_t>& coordinate) {
  if (node.op() == "sdpa" || node.op() == "sdpa_backward") {  // out and dq are placed as q: its first row
    return ShardingSpec{logits, node.output()->meta()}.local_offset(mesh, coordinate).at(2);
  }
  if (node.op() != "pick" && node.op() != "pick_backward") return 0;
  const ir::Value* v = node.op() == "pick" ? node.input(0) : node.output();
  return ShardingSpec{logits, v->meta()}.local_offset(mesh, coordinate).at(1);
}

}  // namespace spmdx::sharding
