#include "spmdx/train/loss_parallel.h"

#include <unordered_map>

namespace spmdx::train {

ir::Graph vocab_parallel_cross_entropy(const ir::Graph& forward) {
  using ir::Value;
  ir::Graph out;
  std::unordered_map<const Value*, Value*> map;  // old value -> new
  for (const Value* v : forward.inputs()) map[v] = out.add_input(v->name(), v->meta());
  for (const auto& node : forward.nodes()) {
    std::vector<Value*> in;
    for (const Value* v : node->inputs()) in.push_back(map.at(v));
    if (node->op() == "cross_entropy" && node->attr_string("reduction") == "sum") {
      Value *logits = in[0], *targets = in[1];
      const std::int64_t ignore = node->attr_int("ignore_index");
      Value* picked = out.add("pick", {logits, targets}, {{"ignore_index", ignore}});
      Value* m = out.add("amax_rows", {logits});
      Value* lse = out.add("add", {out.add("log", {out.add("sum_exp_rows", {logits, m})}), m});
      Value* nll = out.add("sub", {lse, picked});
      Value* valid = out.add("valid_rows", {targets}, {{"ignore_index", ignore}, {"dtype", std::string(ir::to_string(logits->meta().dtype))}});
      map[node->output()] = out.add("sum", {out.add("mul", {nll, valid})});
      continue;
    }
    const ir::Node* copy = out.add_node(node->op(), in, node->attrs());
    for (std::size_t k = 0; k < node->outputs().size(); ++k) map[node->outputs()[k]] = copy->outputs()[k];
  }
  for (const auto& [name, v] : forward.outputs()) out.add_output(name, map.at(v));
  return out;
}

}  // namespace spmdx::train
