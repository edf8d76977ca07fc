// The built-in op schemas: inputs, attributes and shape/dtype inference. Semantics follow the
// ATen op of the same name (the executor's kernel), without type promotion: inputs of a
// floating op share one dtype.
#include <algorithm>
#include <numeric>

#include "spmdx/ir/ops.h"
#include "spmdx/ir/infer.h"

// The table below is what is left of the ops not yet moved into core/src/ops/ (one record
// per op): its entries give the schema only.
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"

namespace spmdx::ir {
namespace {


using namespace infer;

OpSchema binary(const std::string& name) {
  return {name, 2, 2, {}, [](const Metas& in, const Attributes&) {
            same_dtype(in);
            return std::vector{like(*in[0], broadcast(in[0]->shape, in[1]->shape), any_requires_grad(in))};
          }};
}

OpSchema unary(const std::string& name, bool needs_float = true) {
  return {name, 1, 1, {}, [needs_float, name](const Metas& in, const Attributes&) {
            if (needs_float) floating(*in[0], "the input");
            return std::vector{like(*in[0], in[0]->shape, in[0]->requires_grad)};
          }};
}

OpSchema scalar(const std::string& name) {
  return {name, 1, 1, {{"value", AttrType::floating, true, {}}}, [](const Metas& in, const Attributes&) {
            floating(*in[0], "the input");
            return std::vector{like(*in[0], in[0]->shape, in[0]->requires_grad)};
          }};
}

OpSchema reduction(const std::string& name) {
  return {name, 1, 1,
          {{"dims", AttrType::ints, false, Shape{}}, {"keepdim", AttrType::boolean, false, false}},
          [](const Metas& in, const Attributes& a) {
            const Shape& x = in[0]->shape;
            Shape dims = std::get<Shape>(a.at("dims"));
            if (dims.empty()) {  // all dims, as torch.sum(x)
              dims.resize(x.size());
              std::iota(dims.begin(), dims.end(), 0);
            }
            std::vector<bool> reduced(x.size(), false);
            for (auto d : dims) {
              auto w = wrap_dim(d, static_cast<std::int64_t>(x.size()));
              if (reduced[w]) fail("dim " + std::to_string(d) + " appears twice in dims");
              reduced[w] = true;
            }
            const bool keep = std::get<bool>(a.at("keepdim"));
            Shape out;
            for (std::size_t i = 0; i < x.size(); ++i) {
              if (!reduced[i]) out.push_back(x[i]);
              else if (keep) out.push_back(1);
            }
            return std::vector{like(*in[0], out, in[0]->requires_grad)};
          }};
}

OpSchema softmax_like(const std::string& name) {
  return {name, 1, 1, {{"dim", AttrType::integer, false, std::int64_t{-1}}}, [](const Metas& in, const Attributes& a) {
            floating(*in[0], "the input");
            wrap_dim(std::get<std::int64_t>(a.at("dim")), in[0]->rank());
            return std::vector{like(*in[0], in[0]->shape, in[0]->requires_grad)};
          }};
}

std::vector<OpSchema> builtin_ops() {
  std::vector<OpSchema> ops;
  for (const char* n : {"add", "sub", "mul", "div"}) ops.push_back(binary(n));
  // cast: the same values in another dtype, as Tensor.to(dtype) (round to nearest even for
  // floats). The gradient is cast back to the input's dtype.
  ops.push_back({"cast", 1, 1, {{"dtype", AttrType::string, true, {}}}, [](const Metas& in, const Attributes& a) {
                   const auto& name = std::get<std::string>(a.at("dtype"));
                   auto dtype = parse_dtype(name);
                   if (!dtype) fail("dtype \"" + name + "\" is not one of f32, f64, f16, bf16, i32, i64, u8, bool");
                   TensorMeta out = like(*in[0], in[0]->shape, in[0]->requires_grad && is_floating(*dtype));
                   out.dtype = *dtype;
                   return std::vector{out};
                 }});
  for (const char* n : {"add_scalar", "mul_scalar", "pow_scalar"}) ops.push_back(scalar(n));
  ops.push_back(reduction("sum"));
  ops.push_back(reduction("mean"));
  ops.push_back(softmax_like("softmax"));
  ops.push_back(softmax_like("log_softmax"));

  // matmul: a[..., m, k] @ b[..., k, n] -> [broadcast(...), m, n], as torch.matmul for rank >= 2.
  ops.push_back({"matmul", 2, 2, {}, [](const Metas& in, const Attributes&) {
                   same_dtype(in);
                   const Shape& a = in[0]->shape;
                   const Shape& b = in[1]->shape;
                   if (a.size() < 2 || b.size() < 2) fail("both operands need rank >= 2");
                   if (a.back() != b[b.size() - 2]) {
                     fail("inner dimensions differ (" + std::to_string(a.back()) + " vs " +
                          std::to_string(b[b.size() - 2]) + ")");
                   }
                   Shape out = broadcast(Shape(a.begin(), a.end() - 2), Shape(b.begin(), b.end() - 2));
                   out.push_back(a[a.size() - 2]);
                   out.push_back(b.back());
                   return std::vector{like(*in[0], out, any_requires_grad(in))};
                 }});
  // linear: x[..., in] , weight[out, in] -> [..., out]  (x @ weight^T, as torch.nn.functional.linear).
  ops.push_back({"linear", 2, 2, {}, [](const Metas& in, const Attributes&) {
                   same_dtype(in);
                   const Shape& x = in[0]->shape;
                   const Shape& w = in[1]->shape;
                   if (x.empty() || w.size() != 2) fail("linear needs x[..., in] and weight[out, in]");
                   if (x.back() != w[1]) fail("in_features differ (x has " + std::to_string(x.back()) + ", weight " + std::to_string(w[1]) + ")");
                   Shape out = x;
                   out.back() = w[0];
                   return std::vector{like(*in[0], out, any_requires_grad(in))};
                 }});
  // rms_norm: x[..., d] * rsqrt(mean(x^2, -1) + eps) * weight[d]  (Zhang & Sennrich 2019).
  ops.push_back({"rms_norm", 2, 2, {{"eps", AttrType::floating, false, 1e-6}}, [](const Metas& in, const Attributes&) {
                   same_dtype(in);
                   floating(*in[0], "x");
                   if (in[0]->shape.empty() || in[1]->shape != Shape{in[0]->shape.back()}) {
                     fail("weight must be [" + (in[0]->shape.empty() ? std::string("d") : std::to_string(in[0]->shape.back())) +
                          "], the last dim of x");
                   }
                   return std::vector{like(*in[0], in[0]->shape, any_requires_grad(in))};
                 }});
  // layer_norm over the last dim with weight[d] and bias[d] (Ba et al. 2016).
  ops.push_back({"layer_norm", 3, 3, {{"eps", AttrType::floating, false, 1e-5}}, [](const Metas& in, const Attributes&) {
                   same_dtype(in);
                   floating(*in[0], "x");
                   const Shape last{in[0]->shape.empty() ? 0 : in[0]->shape.back()};
                   if (in[1]->shape != last || in[2]->shape != last) fail("weight and bias must be " + shape_str(last));
                   return std::vector{like(*in[0], in[0]->shape, any_requires_grad(in))};
                 }});
  // Scaled dot-product attention: q[b, h, s, d], k and v [b, h, t, d] -> out [b, h, s, d] =
  // softmax(q k^T / sqrt(d) [+ causal mask, top-left aligned]) v, and its row logsumexp
  // [b, h, s] for the backward pass (as torch's flash attention; f32 for f16/bf16 inputs).
  // Context parallelism (train/context_parallel.h) adds two attributes, which matter only when
  // causal: `chunks` > 1 says the sequence of q, k and v is in load-balanced order (chunks
  // pieces of t / chunks positions, seq_permute's order), and q_offset that q's rows are the
  // rows from q_offset on of that sequence (a rank's shard); a key is seen by a query at or
  // after its position in the sequence as written in natural order.
  const std::vector<AttrSpec> attention_attrs{{"causal", AttrType::boolean, false, true},
                                              {"chunks", AttrType::integer, false, std::int64_t{1}},
                                              {"q_offset", AttrType::integer, false, std::int64_t{0}}};
  ops.push_back({"sdpa", 3, 3, attention_attrs, [](const Metas& in, const Attributes& a) {
                   same_dtype(in);
                   floating(*in[0], "q");
                   const Shape& q = in[0]->shape;
                   const Shape& k = in[1]->shape;
                   const Shape& v = in[2]->shape;
                   if (q.size() != 4 || k != v || k.size() != 4) fail("q must be [batch, heads, seq, head_dim], k and v the same [batch, heads, kv_seq, head_dim]");
                   if (q[0] != k[0] || q[1] != k[1] || q[3] != k[3]) fail("q and k do not agree on batch, heads or head_dim");
                   const std::int64_t chunks = std::get<std::int64_t>(a.at("chunks")), offset = std::get<std::int64_t>(a.at("q_offset"));
                   if (chunks < 1 || k[2] % chunks != 0) fail("chunks must be >= 1 and divide the key sequence " + std::to_string(k[2]));
                   if (offset < 0 || offset + q[2] > k[2]) fail("q_offset " + std::to_string(offset) + " puts q's rows past the key sequence");
                   TensorMeta lse = like(*in[0], Shape{q[0], q[1], q[2]}, false);
                   if (lse.dtype == DType::f16 || lse.dtype == DType::bf16) lse.dtype = DType::f32;
                   return std::vector{like(*in[0], q, any_requires_grad(in)), lse};
                 }});
  // cross_entropy: logits[n, c], targets (i64)[n] -> scalar: the mean ("mean") or the sum
  // ("sum") over targets != ignore_index, as torch.nn.functional.cross_entropy.
  ops.push_back({"cross_entropy", 2, 2,
                 {{"ignore_index", AttrType::integer, false, std::int64_t{-100}},
                  {"reduction", AttrType::string, false, std::string("mean")}},
                 [](const Metas& in, const Attributes& a) {
                   floating(*in[0], "logits");
                   if (in[0]->rank() != 2 || in[1]->rank() != 1 || in[0]->shape[0] != in[1]->shape[0]) {
                     fail("needs logits [n, classes] and targets [n]");
                   }
                   if (in[1]->dtype != DType::i64) fail("targets must be i64");
                   const auto& r = std::get<std::string>(a.at("reduction"));
                   if (r != "mean" && r != "sum") fail("reduction must be \"mean\" or \"sum\", got \"" + r + "\"");
                   return std::vector{like(*in[0], Shape{}, in[0]->requires_grad)};
                 }});
  // Vocabulary-parallel cross entropy (Megatron-LM's, torchtitan's loss_parallel), written
  // with ops whose shards need no gathered logits (train/loss_parallel.h):
  // amax_rows: x[n, c] -> its row maxima [n, 1], as torch.amax(x, -1, keepdim=True), with no
  // gradient: it only steadies a logsumexp, whose value and gradient do not depend on it.
  ops.push_back({"amax_rows", 1, 1, {}, [](const Metas& in, const Attributes&) {
                   floating(*in[0], "x");
                   if (in[0]->rank() != 2) fail("needs x [n, classes]");
                   return std::vector{like(*in[0], Shape{in[0]->shape[0], 1}, false)};
                 }});
  // sum_exp_rows: x[n, c], m[n, 1] -> [n, 1]: sum over each row of exp(x - m), as
  // torch.exp(x - m).sum(-1, keepdim=True), its gradient to x alone (m is amax_rows').
  ops.push_back({"sum_exp_rows", 2, 2, {}, [](const Metas& in, const Attributes&) {
                   floating(*in[0], "x");
                   if (in[0]->rank() != 2 || in[1]->shape != Shape{in[0]->shape[0], 1}) fail("needs x [n, classes] and m [n, 1]");
                   return std::vector{like(*in[0], Shape{in[0]->shape[0], 1}, in[0]->requires_grad)};
                 }});
  // sum_exp_rows_backward: grad[n, 1], x[n, c], m[n, 1] -> grad x exp(x - m), [n, c].
  ops.push_back({"sum_exp_rows_backward", 3, 3, {}, [](const Metas& in, const Attributes&) {
                   return std::vector{like(*in[1], in[1]->shape, any_requires_grad(in))};
                 }});
  // pick: logits[n, c], targets (i64)[n] -> [n, 1]: logits[i, targets[i] - offset] where that
  // is one of the c columns and targets[i] != ignore_index, else 0 (`offset`: the first class
  // a rank's columns hold, set by the rewriter).
  ops.push_back({"pick", 2, 2,
                 {{"ignore_index", AttrType::integer, false, std::int64_t{-100}}, {"offset", AttrType::integer, false, std::int64_t{0}}},
                 [](const Metas& in, const Attributes&) {
                   floating(*in[0], "logits");
                   if (in[0]->rank() != 2 || in[1]->rank() != 1 || in[0]->shape[0] != in[1]->shape[0]) fail("needs logits [n, classes] and targets [n]");
                   if (in[1]->dtype != DType::i64) fail("targets must be i64");
                   return std::vector{like(*in[0], Shape{in[0]->shape[0], 1}, in[0]->requires_grad)};
                 }});
  // pick_backward: grad[n, 1], targets (i64)[n] -> [n, num_classes]: zero but grad[i] at the
  // column pick read.
  ops.push_back({"pick_backward", 2, 2,
                 {{"num_classes", AttrType::integer, true, {}}, {"ignore_index", AttrType::integer, false, std::int64_t{-100}},
                  {"offset", AttrType::integer, false, std::int64_t{0}}},
                 [](const Metas& in, const Attributes& a) {
                   if (in[0]->rank() != 2 || in[1]->rank() != 1 || in[0]->shape[0] != in[1]->shape[0]) fail("needs grad [n, 1] and targets [n]");
                   return std::vector{like(*in[0], Shape{in[0]->shape[0], std::get<std::int64_t>(a.at("num_classes"))}, in[0]->requires_grad)};
                 }});
  // valid_rows: targets (i64)[n] -> [n, 1] of `dtype`: 1 where targets[i] != ignore_index, else 0.
  ops.push_back({"valid_rows", 1, 1,
                 {{"ignore_index", AttrType::integer, false, std::int64_t{-100}}, {"dtype", AttrType::string, false, std::string("f32")}},
                 [](const Metas& in, const Attributes& a) {
                   auto dtype = parse_dtype(std::get<std::string>(a.at("dtype")));
                   if (!dtype || !is_floating(*dtype)) fail("dtype must name a floating type");
                   if (in[0]->dtype != DType::i64 || in[0]->rank() != 1) fail("targets must be i64 [n]");
                   return std::vector{TensorMeta{{in[0]->shape[0], 1}, *dtype, in[0]->device, false}};
                 }});
  // linear_weight_grad: g [..., out], x [..., in] -> [out, in] = the sum over every leading
  // position of g^T x: linear's weight gradient without flattening the leading dims first (a
  // sequence shard of [batch, seq, ...] is not a shard of the flattened rows; context
  // parallelism's backward, train/context_parallel.h).
  ops.push_back({"linear_weight_grad", 2, 2, {}, [](const Metas& in, const Attributes&) {
                   same_dtype(in);
                   floating(*in[0], "g");
                   const Shape &g = in[0]->shape, &x = in[1]->shape;
                   if (g.size() < 2 || g.size() != x.size() || !std::equal(g.begin(), g.end() - 1, x.begin())) {
                     fail("g and x must agree on every dim but the last, of at least 2 dims: " + shape_str(g) + " and " + shape_str(x));
                   }
                   return std::vector{like(*in[0], Shape{g.back(), x.back()}, any_requires_grad(in))};
                 }});
  // count_valid: targets (i64)[...] -> the number of entries != ignore_index, a scalar of `dtype`
  // (the denominator of a mean loss, kept apart so that it can be summed across ranks).
  ops.push_back({"count_valid", 1, 1,
                 {{"ignore_index", AttrType::integer, false, std::int64_t{-100}},
                  {"dtype", AttrType::string, false, std::string("f32")}},
                 [](const Metas& in, const Attributes& a) {
                   auto dtype = parse_dtype(std::get<std::string>(a.at("dtype")));
                   if (!dtype || !is_floating(*dtype)) fail("dtype must name a floating type");
                   if (in[0]->dtype != DType::i64) fail("targets must be i64");
                   return std::vector{TensorMeta{{}, *dtype, in[0]->device, false}};
                 }});

  // ---- Ops that gradients and the optimizer need ----
  // value / x, min(x, value), value ** x
  for (const char* n : {"rdiv_scalar", "clamp_max_scalar", "rpow_scalar"}) ops.push_back(scalar(n));
  for (const char* n : {"zeros_like", "ones_like"}) ops.push_back(unary(n, false));
  // sum_to: the reverse of expand (core/src/ops/shape.cpp), summing the broadcast dims away
  // (as at::sum_to).
  ops.push_back({"sum_to", 1, 1, {{"shape", AttrType::ints, true, {}}}, [](const Metas& in, const Attributes& a) {
                   const Shape& shape = std::get<Shape>(a.at("shape"));
                   if (broadcast(shape, in[0]->shape) != in[0]->shape) fail("cannot sum " + shape_str(in[0]->shape) + " to " + shape_str(shape));
                   return std::vector{like(*in[0], shape, in[0]->requires_grad)};
                 }});
  // Backward ops: (grad_out, saved...) -> grad_in, with the ATen backward kernel of the same name.
  auto grad_like = [](int grad_input, int like_input) {
    return [=](const Metas& in, const Attributes&) {
      same_dtype({in[0], in[static_cast<std::size_t>(like_input)]});
      if (in[0]->shape != in[static_cast<std::size_t>(grad_input)]->shape) fail("grad and input shapes differ");
      return std::vector{like(*in[static_cast<std::size_t>(like_input)], in[static_cast<std::size_t>(like_input)]->shape,
                              any_requires_grad(in))};
    };
  };
  for (const char* n : {"relu_backward", "silu_backward"}) ops.push_back({n, 2, 2, {}, grad_like(1, 1)});
  const AttrSpec approximate{"approximate", AttrType::string, false, std::string("none")};
  auto check_approximate = [](const Attributes& a) {
    const auto& v = std::get<std::string>(a.at("approximate"));
    if (v != "none" && v != "tanh") fail("approximate must be \"none\" or \"tanh\", got \"" + v + "\"");
  };
  ops.push_back({"gelu_backward", 2, 2, {approximate}, [grad_like, check_approximate](const Metas& in, const Attributes& a) {
                   check_approximate(a);
                   return grad_like(1, 1)(in, a);
                 }});
  for (const char* n : {"softmax_backward", "log_softmax_backward"}) {
    ops.push_back({n, 2, 2, {{"dim", AttrType::integer, false, std::int64_t{-1}}}, grad_like(1, 1)});
  }
  // cross_entropy_backward: grad (scalar), logits[n, c], targets[n] -> grad_logits[n, c].
  ops.push_back({"cross_entropy_backward", 3, 3,
                 {{"ignore_index", AttrType::integer, false, std::int64_t{-100}},
                  {"reduction", AttrType::string, false, std::string("mean")}},
                 [](const Metas& in, const Attributes&) {
                   return std::vector{like(*in[1], in[1]->shape, any_requires_grad(in))};
                 }});
  // rms_norm_backward: grad, x, weight -> (grad_x, grad_weight).
  ops.push_back({"rms_norm_backward", 3, 3, {{"eps", AttrType::floating, false, 1e-6}}, [](const Metas& in, const Attributes&) {
                   return std::vector{like(*in[1], in[1]->shape, true), like(*in[2], in[2]->shape, true)};
                 }});
  // layer_norm_backward: grad, x, weight, bias -> (grad_x, grad_weight, grad_bias).
  ops.push_back({"layer_norm_backward", 4, 4, {{"eps", AttrType::floating, false, 1e-5}}, [](const Metas& in, const Attributes&) {
                   return std::vector{like(*in[1], in[1]->shape, true), like(*in[2], in[2]->shape, true),
                                      like(*in[3], in[3]->shape, true)};
                 }});
  // sdpa_backward: grad, q, k, v, out, logsumexp -> (grad_q, grad_k, grad_v).
  ops.push_back({"sdpa_backward", 6, 6, attention_attrs, [](const Metas& in, const Attributes&) {
                   return std::vector{like(*in[1], in[1]->shape, true), like(*in[2], in[2]->shape, true),
                                      like(*in[3], in[3]->shape, true)};
                 }});
  // found_inf: x (floating) -> 1.0 when any element of x is inf or nan, else 0.0, a float32
  // scalar (torch.amp.GradScaler's found_inf, from _amp_foreach_non_finite_check_and_unscale_).
  ops.push_back({"found_inf", 1, 1, {}, [](const Metas& in, const Attributes&) {
                   floating(*in[0], "found_inf's input");
                   return std::vector{TensorMeta{{}, DType::f32, in[0]->device, false}};
                 }});
  // adamw: one AdamW update of one parameter (Loshchilov & Hutter 2019, as torch.optim.AdamW's
  // single-tensor path): (param, grad, exp_avg, exp_avg_sq, lr [], step [] [, found_inf []]) ->
  // (param', exp_avg', exp_avg_sq'). step is the 1-based count after this update. With
  // found_inf (float16 loss scaling) the update is skipped, state unchanged, when it is nonzero
  // (the fused kernels' found_inf, as GradScaler.step skips optimizer.step).
  ops.push_back({"adamw", 6, 7,
                 {{"beta1", AttrType::floating, false, 0.9},
                  {"beta2", AttrType::floating, false, 0.999},
                  {"eps", AttrType::floating, false, 1e-8},
                  {"weight_decay", AttrType::floating, false, 0.01}},
                 [](const Metas& in, const Attributes&) {
                   same_dtype({in[0], in[1], in[2], in[3]});
                   for (int i = 1; i < 4; ++i) {
                     if (in[static_cast<std::size_t>(i)]->shape != in[0]->shape) fail("grad and state must have the parameter's shape");
                   }
                   if (!in[4]->shape.empty() || !in[5]->shape.empty()) fail("lr and step must be scalars");
                   if (in.size() > 6 && (!in[6]->shape.empty() || in[6]->dtype != DType::f32)) fail("found_inf must be a float32 scalar");
                   return std::vector{like(*in[0], in[0]->shape, false), like(*in[2], in[2]->shape, false),
                                      like(*in[3], in[3]->shape, false)};
                 }});
  // ---- Communication (inserted by the rewriter into per-rank graphs) ----
  // mesh_dim names the process group: the ranks that differ from this one only along that
  // mesh dim. sizes: the chunk sizes of all group members along `dim` (torch.chunk); index:
  // this rank's position in the group. Semantics as torch.distributed's collectives.
  const AttrSpec mesh_dim{"mesh_dim", AttrType::integer, true, {}};
  const AttrSpec reduce_op{"op", AttrType::string, false, std::string("sum")};
  const AttrSpec index{"index", AttrType::integer, true, {}};
  ops.push_back({"all_reduce", 1, 1, {mesh_dim, reduce_op}, [](const Metas& in, const Attributes&) { return std::vector{*in[0]}; }});
  ops.push_back({"all_gather", 1, 1, {mesh_dim, {"dim", AttrType::integer, true, {}}, {"sizes", AttrType::ints, true, {}}, index},
                 [=](const Metas& in, const Attributes& a) {
                   Shape s = in[0]->shape;
                   auto d = static_cast<std::size_t>(wrap_dim(std::get<std::int64_t>(a.at("dim")), in[0]->rank()));
                   if (s[d] != at_index(a, "sizes")) fail("the local dim " + std::to_string(d) + " is not this rank's chunk size");
                   s[d] = sum_of(std::get<Shape>(a.at("sizes")));
                   return std::vector{like(*in[0], s, in[0]->requires_grad)};
                 }});
  ops.push_back({"reduce_scatter", 1, 1,
                 {mesh_dim, {"dim", AttrType::integer, true, {}}, reduce_op, {"sizes", AttrType::ints, true, {}}, index},
                 scatter_dim});
  // all_to_all: Shard(gather_dim) -> Shard(scatter_dim) along the group.
  ops.push_back({"all_to_all", 1, 1,
                 {mesh_dim, {"gather_dim", AttrType::integer, true, {}}, {"scatter_dim", AttrType::integer, true, {}},
                  {"gather_sizes", AttrType::ints, true, {}}, {"scatter_sizes", AttrType::ints, true, {}}, index},
                 [=](const Metas& in, const Attributes& a) {
                   Shape s = in[0]->shape;
                   auto g = static_cast<std::size_t>(wrap_dim(std::get<std::int64_t>(a.at("gather_dim")), in[0]->rank()));
                   auto c = static_cast<std::size_t>(wrap_dim(std::get<std::int64_t>(a.at("scatter_dim")), in[0]->rank()));
                   if (s[g] != at_index(a, "gather_sizes") || s[c] != sum_of(std::get<Shape>(a.at("scatter_sizes")))) {
                     fail("local shape does not match gather_sizes / scatter_sizes");
                   }
                   s[g] = sum_of(std::get<Shape>(a.at("gather_sizes")));
                   s[c] = at_index(a, "scatter_sizes");
                   return std::vector{like(*in[0], s, in[0]->requires_grad)};
                 }});
  // to_partial (local, Replicate -> Partial(sum)): the value on index 0, zeros elsewhere.
  ops.push_back({"to_partial", 1, 1, {index}, [](const Metas& in, const Attributes&) { return std::vector{*in[0]}; }});
  // Point to point between pipeline stages (torch.distributed's isend / irecv, as
  // torch.distributed.pipelining's stages exchange activations and their gradients). peer: the
  // global rank on the other side; tag: what the pair's two nodes share (0 to 2^24 - 1).
  // send: x -> a f32[] token, complete when x has gone (nothing reads it; the executor waits for
  // it at the end of the step). recv: () -> a tensor of `shape` and `dtype` ("f32", ...).
  const AttrSpec peer{"peer", AttrType::integer, true, {}};
  const AttrSpec tag{"tag", AttrType::integer, true, {}};
  ops.push_back({"send", 1, 1, {peer, tag}, [](const Metas& in, const Attributes&) {
                   return std::vector{TensorMeta{{}, DType::f32, in[0]->device, false}};
                 }});
  ops.push_back({"recv", 0, 0,
                 {peer, tag, {"shape", AttrType::ints, true, {}}, {"dtype", AttrType::string, true, {}},
                  {"device", AttrType::string, false, std::string("cpu")}},
                 [](const Metas&, const Attributes& a) {
                   const auto dtype = parse_dtype(std::get<std::string>(a.at("dtype")));
                   if (!dtype) fail("recv: unknown dtype '" + std::get<std::string>(a.at("dtype")) + "'");
                   return std::vector{TensorMeta{std::get<Shape>(a.at("shape")), *dtype, std::get<std::string>(a.at("device")), false}};
                 }});
  return ops;
}

}  // namespace

void OpRegistry::add(OpSchema schema) {
  const std::string name = schema.name;
  if (!ops_.emplace(name, std::move(schema)).second) throw std::invalid_argument("op '" + name + "' registered twice");
}

const OpSchema* OpRegistry::find(const std::string& name) const {
  auto it = ops_.find(name);
  return it == ops_.end() ? nullptr : &it->second;
}

std::vector<std::string> OpRegistry::names() const {
  std::vector<std::string> out;
  for (const auto& [name, schema] : ops_) out.push_back(name);
  return out;
}

std::int64_t balanced_piece(std::int64_t slot, std::int64_t chunks) { return slot % 2 == 0 ? slot / 2 : chunks - 1 - slot / 2; }

bool blocked_attention(const Node& node) {
  return node.attr_bool("causal") && (node.attr_int("chunks") > 1 || node.attr_int("q_offset") > 0);
}

namespace {
// Function-local, so that core/src/ops/'s definitions at load time find it constructed.
OpRegistry& mutable_global() {
  static OpRegistry registry = [] {
    OpRegistry r;
    for (auto& op : builtin_ops()) r.add(std::move(op));
    return r;
  }();
  return registry;
}
}  // namespace

void OpRegistry::define(OpSchema schema) {
  schema.defined_by_record = true;
  mutable_global().add(std::move(schema));
}

const OpRegistry& OpRegistry::global() { return mutable_global(); }

namespace infer {

[[noreturn]] void fail(const std::string& why) { throw IrError(why); }

std::int64_t wrap_dim(std::int64_t dim, std::int64_t rank, const char* what) {
  const std::int64_t r = std::max<std::int64_t>(rank, 1);
  if (dim < -r || dim >= r) {
    fail(std::string(what) + " " + std::to_string(dim) + " is out of range for a tensor of rank " + std::to_string(rank));
  }
  return dim < 0 ? dim + r : dim;
}

void same_dtype(const Metas& in) {
  for (const TensorMeta* m : in) {
    if (m->dtype != in[0]->dtype) fail("dtypes differ (" + in[0]->str() + " vs " + m->str() + "); cast explicitly");
  }
}

void floating(const TensorMeta& m, const char* what) {
  if (!is_floating(m.dtype)) fail(std::string(what) + " must be floating point, got " + m.str());
}

bool any_requires_grad(const Metas& in) {
  return std::any_of(in.begin(), in.end(), [](const TensorMeta* m) { return m->requires_grad; });
}

TensorMeta like(const TensorMeta& m, Shape shape, bool requires_grad) {
  TensorMeta out = m;
  out.shape = std::move(shape);
  out.requires_grad = requires_grad;
  return out;
}

// NumPy broadcasting, as torch.broadcast_shapes.
Shape broadcast(const Shape& a, const Shape& b) {
  const std::size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::int64_t x = i < n - a.size() ? 1 : a[i - (n - a.size())];
    const std::int64_t y = i < n - b.size() ? 1 : b[i - (n - b.size())];
    if (x != y && x != 1 && y != 1) fail("shapes " + shape_str(a) + " and " + shape_str(b) + " do not broadcast");
    out[i] = x == 1 ? y : x;
  }
  return out;
}

std::int64_t sum_of(const Shape& sizes) { return std::accumulate(sizes.begin(), sizes.end(), std::int64_t{0}); }

std::int64_t at_index(const Attributes& a, const char* key) {
  const Shape& sizes = std::get<Shape>(a.at(key));
  const auto index = std::get<std::int64_t>(a.at("index"));
  if (index < 0 || index >= static_cast<std::int64_t>(sizes.size())) fail("index " + std::to_string(index) + " outside " + key);
  return sizes[static_cast<std::size_t>(index)];
}

std::vector<TensorMeta> scatter_dim(const Metas& in, const Attributes& a) {
  Shape s = in[0]->shape;
  auto d = static_cast<std::size_t>(wrap_dim(std::get<std::int64_t>(a.at("dim")), in[0]->rank()));
  if (s[d] != sum_of(std::get<Shape>(a.at("sizes")))) fail("dim " + std::to_string(d) + " is not the sum of sizes");
  s[d] = at_index(a, "sizes");
  return std::vector{like(*in[0], s, in[0]->requires_grad)};
}

}  // namespace infer

}  // namespace spmdx::ir
