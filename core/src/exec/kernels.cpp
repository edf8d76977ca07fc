#include "spmdx/exec/kernels.h"
#include "spmdx/ir/ops.h"
#include "spmdx/core/log.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/cpu/Utils.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <tuple>
#include <unordered_map>
#include <stdexcept>

namespace spmdx::exec {
namespace {

using Tensors = std::vector<at::Tensor>;
using ir::Node;

// The causal mask of scores [.., s, t]: true above the diagonal (key after query), as
// PyTorch's is_causal (top-left aligned).
at::Tensor future(const at::Tensor& scores) {
  return at::ones({scores.size(-2), scores.size(-1)}, scores.options().dtype(at::kBool)).triu(1);
}

// Scaled scores q k^T / sqrt(d), masked: [b, h, s, t].
at::Tensor scores(const at::Tensor& q, const at::Tensor& k, bool causal) {
  at::Tensor s = at::matmul(q, k.transpose(-2, -1)).mul_(1.0 / std::sqrt(static_cast<double>(q.size(-1))));
  if (causal) s.masked_fill_(future(s), -std::numeric_limits<double>::infinity());
  return s;
}


// One attention call: ATen's fused kernel of the device (sdpa(), kernels.h).
Tensors attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal) { return sdpa(q, k, v, causal); }
Tensors attend_backward(const at::Tensor& g, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                        const at::Tensor& lse, bool causal) {
  return sdpa_backward(g, q, k, v, out, lse, causal);
}

bool half(const at::Tensor& x) { return x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf; }

// The memory-efficient kernel pads its log-sum-exp's rows to a multiple of 32 (kAlignLSE, the
// backward's block of queries; PyTorch's mem_eff_attention kernel_forward.h); the sdpa op's
// is [b, h, s]. The backward reads rows < s only, at the strides it is given.
constexpr std::int64_t kEfficientLseAlign = 32;


// Causal attention of a block of query rows at known positions (context parallelism, the sdpa
// op's chunks and q_offset): the keys before the block's first position are all seen, the
// block's own positions causally. `rows` are the block's rows of the local q, `prefix` the key
// rows wholly seen (may be empty), `own` the first key row of the block's positions.
struct AttentionBlock {
  std::int64_t row0, rows;
  at::Tensor prefix;  // i64 key rows, or undefined when none
  std::int64_t own;
};

// The blocks of an sdpa node's local q: one block at q_offset in natural order (chunks = 1),
// else one a piece of the load-balanced order (ir::balanced_piece), with the pieces before it
// in natural order.
std::vector<AttentionBlock> attention_blocks(const Node& n, std::int64_t q_rows, std::int64_t kv_rows, const at::Device& device) {
  const std::int64_t chunks = n.attr_int("chunks"), offset = n.attr_int("q_offset");
  auto rows_of = [&](std::vector<std::int64_t> r) { return at::tensor(r, at::TensorOptions().dtype(at::kLong)).to(device); };
  std::vector<AttentionBlock> blocks;
  if (chunks == 1) {
    std::vector<std::int64_t> prefix(static_cast<std::size_t>(offset));
    for (std::int64_t i = 0; i < offset; ++i) prefix[static_cast<std::size_t>(i)] = i;
    blocks.push_back({0, q_rows, offset > 0 ? rows_of(prefix) : at::Tensor(), offset});
    return blocks;
  }
  const std::int64_t piece = kv_rows / chunks;
  if (offset % piece != 0 || q_rows % piece != 0) {
    throw std::invalid_argument("sdpa: q's rows from " + std::to_string(offset) + " (" + std::to_string(q_rows) + " of them) are not whole pieces of " +
                                std::to_string(piece) + " positions of the load-balanced sequence");
  }
  for (std::int64_t b = 0; b < q_rows / piece; ++b) {
    const std::int64_t slot = offset / piece + b, position = ir::balanced_piece(slot, chunks);
    std::vector<std::int64_t> prefix;
    for (std::int64_t j = 0; j < chunks; ++j) {
      if (ir::balanced_piece(j, chunks) >= position) continue;
      for (std::int64_t i = 0; i < piece; ++i) prefix.push_back(j * piece + i);
    }
    blocks.push_back({b * piece, piece, prefix.empty() ? at::Tensor() : rows_of(prefix), slot * piece});
  }
  return blocks;
}


}  // namespace

AttentionMask attention_mask(const Node& n, const Tensors& x, std::size_t documents) {
  return {n.attr_int("window"), n.attr_int("chunks"), n.attr_int("q_offset"), x.size() > documents ? x[documents] : at::Tensor()};
}

// sdpa with context parallelism's positions: each block's two parts merged by their
// log-sum-exp, as ring attention and FlashAttention's split-KV do (out = sum of each part's
// out x exp(lse_part - lse), lse = logaddexp of the parts').
// The outputs are laid out as the fused kernel's: out as q, the log-sum-exp [b, s, h] in memory
// (the memory plan's layouts; a contiguous out would make the reshape after it copy).
Tensors blocked_attention(const Node& n, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const auto lse_type = to_aten(n.output(1)->meta().dtype);
  at::Tensor out = at::empty_like(q), lse = at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(lse_type)).transpose(1, 2);
  for (const auto& b : attention_blocks(n, q.size(2), k.size(2), q.device())) {
    const at::Tensor qb = q.narrow(2, b.row0, b.rows).contiguous();
    Tensors own = attend(qb, k.narrow(2, b.own, b.rows).contiguous(), v.narrow(2, b.own, b.rows).contiguous(), true);
    if (!b.prefix.defined()) {
      out.narrow(2, b.row0, b.rows).copy_(own[0]);
      lse.narrow(2, b.row0, b.rows).copy_(own[1]);
      continue;
    }
    Tensors seen = attend(qb, k.index_select(2, b.prefix), v.index_select(2, b.prefix), false);
    const at::Tensor merged = at::logaddexp(seen[1], own[1]);
    out.narrow(2, b.row0, b.rows)
        .copy_(seen[0].to(merged.scalar_type()) * at::exp(seen[1] - merged).unsqueeze(-1) + own[0].to(merged.scalar_type()) * at::exp(own[1] - merged).unsqueeze(-1));
    lse.narrow(2, b.row0, b.rows).copy_(merged);
  }
  return Tensors{out, lse};
}

// Its gradients: each part's backward from the merged out and lse (the probabilities it
// recomputes are then the merged softmax's), dq summed, dk and dv added at the key rows.
Tensors blocked_attention_backward(const Node& n, const at::Tensor& g, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& out, const at::Tensor& lse) {
  // [b, s, h, d] in memory, as the fused kernel's gradients (the memory plan's layout).
  auto bshd = [](const at::Tensor& like) { return at::zeros({like.size(0), like.size(2), like.size(1), like.size(3)}, like.options()).transpose(1, 2); };
  at::Tensor gq = bshd(q), gk = bshd(k), gv = bshd(v);
  for (const auto& b : attention_blocks(n, q.size(2), k.size(2), q.device())) {
    const at::Tensor gb = g.narrow(2, b.row0, b.rows).contiguous(), qb = q.narrow(2, b.row0, b.rows).contiguous();
    const at::Tensor ob = out.narrow(2, b.row0, b.rows).contiguous(), lb = lse.narrow(2, b.row0, b.rows).contiguous();
    Tensors own = attend_backward(gb, qb, k.narrow(2, b.own, b.rows).contiguous(), v.narrow(2, b.own, b.rows).contiguous(), ob, lb, true);
    at::Tensor dq = own[0];
    gk.narrow(2, b.own, b.rows).add_(own[1]);
    gv.narrow(2, b.own, b.rows).add_(own[2]);
    if (b.prefix.defined()) {
      Tensors seen = attend_backward(gb, qb, k.index_select(2, b.prefix), v.index_select(2, b.prefix), ob, lb, false);
      dq = dq + seen[0];
      gk.index_add_(2, b.prefix, seen[1]);
      gv.index_add_(2, b.prefix, seen[2]);
    }
    gq.narrow(2, b.row0, b.rows).copy_(dq);
  }
  return Tensors{gq, gk, gv};
}

namespace {

// The natural order of k's rows: row_of[position] (load-balanced order, chunks > 1) and
// position_of[row], or undefined for chunks = 1 (k already in natural order).
struct KeyOrder {
  at::Tensor row_of, position_of;
};
KeyOrder key_order(std::int64_t rows, std::int64_t chunks, const at::Device& device) {
  if (chunks <= 1) return {};
  std::vector<std::int64_t> row_of(static_cast<std::size_t>(rows)), position_of(static_cast<std::size_t>(rows));
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t p = ir::natural_position(r, rows, chunks);
    row_of[static_cast<std::size_t>(p)] = r;
    position_of[static_cast<std::size_t>(r)] = p;
  }
  auto index = [&](const std::vector<std::int64_t>& i) { return at::tensor(i, at::TensorOptions().dtype(at::kLong)).to(device); };
  return {index(row_of), index(position_of)};
}

}  // namespace

at::Tensor document_ids(const at::Tensor& tokens, std::int64_t eos, std::int64_t chunks) {
  const std::int64_t seq = tokens.size(1);
  const KeyOrder order = key_order(seq, chunks, tokens.device());
  const at::Tensor natural = order.row_of.defined() ? tokens.index_select(1, order.row_of) : tokens;
  at::Tensor ids = at::zeros_like(natural);  // eos tokens before each position
  if (seq > 1) ids.narrow(1, 1, seq - 1).copy_(at::cumsum(natural.narrow(1, 0, seq - 1).eq(eos), 1));
  return order.position_of.defined() ? ids.index_select(1, order.position_of) : ids;
}

namespace {

// One tile of tiled attention on batch rows [b0, b0 + batches): its visited key positions and
// the mask of its scores [batches or 1, 1, rows, keys] (true: masked).
struct TileKeys {
  std::int64_t b0, batches, begin, end;
  at::Tensor masked;
};

// Visits the tiles with their key ranges and masks. With documents a tile's range starts at the
// earliest start, over the batch rows, of its first query's document (documents are runs of one
// id in natural order), and the mask is per batch row.
template <typename Visit>
void for_each_tile(const at::Tensor& q, std::int64_t kv_rows, const AttentionMask& m, const at::Tensor& documents, Visit visit) {
  const at::TensorOptions longs = at::TensorOptions().dtype(at::kLong).device(q.device());
  const std::int64_t batch = q.size(0);
  std::vector<std::int64_t> doc_start;  // per position, the earliest start over the batch rows of its document
  if (documents.defined()) {
    const at::Tensor docs = documents.to(at::kCPU).contiguous();
    const auto* d = docs.data_ptr<std::int64_t>();
    doc_start.assign(static_cast<std::size_t>(kv_rows), kv_rows);
    std::vector<std::int64_t> start(static_cast<std::size_t>(kv_rows));
    for (std::int64_t b = 0; b < batch; ++b) {
      for (std::int64_t p = 0; p < kv_rows; ++p) {
        auto& s = start[static_cast<std::size_t>(p)];
        s = p > 0 && d[b * kv_rows + p] == d[b * kv_rows + p - 1] ? start[static_cast<std::size_t>(p - 1)] : p;
        doc_start[static_cast<std::size_t>(p)] = std::min(doc_start[static_cast<std::size_t>(p)], s);
      }
    }
  }
  for (const auto& tile : ir::attention_tiles(q.size(2), kv_rows, m.chunks, m.q_offset, m.window)) {
    const std::int64_t begin = documents.defined() ? std::max(tile.key_begin, doc_start[static_cast<std::size_t>(tile.position)]) : tile.key_begin;
    const at::Tensor query = at::arange(tile.position, tile.position + tile.rows, longs).unsqueeze(1);
    const at::Tensor key = at::arange(begin, tile.key_end, longs).unsqueeze(0);
    at::Tensor masked = key > query;
    if (m.window > 0) masked = masked.logical_or_(key <= query - m.window);
    masked = masked.view({1, 1, tile.rows, -1});
    if (documents.defined()) {
      const at::Tensor keys = documents.narrow(1, begin, tile.key_end - begin), queries = documents.narrow(1, tile.position, tile.rows);
      masked = masked.logical_or(keys.unsqueeze(1) != queries.unsqueeze(2)).unsqueeze_(1).view({batch, 1, tile.rows, -1});
    }
    visit(tile, TileKeys{0, batch, begin, tile.key_end, masked});
  }
}

at::ScalarType accumulate_type(const at::Tensor& x) { return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

// k, v (and documents) in natural order.
struct NaturalKeys {
  KeyOrder order;
  at::Tensor k, v, documents;
};
NaturalKeys natural_keys(const at::Tensor& k, const at::Tensor& v, const AttentionMask& m) {
  NaturalKeys n{key_order(k.size(2), m.chunks, k.device()), k, v, m.documents};
  if (n.order.row_of.defined()) {
    n.k = n.k.index_select(2, n.order.row_of);
    n.v = n.v.index_select(2, n.order.row_of);
    if (n.documents.defined()) n.documents = n.documents.index_select(1, n.order.row_of);
  }
  return n;
}

// A boolean mask (true: masked) as the additive bias ATen's attention kernels take, in x's dtype.
at::Tensor additive(const at::Tensor& masked, const at::Tensor& x) {
  return at::zeros(masked.sizes(), x.options()).masked_fill_(masked, -std::numeric_limits<double>::infinity());
}

}  // namespace

std::vector<at::Tensor> tiled_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const AttentionMask& mask) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
  const NaturalKeys keys = natural_keys(k, v, mask);
  const at::ScalarType acc = accumulate_type(q);
  at::Tensor out = at::empty_like(q), lse = at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(acc)).transpose(1, 2);
  for_each_tile(q, k.size(2), mask, keys.documents, [&](const ir::AttentionTile& tile, const TileKeys& t) {
    const at::Tensor qb = q.narrow(0, t.b0, t.batches).narrow(2, tile.row0, tile.rows);
    const at::Tensor kb = keys.k.narrow(0, t.b0, t.batches).narrow(2, t.begin, t.end - t.begin);
    const at::Tensor vb = keys.v.narrow(0, t.b0, t.batches).narrow(2, t.begin, t.end - t.begin);
    at::Tensor o, l;
    if (q.is_cpu()) {  // ATen's fused CPU kernel on the tile's keys, the mask as an additive bias
      std::tie(o, l) = at::_scaled_dot_product_flash_attention_for_cpu(qb, kb, vb, 0.0, false, additive(t.masked, q));
    } else {  // the scores materialised, [tile rows, keys]
      const at::Tensor s = at::matmul(qb.to(acc), kb.to(acc).transpose(-2, -1)).mul_(scale).masked_fill_(t.masked, -std::numeric_limits<double>::infinity());
      l = at::logsumexp(s, -1);
      o = at::matmul(at::exp(s - l.unsqueeze(-1)), vb.to(acc));
    }
    out.narrow(0, t.b0, t.batches).narrow(2, tile.row0, tile.rows).copy_(o);
    lse.narrow(0, t.b0, t.batches).narrow(2, tile.row0, tile.rows).copy_(l);
  });
  return {out, lse};
}

std::vector<at::Tensor> tiled_attention_backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 const at::Tensor& out, const at::Tensor& lse, const AttentionMask& mask) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
  const NaturalKeys keys = natural_keys(k, v, mask);
  const at::ScalarType acc = accumulate_type(q);
  // dk and dv gather every tile's part in the accumulation type (tiles' key rows overlap).
  at::Tensor dq = at::empty(q.sizes(), q.options().dtype(acc)), dk = at::zeros(k.sizes(), k.options().dtype(acc)), dv = at::zeros_like(dk);
  const at::Tensor delta = q.is_cpu() ? at::Tensor() : (grad_out.to(acc) * out.to(acc)).sum(-1);  // rowsum(dO * O) = rowsum(P * dP)
  for_each_tile(q, k.size(2), mask, keys.documents, [&](const ir::AttentionTile& tile, const TileKeys& t) {
    auto rows = [&](const at::Tensor& x) { return x.narrow(0, t.b0, t.batches).narrow(2, tile.row0, tile.rows); };
    auto cols = [&](const at::Tensor& x) { return x.narrow(0, t.b0, t.batches).narrow(2, t.begin, t.end - t.begin); };
    if (q.is_cpu()) {  // ATen's fused CPU backward from the whole row's out and lse
      auto [gq, gk, gv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(rows(grad_out).contiguous(), rows(q).contiguous(), cols(keys.k).contiguous(),
                                                                                  cols(keys.v).contiguous(), rows(out).contiguous(), rows(lse).contiguous(), 0.0,
                                                                                  false, additive(t.masked, q));
      rows(dq).copy_(gq);
      cols(dk).add_(gk);
      cols(dv).add_(gv);
      return;
    }
    const at::Tensor qb = rows(q).to(acc), gb = rows(grad_out).to(acc), kb = cols(keys.k).to(acc), vb = cols(keys.v).to(acc);
    at::Tensor p = at::matmul(qb, kb.transpose(-2, -1)).mul_(scale).masked_fill_(t.masked, -std::numeric_limits<double>::infinity());
    p.sub_(rows(lse).to(acc).unsqueeze(-1)).exp_();  // the forward's probabilities, recomputed
    cols(dv).add_(at::matmul(p.transpose(-2, -1), gb));
    const at::Tensor ds = p.mul_(at::matmul(gb, vb.transpose(-2, -1)).sub_(rows(delta).unsqueeze(-1))).mul_(scale);
    rows(dq).copy_(at::matmul(ds, kb));
    cols(dk).add_(at::matmul(ds.transpose(-2, -1), qb));
  });
  if (keys.order.position_of.defined()) {
    dk = dk.index_select(2, keys.order.position_of);
    dv = dv.index_select(2, keys.order.position_of);
  }
  // [b, s, h, d] in memory, as the fused kernel's gradients (the memory plan's layout).
  auto bshd = [](const at::Tensor& like, const at::Tensor& value) {
    at::Tensor t = at::empty({like.size(0), like.size(2), like.size(1), like.size(3)}, like.options()).transpose(1, 2);
    return t.copy_(value);
  };
  return {bshd(q, dq), bshd(k, dk), bshd(v, dv)};
}

bool cpu_attention_upcast(const at::Tensor& q, bool backward) {
  if (!q.is_cpu() || !half(q)) return false;
  return half_gemm(q.scalar_type()) == HalfGemm::upcast || (backward && q.size(-1) < kCpuHalfAttentionHeadDim);
}

std::vector<at::Tensor> sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal) {
  if (cpu_attention_upcast(q, /*backward=*/false)) {
    auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q.to(at::kFloat), k.to(at::kFloat), v.to(at::kFloat), 0.0, causal);
    return {out.to(q.scalar_type()), lse};  // lse float32, as the half kernel's
  }
  if (q.is_cpu()) {
    auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal);
    return {out, lse};
  }
  if (q.is_cuda()) {
    try {
      if (half(q)) {
        auto r = at::_scaled_dot_product_flash_attention(q, k, v, 0.0, causal, /*return_debug_mask=*/false);
        return {std::get<0>(r), std::get<1>(r)};
      }
      auto [out, lse, seed, offset] = at::_scaled_dot_product_efficient_attention(q, k, v, std::nullopt, /*compute_log_sumexp=*/true, 0.0, causal);
      return {out, lse.narrow(2, 0, q.size(2))};
    } catch (const c10::Error& e) {
      fused_refused(half(q) ? "FlashAttention-2 kernel" : "memory-efficient attention kernel", e);
    }
  }
  return attention(q, k, v, causal);
}

std::vector<at::Tensor> sdpa_backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                                      const at::Tensor& lse, bool causal) {
  if (cpu_attention_upcast(q, /*backward=*/true)) {
    const at::ScalarType t = q.scalar_type();
    auto [gq, gk, gv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(grad_out.to(at::kFloat), q.to(at::kFloat), k.to(at::kFloat), v.to(at::kFloat),
                                                                                 out.to(at::kFloat), lse.to(at::kFloat), 0.0, causal);
    return {gq.to(t), gk.to(t), gv.to(t)};
  }
  if (q.is_cpu()) {
    auto [gq, gk, gv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, lse, 0.0, causal);
    return {gq, gk, gv};
  }
  if (q.is_cuda()) {
    // Dropout 0: the kernels read no philox seed or offset (undefined tensors here).
    try {
      if (half(q)) {
        auto [gq, gk, gv] = at::_scaled_dot_product_flash_attention_backward(grad_out, q, k, v, out, lse.contiguous(), at::Tensor(), at::Tensor(), q.size(2),
                                                                             k.size(2), 0.0, causal, at::Tensor(), at::Tensor());
        return {gq, gk, gv};
      }
      const std::int64_t rows = (q.size(2) + kEfficientLseAlign - 1) / kEfficientLseAlign * kEfficientLseAlign;
      at::Tensor padded = at::empty({lse.size(0), lse.size(1), rows}, lse.options().dtype(at::kFloat));
      padded.narrow(2, 0, q.size(2)).copy_(lse);
      auto [gq, gk, gv, gb] = at::_scaled_dot_product_efficient_attention_backward(grad_out, q, k, v, at::Tensor(), out, padded, at::Tensor(), at::Tensor(), 0.0,
                                                                                  {true, true, true, false}, causal);
      return {gq, gk, gv};
    } catch (const c10::Error& e) {
      fused_refused(half(q) ? "FlashAttention-2 backward" : "memory-efficient attention backward", e);
    }
  }
  return attention_backward(grad_out, q, k, v, out, lse, causal);
}

std::vector<at::Tensor> attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal) {
  const at::Tensor s = scores(q, k, causal);
  at::Tensor lse = at::logsumexp(s, -1);
  at::Tensor out = at::matmul(at::exp(s - lse.unsqueeze(-1)), v);
  return {out, lse};
}

std::vector<at::Tensor> attention_backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           const at::Tensor& out, const at::Tensor& lse, bool causal) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  const at::Tensor p = at::exp(scores(q, k, causal) - lse.unsqueeze(-1));  // the forward's probabilities, recomputed
  at::Tensor grad_v = at::matmul(p.transpose(-2, -1), grad_out);
  const at::Tensor dp = at::matmul(grad_out, v.transpose(-2, -1));
  const at::Tensor ds = p * (dp - (grad_out * out).sum(-1, true));  // softmax's backward: rowsum(dO * O) = rowsum(P * dP)
  at::Tensor grad_q = at::matmul(ds, k).mul_(scale);
  at::Tensor grad_k = at::matmul(ds.transpose(-2, -1), q).mul_(scale);
  return {grad_q, grad_k, grad_v};
}

std::vector<at::Tensor> adamw_on_device(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                                        const at::Tensor& lr, const at::Tensor& step, const AdamW& h, const at::Tensor& found_inf) {
  const at::Tensor lr64 = lr.to(at::kDouble), step64 = step.to(at::kDouble);
  const at::Tensor bc1 = 1.0 - at::pow(h.beta1, step64), bc2 = 1.0 - at::pow(h.beta2, step64);
  at::Tensor next_param = param * (1.0 - lr64 * h.weight_decay).to(param.scalar_type());
  at::Tensor next_avg = exp_avg * h.beta1;
  next_avg.add_(grad, 1.0 - h.beta1);
  at::Tensor next_avg_sq = exp_avg_sq * h.beta2;
  next_avg_sq.addcmul_(grad, grad, 1.0 - h.beta2);
  at::Tensor denom = (next_avg_sq.sqrt() / at::sqrt(bc2).to(param.scalar_type())).add_(h.eps);
  next_param.sub_((next_avg / denom) * (lr64 / bc1).to(param.scalar_type()));
  if (found_inf.defined()) {  // skipped on the device, without the host reading found_inf
    const at::Tensor skip = found_inf.ne(0);
    return {at::where(skip, param, next_param), at::where(skip, exp_avg, next_avg), at::where(skip, exp_avg_sq, next_avg_sq)};
  }
  return {next_param, next_avg, next_avg_sq};
}

namespace {


// oneDNN's linear, looked up in the dispatcher once (nullopt: this LibTorch lacks it).
using OneDnnLinear = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
                                c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>);
const std::optional<c10::TypedOperatorHandle<OneDnnLinear>>& onednn_linear_op() {
  static const std::optional<c10::TypedOperatorHandle<OneDnnLinear>> op = []() -> std::optional<c10::TypedOperatorHandle<OneDnnLinear>> {
    if (!at::hasMKLDNN()) return std::nullopt;
    const auto handle = c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
    if (!handle || !handle->hasKernelForDispatchKey(c10::DispatchKey::CPU)) return std::nullopt;
    return handle->typed<OneDnnLinear>();
  }();
  return op;
}

std::atomic<CpuMatmul>& cpu_matmul_setting() {
  static std::atomic<CpuMatmul> library{onednn_linear_op() ? CpuMatmul::onednn : CpuMatmul::aten};
  return library;
}


}  // namespace

void set_cpu_matmul(CpuMatmul library) {
  if (library == CpuMatmul::onednn && !onednn_linear_op())
    throw std::runtime_error("training.cpu_matmul = \"onednn\": this LibTorch has no oneDNN linear (mkldnn::_linear_pointwise); use \"aten\"");
  cpu_matmul_setting().store(library);
}
CpuMatmul cpu_matmul() { return cpu_matmul_setting().load(); }
bool onednn_linear_available() { return onednn_linear_op().has_value(); }
CpuMatmul cpu_matmul_named(const std::string& name) {
  if (name == "onednn") return CpuMatmul::onednn;
  if (name == "aten") return CpuMatmul::aten;
  if (name == "auto") return onednn_linear_available() ? CpuMatmul::onednn : CpuMatmul::aten;
  throw std::runtime_error("training.cpu_matmul = \"" + name + "\": use \"auto\", \"onednn\" or \"aten\"");
}
const char* library_name(CpuMatmul library) { return library == CpuMatmul::onednn ? "oneDNN" : "ATen's BLAS"; }

namespace {

bool is_half(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

// Whether ATen's cpuinfo found the capability `key` (false when it has no such key).
bool cpu_has(const std::unordered_map<std::string, c10::IValue>& caps, const char* key) {
  const auto it = caps.find(key);
  return it != caps.end() && it->second.isBool() && it->second.toBool();
}

// The CPU's own choice for bfloat16 ([0]) and float16 ([1]), and the instructions found.
struct HalfGemmOfCpu {
  HalfGemm bf16 = HalfGemm::upcast, f16 = HalfGemm::upcast;
  std::string bf16_isa, f16_isa;  // "AVX512-BF16", "AMX-BF16", ... or empty
};
const HalfGemmOfCpu& half_gemm_of_cpu() {
  static const HalfGemmOfCpu of = [] {
    HalfGemmOfCpu o;
    const auto caps = at::cpu::get_cpu_capabilities();
    for (const auto& [key, isa] : {std::pair{"amx_bf16", "AMX-BF16"}, {"avx512_bf16", "AVX512-BF16"}}) {
      if (cpu_has(caps, key)) o.bf16_isa += (o.bf16_isa.empty() ? "" : ", ") + std::string(isa);
    }
    for (const auto& [key, isa] : {std::pair{"amx_fp16", "AMX-FP16"}, {"avx512_fp16", "AVX512-FP16"}}) {
      if (cpu_has(caps, key)) o.f16_isa += (o.f16_isa.empty() ? "" : ", ") + std::string(isa);
    }
    if (!o.bf16_isa.empty()) o.bf16 = HalfGemm::native;
    if (!o.f16_isa.empty()) o.f16 = HalfGemm::native;
    if (const char* env = std::getenv("SPMDX_HALF_GEMM"); env != nullptr && *env != '\0') {
      const std::string v = env;
      if (v != "native" && v != "upcast" && v != "auto") {
        SPMDX_WARN("SPMDX_HALF_GEMM='" << v << "' is not native, upcast or auto: ignored, the CPU's choice is made");
      } else if (v != "auto") {
        o.bf16 = o.f16 = v == "native" ? HalfGemm::native : HalfGemm::upcast;
        o.bf16_isa = o.f16_isa = "SPMDX_HALF_GEMM=" + v;
      }
    }
    return o;
  }();
  return of;
}

std::atomic<int>& half_gemm_forced() {  // -1: the CPU's choice, else a HalfGemm
  static std::atomic<int> forced{-1};
  return forced;
}

}  // namespace

HalfGemm half_gemm(at::ScalarType dtype) {
  if (!is_half(dtype)) return HalfGemm::native;
  if (const int f = half_gemm_forced().load(std::memory_order_relaxed); f >= 0) return static_cast<HalfGemm>(f);
  return dtype == at::kBFloat16 ? half_gemm_of_cpu().bf16 : half_gemm_of_cpu().f16;
}

void set_half_gemm(std::optional<HalfGemm> forced) { half_gemm_forced().store(forced ? static_cast<int>(*forced) : -1); }

std::string half_gemm_summary(at::ScalarType dtype) {
  const bool bf16 = dtype == at::kBFloat16;
  const std::string name = bf16 ? "bfloat16" : "float16";
  const std::string& isa = bf16 ? half_gemm_of_cpu().bf16_isa : half_gemm_of_cpu().f16_isa;
  const bool forced = half_gemm_forced().load() >= 0;
  if (half_gemm(dtype) == HalfGemm::native) return name + " GEMMs native (" + (isa.empty() ? std::string("forced") : isa) + ")";
  const bool by_env = isa.rfind("SPMDX_HALF_GEMM=", 0) == 0;
  return name + " GEMMs upcast to float32 (" +
         (forced ? std::string("forced") : by_env ? isa : "no " + std::string(bf16 ? "AVX512-BF16 or AMX-BF16" : "AVX512-FP16 or AMX-FP16")) + ")";
}

bool upcast_half_gemm(const at::Tensor& x) { return x.is_cpu() && is_half(x.scalar_type()) && half_gemm(x.scalar_type()) == HalfGemm::upcast; }

at::Tensor cpu_half_aware_matmul(const at::Tensor& a, const at::Tensor& b) {
  if (upcast_half_gemm(a)) return at::matmul(a.to(at::kFloat), b.to(at::kFloat)).to(a.scalar_type());
  // oneDNN's bf16/fp16 GEMM of a transposed a (a weight's gradient, g^T x) runs at 0.6x the
  // rate of the same product with a laid out row-major, and the copy costs a few percent of the
  // product (Intel Xeon with AMX-BF16, one thread, [5632, 512] x [512, 2048]: 20.0 ms strided,
  // 13.6 ms with the copy; float32 on MKL gains nothing, so only half dtypes copy).
  if (strided_half_operand(a)) return at::matmul(a.contiguous(), b);
  return at::matmul(a, b);
}

bool strided_half_operand(const at::Tensor& a) { return a.is_cpu() && is_half(a.scalar_type()) && a.dim() == 2 && !a.is_contiguous(); }

at::Tensor cpu_linear(const at::Tensor& x, const at::Tensor& w) {
  if (upcast_half_gemm(x)) return cpu_linear(x.to(at::kFloat), w.to(at::kFloat)).to(x.scalar_type());
  if (cpu_matmul_setting().load(std::memory_order_relaxed) == CpuMatmul::onednn && x.is_cpu() && x.scalar_type() == at::kFloat &&
      w.scalar_type() == at::kFloat && w.dim() == 2 && x.dim() >= 2 && x.is_contiguous() && x.numel() > 0 && w.numel() > 0 &&
      !(x.requires_grad() || w.requires_grad())) {
    return onednn_linear_op()->call(x, w, std::nullopt, "none", c10::List<std::optional<at::Scalar>>(), c10::string_view(""));
  }
  return at::linear(x, w);
}

namespace {

struct Defined {
  Kernel kernel;
  InPlaceKernel in_place;
};

// The kernels core/src/ops/ defines next to each op's record (at load time: function-local).
std::map<std::string, Defined>& defined() {
  static std::map<std::string, Defined> table;
  return table;
}

}  // namespace

void fused_refused(const char* kernel, const c10::Error& e) {
  static std::mutex m;
  static std::set<std::string> said;
  const std::lock_guard<std::mutex> lock(m);
  if (!said.insert(kernel).second) return;
  SPMDX_WARN("ATen's " << kernel << " refused its inputs (" << e.what_without_backtrace() << "); plain ATen ops run instead");
}

void define_kernel(const std::string& op, Kernel kernel, InPlaceKernel in_place) {
  if (!defined().emplace(op, Defined{std::move(kernel), std::move(in_place)}).second) throw std::invalid_argument("kernel for op '" + op + "' defined twice");
}

const Kernel* find_kernel(const std::string& op) {
  auto d = defined().find(op);
  return d == defined().end() ? nullptr : &d->second.kernel;
}

const InPlaceKernel* find_in_place_kernel(const std::string& op) {
  auto d = defined().find(op);
  return d != defined().end() && d->second.in_place ? &d->second.in_place : nullptr;
}

}  // namespace spmdx::exec
