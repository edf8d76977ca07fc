// Reverse-mode autodiff over the IR: each node's VJP (its op record's, core/src/ops/) emits IR
// computing the gradients of its inputs (nullptr for inputs that take none, e.g. indices). The
// records follow PyTorch's derivatives.yaml; composite ops with a cheaper fused form (rms_norm,
// sdpa, cross_entropy, ...) emit a dedicated backward op with its own ATen kernel.
#include <functional>
#include <map>
#include <set>

#include "spmdx/ir/autodiff.h"
#include "spmdx/ir/ops.h"

namespace spmdx::ir {
namespace {

using Grads = std::vector<Value*>;

// The op's VJP, from its record (core/src/ops/).
const VjpRule* vjp_of(const std::string& op) {
  const OpSchema* s = OpRegistry::global().find(op);
  return s != nullptr && s->vjp ? &s->vjp : nullptr;
}

}  // namespace

bool has_vjp(const std::string& op) { return vjp_of(op) != nullptr; }

std::vector<Value*> gradients(Graph& graph, Value* loss, const std::vector<Value*>& wrt) {
  if (!loss->meta().shape.empty() || !is_floating(loss->meta().dtype)) {
    throw IrError("gradients: the loss " + loss->ref() + " must be a floating scalar, it is " + loss->meta().str());
  }
  // Nodes on a path from wrt to loss: forward-reachable from wrt and backward-reachable from loss.
  std::set<const Value*> from_wrt(wrt.begin(), wrt.end());
  std::vector<Node*> forward;
  for (const auto& node : graph.nodes()) {
    bool reached = false;
    for (const Value* v : node->inputs()) reached = reached || from_wrt.count(v);
    if (!reached) continue;
    for (const Value* v : node->outputs()) from_wrt.insert(v);
    forward.push_back(node.get());
  }
  std::map<const Value*, Value*> grad;
  grad[loss] = graph.add("ones_like", {loss});
  auto accumulate = [&](const Value* x, Value* g) {
    auto [it, inserted] = grad.emplace(x, g);
    if (!inserted) it->second = graph.add("add", {it->second, g});
  };
  for (auto it = forward.rbegin(); it != forward.rend(); ++it) {
    const Node& node = **it;
    Grads go;
    bool any = false;
    for (const Value* out : node.outputs()) {
      auto found = grad.find(out);
      go.push_back(found == grad.end() ? nullptr : found->second);
      any = any || found != grad.end();
    }
    if (!any) continue;
    for (std::size_t i = 0; i < go.size(); ++i) {
      if (go[i] == nullptr) go[i] = graph.add("zeros_like", {node.outputs()[i]});
    }
    const VjpRule* rule = vjp_of(node.op());
    if (rule == nullptr) {
      throw IrError("gradients: node %" + std::to_string(node.id()) + " (" + node.op() +
                    ") lies between the parameters and the loss but the op has no VJP rule");
    }
    Grads gi = (*rule)(graph, node, go);
    for (std::size_t i = 0; i < gi.size() && i < node.inputs().size(); ++i) {
      if (gi[i] != nullptr && from_wrt.count(node.inputs()[i])) accumulate(node.inputs()[i], gi[i]);
    }
  }
  std::vector<Value*> out;
  for (Value* x : wrt) {
    auto found = grad.find(x);
    out.push_back(found != grad.end() ? found->second : graph.add("zeros_like", {x}));
  }
#ifndef NDEBUG
  graph.verify();  // every pass leaves a valid graph (checked in debug builds)
#endif
  return out;
}

}  // namespace spmdx::ir
