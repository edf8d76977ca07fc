// Pointwise ops beyond the unary functions of elementwise.cpp: binary arithmetic with NumPy
// broadcasting, arithmetic with a scalar attribute, dtype casts, zeros_like / ones_like (the
// seeds autodiff plants), and the backward ops of relu, silu and gelu. Each kernel is ATen's op
// of the same meaning, its in-place twin ATen's in-place or out= form of it (the same loop, bit
// for bit); the VJPs follow PyTorch's derivatives.yaml.
#include "common.h"

#if defined(SPMDX_OPS_KERNELS)
#include "spmdx/exec/dtype.h"
#endif

namespace spmdx::ops {
namespace {

// Partial patterns of an op's pointwise rule (true: a Partial input; false: Replicate).
using Patterns = std::vector<std::vector<bool>>;

sharding::Rule pointwise_rule(Patterns patterns) {
  return [patterns](const Node&, const std::vector<sharding::Shape>& in, const std::vector<sharding::Shape>& out, std::int64_t k) {
    return sharding::rule::pointwise(in, out, k, patterns);
  };
}

// A binary op of inputs of one dtype, broadcast (as torch.broadcast_shapes): elementwise, written
// in place into either input, linear in each input of `partial`'s patterns.
[[maybe_unused]] Op binary(const std::string& name, ir::VjpRule vjp, Patterns partial, std::vector<ir::SampleInput> sample,
                           const std::string& label) {
  OpSchema s = elementwise(
      name, 2,
      [](const Metas& in, const Attributes&) {
        same_dtype(in);
        return std::vector{like(*in[0], broadcast(in[0]->shape, in[1]->shape), any_requires_grad(in))};
      },
      std::move(sample));
  s.samples[0].label = label;
  s.vjp = std::move(vjp);
  s.in_place = {0, 1};
  return {std::move(s), pointwise_rule(std::move(partial)), nullptr};
}

// An op of a floating input x and a float attribute `value` (v): written in place into x unless
// in_place is false, nonlinear unless `linear`; one sample of {4, 5} `fill` values with v.
[[maybe_unused]] Op scalar(const std::string& name, ir::VjpRule vjp, double v, Fill fill = Fill::normal, bool linear = false, bool in_place = true) {
  OpSchema s = elementwise(name, 1, same_as_input(), {{{4, 5}, fill}}, {{"value", ir::AttrType::floating, true, {}}});
  s.samples[0].attrs = float_attr(v);
  s.samples[0].gradient = vjp != nullptr;
  s.vjp = std::move(vjp);
  if (in_place) s.in_place = {0};
  return {std::move(s), linear ? sharding::rule::linear_unary() : sharding::rule::nonlinear(), nullptr};
}

// A backward op (grad_out, saved) -> grad_in, of saved's meta: elementwise, written in place
// into either input, linear in grad_out; no VJP (no double backward).
[[maybe_unused]] Op backward(const std::string& name, Fill saved, std::vector<ir::AttrSpec> attrs = {}) {
  OpSchema s = elementwise(
      name, 2, [](const Metas& in, const Attributes&) { return grad_like(in, 1, 1); }, {{{4, 5}}, {{4, 5}, saved}}, std::move(attrs));
  s.samples[0].gradient = false;
  s.in_place = {0, 1};
  return {std::move(s), sharding::rule::linear_in_first(), nullptr};
}

// zeros_like / ones_like: x's meta, any dtype. Its value does not depend on x's, so nothing
// flows back to x (derivatives.yaml: not differentiable): the VJP gives no gradient, which lets
// a model start a sum from zeros_like of a trained value (the MoE combine's scatter_add base).
[[maybe_unused]] Op filled_like(const std::string& name, bool linear) {
  OpSchema s = elementwise(
      name, 1, [](const Metas& in, const Attributes&) { return std::vector{like(*in[0], in[0]->shape, in[0]->requires_grad)}; },
      {{{4, 5}}});
  s.samples[0].gradient = false;
  s.vjp = [](Graph&, const Node&, const Grads&) { return Grads{nullptr}; };
  return {std::move(s), linear ? sharding::rule::linear_unary() : sharding::rule::nonlinear(), nullptr};
}

}  // namespace

// ---- binary ops: a op b ----

// add: a + b (torch.add); linear in both, so Partial + Partial stays Partial.
SPMDX_OP(binary(
    "add", [](Graph& g, const Node& n, const Grads& go) { return Grads{reduce_to(g, go[0], n.input(0)), reduce_to(g, go[0], n.input(1))}; },
    {{true, true}}, {{{6, 4}}, {{4}}}, "add_broadcast"))
SPMDX_KERNEL("add", [](const Node&, const Tensors& x) { return one(at::add(x[0], x[1])); },
             binary_in_place([](const Node&, at::Tensor& o, const at::Tensor& a, const at::Tensor& b) { at::add_out(o, a, b); }))

// sub: a - b (torch.sub).
SPMDX_OP(binary(
    "sub",
    [](Graph& g, const Node& n, const Grads& go) { return Grads{reduce_to(g, go[0], n.input(0)), reduce_to(g, g.add("neg", {go[0]}), n.input(1))}; },
    {{true, true}}, {{{4, 6}}, {{4, 1}}}, "sub_broadcast"))
SPMDX_KERNEL("sub", [](const Node&, const Tensors& x) { return one(at::sub(x[0], x[1])); },
             binary_in_place([](const Node&, at::Tensor& o, const at::Tensor& a, const at::Tensor& b) { at::sub_out(o, a, b); }))

// mul: a * b (torch.mul); linear in either input when the other is replicated.
SPMDX_OP(binary(
    "mul",
    [](Graph& g, const Node& n, const Grads& go) {
      return Grads{reduce_to(g, g.add("mul", {go[0], n.input(1)}), n.input(0)), reduce_to(g, g.add("mul", {go[0], n.input(0)}), n.input(1))};
    },
    {{true, false}, {false, true}}, {{{4, 6}}, {{4, 6}}}, "mul"))
SPMDX_KERNEL("mul", [](const Node&, const Tensors& x) { return one(at::mul(x[0], x[1])); },
             binary_in_place([](const Node&, at::Tensor& o, const at::Tensor& a, const at::Tensor& b) { at::mul_out(o, a, b); }))

// div: a / b (torch.div, true division); d(a/b)/db = -(a/b)/b; linear in a.
SPMDX_OP(binary(
    "div",
    [](Graph& g, const Node& n, const Grads& go) {
      Value* ga = g.add("div", {go[0], n.input(1)});
      Value* gb = g.add("neg", {g.add("div", {g.add("mul", {go[0], n.output()}), n.input(1)})});
      return Grads{reduce_to(g, ga, n.input(0)), reduce_to(g, gb, n.input(1))};
    },
    {{true, false}}, {{{4, 6}}, {{1, 6}, Fill::positive}}, "div"))
SPMDX_KERNEL("div", [](const Node&, const Tensors& x) { return one(at::div(x[0], x[1])); },
             binary_in_place([](const Node&, at::Tensor& o, const at::Tensor& a, const at::Tensor& b) { at::div_out(o, a, b); }))

// ---- ops with a scalar attribute v ----

// add_scalar: x + v (torch.add with a Number).
SPMDX_OP(scalar("add_scalar", [](Graph&, const Node&, const Grads& go) { return Grads{go[0]}; }, 1.5))
SPMDX_KERNEL("add_scalar", [](const Node& n, const Tensors& x) { return one(at::add(x[0], n.attr_float("value"))); },
             unary_in_place([](const Node& n, at::Tensor& t) { t.add_(n.attr_float("value")); }))

// mul_scalar: x * v (torch.mul with a Number); linear, so a Partial sum stays one.
SPMDX_OP(scalar(
    "mul_scalar", [](Graph& g, const Node& n, const Grads& go) { return Grads{g.add("mul_scalar", {go[0]}, float_attr(n.attr_float("value")))}; },
    -2.0, Fill::normal, true))
SPMDX_KERNEL("mul_scalar", [](const Node& n, const Tensors& x) { return one(at::mul(x[0], n.attr_float("value"))); },
             unary_in_place([](const Node& n, at::Tensor& t) { t.mul_(n.attr_float("value")); }))

// pow_scalar: x ** v (torch.pow with a Number exponent); dy/dx = v x^(v-1).
SPMDX_OP(scalar(
    "pow_scalar",
    [](Graph& g, const Node& n, const Grads& go) {
      const double v = n.attr_float("value");
      Value* d = g.add("mul_scalar", {g.add("pow_scalar", {n.input(0)}, float_attr(v - 1.0))}, float_attr(v));
      return Grads{g.add("mul", {go[0], d})};
    },
    1.5, Fill::positive))
SPMDX_KERNEL("pow_scalar", [](const Node& n, const Tensors& x) { return one(at::pow(x[0], n.attr_float("value"))); },
             unary_in_place([](const Node& n, at::Tensor& t) { t.pow_(n.attr_float("value")); }))

// rdiv_scalar: v / x (torch.reciprocal(x) * v); dy/dx = -y / x. The kernel's reciprocal is a
// temporary of x's size (the memory plan's scratch).
SPMDX_OP([] {
  Op op = scalar(
      "rdiv_scalar", [](Graph& g, const Node& n, const Grads& go) { return Grads{g.add("neg", {g.add("div", {g.add("mul", {go[0], n.output()}), n.input(0)})})}; },
      2.0, Fill::positive);
  op.schema.scratch = [](const Node& n, const ir::LayoutQuery&) { return n.input(0)->meta().nbytes(); };
  return op;
}())
SPMDX_KERNEL("rdiv_scalar", [](const Node& n, const Tensors& x) { return one(at::reciprocal(x[0]) * n.attr_float("value")); },
             unary_in_place([](const Node& n, at::Tensor& t) { t.reciprocal_().mul_(n.attr_float("value")); }))

// clamp_max_scalar: min(x, v) (torch.clamp_max); no VJP (gradient clipping's coefficient only).
SPMDX_OP(scalar("clamp_max_scalar", nullptr, 0.1))
SPMDX_KERNEL("clamp_max_scalar", [](const Node& n, const Tensors& x) { return one(at::clamp_max(x[0], n.attr_float("value"))); },
             unary_in_place([](const Node& n, at::Tensor& t) { t.clamp_max_(n.attr_float("value")); }))

// rpow_scalar: v ** x (torch.pow with a Number base); no VJP, not written in place, and not
// counted elementwise by the memory plan (its output is laid out contiguous).
SPMDX_OP([] {
  Op op = scalar("rpow_scalar", nullptr, 0.9, Fill::normal, false, false);
  op.schema.elementwise = false;
  return op;
}())
SPMDX_KERNEL("rpow_scalar", [](const Node& n, const Tensors& x) { return one(at::pow(n.attr_float("value"), x[0])); })

// ---- casts and constants ----

// cast: the same values in another dtype, as Tensor.to(dtype) (round to nearest even for
// floats); the gradient is cast back to the input's dtype. Linear up to rounding: a Partial sum
// stays one (as DTensor's to(dtype)).
SPMDX_OP([] {
  OpSchema s = elementwise(
      "cast", 1,
      [](const Metas& in, const Attributes& a) {
        const auto& name = std::get<std::string>(a.at("dtype"));
        auto dtype = ir::parse_dtype(name);
        if (!dtype) fail("dtype \"" + name + "\" is not one of f32, f64, f16, bf16, i32, i64, u8, bool");
        ir::TensorMeta out = like(*in[0], in[0]->shape, in[0]->requires_grad && ir::is_floating(*dtype));
        out.dtype = *dtype;
        return std::vector{out};
      },
      {{{4, 5}}}, {{"dtype", ir::AttrType::string, true, {}}});
  // (A cast to f32 is checked by vjp_test alone: as a sample, the rules test would hold its
  // Partial strategy to 1e-8, which rounding each summand to float32 cannot meet.)
  s.samples[0] = {"cast_f64", {{{4, 5}}}, {{"dtype", std::string("f64")}}};
  s.vjp = [](Graph& g, const Node& n, const Grads& go) {
    return Grads{g.add("cast", {go[0]}, {{"dtype", std::string(ir::to_string(n.input(0)->meta().dtype))}})};
  };
  return Op{std::move(s), sharding::rule::linear_unary(), nullptr};
}())
SPMDX_KERNEL("cast", [](const Node& n, const Tensors& x) { return one(x[0].to(exec::to_aten(n.output()->meta().dtype))); })

// zeros_like: zeros of x's shape and dtype (torch.zeros_like); linear (0 is a Partial sum of 0s).
SPMDX_OP(filled_like("zeros_like", true))
SPMDX_KERNEL("zeros_like", [](const Node&, const Tensors& x) { return one(at::zeros_like(x[0])); })

// ones_like: ones of x's shape and dtype (torch.ones_like).
SPMDX_OP(filled_like("ones_like", false))
SPMDX_KERNEL("ones_like", [](const Node&, const Tensors& x) { return one(at::ones_like(x[0])); })

// ---- backward ops: (grad_out, saved) -> grad_in ----

// relu_backward: grad_out where y > 0, else 0, from relu's output y (ATen's threshold_backward
// at 0).
SPMDX_OP(backward("relu_backward", Fill::nonnegative))
SPMDX_KERNEL("relu_backward", [](const Node&, const Tensors& x) { return one(at::threshold_backward(x[0], x[1], 0)); },
             binary_in_place([](const Node&, at::Tensor& o, const at::Tensor& g, const at::Tensor& y) { at::threshold_backward_out(o, g, y, 0); }))

// silu_backward: grad_out * d silu(x)/dx, from silu's input x (ATen's silu_backward).
SPMDX_OP(backward("silu_backward", Fill::normal))
SPMDX_KERNEL("silu_backward", [](const Node&, const Tensors& x) { return one(at::silu_backward(x[0], x[1])); },
             binary_in_place([](const Node&, at::Tensor& o, const at::Tensor& g, const at::Tensor& x) { at::silu_backward_out(o, g, x); }))

// gelu_backward: grad_out * d gelu(x)/dx, from gelu's input x, exact or tanh-approximated
// (ATen's gelu_backward).
SPMDX_OP([] {
  Op op = backward("gelu_backward", Fill::normal, {gelu_approximate()});
  op.schema.infer = [](const Metas& in, const Attributes& a) {
    check_gelu_approximate(a);
    return grad_like(in, 1, 1);
  };
  op.schema.samples.push_back({"gelu_backward_tanh", {{{4, 5}}, {{4, 5}}}, {{"approximate", std::string("tanh")}}, false});
  return op;
}())
SPMDX_KERNEL("gelu_backward", [](const Node& n, const Tensors& x) { return one(at::gelu_backward(x[0], x[1], n.attr_string("approximate"))); },
             binary_in_place([](const Node& n, at::Tensor& o, const at::Tensor& g, const at::Tensor& x) {
               at::gelu_backward_out(o, g, x, n.attr_string("approximate"));
             }))

}  // namespace spmdx::ops
