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

// Elementwise with broadcasting. `linear_in`: the inputs the op is linear in, for Partial.
}  // namespace

namespace rule {

OpStrategy all(const Placement& p, std::size_t n_in, std::size_t n_out) {
  return {std::vector<Placement>(n_in, p), std::vector<Placement>(n_out, p)};
}

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

// Attention's strategy with its documents input placed as `placement`, when it has one.
OpStrategy documents(OpStrategy s, bool has, const Placement& placement) {
  if (has) s.inputs.push_back(placement);
  return s;
}

const std::map<std::string, Rule>& rules() {
  static const std::map<std::string, Rule> table = [] {
    std::map<std::string, Rule> r;

    // Attention: batch or heads sharded alike on q, k, v (and out, logsumexp). Or the query
    // rows (context parallelism, Llama 3's all-gather attention: Dubey et al. 2024, 3.3.2)
    // with k and v whole: each rank attends its rows to every key it may see (local_attrs
    // gives the kernel its rows' q_offset), and in the backward its dk, dv are partial sums.
    // Document ids (block_causal, a last input [b, t] laid out as k's rows) go with the batch,
    // and stay whole otherwise: every head and every query row may look up any key's document.
    r["sdpa"] = [](const Node& n, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t k) {
      const bool docs = in.size() == 4;
      Strategies s{all(R, in.size(), 2)};
      for (std::int64_t d : {0, 1}) {
        if (in[0][static_cast<std::size_t>(d)] >= k) s.push_back(documents(all(S(d), 3, 2), docs, d == 0 ? S(0) : R));
      }
      if (query_rows_split(n, in[0][2], k)) s.push_back(documents({{S(2), R, R}, {S(2), S(2)}}, docs, R));
      return s;
    };
    r["sdpa_backward"] = [](const Node& n, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t k) {
      const bool docs = in.size() == 7;
      Strategies s{all(R, in.size(), 3)};
      for (std::int64_t d : {0, 1}) {
        if (in[1][static_cast<std::size_t>(d)] >= k) s.push_back(documents(all(S(d), 6, 3), docs, d == 0 ? S(0) : R));
      }
      if (query_rows_split(n, in[1][2], k)) s.push_back(documents({{S(2), S(2), R, R, S(2), S(2)}, {S(2), P, P}}, docs, R));
      return s;
    };
    // Each row's ids count along the whole row: split on the batch only.
    r["document_ids"] = [](const Node&, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t k) {
      Strategies s{all(R, 1, 1)};
      if (in[0][0] >= k) s.push_back(all(S(0), 1, 1));
      return s;
    };
      for (std::size_t d = 0; d < in[0].size(); ++d) {
        if (in[0][d] >= k) s.push_back({{S(static_cast<std::int64_t>(d))}, {P}});
      }
      return s;
    };
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
