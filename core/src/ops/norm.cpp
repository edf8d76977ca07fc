// Norms over the last dim: rms_norm (Zhang & Sennrich 2019) and layer_norm (Ba et al. 2016),
// with their backward ops. Autocast and torchtitan compute them in float32 and cast the output
// back to x's dtype (RMSNorm's `output.type_as(x)`). Sharding: any dim but the last, weights
// replicated, weight gradients partial sums.
#include "common.h"

#if defined(SPMDX_OPS_KERNELS)
#include <optional>
#include <tuple>
#endif

namespace spmdx::ops {
namespace {

// Norms: shard any dim of x but the last; the weights (and bias) replicated.
[[maybe_unused]] Strategies norm_strategies(const Node&, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t k) {
  Strategies s{sharding::rule::all(R(), in.size(), 1)};
  for (std::size_t d = 0; d + 1 < in[0].size(); ++d) {
    if (in[0][d] < k) continue;
    OpStrategy st{std::vector<Placement>(in.size(), R()), {S(static_cast<std::int64_t>(d))}};
    st.inputs[0] = S(static_cast<std::int64_t>(d));
    s.push_back(st);
  }
  return s;
}

// Their backward: grad and x sharded alike give grad_x sharded and partial weight gradients; a
// Partial incoming gradient gives Partial outputs (linear in it).
[[maybe_unused]] Strategies norm_backward_strategies(const Node&, const std::vector<Shape>& in, const std::vector<Shape>& out, std::int64_t k) {
  Strategies s{sharding::rule::all(R(), in.size(), out.size())};
  for (std::size_t d = 0; d + 1 < in[1].size(); ++d) {
    if (in[1][d] < k) continue;
    OpStrategy st{std::vector<Placement>(in.size(), R()), std::vector<Placement>(out.size(), P())};
    st.inputs[0] = st.inputs[1] = st.outputs[0] = S(static_cast<std::int64_t>(d));
    s.push_back(st);
  }
  OpStrategy partial{std::vector<Placement>(in.size(), R()), std::vector<Placement>(out.size(), P())};
  partial.inputs[0] = P();  // linear in the incoming gradient
  s.push_back(partial);
  return s;
}

}  // namespace

#if defined(SPMDX_OPS_KERNELS)
namespace {

// rms_norm(x) = x * rsqrt(mean(x^2, -1) + eps) * w  (Zhang & Sennrich 2019).
at::Tensor rms_inv(const at::Tensor& x, double eps) { return at::rsqrt(x.pow(2).mean(-1, true) + eps); }

// rms_norm with ATen's fused CUDA kernel (at::_fused_rms_norm, torch.nn.functional.rms_norm's
// on CUDA since PyTorch 2.8): {y, rstd [..., 1]}; nullopt where it refuses the inputs.
std::optional<std::tuple<at::Tensor, at::Tensor>> fused_rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  try {
    return at::_fused_rms_norm(x, {x.size(-1)}, w, eps);
  } catch (const c10::Error& e) {
    exec::fused_refused("fused RMSNorm", e);
    return std::nullopt;
  }
}

}  // namespace
#endif

// rms_norm: x[..., d] * rsqrt(mean(x^2, -1) + eps) * weight[d], torch.nn.functional.rms_norm.
// Its output is laid out as TensorIterator's (x * r): as the first dense input of its shape.
SPMDX_OP([] {
  OpSchema s;
  s.name = "rms_norm";
  s.min_inputs = s.max_inputs = 2;
  s.attrs = {{"eps", ir::AttrType::floating, false, 1e-6}};
  s.infer = [](const Metas& in, const Attributes&) {
    same_dtype(in);
    floating(*in[0], "x");
    if (in[0]->shape.empty() || in[1]->shape != Shape{in[0]->shape.back()}) {
      fail("weight must be [" + (in[0]->shape.empty() ? std::string("d") : std::to_string(in[0]->shape.back())) + "], the last dim of x");
    }
    return std::vector{like(*in[0], in[0]->shape, any_requires_grad(in))};
  };
  s.vjp = [](Graph& g, const Node& n, const Grads& go) {
    Node* b = g.add_node("rms_norm_backward", {go[0], n.input(0), n.input(1)}, {{"eps", n.attr_float("eps")}});
    return Grads{b->output(0), b->output(1)};
  };
  s.layout = [](const Node& n, std::size_t k, const ir::LayoutQuery& q) -> std::optional<ir::OutputLayout> {
    const Shape& shape = n.output(static_cast<int>(k))->meta().shape;
    for (int i = 0; i < static_cast<int>(n.inputs().size()); ++i) {
      if (n.input(i)->meta().shape == shape && q.dense(i)) return ir::OutputLayout{ir::dense_like(shape, q.strides(i)), false};
    }
    return std::nullopt;  // contiguous
  };
  s.precision = ir::Precision::float32_cast_back;
  s.samples = {{"rms_norm", {{{4, 6, 8}}, {{8}}}, {{"eps", 1e-5}}}};
  return Op{std::move(s), norm_strategies, nullptr};
}())
// (x * rsqrt(mean(x^2) + eps)) * w, the product by w in place: no temporary beside the output.
SPMDX_KERNEL("rms_norm", [](const Node& n, const Tensors& x) {
  if (x[0].is_cuda()) {
    if (auto r = fused_rms_norm(x[0], x[1], n.attr_float("eps"))) return one(std::get<0>(*r));
  }
  return one((x[0] * rms_inv(x[0], n.attr_float("eps"))).mul_(x[1]));
})

// rms_norm_backward: grad, x, weight -> (grad_x, grad_weight).
SPMDX_OP([] {
  OpSchema s;
  s.name = "rms_norm_backward";
  s.min_inputs = s.max_inputs = 3;
  s.attrs = {{"eps", ir::AttrType::floating, false, 1e-6}};
  s.infer = [](const Metas& in, const Attributes&) { return std::vector{like(*in[1], in[1]->shape, true), like(*in[2], in[2]->shape, true)}; };
  // xhat, xhat * mean(..) or g * xhat; r and the mean.
  s.scratch = [](const Node& n, const ir::LayoutQuery&) {
    const ir::TensorMeta& x = n.input(1)->meta();
    const std::int64_t rows = n.input(0)->meta().shape.empty() ? 0 : n.input(0)->meta().numel_without(-1);
    return 2 * x.nbytes() + 2 * rows * static_cast<std::int64_t>(ir::element_size(x.dtype));
  };
  s.samples = {{"rms_norm_backward", {{{4, 6, 8}}, {{4, 6, 8}}, {{8}}}, {}, false}};
  return Op{std::move(s), norm_backward_strategies, nullptr};
}())
// gx = r * (g w - xhat * mean(g w * xhat)), gw = sum(g * xhat); the subtraction and the
// product by r in place in g w (the same elementwise operations): at most two temporaries
// of x's size beside the outputs, not five.
SPMDX_KERNEL("rms_norm_backward", [](const Node& n, const Tensors& x) {
  const at::Tensor &g = x[0], &in = x[1], &w = x[2];
  if (in.is_cuda()) {
    // The forward's rstd again (one fused pass), then ATen's fused backward.
    if (auto r = fused_rms_norm(in, w, n.attr_float("eps"))) {
      try {
        auto [gx, gw] = at::_fused_rms_norm_backward(g, in, {in.size(-1)}, std::get<1>(*r), w, {true, true});
        return Tensors{gx, gw};
      } catch (const c10::Error& e) {
        exec::fused_refused("fused RMSNorm backward", e);
      }
    }
  }
  const at::Tensor r = rms_inv(in, n.attr_float("eps"));
  const at::Tensor xhat = in * r;
  at::Tensor gx = g * w;
  const at::Tensor dot = (gx * xhat).mean(-1, true);
  gx.sub_(xhat * dot).mul_(r);
  std::vector<std::int64_t> batch_dims;
  for (std::int64_t i = 0; i + 1 < in.dim(); ++i) batch_dims.push_back(i);
  return Tensors{gx, (g * xhat).sum(batch_dims)};
})

// layer_norm: (x - mean) / sqrt(var + eps) * weight[d] + bias[d] over the last dim,
// torch.nn.functional.layer_norm.
SPMDX_OP([] {
  OpSchema s;
  s.name = "layer_norm";
  s.min_inputs = s.max_inputs = 3;
  s.attrs = {{"eps", ir::AttrType::floating, false, 1e-5}};
  s.infer = [](const Metas& in, const Attributes&) {
    same_dtype(in);
    floating(*in[0], "x");
    const Shape last{in[0]->shape.empty() ? 0 : in[0]->shape.back()};
    if (in[1]->shape != last || in[2]->shape != last) fail("weight and bias must be " + ir::shape_str(last));
    return std::vector{like(*in[0], in[0]->shape, any_requires_grad(in))};
  };
  s.vjp = [](Graph& g, const Node& n, const Grads& go) {
    Node* b = g.add_node("layer_norm_backward", {go[0], n.input(0), n.input(1), n.input(2)}, {{"eps", n.attr_float("eps")}});
    return Grads{b->output(0), b->output(1), b->output(2)};
  };
  s.precision = ir::Precision::float32_cast_back;
  s.samples = {{"layer_norm", {{{4, 6, 8}}, {{8}}, {{8}}}, {}}};
  return Op{std::move(s), norm_strategies, nullptr};
}())
SPMDX_KERNEL("layer_norm", [](const Node& n, const Tensors& x) {
  return one(at::layer_norm(x[0], {x[0].size(-1)}, x[1], x[2], n.attr_float("eps")));
})

// layer_norm_backward: grad, x, weight, bias -> (grad_x, grad_weight, grad_bias), ATen's
// native_layer_norm_backward after the forward recomputed (its scratch: x's size).
SPMDX_OP([] {
  OpSchema s;
  s.name = "layer_norm_backward";
  s.min_inputs = s.max_inputs = 4;
  s.attrs = {{"eps", ir::AttrType::floating, false, 1e-5}};
  s.infer = [](const Metas& in, const Attributes&) {
    return std::vector{like(*in[1], in[1]->shape, true), like(*in[2], in[2]->shape, true), like(*in[3], in[3]->shape, true)};
  };
  s.scratch = [](const Node& n, const ir::LayoutQuery&) { return n.input(1)->meta().nbytes(); };
  s.samples = {{"layer_norm_backward", {{{4, 6, 8}}, {{4, 6, 8}}, {{8}}, {{8}}}, {}, false}};
  return Op{std::move(s), norm_backward_strategies, nullptr};
}())
SPMDX_KERNEL("layer_norm_backward", [](const Node& n, const Tensors& x) {
  const std::vector<std::int64_t> shape{x[1].size(-1)};
  auto [out, mean, rstd] = at::native_layer_norm(x[1], shape, x[2], x[3], n.attr_float("eps"));
  auto [gx, gw, gb] = at::native_layer_norm_backward(x[0], x[1], shape, mean, rstd, x[2], x[3], {true, true, true});
  return Tensors{gx, gw, gb};
})

}  // namespace spmdx::ops
