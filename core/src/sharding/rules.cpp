// Sharding rules: each op's strategies, defined next to its record (core/src/ops/, through
// define_rules), and the builders those records share (sharding::rule). Notation: R =
// Replicate, S(d) = Shard(d), P = Partial(sum). A rule is valid when running the op on each
// rank's local inputs gives each rank's local output.
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
  auto d = defined().find(node.op());
  if (d == defined().end()) throw ir::IrError("no sharding rule for op '" + node.op() + "' (node %" + std::to_string(node.id()) + ")");
  return d->second.rule(node, in, out, k);
}

}  // namespace spmdx::sharding

namespace spmdx::sharding {

ir::Attributes local_attrs(const ir::Node& node, const std::vector<Shape>& local_out, std::int64_t column_offset) {
  if (auto d = defined().find(node.op()); d != defined().end() && d->second.local_attrs) return d->second.local_attrs(node, local_out, column_offset);
  return node.attrs();
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
