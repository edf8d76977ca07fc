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

std::vector<OpSchema> builtin_ops() {
  std::vector<OpSchema> ops;

  // Scaled dot-product attention: q[b, h, s, d], k and v [b, h, t, d] -> out [b, h, s, d] =
  // softmax(q k^T / sqrt(d) [+ causal mask, top-left aligned]) v, and its row logsumexp
  // [b, h, s] for the backward pass (as torch's flash attention; f32 for f16/bf16 inputs).
  // Context parallelism (train/context_parallel.h) adds two attributes, which matter only when
  // causal: `chunks` > 1 says the sequence of q, k and v is in load-balanced order (chunks
  // pieces of t / chunks positions, seq_permute's order), and q_offset that q's rows are the
  // rows from q_offset on of that sequence (a rank's shard); a key is seen by a query at or
  // after its position in the sequence as written in natural order.
  // `window` > 0 (causal only) keeps a key j for a query i when i - window < j <= i (Mistral's
  // and Qwen2's sliding window, transformers' sliding_window_causal_mask_function); a fourth
  // input, documents (i64 [b, t], one id a key row, laid out as k's rows and nondecreasing in
  // natural order), keeps only keys of the query's own document (torchtitan's block_causal).
  // Both run a tiled kernel that visits only the key blocks a query tile may see.
  const std::vector<AttrSpec> attention_attrs{{"causal", AttrType::boolean, false, true},
                                              {"chunks", AttrType::integer, false, std::int64_t{1}},
                                              {"q_offset", AttrType::integer, false, std::int64_t{0}},
                                              {"window", AttrType::integer, false, std::int64_t{0}}};
  ops.push_back({"sdpa", 3, 4, attention_attrs, [](const Metas& in, const Attributes& a) {
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
                     if (in[3]->dtype != DType::i64 || in[3]->shape != Shape{k[0], k[2]}) fail("documents must be i64 [batch, kv_seq] = " + shape_str({k[0], k[2]}));
                   }
                   TensorMeta lse = like(*in[0], Shape{q[0], q[1], q[2]}, false);
                   if (lse.dtype == DType::f16 || lse.dtype == DType::bf16) lse.dtype = DType::f32;
                   return std::vector{like(*in[0], q, any_requires_grad(in)), lse};
                 }});
  // document_ids: tokens (i64)[b, s] -> i64 [b, s], the document of each position: how many
  // `eos` tokens come before it in its row (torchtitan's get_document_mask_mod: an EOS belongs
  // to the document it ends), for sdpa's documents input (block_causal). With chunks > 1 the
  // rows are in context parallelism's load-balanced order (seq_permute's), and so are the ids;
  // they are counted in natural order.
  ops.push_back({"document_ids", 1, 1,
                 {{"eos", AttrType::integer, true, std::int64_t{0}}, {"chunks", AttrType::integer, false, std::int64_t{1}}},
                 [](const Metas& in, const Attributes& a) {
                   if (in[0]->dtype != DType::i64 || in[0]->rank() != 2) fail("tokens must be i64 [batch, seq]");
                   const std::int64_t chunks = std::get<std::int64_t>(a.at("chunks"));
                   if (chunks < 1 || in[0]->shape[1] % chunks != 0) fail("chunks " + std::to_string(chunks) + " does not divide the sequence of " + in[0]->str());
                   return std::vector{TensorMeta{in[0]->shape, DType::i64, in[0]->device, false}};
                 }});

  // ---- Ops that gradients and the optimizer need ----
  // expand: broadcast to `shape` (as torch.Tensor.expand); sum_to, the reverse, is in
  // core/src/ops/reduction.cpp.
  // sum_to: the reverse of expand (core/src/ops/shape.cpp), summing the broadcast dims away
  // (as at::sum_to).
  // Backward ops: (grad_out, saved...) -> grad_in, with the ATen backward kernel of the same name.
  auto grad_like = [](int grad_input, int like_input) {
    return [=](const Metas& in, const Attributes&) {
      return infer::grad_like(in, static_cast<std::size_t>(grad_input), static_cast<std::size_t>(like_input));
    };
  };
  // sdpa_backward: grad, q, k, v, out, logsumexp [, documents] -> (grad_q, grad_k, grad_v).
  ops.push_back({"sdpa_backward", 6, 7, attention_attrs, [](const Metas& in, const Attributes&) {
                   return std::vector{like(*in[1], in[1]->shape, true), like(*in[2], in[2]->shape, true),
                                      like(*in[3], in[3]->shape, true)};
                 }});
  // The communication ops are in core/src/ops/comm.cpp; chunk, the local half of
  // Replicate -> Shard, has their attributes: sizes, the chunk sizes of all group members along
  // `dim` (torch.chunk), and index, this rank's position in the group.
  const AttrSpec index{"index", AttrType::integer, true, {}};
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
  return !tiled_attention(node) && node.attr_bool("causal") && (node.attr_int("chunks") > 1 || node.attr_int("q_offset") > 0);
}

std::int64_t natural_position(std::int64_t row, std::int64_t total, std::int64_t chunks) {
  if (chunks <= 1) return row;
  const std::int64_t piece = total / chunks;
  return balanced_piece(row / piece, chunks) * piece + row % piece;
}

std::vector<AttentionTile> attention_tiles(std::int64_t q_rows, std::int64_t kv_rows, std::int64_t chunks, std::int64_t q_offset, std::int64_t window) {
  std::vector<AttentionTile> tiles;
  // Runs of rows at consecutive natural positions (a whole q, or one piece of the balanced
  // order), each cut into tiles of kAttentionTile rows.
  const std::int64_t run = chunks <= 1 ? std::max<std::int64_t>(q_rows, 1) : kv_rows / chunks;
  for (std::int64_t r0 = 0; r0 < q_rows; r0 += run) {
    const std::int64_t n = std::min(run, q_rows - r0), first = natural_position(q_offset + r0, kv_rows, chunks);
    for (std::int64_t t = 0; t < n; t += kAttentionTile) {
      const std::int64_t rows = std::min(kAttentionTile, n - t), position = first + t;
      const std::int64_t begin = window > 0 ? std::max<std::int64_t>(0, position - window + 1) : 0;
      tiles.push_back({r0 + t, rows, position, begin, std::min(position + rows, kv_rows)});
    }
  }
  return tiles;
}

bool tiled_attention(const Node& node) {
  const std::size_t documents = node.op() == "sdpa" ? 3 : 6;
  return node.attr_int("window") > 0 || node.inputs().size() > documents;
}

std::vector<AttentionTile> attention_tiles(const Node& node) {
  const bool forward = node.op() == "sdpa";
  const Shape &q = node.input(forward ? 0 : 1)->meta().shape, &k = node.input(forward ? 1 : 2)->meta().shape;
  return attention_tiles(q.at(2), k.at(2), node.attr_int("chunks"), node.attr_int("q_offset"), node.attr_int("window"));
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

std::vector<std::int64_t> dense_like(const std::vector<std::int64_t>& shape, const std::vector<std::int64_t>& like) {
  std::vector<std::size_t> dims(shape.size());
  std::iota(dims.begin(), dims.end(), 0);
  std::stable_sort(dims.begin(), dims.end(), [&](std::size_t a, std::size_t b) { return like[a] > like[b]; });
  std::vector<std::int64_t> s(shape.size(), 1);
  std::int64_t step = 1;
  for (std::size_t k = dims.size(); k-- > 0;) {
    s[dims[k]] = step;
    step *= std::max<std::int64_t>(shape[dims[k]], 1);
  }
  return s;
}

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

std::vector<TensorMeta> grad_like(const Metas& in, std::size_t grad_input, std::size_t like_input) {
  same_dtype({in[0], in[like_input]});
  if (in[0]->shape != in[grad_input]->shape) fail("grad and input shapes differ");
  return std::vector{like(*in[like_input], in[like_input]->shape, any_requires_grad(in))};
}

}  // namespace infer

}  // namespace spmdx::ir
