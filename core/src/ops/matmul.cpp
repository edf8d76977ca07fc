// Matrix products: matmul (torch.matmul), linear (torch.nn.functional.linear) and linear's
// weight gradient over leading dims (linear_weight_grad). Each costs 2 M N K FLOPs, runs in the
// compute dtype under mixed precision (autocast's lower-precision list) and is kept by
// selective activation checkpointing (torchtitan's op SAC list), bar the weight gradient, a
// backward op.
#include "common.h"

namespace spmdx::ops {
namespace {

// 2 M N K: two FLOPs for each output element and each element of the contracted dim, the last
// of input 0 (x's in_features, a's k).
[[maybe_unused]] double contracted_flops(const Node& n) {
  const auto& s = n.input(0)->meta().shape;
  return 2 * static_cast<double>(n.output()->meta().numel()) * (s.empty() ? 1.0 : static_cast<double>(s.back()));
}

// The contiguous() copy ATen's kernel makes of input i when it is strided.
[[maybe_unused]] std::int64_t copy_if_strided(const Node& n, const ir::LayoutQuery& q, int i) { return q.contiguous(i) ? 0 : n.input(i)->meta().nbytes(); }

}  // namespace

// matmul: a[..., m, k] @ b[..., k, n] -> [broadcast(...), m, n], as torch.matmul for rank >= 2;
// the gradients as derivatives.yaml's (g b^T, a^T g, each summed to its operand's shape).
SPMDX_OP([] {
  Op op;
  OpSchema& s = op.schema;
  s.name = "matmul";
  s.min_inputs = s.max_inputs = 2;
  s.infer = [](const Metas& in, const Attributes&) {
    same_dtype(in);
    const Shape& a = in[0]->shape;
    const Shape& b = in[1]->shape;
    if (a.size() < 2 || b.size() < 2) fail("both operands need rank >= 2");
    if (a.back() != b[b.size() - 2]) {
      fail("inner dimensions differ (" + std::to_string(a.back()) + " vs " + std::to_string(b[b.size() - 2]) + ")");
    }
    Shape out = broadcast(Shape(a.begin(), a.end() - 2), Shape(b.begin(), b.end() - 2));
    out.push_back(a[a.size() - 2]);
    out.push_back(b.back());
    return std::vector{like(*in[0], out, any_requires_grad(in))};
  };
  s.vjp = [](Graph& g, const Node& n, const Grads& go) {
    Attributes last_two{{"dim0", std::int64_t{-1}}, {"dim1", std::int64_t{-2}}};
    Value* ga = g.add("matmul", {go[0], g.add("transpose", {n.input(1)}, last_two)});
    Value* gb = g.add("matmul", {g.add("transpose", {n.input(0)}, last_two), go[0]});
    return Grads{reduce_to(g, ga, n.input(0)), reduce_to(g, gb, n.input(1))};
  };
  s.flops = contracted_flops;
  s.scratch = [](const Node& n, const ir::LayoutQuery& q) -> std::int64_t {
    const ir::DType t = n.input(0)->meta().dtype;
    if (t == ir::DType::bf16 || t == ir::DType::f16) {  // computed in float32 on a CPU without bf16/fp16 dot products: the inputs and the result upcast (an upper bound)
      return 2 * (n.input(0)->meta().nbytes() + n.input(1)->meta().nbytes() + n.output()->meta().nbytes());
    }
    return copy_if_strided(n, q, 0) + (n.input(1)->meta().shape.size() > 2 ? copy_if_strided(n, q, 1) : 0);
  };
  s.precision = ir::Precision::low;
  s.saved_by_selective = true;
  s.samples = {{"matmul", {{{4, 6, 4}}, {{4, 6}}}, {}}, {"matmul_batched", {{{4, 6, 4}}, {{4, 4, 6}}}, {}}};
  // Batch dims alike (Replicate where an operand broadcasts), a's rows, b's columns, the
  // contracted dim split on both (Partial), or linear in either operand.
  op.rules = [](const Node&, const std::vector<Shape>& in, const std::vector<Shape>& out, std::int64_t k) {
    const Shape &a = in[0], &b = in[1], &o = out[0];
    const auto ra = static_cast<std::int64_t>(a.size()), rb = static_cast<std::int64_t>(b.size()), ro = static_cast<std::int64_t>(o.size());
    Strategies st{{{R(), R()}, {R()}}};
    for (std::int64_t d = 0; d < ro - 2; ++d) {  // batch dims
      if (o[static_cast<std::size_t>(d)] < k) continue;
      auto align = [&](const Shape& x, std::int64_t rx) -> Placement {
        const std::int64_t ad = d - (ro - rx);
        return ad < 0 || x[static_cast<std::size_t>(ad)] == 1 ? R() : S(ad);
      };
      st.push_back({{align(a, ra), align(b, rb)}, {S(d)}});
    }
    if (a[static_cast<std::size_t>(ra - 2)] >= k) st.push_back({{S(ra - 2), R()}, {S(ro - 2)}});
    if (b[static_cast<std::size_t>(rb - 1)] >= k) st.push_back({{R(), S(rb - 1)}, {S(ro - 1)}});
    if (a[static_cast<std::size_t>(ra - 1)] >= k) st.push_back({{S(ra - 1), S(rb - 2)}, {P()}});
    st.push_back({{P(), R()}, {P()}});
    st.push_back({{R(), P()}, {P()}});
    return st;
  };
  return op;
}())

// linear: x[..., in], weight[out, in] -> [..., out] = x weight^T, as
// torch.nn.functional.linear without bias; the weight's gradient over the rows of x flattened.
SPMDX_OP([] {
  Op op;
  OpSchema& s = op.schema;
  s.name = "linear";
  s.min_inputs = s.max_inputs = 2;
  s.infer = [](const Metas& in, const Attributes&) {
    same_dtype(in);
    const Shape& x = in[0]->shape;
    const Shape& w = in[1]->shape;
    if (x.empty() || w.size() != 2) fail("linear needs x[..., in] and weight[out, in]");
    if (x.back() != w[1]) fail("in_features differ (x has " + std::to_string(x.back()) + ", weight " + std::to_string(w[1]) + ")");
    Shape out = x;
    out.back() = w[0];
    return std::vector{like(*in[0], out, any_requires_grad(in))};
  };
  s.vjp = [](Graph& g, const Node& n, const Grads& go) {  // y = x W^T
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
  s.flops = contracted_flops;
  s.scratch = [](const Node& n, const ir::LayoutQuery& q) { return copy_if_strided(n, q, 0); };
  s.precision = ir::Precision::low;
  s.saved_by_selective = true;
  s.samples = {{"linear", {{{4, 6, 4}}, {{6, 4}}}, {}}};
  op.rules = [](const Node&, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t k) {
    const Shape &x = in[0], &w = in[1];
    const auto rx = static_cast<std::int64_t>(x.size());
    Strategies st{{{R(), R()}, {R()}}};
    for (std::int64_t d = 0; d < rx - 1; ++d) {
      if (x[static_cast<std::size_t>(d)] >= k) st.push_back({{S(d), R()}, {S(d)}});
    }
    if (w[0] >= k) st.push_back({{R(), S(0)}, {S(rx - 1)}});  // column parallel
    if (w[1] >= k) st.push_back({{S(rx - 1), S(1)}, {P()}});  // row parallel
    st.push_back({{P(), R()}, {P()}});
    return st;
  };
  return op;
}())

// linear_weight_grad: g [..., out], x [..., in] -> [out, in] = the sum over every leading
// position of g^T x: linear's weight gradient without flattening the leading dims first (a
// sequence shard of [batch, seq, ...] is not a shard of the flattened rows; context
// parallelism's backward, train/context_parallel.h). A backward op: no VJP.
SPMDX_OP([] {
  Op op;
  OpSchema& s = op.schema;
  s.name = "linear_weight_grad";
  s.min_inputs = s.max_inputs = 2;
  s.infer = [](const Metas& in, const Attributes&) {
    same_dtype(in);
    floating(*in[0], "g");
    const Shape &g = in[0]->shape, &x = in[1]->shape;
    if (g.size() < 2 || g.size() != x.size() || !std::equal(g.begin(), g.end() - 1, x.begin())) {
      fail("g and x must agree on every dim but the last, of at least 2 dims: " + ir::shape_str(g) + " and " + ir::shape_str(x));
    }
    return std::vector{like(*in[0], Shape{g.back(), x.back()}, any_requires_grad(in))};
  };
  // [out, in] from g [rows, out]: 2 * out * in * rows (rows = every dim of g but its last; 0 / 0 for a zero-size one)
  s.flops = [](const Node& n) {
    const ir::TensorMeta& g = n.input(0)->meta();
    return 2 * static_cast<double>(n.output()->meta().numel()) * (g.shape.empty() ? 1.0 : static_cast<double>(g.numel_without(-1)));
  };
  s.samples = {{"linear_weight_grad", {{{4, 6, 5}}, {{4, 6, 3}}}, {}, false}};
  // g^T x summed over the leading dims: a leading dim split alike gives partial sums; g's
  // last dim split gives rows of the result, x's its columns.
  op.rules = [](const Node&, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t k) {
    const std::size_t last = in[0].size() - 1;
    Strategies st{{{R(), R()}, {R()}}};
    for (std::size_t d = 0; d < last; ++d) {
      if (in[0][d] >= k) st.push_back({{S(static_cast<std::int64_t>(d)), S(static_cast<std::int64_t>(d))}, {P()}});
    }
    if (in[0][last] >= k) st.push_back({{S(static_cast<std::int64_t>(last)), R()}, {S(0)}});
    if (in[1][last] >= k) st.push_back({{R(), S(static_cast<std::int64_t>(last))}, {S(1)}});
    st.push_back({{P(), R()}, {P()}});
    st.push_back({{R(), P()}, {P()}});
    return st;
  };
  return op;
}())

// bfloat16 / float16 on a CPU: ATen's kernel of the dtype where the CPU has its dot products
// (AVX512-BF16, AMX; oneDNN underneath, as PyTorch's own bfloat16 linear and matmul), else a
// float32 GEMM of the upcast operands rounded back (exec::half_gemm: ATen's half kernel runs up
// to 50 times slower than float32 without them, 1.2 of 1.4 s of a debugmodel bf16 step on an
// AVX2 machine). Both accumulate in float32 and round once, as PyTorch's kernel.
SPMDX_KERNEL("matmul", [](const Node&, const Tensors& x) {
  if (exec::upcast_half_gemm(x[0]) || exec::strided_half_operand(x[0])) return one(exec::cpu_half_aware_matmul(x[0], x[1]));
  // x [..., k] times a whole weight w [k, n] (the linear's input gradient) is x (w^T)^T.
  if (x[1].dim() == 2 && x[1].is_contiguous() && x[0].dim() >= 2) return one(exec::cpu_linear(x[0], x[1].t()));
  return one(at::matmul(x[0], x[1]));
})

SPMDX_KERNEL("linear", [](const Node&, const Tensors& x) { return one(exec::cpu_linear(x[0], x[1])); })

SPMDX_KERNEL("linear_weight_grad", [](const Node&, const Tensors& x) {
  std::int64_t rows = 1;  // explicit: a shard may hold 0 columns, which -1 cannot infer rows from
  for (std::int64_t d = 0; d + 1 < x[0].dim(); ++d) rows *= x[0].size(d);
  return one(exec::cpu_half_aware_matmul(x[0].reshape({rows, x[0].size(-1)}).t(), x[1].reshape({rows, x[1].size(-1)})));
})

}  // namespace spmdx::ops
