// Sharding rules: for each IR op, the input -> output placement combinations that compute the
// right result locally on one mesh dim (as DTensor's op strategies). Every rule is checked
// against full tensors by tests/sharding_rules_test.cpp.
#pragma once

#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "spmdx/ir/graph.h"
#include "spmdx/placement.h"
#include "spmdx/sharding/spec.h"

namespace spmdx::sharding {

using Shape = std::vector<std::int64_t>;

/// Run the op locally with these input placements and its outputs have these placements.
struct OpStrategy {
  std::vector<Placement> inputs;
  std::vector<Placement> outputs;
};

/// The valid strategies of `node` on one mesh dim of `k` ranks; `in` and `out` are the shapes
/// that mesh dim sees (global shapes after the shards of the mesh dims before it). The first
/// entry is always all-Replicate; sharded strategies follow, partial ones last. A dim is
/// sharded only when it has at least k elements; ops that change shape (reshape) shard only
/// where the split is even. Throws ir::IrError for an op without rules.
std::vector<OpStrategy> op_strategies(const ir::Node& node, const std::vector<Shape>& in, const std::vector<Shape>& out,
                                      std::int64_t k);

/// An op's sharding rule: op_strategies for its nodes.
using Rule = std::function<std::vector<OpStrategy>(const ir::Node& node, const std::vector<Shape>& in, const std::vector<Shape>& out, std::int64_t k)>;
/// An op's attributes for a rank computing outputs of `local_out` shapes (local_attrs below),
/// for ops whose attributes spell out a shape or an offset.
using LocalAttrsFn = std::function<ir::Attributes(const ir::Node& node, const std::vector<Shape>& local_out, std::int64_t column_offset)>;

/// Registers an op's rule (and its local attributes, when they change with the shards), next
/// to its record in core/src/ops/. Throws std::invalid_argument when the op has one already.
void define_rules(const std::string& op, Rule rule, LocalAttrsFn local_attrs = nullptr);

/// Rule builders for the records in core/src/ops/ (R = Replicate, S(d) = Shard(d), P = Partial(sum)).
namespace rule {
/// Every input and output in placement p.
OpStrategy all(const Placement& p, std::size_t n_in, std::size_t n_out);
/// Elementwise with broadcasting: every output dim with >= k elements sharded alike on each
/// input that has it (Replicate where broadcast); plus, for each pattern (true: Partial input,
/// false: Replicate), all-Partial outputs: the op is linear in the Partial inputs.
std::vector<OpStrategy> pointwise(const std::vector<Shape>& in, const std::vector<Shape>& out, std::int64_t k,
                                  const std::vector<std::vector<bool>>& partial_patterns);
/// pointwise with no Partial strategy (a nonlinear op).
Rule nonlinear();
/// pointwise, and Partial in -> Partial out (a unary op linear in its input).
Rule linear_unary();
/// pointwise, and Partial out from a Partial first input (grad, saved...) -> linear in grad.
Rule linear_in_first();
/// All-Replicate, then every dim d < rank not in `avoid` with >= k elements sharded on every
/// input and output alike.
std::vector<OpStrategy> same_dim(const std::vector<Shape>& in, const std::vector<Shape>& out, std::int64_t k, const std::set<std::int64_t>& avoid,
                                 std::size_t rank);
}  // namespace rule

}  // namespace spmdx::sharding

namespace spmdx::sharding {

/// The node's attributes for a rank that computes outputs of `local_out` shapes: attributes
/// that spell out a shape (reshape, expand and sum_to "shape", slice_backward "input_shape",
/// embedding_backward "num_weights", pick_backward "num_classes") follow the local shapes;
/// pick's and pick_backward's "offset" grows by `column_offset`, the first class the rank's
/// columns of the logits hold (column_offset_of), and sdpa's and sdpa_backward's "q_offset" by
/// the first query row the rank holds; the others stay.
ir::Attributes local_attrs(const ir::Node& node, const std::vector<Shape>& local_out, std::int64_t column_offset = 0);

/// For pick and pick_backward read or written in `logits` placements, the first column of the
/// logits [n, classes] the rank at `coordinate` holds; for sdpa and sdpa_backward whose first
/// output is placed `logits`, the first query row (dim 2) the rank holds; 0 for other ops.
std::int64_t column_offset_of(const ir::Node& node, const DeviceMesh& mesh, const std::vector<Placement>& logits, const std::vector<std::int64_t>& coordinate);

}  // namespace spmdx::sharding
