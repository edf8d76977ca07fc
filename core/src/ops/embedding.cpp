// Embeddings: the token embedding lookup (and its gradient, which adds rows into the weight)
// and the rotary position embedding of attention's queries and keys.
#include "common.h"

namespace spmdx::ops {
namespace {

const ir::AttrSpec kPaddingIdx{"padding_idx", ir::AttrType::integer, false, std::int64_t{-1}};

}  // namespace

// embedding: weight[num, dim], indices (i64 or i32)[...] -> [..., dim], as
// torch.nn.functional.embedding. padding_idx (-1: none) leaves the forward unchanged and zeroes
// that row of the weight's gradient (ATen's embedding_dense_backward). Computed in the low
// precision under mixed precision (autocast's lower-precision list).
SPMDX_OP([] {
  OpSchema s;
  s.name = "embedding";
  s.min_inputs = s.max_inputs = 2;
  s.attrs = {kPaddingIdx};
  s.infer = [](const Metas& in, const Attributes& a) {
    if (in[0]->rank() != 2) fail("the weight must be [num_embeddings, dim]");
    const std::int64_t pad = std::get<std::int64_t>(a.at("padding_idx"));
    if (pad < -1 || pad >= in[0]->shape[0]) {
      fail("padding_idx " + std::to_string(pad) + " is not a row of the weight [" + std::to_string(in[0]->shape[0]) + ", ...] (-1 for none)");
    }
    if (in[1]->dtype != ir::DType::i64 && in[1]->dtype != ir::DType::i32) fail("indices must be i64 or i32");
    Shape out = in[1]->shape;
    out.push_back(in[0]->shape[1]);
    return std::vector{like(*in[0], out, in[0]->requires_grad)};
  };
  s.vjp = [](Graph& g, const Node& n, const Grads& go) {
    return Grads{
        g.add("embedding_backward", {go[0], n.input(1)}, {{"num_weights", n.input(0)->meta().shape[0]}, {"padding_idx", n.attr_int("padding_idx")}}),
        nullptr};
  };
  s.precision = ir::Precision::low;
  s.samples = {{"embedding", {{{5, 6}}, {{4, 6}, Fill::indices}}, {}},
               {"embedding_padding_idx", {{{10, 6}}, {{4, 7}, Fill::indices}}, {{"padding_idx", std::int64_t{3}}}}};
  // Rows of indices split alike; or the weight's columns, which are the output's last dim.
  sharding::Rule rules = [](const Node&, const std::vector<Shape>& in, const std::vector<Shape>& out, std::int64_t k) {
    const Shape &w = in[0], &idx = in[1];
    Strategies st{{{R(), R()}, {R()}}};
    for (std::size_t d = 0; d < idx.size(); ++d) {
      if (idx[d] >= k) st.push_back({{R(), S(static_cast<std::int64_t>(d))}, {S(static_cast<std::int64_t>(d))}});
    }
    if (w[1] >= k) st.push_back({{S(1), R()}, {S(static_cast<std::int64_t>(out[0].size()) - 1)}});
    return st;
  };
  return Op{std::move(s), std::move(rules), nullptr};
}())
SPMDX_KERNEL("embedding", [](const Node& n, const Tensors& x) { return one(at::embedding(x[0], x[1], n.attr_int("padding_idx"))); })

// embedding_backward: grad[..., dim], indices[...] -> [num_weights, dim], the rows of grad added
// into the rows their indices name, padding_idx's row zero (ATen's embedding_dense_backward).
SPMDX_OP([] {
  OpSchema s;
  s.name = "embedding_backward";
  s.min_inputs = s.max_inputs = 2;
  s.attrs = {{"num_weights", ir::AttrType::integer, true, {}}, kPaddingIdx};
  s.infer = [](const Metas& in, const Attributes& a) {
    return std::vector{like(*in[0], Shape{std::get<std::int64_t>(a.at("num_weights")), in[0]->shape.back()}, in[0]->requires_grad)};
  };
  s.samples = {{"embedding_backward", {{{4, 6, 6}}, {{4, 6}, Fill::indices}}, {{"num_weights", std::int64_t{5}}}, false}};
  // Rows split alike give partial sums; grad's last dim split gives the weight's columns.
  sharding::Rule rules = [](const Node&, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t k) {
    const Shape &g = in[0], &idx = in[1];
    Strategies st{{{R(), R()}, {R()}}};
    for (std::size_t d = 0; d < idx.size(); ++d) {
      if (idx[d] >= k) st.push_back({{S(static_cast<std::int64_t>(d)), S(static_cast<std::int64_t>(d))}, {P()}});
    }
    if (g.back() >= k) st.push_back({{S(static_cast<std::int64_t>(g.size()) - 1), R()}, {S(1)}});
    st.push_back({{P(), R()}, {P()}});
    return st;
  };
  sharding::LocalAttrsFn local = [](const Node& n, const std::vector<Shape>& local_out, std::int64_t) {
    Attributes a = n.attrs();
    a["num_weights"] = local_out.at(0).at(0);
    return a;
  };
  return Op{std::move(s), std::move(rules), std::move(local)};
}())
SPMDX_KERNEL("embedding_backward", [](const Node& n, const Tensors& x) {
  return one(at::embedding_dense_backward(x[0], x[1], n.attr_int("num_weights"), n.attr_int("padding_idx"), false));
})

// rotary_embedding: x[b, s, h, d] with cos, sin [s, d/2]; rotates pairs by the angle whose cos
// and sin are given (Su et al. 2021, RoFormer). `style` "interleaved" pairs (x[2i], x[2i+1]), as
// torchtitan's llama3 apply_rotary_emb with complex freqs_cis; "half" pairs (x[i], x[i + d/2]),
// as Hugging Face's rotate_half and torchtitan's "cos_sin" RoPE backend (Qwen3):
// x cos + rotate_half(x) sin with rotate_half(x) = cat(-x[d/2:], x[:d/2]). The gradient is the
// inverse rotation (sin negated).
SPMDX_OP([] {
  OpSchema s;
  s.name = "rotary_embedding";
  s.min_inputs = s.max_inputs = 3;
  s.attrs = {{"style", ir::AttrType::string, false, std::string("interleaved")}};
  s.infer = [](const Metas& in, const Attributes& a) {
    same_dtype(in);
    const auto& style = std::get<std::string>(a.at("style"));
    if (style != "interleaved" && style != "half") fail("style must be \"interleaved\" or \"half\", got \"" + style + "\"");
    const Shape& x = in[0]->shape;
    if (x.size() != 4 || x[3] % 2 != 0) fail("x must be [batch, seq, heads, head_dim] with an even head_dim");
    const Shape want{x[1], x[3] / 2};
    if (in[1]->shape != want || in[2]->shape != want) fail("cos and sin must be " + ir::shape_str(want));
    return std::vector{like(*in[0], x, in[0]->requires_grad)};
  };
  s.vjp = [](Graph& g, const Node& n, const Grads& go) {
    return Grads{g.add("rotary_embedding", {go[0], n.input(1), g.add("neg", {n.input(2)})}, {{"style", n.attr_string("style")}}), nullptr, nullptr};
  };
  // The kernel's x.contiguous(): a copy of a strided x.
  s.scratch = [](const Node& n, const ir::LayoutQuery& q) -> std::int64_t { return q.contiguous(0) ? 0 : n.input(0)->meta().nbytes(); };
  s.samples = {{"rotary_embedding", {{{4, 6, 4, 8}}, {{6, 4}, Fill::constant}, {{6, 4}, Fill::constant}}, {}},
               {"rotary_embedding_half", {{{4, 6, 4, 8}}, {{6, 4}, Fill::constant}, {{6, 4}, Fill::constant}}, {{"style", std::string("half")}}}};
  // Batch or heads; or the sequence, with its rows of the tables.
  sharding::Rule rules = [](const Node&, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t k) {
    Strategies st{{{R(), R(), R()}, {R()}}};
    for (std::int64_t d : {0, 2}) {
      if (in[0][static_cast<std::size_t>(d)] >= k) st.push_back({{S(d), R(), R()}, {S(d)}});
    }
    if (in[0][1] >= k) st.push_back({{S(1), S(0), S(0)}, {S(1)}});
    st.push_back({{P(), R(), R()}, {P()}});
    return st;
  };
  return Op{std::move(s), std::move(rules), nullptr};
}())
SPMDX_KERNEL("rotary_embedding", [](const Node& n, const Tensors& x) {
  if (n.attr_string("style") == "half") {  // x1 cos - x2 sin, x2 cos + x1 sin over the two halves
    const std::int64_t s = x[0].size(1), half = x[0].size(3) / 2;
    const at::Tensor cos = x[1].view({1, s, 1, half}), sin = x[2].view({1, s, 1, half});
    const at::Tensor x1 = x[0].narrow(3, 0, half), x2 = x[0].narrow(3, half, half);
    return one(at::cat({x1 * cos - x2 * sin, x2 * cos + x1 * sin}, 3));
  }
  // One complex multiply over (re, im) pairs, as torchtitan's apply_rotary_emb: six strided
  // real kernels and a stack took 5% of a debugmodel step.
  const auto b = x[0].size(0), s = x[0].size(1), h = x[0].size(2), d = x[0].size(3);
  if (x[0].numel() == 0) return one(x[0].clone());
  at::Tensor pairs = at::view_as_complex(x[0].contiguous().view({b, s, h, d / 2, 2}));
  at::Tensor freqs = at::complex(x[1].contiguous(), x[2].contiguous()).view({1, s, 1, d / 2});
  return one(at::view_as_real(pairs * freqs).view({b, s, h, d}));
})

}  // namespace spmdx::ops
