// Attention: scaled dot-product attention (sdpa, Vaswani et al. 2017, as
// torch.nn.functional.scaled_dot_product_attention with FlashAttention's log-sum-exp output:
// Dao 2023), its backward, and document_ids (torchtitan's block_causal masks). The kernels are
// ATen's fused attention of the device, or, for a sliding window or documents, the tiled kernel
// (exec::tiled_attention), or, for a rank's rows of a context-parallel sequence, the blocked
// kernel (exec::blocked_attention); the shared pieces stay in core/src/exec/kernels.cpp, which
// tests call directly. Sharding: batch or heads alike, or the query rows (context parallelism).
#include "common.h"

#include <algorithm>
#include <utility>

namespace spmdx::ops {
namespace {

// sdpa's and sdpa_backward's attributes. `chunks` > 1 says the sequence of q, k and v is in
// context parallelism's load-balanced order (chunks pieces of t / chunks positions,
// seq_permute's order); q_offset that q's rows are the rows from q_offset on of that sequence (a
// rank's shard); a key is seen by a query at or after its position in natural order. `window`
// > 0 (causal only) keeps a key j for a query i when i - window < j <= i (Mistral's and Qwen2's
// sliding window, transformers' sliding_window_causal_mask_function).
[[maybe_unused]] std::vector<ir::AttrSpec> attention_attrs() {
  return {{"causal", ir::AttrType::boolean, false, true},
          {"chunks", ir::AttrType::integer, false, std::int64_t{1}},
          {"q_offset", ir::AttrType::integer, false, std::int64_t{0}},
          {"window", ir::AttrType::integer, false, std::int64_t{0}}};
}

// 4 B H S^2 D for the score and value products of a forward (the cost model's count since it
// began: causal or not, a rank's rows or all), over the visited tiles only when tiled; the
// backward twice that.
[[maybe_unused]] double attention_flops(const Node& node) {
  const bool forward = node.op() == "sdpa";
  const auto& q = node.input(forward ? 0 : 1)->meta().shape;  // [B, H, S, D]
  double f = 4.0 * static_cast<double>(q[0] * q[1]) * static_cast<double>(q[2]) * static_cast<double>(q[2]) * static_cast<double>(q[3]);
  if (ir::tiled_attention(node)) {  // the visited tiles only (query rows x key rows each)
    double pairs = 0;
    for (const auto& t : ir::attention_tiles(node)) pairs += static_cast<double>(t.rows) * static_cast<double>(t.key_end - t.key_begin);
    f = 4.0 * static_cast<double>(q[0] * q[1]) * pairs * static_cast<double>(q[3]);
  }
  return forward ? f : 2 * f;
}

// Context parallelism's attention (exec::blocked_attention): per block of query rows,
// contiguous copies of its rows and of its keys' and values' rows (its own and the ones before
// it, gathered by index_select), two attention calls and their merge (in the log-sum-exp's
// dtype), written into outputs laid out as the fused kernel's.
[[maybe_unused]] std::int64_t blocked_scratch(const Node& n) {
  const bool forward = n.op() == "sdpa";
  const ir::TensorMeta &q = n.input(forward ? 0 : 1)->meta(), &k = n.input(forward ? 1 : 2)->meta();
  const ir::TensorMeta& lse = forward ? n.output(1)->meta() : n.input(5)->meta();
  const std::int64_t q_rows = std::max<std::int64_t>(q.shape.at(2), 1), kv_rows = std::max<std::int64_t>(k.shape.at(2), 1);
  const std::int64_t chunks = n.attr_int("chunks"), offset = n.attr_int("q_offset");
  const std::int64_t q_row = q.nbytes() / q_rows, k_row = k.nbytes() / kv_rows, lse_row = lse.nbytes() / q_rows;
  const std::int64_t wide = static_cast<std::int64_t>(ir::element_size(lse.dtype));  // the merge computes in the log-sum-exp's dtype
  std::vector<std::pair<std::int64_t, std::int64_t>> blocks;  // (rows, rows of keys wholly seen)
  if (chunks == 1) {
    blocks.emplace_back(q_rows, offset);
  } else {
    const std::int64_t piece = kv_rows / chunks;
    for (std::int64_t b = 0; piece > 0 && b < q_rows / piece; ++b) {
      blocks.emplace_back(piece, ir::balanced_piece(offset / piece + b, chunks) * piece);  // the pieces before it in natural order
    }
  }
  std::int64_t most = 0;
  for (const auto& [rows, seen] : blocks) {
    const std::int64_t qb = rows * q_row, lb = rows * lse_row, out_wide = rows * (q_row / std::max<std::int64_t>(static_cast<std::int64_t>(ir::element_size(q.dtype)), 1)) * wide;
    // Measured with the CPU's counting allocator (q [2, 4, 64, 16], k [2, 4, 128, 16], f32, cp 2
    // load-balanced): forward 179,456 and 138,496 bytes for ranks 0 and 1 (planned 199,680
    // and 166,912), backward 378,880 and 296,960 (planned exactly).
    const std::int64_t block = forward ? 2 * qb + lb + 2 * rows * k_row + (seen > 0 ? 2 * seen * k_row + qb + 2 * lb + out_wide : 0)
                                       : 4 * qb + 2 * lb + 4 * rows * k_row + (seen > 0 ? 5 * seen * k_row : 0);
    most = std::max(most, block);
  }
  return most;
}

// Tiled attention (exec::tiled_attention), as its materialising path allocates (the CPU's
// fused path allocates less: an upper bound there): q, k, v (and in the backward the gradient,
// out, lse and float dq, dk, dv) in the accumulation type, k and v reordered to natural order
// under context parallelism, and per tile its scores and probabilities (tile rows x visited
// keys) with the matmuls' products; the largest tile counts.
[[maybe_unused]] std::int64_t tiled_scratch(const Node& n) {
  const bool forward = n.op() == "sdpa";
  const ir::TensorMeta &q = n.input(forward ? 0 : 1)->meta(), &k = n.input(forward ? 1 : 2)->meta();
  const std::int64_t acc = q.dtype == ir::DType::f64 ? 8 : 4, b = q.shape.at(0), h = q.shape.at(1), d = q.shape.at(3);
  const std::int64_t q_acc = q.numel() * acc, k_acc = k.numel() * acc;
  const bool documents = n.inputs().size() > (forward ? 3u : 6u);
  std::int64_t tile = 0;
  for (const auto& t : ir::attention_tiles(n)) {
    const std::int64_t keys = t.key_end - t.key_begin, batches = documents ? 1 : b;
    const std::int64_t scores = batches * h * t.rows * keys * acc, products = batches * h * (t.rows + keys) * d * acc;
    tile = std::max(tile, (forward ? 2 : 3) * scores + (forward ? 1 : 2) * products + t.rows * keys * 24);
  }
  const std::int64_t docs = documents ? 3 * k.shape.at(0) * k.shape.at(2) * 8 : 0;
  if (forward) return q_acc + 4 * k_acc + docs + tile;
  return 5 * q_acc + 6 * k_acc + b * h * q.shape.at(2) * acc + docs + tile;
}

[[maybe_unused]] std::int64_t attention_scratch(const Node& n, const ir::LayoutQuery&) {
  if (ir::tiled_attention(n)) return tiled_scratch(n);
  if (ir::blocked_attention(n)) return blocked_scratch(n);
  return 0;  // ATen's fused kernel: its temporaries are per thread block, not counted
}

// Whether attention's query rows (`rows` of them as this mesh dim sees q) may be split k ways:
// evenly, and for a load-balanced sequence (chunks > 1) in whole pieces.
[[maybe_unused]] bool query_rows_split(const Node& n, std::int64_t rows, std::int64_t k) {
  if (rows < k) return false;
  const std::int64_t chunks = n.attr_int("chunks");
  if (chunks == 1) return true;
  const std::int64_t piece = n.input(n.op() == "sdpa" ? 1 : 2)->meta().shape[2] / chunks;
  return rows % k == 0 && (rows / k) % piece == 0;
}

// Attention's strategy with its documents input placed as `placement`, when it has one.
[[maybe_unused]] OpStrategy with_documents(OpStrategy s, bool has, const Placement& placement) {
  if (has) s.inputs.push_back(placement);
  return s;
}

// A rank's rows of q start at its shard's first row (the rewriter's column offset of q's dim 2).
[[maybe_unused]] Attributes rows_offset(const Node& node, const std::vector<Shape>&, std::int64_t column_offset) {
  Attributes a = node.attrs();
  a["q_offset"] = node.attr_int("q_offset") + column_offset;
  return a;
}

}  // namespace

// sdpa: q[b, h, s, d], k and v [b, h, t, d] [, documents (i64)[b, t]] -> out [b, h, s, d] =
// softmax(q k^T / sqrt(d) [+ causal mask, top-left aligned]) v, and its row logsumexp
// [b, h, s] for the backward pass (as torch's flash attention; f32 for f16/bf16 inputs). A
// fourth input, documents (one id a key row, laid out as k's rows and nondecreasing in natural
// order), keeps only keys of the query's own document (torchtitan's block_causal). A window or
// documents run the tiled kernel, which visits only the key blocks a query tile may see.
// Out is laid out as q, the log-sum-exp as [b, s, h] in memory (ATen's CPU flash attention).
SPMDX_OP([] {
  Op op;
  OpSchema& s = op.schema;
  s.name = "sdpa";
  s.min_inputs = 3;
  s.max_inputs = 4;
  s.attrs = attention_attrs();
  s.infer = [](const Metas& in, const Attributes& a) {
    same_dtype(Metas(in.begin(), in.begin() + 3));
    floating(*in[0], "q");
    const Shape& q = in[0]->shape;
    const Shape& k = in[1]->shape;
    const Shape& v = in[2]->shape;
    if (q.size() != 4 || k != v || k.size() != 4) fail("q must be [batch, heads, seq, head_dim], k and v the same [batch, heads, kv_seq, head_dim]");
    if (q[0] != k[0] || q[1] != k[1] || q[3] != k[3]) fail("q and k do not agree on batch, heads or head_dim");
    const std::int64_t chunks = std::get<std::int64_t>(a.at("chunks")), offset = std::get<std::int64_t>(a.at("q_offset"));
    if (chunks < 1 || k[2] % chunks != 0) fail("chunks must be >= 1 and divide the key sequence " + std::to_string(k[2]));
    if (offset < 0 || offset + q[2] > k[2]) fail("q_offset " + std::to_string(offset) + " puts q's rows past the key sequence");
    const std::int64_t window = std::get<std::int64_t>(a.at("window"));
    const bool causal = std::get<bool>(a.at("causal"));
    if (window < 0 || (window > 0 && !causal)) fail("window " + std::to_string(window) + " must be >= 0, and > 0 only with causal");
    if (in.size() == 4) {
      if (!causal) fail("documents mask causal attention only");
      if (in[3]->dtype != ir::DType::i64 || in[3]->shape != Shape{k[0], k[2]}) fail("documents must be i64 [batch, kv_seq] = " + ir::shape_str({k[0], k[2]}));
    }
    ir::TensorMeta lse = like(*in[0], Shape{q[0], q[1], q[2]}, false);
    if (lse.dtype == ir::DType::f16 || lse.dtype == ir::DType::bf16) lse.dtype = ir::DType::f32;
    return std::vector{like(*in[0], q, any_requires_grad(in)), lse};
  };
  s.vjp = [](Graph& g, const Node& n, const Grads& go) {
    std::vector<Value*> in{go[0], n.input(0), n.input(1), n.input(2), n.output(0), n.output(1)};
    if (n.inputs().size() == 4) in.push_back(n.input(3));  // the documents (block_causal): no gradient
    Node* b = g.add_node("sdpa_backward", in, n.attrs());
    if (n.inputs().size() == 4) return Grads{b->output(0), b->output(1), b->output(2), nullptr};
    return Grads{b->output(0), b->output(1), b->output(2)};
  };
  s.flops = attention_flops;
  s.scratch = attention_scratch;
  s.layout = [](const Node& n, std::size_t k, const ir::LayoutQuery& q) -> std::optional<ir::OutputLayout> {
    const Shape& shape = n.output(static_cast<int>(k))->meta().shape;
    if (k == 0) return ir::OutputLayout{ir::dense_like(shape, q.strides(0)), false};
    return ir::OutputLayout{ir::dense_like(shape, {shape[1] * shape[2], 1, shape[1]}), false};
  };
  s.precision = ir::Precision::low;
  s.saved_by_selective = true;
  s.samples = {{"sdpa_causal", {{{2, 2, 5, 4}}, {{2, 2, 5, 4}}, {{2, 2, 5, 4}}}, {{"causal", true}}},
               {"sdpa_full", {{{2, 2, 5, 4}}, {{2, 2, 6, 4}}, {{2, 2, 6, 4}}}, {{"causal", false}}},
               {"sdpa_window", {{{2, 2, 7, 4}}, {{2, 2, 7, 4}}, {{2, 2, 7, 4}}}, {{"window", std::int64_t{3}}}},
               {"sdpa_rows", {{{4, 4, 6, 8}}, {{4, 4, 6, 8}}, {{4, 4, 6, 8}}}, {}, false},
               {"sdpa_balanced", {{{4, 4, 8, 8}}, {{4, 4, 8, 8}}, {{4, 4, 8, 8}}}, {{"chunks", std::int64_t{4}}}, false},
               {"sdpa_window_rows", {{{4, 4, 8, 8}}, {{4, 4, 8, 8}}, {{4, 4, 8, 8}}}, {{"window", std::int64_t{3}}}, false},
               {"sdpa_window_balanced", {{{4, 4, 8, 8}}, {{4, 4, 8, 8}}, {{4, 4, 8, 8}}}, {{"window", std::int64_t{3}}, {"chunks", std::int64_t{4}}}, false}};
  // Batch or heads sharded alike on q, k, v (and out, logsumexp). Or the query rows (context
  // parallelism, Llama 3's all-gather attention: Dubey et al. 2024, 3.3.2) with k and v whole:
  // each rank attends its rows to every key it may see (local_attrs gives the kernel its rows'
  // q_offset). Document ids (a last input [b, t] laid out as k's rows) go with the batch, and
  // stay whole otherwise: every head and every query row may look up any key's document.
  op.rules = [](const Node& n, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t k) {
    const bool docs = in.size() == 4;
    Strategies st{sharding::rule::all(R(), in.size(), 2)};
    for (std::int64_t d : {0, 1}) {
      if (in[0][static_cast<std::size_t>(d)] >= k) st.push_back(with_documents(sharding::rule::all(S(d), 3, 2), docs, d == 0 ? S(0) : R()));
    }
    if (query_rows_split(n, in[0][2], k)) st.push_back(with_documents({{S(2), R(), R()}, {S(2), S(2)}}, docs, R()));
    return st;
  };
  op.local_attrs = rows_offset;
  return op;
}())
// ATen's fused attention of the device (exec::sdpa): no [s, t] matrix kept.
SPMDX_KERNEL("sdpa", [](const Node& n, const Tensors& x) {
  if (x[0].numel() == 0 || x[1].numel() == 0) {  // an empty shard: ATen's kernel divides by zero
    return Tensors{at::zeros_like(x[0]), at::zeros(n.output(1)->meta().shape, x[0].options().dtype(exec::to_aten(n.output(1)->meta().dtype)))};
  }
  if (ir::tiled_attention(n)) return exec::tiled_attention(x[0], x[1], x[2], exec::attention_mask(n, x, 3));
  if (ir::blocked_attention(n)) return exec::blocked_attention(n, x[0], x[1], x[2]);
  return exec::sdpa(x[0], x[1], x[2], n.attr_bool("causal"));
})

// sdpa_backward: grad, q, k, v, out, logsumexp [, documents] -> (grad_q, grad_k, grad_v), the
// probabilities recomputed from the log-sum-exp (FlashAttention's backward), each gradient
// [b, s, h, d] in memory (ATen's CPU flash attention backward).
SPMDX_OP([] {
  Op op;
  OpSchema& s = op.schema;
  s.name = "sdpa_backward";
  s.min_inputs = 6;
  s.max_inputs = 7;
  s.attrs = attention_attrs();
  s.infer = [](const Metas& in, const Attributes&) {
    return std::vector{like(*in[1], in[1]->shape, true), like(*in[2], in[2]->shape, true), like(*in[3], in[3]->shape, true)};
  };
  s.flops = attention_flops;
  s.scratch = attention_scratch;
  s.layout = [](const Node& n, std::size_t k, const ir::LayoutQuery&) -> std::optional<ir::OutputLayout> {
    const Shape& shape = n.output(static_cast<int>(k))->meta().shape;
    return ir::OutputLayout{ir::dense_like(shape, {shape[1] * shape[2] * shape[3], shape[3], shape[1] * shape[3], 1}), false};
  };
  // Rules only (the gradient of a backward op is not taken); out and the log-sum-exp are any
  // values here, which the kernel's row-local arithmetic does not mind.
  s.samples = {{"sdpa_backward_rows", {{{4, 4, 6, 8}}, {{4, 4, 6, 8}}, {{4, 4, 6, 8}}, {{4, 4, 6, 8}}, {{4, 4, 6, 8}, Fill::constant}, {{4, 4, 6}, Fill::constant}},
                {}, false}};
  // As sdpa's; with the query rows split, dk and dv are partial sums over each rank's rows.
  op.rules = [](const Node& n, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t k) {
    const bool docs = in.size() == 7;
    Strategies st{sharding::rule::all(R(), in.size(), 3)};
    for (std::int64_t d : {0, 1}) {
      if (in[1][static_cast<std::size_t>(d)] >= k) st.push_back(with_documents(sharding::rule::all(S(d), 6, 3), docs, d == 0 ? S(0) : R()));
    }
    if (query_rows_split(n, in[1][2], k)) st.push_back(with_documents({{S(2), S(2), R(), R(), S(2), S(2)}, {S(2), P(), P()}}, docs, R()));
    return st;
  };
  op.local_attrs = rows_offset;
  return op;
}())
SPMDX_KERNEL("sdpa_backward", [](const Node& n, const Tensors& x) {
  if (x[1].numel() == 0 || x[2].numel() == 0) return Tensors{at::zeros_like(x[1]), at::zeros_like(x[2]), at::zeros_like(x[3])};
  if (ir::tiled_attention(n)) return exec::tiled_attention_backward(x[0], x[1], x[2], x[3], x[4], x[5], exec::attention_mask(n, x, 6));
  if (ir::blocked_attention(n)) return exec::blocked_attention_backward(n, x[0], x[1], x[2], x[3], x[4], x[5]);
  return exec::sdpa_backward(x[0], x[1], x[2], x[3], x[4], x[5], n.attr_bool("causal"));
})

// document_ids: tokens (i64)[b, s] -> i64 [b, s], the document of each position: how many
// `eos` tokens come before it in its row (torchtitan's get_document_mask_mod: an EOS belongs
// to the document it ends), for sdpa's documents input (block_causal). With chunks > 1 the
// rows are in context parallelism's load-balanced order (seq_permute's), and so are the ids;
// they are counted in natural order.
SPMDX_OP([] {
  Op op;
  OpSchema& s = op.schema;
  s.name = "document_ids";
  s.min_inputs = s.max_inputs = 1;
  s.attrs = {{"eos", ir::AttrType::integer, true, std::int64_t{0}}, {"chunks", ir::AttrType::integer, false, std::int64_t{1}}};
  s.infer = [](const Metas& in, const Attributes& a) {
    if (in[0]->dtype != ir::DType::i64 || in[0]->rank() != 2) fail("tokens must be i64 [batch, seq]");
    const std::int64_t chunks = std::get<std::int64_t>(a.at("chunks"));
    if (chunks < 1 || in[0]->shape[1] % chunks != 0) fail("chunks " + std::to_string(chunks) + " does not divide the sequence of " + in[0]->str());
    return std::vector{ir::TensorMeta{in[0]->shape, ir::DType::i64, in[0]->device, false}};
  };
  s.samples = {{"document_ids", {{{4, 8}, Fill::indices, 4}}, {{"eos", std::int64_t{2}}}, false},
               {"document_ids_balanced", {{{4, 8}, Fill::indices, 4}}, {{"eos", std::int64_t{2}}, {"chunks", std::int64_t{4}}}, false}};
  // Each row's ids count along the whole row: split on the batch only.
  op.rules = [](const Node&, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t k) {
    Strategies st{sharding::rule::all(R(), 1, 1)};
    if (in[0][0] >= k) st.push_back(sharding::rule::all(S(0), 1, 1));
    return st;
  };
  return op;
}())
SPMDX_KERNEL("document_ids", [](const Node& n, const Tensors& x) { return one(exec::document_ids(x[0], n.attr_int("eos"), n.attr_int("chunks"))); })

}  // namespace spmdx::ops
