// VJP rules: for a forward node and the gradients of its outputs, emit IR computing the
// gradients of its inputs (nullptr for inputs that take none, e.g. indices). The rules follow
// PyTorch's derivatives.yaml; composite ops with a cheaper fused form (rms_norm, sdpa,
// cross_entropy, ...) emit a dedicated backward op with its own ATen kernel.
#include <functional>
#include <map>
#include <set>

#include "spmdx/ir/autodiff.h"
#include "spmdx/ir/ops.h"

namespace spmdx::ir {
namespace {

using Shape = std::vector<std::int64_t>;
using Grads = std::vector<Value*>;
using Rule = VjpRule;

// g reduced to the shape of x when broadcasting made it larger.
Value* reduce_to(Graph& g, Value* grad, const Value* x) {
  if (grad->meta().shape == x->meta().shape) return grad;
  return g.add("sum_to", {grad}, {{"shape", x->meta().shape}});
}

Attributes float_attr(double v) { return {{"value", v}}; }

const std::map<std::string, Rule>& rules() {
  static const std::map<std::string, Rule> table = [] {
    std::map<std::string, Rule> r;
    r["add"] = [](Graph& g, const Node& n, const Grads& go) {
      return Grads{reduce_to(g, go[0], n.input(0)), reduce_to(g, go[0], n.input(1))};
    };
    r["sub"] = [](Graph& g, const Node& n, const Grads& go) {
      return Grads{reduce_to(g, go[0], n.input(0)), reduce_to(g, g.add("neg", {go[0]}), n.input(1))};
    };
    r["mul"] = [](Graph& g, const Node& n, const Grads& go) {
      return Grads{reduce_to(g, g.add("mul", {go[0], n.input(1)}), n.input(0)),
                   reduce_to(g, g.add("mul", {go[0], n.input(0)}), n.input(1))};
    };
    r["div"] = [](Graph& g, const Node& n, const Grads& go) {  // d(a/b)/db = -(a/b)/b
      Value* ga = g.add("div", {go[0], n.input(1)});
      Value* gb = g.add("neg", {g.add("div", {g.add("mul", {go[0], n.output()}), n.input(1)})});
      return Grads{reduce_to(g, ga, n.input(0)), reduce_to(g, gb, n.input(1))};
    };
    r["cast"] = [](Graph& g, const Node& n, const Grads& go) {
      return Grads{g.add("cast", {go[0]}, {{"dtype", std::string(to_string(n.input(0)->meta().dtype))}})};
    };
    r["add_scalar"] = [](Graph&, const Node&, const Grads& go) { return Grads{go[0]}; };
    r["mul_scalar"] = [](Graph& g, const Node& n, const Grads& go) {
      return Grads{g.add("mul_scalar", {go[0]}, float_attr(n.attr_float("value")))};
    };
    r["pow_scalar"] = [](Graph& g, const Node& n, const Grads& go) {  // v x^(v-1)
      const double v = n.attr_float("value");
      Value* d = g.add("mul_scalar", {g.add("pow_scalar", {n.input(0)}, float_attr(v - 1.0))}, float_attr(v));
      return Grads{g.add("mul", {go[0], d})};
    };
    r["rdiv_scalar"] = [](Graph& g, const Node& n, const Grads& go) {  // d(v/x) = -y/x
      return Grads{g.add("neg", {g.add("div", {g.add("mul", {go[0], n.output()}), n.input(0)})})};
    };
    auto reduction = [](bool mean) {
      return [mean](Graph& g, const Node& n, const Grads& go) {
        const Shape& x = n.input(0)->meta().shape;
        Shape dims = n.attr_ints("dims");
        if (dims.empty()) {
          for (std::size_t i = 0; i < x.size(); ++i) dims.push_back(static_cast<std::int64_t>(i));
        }
        Shape kept = x;
        std::int64_t count = 1;
        for (auto d : dims) {
          const auto w = static_cast<std::size_t>(d < 0 ? d + static_cast<std::int64_t>(x.size()) : d);
          count *= x[w];
          kept[w] = 1;
        }
        Value* grad = go[0];
        if (grad->meta().shape != kept) grad = g.add("reshape", {grad}, {{"shape", kept}});
        grad = g.add("expand", {grad}, {{"shape", x}});
        if (mean) grad = g.add("mul_scalar", {grad}, float_attr(1.0 / static_cast<double>(count)));
        return Grads{grad};
      };
    };
    r["sum"] = reduction(false);
    r["mean"] = reduction(true);
    r["softmax"] = [](Graph& g, const Node& n, const Grads& go) {
      return Grads{g.add("softmax_backward", {go[0], n.output()}, {{"dim", n.attr_int("dim")}})};
    };
    r["log_softmax"] = [](Graph& g, const Node& n, const Grads& go) {
      return Grads{g.add("log_softmax_backward", {go[0], n.output()}, {{"dim", n.attr_int("dim")}})};
    };
    r["matmul"] = [](Graph& g, const Node& n, const Grads& go) {
      Attributes last_two{{"dim0", std::int64_t{-1}}, {"dim1", std::int64_t{-2}}};
      Value* ga = g.add("matmul", {go[0], g.add("transpose", {n.input(1)}, last_two)});
      Value* gb = g.add("matmul", {g.add("transpose", {n.input(0)}, last_two), go[0]});
      return Grads{reduce_to(g, ga, n.input(0)), reduce_to(g, gb, n.input(1))};
    };
    r["linear"] = [](Graph& g, const Node& n, const Grads& go) {  // y = x W^T
      Value* x = n.input(0);
      Value* w = n.input(1);
      Value* gx = g.add("matmul", {go[0], w});
      const std::int64_t out = w->meta().shape[0];
      const std::int64_t in = w->meta().shape[1];
      Value* g2 = g.add("reshape", {go[0]}, {{"shape", Shape{-1, out}}});
      Value* x2 = g.add("reshape", {x}, {{"shape", Shape{-1, in}}});
      Value* gw = g.add("matmul", {g.add("transpose", {g2}, {{"dim0", std::int64_t{0}}, {"dim1", std::int64_t{1}}}), x2});
      return Grads{gx, gw};
    };
    r["sum_to"] = [](Graph& g, const Node& n, const Grads& go) {
      return Grads{g.add("expand", {go[0]}, {{"shape", n.input(0)->meta().shape}})};
    };
    r["rms_norm"] = [](Graph& g, const Node& n, const Grads& go) {
      Node* b = g.add_node("rms_norm_backward", {go[0], n.input(0), n.input(1)}, {{"eps", n.attr_float("eps")}});
      return Grads{b->output(0), b->output(1)};
    };
    r["layer_norm"] = [](Graph& g, const Node& n, const Grads& go) {
      Node* b = g.add_node("layer_norm_backward", {go[0], n.input(0), n.input(1), n.input(2)}, {{"eps", n.attr_float("eps")}});
      return Grads{b->output(0), b->output(1), b->output(2)};
    };
    r["sdpa"] = [](Graph& g, const Node& n, const Grads& go) {
      Node* b = g.add_node("sdpa_backward", {go[0], n.input(0), n.input(1), n.input(2), n.output(0), n.output(1)}, n.attrs());
      return Grads{b->output(0), b->output(1), b->output(2)};
    };
    // The row maximum only steadies a logsumexp (loss_parallel.h): no gradient flows through it.
    r["amax_rows"] = [](Graph&, const Node&, const Grads&) { return Grads{nullptr}; };
    r["sum_exp_rows"] = [](Graph& g, const Node& n, const Grads& go) {
      return Grads{g.add("sum_exp_rows_backward", {go[0], n.input(0), n.input(1)}), nullptr};
    };
    r["pick"] = [](Graph& g, const Node& n, const Grads& go) {
      return Grads{g.add("pick_backward", {go[0], n.input(1)},
                         {{"num_classes", n.input(0)->meta().shape[1]}, {"ignore_index", n.attr_int("ignore_index")}, {"offset", n.attr_int("offset")}}),
                   nullptr};
    };
    r["cross_entropy"] = [](Graph& g, const Node& n, const Grads& go) {
      return Grads{g.add("cross_entropy_backward", {go[0], n.input(0), n.input(1)},
                         {{"ignore_index", n.attr_int("ignore_index")}, {"reduction", n.attr_string("reduction")}}),
                   nullptr};
    };
    return r;
  }();
  return table;
}

// The op's VJP: its record's (core/src/ops/), else the table above.
const Rule* vjp_of(const std::string& op) {
  if (const OpSchema* s = OpRegistry::global().find(op); s != nullptr && s->vjp) return &s->vjp;
  auto it = rules().find(op);
  return it == rules().end() ? nullptr : &it->second;
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
    const Rule* rule = vjp_of(node.op());
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
