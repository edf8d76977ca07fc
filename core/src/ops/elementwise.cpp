// Unary elementwise ops: y = f(x), any shape, floating dtypes; the kernel is ATen's op of the
// same name (torch.<name>), the VJP PyTorch's derivatives.yaml entry, and each writes into its
// input where the memory plan lets it (ATen's in-place form, the same loop bit for bit).
#include "common.h"

namespace spmdx::ops {
namespace {

// A unary op's record: elementwise, written in place into input 0, nonlinear unless `linear`
// (then Partial in -> Partial out), one sample of `fill` values.
[[maybe_unused]] Op unary(const std::string& name, ir::VjpRule vjp, Fill fill = Fill::normal, bool linear = false) {
  OpSchema s = elementwise(name, 1, same_as_input(), {{{4, 5}, fill}});
  s.vjp = std::move(vjp);
  s.in_place = {0};
  return {std::move(s), linear ? sharding::rule::linear_unary() : sharding::rule::nonlinear(), nullptr};
}

}  // namespace

// neg: -x; linear, so a Partial sum stays one.
SPMDX_OP(unary("neg", [](Graph& g, const Node&, const Grads& go) { return Grads{g.add("neg", {go[0]})}; }, Fill::normal, true))
SPMDX_KERNEL("neg", [](const Node&, const Tensors& x) { return one(at::neg(x[0])); }, unary_in_place([](const Node&, at::Tensor& t) { t.neg_(); }))

// exp: dy/dx = y.
SPMDX_OP(unary("exp", [](Graph& g, const Node& n, const Grads& go) { return Grads{g.add("mul", {go[0], n.output()})}; }))
SPMDX_KERNEL("exp", [](const Node&, const Tensors& x) { return one(at::exp(x[0])); }, unary_in_place([](const Node&, at::Tensor& t) { t.exp_(); }))

// log: natural log; dy/dx = 1 / x.
SPMDX_OP(unary("log", [](Graph& g, const Node& n, const Grads& go) { return Grads{g.add("div", {go[0], n.input(0)})}; }, Fill::positive))
SPMDX_KERNEL("log", [](const Node&, const Tensors& x) { return one(at::log(x[0])); }, unary_in_place([](const Node&, at::Tensor& t) { t.log_(); }))

// sqrt: dy/dx = 1 / (2 y).
SPMDX_OP(unary(
    "sqrt", [](Graph& g, const Node& n, const Grads& go) { return Grads{g.add("div", {go[0], g.add("mul_scalar", {n.output()}, float_attr(2.0))})}; },
    Fill::positive))
SPMDX_KERNEL("sqrt", [](const Node&, const Tensors& x) { return one(at::sqrt(x[0])); }, unary_in_place([](const Node&, at::Tensor& t) { t.sqrt_(); }))

// rsqrt: x^-1/2; dy/dx = -y^3 / 2.
SPMDX_OP(unary(
    "rsqrt",
    [](Graph& g, const Node& n, const Grads& go) {
      Value* y = n.output();
      Value* y3 = g.add("mul", {y, g.add("mul", {y, y})});
      return Grads{g.add("mul_scalar", {g.add("mul", {go[0], y3})}, float_attr(-0.5))};
    },
    Fill::positive))
SPMDX_KERNEL("rsqrt", [](const Node&, const Tensors& x) { return one(at::rsqrt(x[0])); }, unary_in_place([](const Node&, at::Tensor& t) { t.rsqrt_(); }))

// sigmoid: 1 / (1 + e^-x); dy/dx = y (1 - y).
SPMDX_OP(unary("sigmoid", [](Graph& g, const Node& n, const Grads& go) {
  Value* y = n.output();
  Value* one_minus = g.add("add_scalar", {g.add("neg", {y})}, float_attr(1.0));
  return Grads{g.add("mul", {go[0], g.add("mul", {y, one_minus})})};
}))
SPMDX_KERNEL("sigmoid", [](const Node&, const Tensors& x) { return one(at::sigmoid(x[0])); }, unary_in_place([](const Node&, at::Tensor& t) { t.sigmoid_(); }))

// tanh: dy/dx = 1 - y^2, as ATen's tanh_backward.
SPMDX_OP(unary("tanh", [](Graph& g, const Node& n, const Grads& go) {
  Value* y = n.output();
  Value* one_minus = g.add("add_scalar", {g.add("neg", {g.add("mul", {y, y})})}, float_attr(1.0));
  return Grads{g.add("mul", {go[0], one_minus})};
}))
SPMDX_KERNEL("tanh", [](const Node&, const Tensors& x) { return one(at::tanh(x[0])); }, unary_in_place([](const Node&, at::Tensor& t) { t.tanh_(); }))

// sign: -1, 0 or 1 as x < 0, x = 0, x > 0 (torch.sign); the gradient is zero (derivatives.yaml).
// DeepSeek-V3's load balancing steps each expert's bias by the sign of its load's deficit.
SPMDX_OP(unary("sign", [](Graph& g, const Node& n, const Grads&) { return Grads{g.add("zeros_like", {n.input(0)})}; }))
SPMDX_KERNEL("sign", [](const Node&, const Tensors& x) { return one(at::sign(x[0])); }, unary_in_place([](const Node&, at::Tensor& t) { t.sign_(); }))

// relu: max(x, 0); the gradient through relu_backward (ATen's threshold_backward at 0).
SPMDX_OP(unary("relu", [](Graph& g, const Node& n, const Grads& go) { return Grads{g.add("relu_backward", {go[0], n.output()})}; }))
SPMDX_KERNEL("relu", [](const Node&, const Tensors& x) { return one(at::relu(x[0])); }, unary_in_place([](const Node&, at::Tensor& t) { t.relu_(); }))

// silu: x * sigmoid(x) (Elfwing et al. 2017); the gradient through silu_backward (ATen's).
SPMDX_OP(unary("silu", [](Graph& g, const Node& n, const Grads& go) { return Grads{g.add("silu_backward", {go[0], n.input(0)})}; }))
SPMDX_KERNEL("silu", [](const Node&, const Tensors& x) { return one(at::silu(x[0])); }, unary_in_place([](const Node&, at::Tensor& t) { at::silu_(t); }))

// gelu: x * Phi(x) ("none"), or its tanh approximation ("tanh"), as torch.nn.functional.gelu;
// the gradient through gelu_backward (ATen's).
SPMDX_OP([] {
  Op op = unary("gelu", [](Graph& g, const Node& n, const Grads& go) {
    return Grads{g.add("gelu_backward", {go[0], n.input(0)}, {{"approximate", n.attr_string("approximate")}})};
  });
  op.schema.attrs = {gelu_approximate()};
  op.schema.infer = [](const Metas& in, const Attributes& a) {
    floating(*in[0], "the input");
    check_gelu_approximate(a);
    return std::vector{like(*in[0], in[0]->shape, in[0]->requires_grad)};
  };
  op.schema.samples.push_back({"gelu_tanh", {{{4, 5}}}, {{"approximate", std::string("tanh")}}});
  return op;
}())
SPMDX_KERNEL("gelu", [](const Node& n, const Tensors& x) { return one(at::gelu(x[0], n.attr_string("approximate"))); },
             unary_in_place([](const Node& n, at::Tensor& t) { at::gelu_(t, n.attr_string("approximate")); }))

}  // namespace spmdx::ops
