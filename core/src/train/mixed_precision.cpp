#include "spmdx/train/mixed_precision.h"
#include "spmdx/ir/ops.h"

#include <map>
#include <set>
#include <unordered_map>

namespace spmdx::train {
namespace {

using ir::DType;
using ir::Value;

// The op's policy, from its record (core/src/ops/): autocast's lists and torchtitan's float32
// norms and loss.
ir::Precision precision_of(const std::string& op) {
  const ir::OpSchema* s = ir::OpRegistry::global().find(op);
  return s != nullptr ? s->precision : ir::Precision::promote;
}

}  // namespace

ir::Graph cast_for_mixed_precision(const ir::Graph& forward, DType compute) {
  ir::Graph out;
  std::unordered_map<const Value*, Value*> map;  // old value -> new
  for (const Value* v : forward.inputs()) map[v] = out.add_input(v->name(), v->meta());
  std::map<std::pair<Value*, DType>, Value*> casts;
  auto as = [&](Value* v, DType d) {
    if (v->meta().dtype == d || !ir::is_floating(v->meta().dtype)) return v;
    Value*& c = casts[{v, d}];
    if (c == nullptr) c = out.add("cast", {v}, {{"dtype", std::string(ir::to_string(d))}});
    return c;
  };
  for (const auto& node : forward.nodes()) {
    std::vector<Value*> in;
    for (const Value* v : node->inputs()) in.push_back(map.at(v));
    DType want = DType::f32;
    bool cast = true;
    const ir::Precision policy = precision_of(node->op());
    if (policy == ir::Precision::low) {
      want = compute;
    } else if (policy == ir::Precision::promote) {
      // Promote: the widest floating dtype among the inputs, only when they differ.
      std::set<DType> seen;
      for (Value* v : in) {
        if (ir::is_floating(v->meta().dtype)) seen.insert(v->meta().dtype);
      }
      cast = seen.size() > 1;
    }
    const DType x_dtype = in.empty() ? DType::f32 : in[0]->meta().dtype;
    if (cast) {
      for (Value*& v : in) v = as(v, want);
    }
    const ir::Node* copy = out.add_node(node->op(), in, node->attrs());
    for (std::size_t k = 0; k < node->outputs().size(); ++k) map[node->outputs()[k]] = copy->outputs()[k];
    if (policy == ir::Precision::float32_cast_back) map[node->output()] = as(copy->outputs()[0], x_dtype);
  }
  for (const auto& [name, v] : forward.outputs()) out.add_output(name, map.at(v));
  return out;
}

}  // namespace spmdx::train
