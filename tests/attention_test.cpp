// The tiled attention kernel (exec/kernels.h, tiled_attention): sliding-window causal and
// document (block-causal) masks, whole and as context parallelism's ranks run them, forward and
// backward, against the full masked computation in ATen (softmax of the masked [s, t] scores,
// autograd for the gradients).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <limits>

#include "spmdx/exec/kernels.h"
#include "spmdx/ir/graph.h"
#include "spmdx/ir/ops.h"
#include "kernel_util.h"

namespace spmdx {
namespace {

using Tensors = std::vector<at::Tensor>;

using test::run_op;

// Which keys each query keeps ([b, 1, s, t]): causal, within `window` (0: none), within its
// document (documents [b, t] or undefined), in natural order.
at::Tensor kept(std::int64_t batch, std::int64_t seq, std::int64_t window, const at::Tensor& documents) {
  const at::Tensor i = at::arange(seq, at::kLong).unsqueeze(1), j = at::arange(seq, at::kLong).unsqueeze(0);
  at::Tensor keep = (j <= i).expand({batch, 1, seq, seq}).clone();
  if (window > 0) keep.logical_and_(j > i - window);
  if (documents.defined()) keep.logical_and_((documents.unsqueeze(2) == documents.unsqueeze(1)).unsqueeze(1));
  return keep;
}

struct Reference {
  at::Tensor out, lse, dq, dk, dv;
};

// softmax(q k^T / sqrt(d) masked) v and its gradients by ATen's autograd.
Reference reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& keep) {
  const at::Tensor qr = q.clone().requires_grad_(), kr = k.clone().requires_grad_(), vr = v.clone().requires_grad_();
  const at::Tensor s = (at::matmul(qr, kr.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(-1)))).masked_fill(keep.logical_not(), -std::numeric_limits<double>::infinity());
  const at::Tensor out = at::matmul(at::softmax(s, -1), vr);
  out.backward(g);
  return {out.detach(), at::logsumexp(s, -1).detach(), qr.grad(), kr.grad(), vr.grad()};
}

// Documents of random lengths (nondecreasing ids, as block_causal derives them).
at::Tensor random_documents(std::int64_t batch, std::int64_t seq, at::Generator& gen) {
  return at::cumsum(at::rand({batch, seq}, gen, at::kDouble).lt(0.04), 1).to(at::kLong);
}

void expect_close(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  EXPECT_TRUE(at::allclose(got, want, 1e-9, 1e-11)) << what << ": max diff " << (got - want).abs().max().item<double>();
}

// Whole sequences: several query tiles (200 rows, tiles of 64), windows narrower and wider than
// a tile, with and without documents.
TEST(TiledAttention, MatchesTheFullMaskedComputation) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(11);
  const auto opts = at::TensorOptions().dtype(at::kDouble);
  const std::int64_t b = 2, h = 3, s = 200, d = 8;
  const at::Tensor q = at::randn({b, h, s, d}, gen, opts), k = at::randn({b, h, s, d}, gen, opts), v = at::randn({b, h, s, d}, gen, opts);
  const at::Tensor g = at::randn({b, h, s, d}, gen, opts), docs = random_documents(b, s, gen);
  for (const auto& [window, documents] : std::vector<std::pair<std::int64_t, bool>>{{1, false}, {37, false}, {64, false}, {150, false}, {0, true}, {37, true}}) {
    SCOPED_TRACE("window " + std::to_string(window) + (documents ? ", documents" : ""));
    const at::Tensor doc = documents ? docs : at::Tensor();
    const Reference want = reference(q, k, v, g, kept(b, s, window, doc));
    Tensors in{q, k, v};
    if (documents) in.push_back(doc);
    const Tensors got = run_op("sdpa", in, {{"window", window}});
    expect_close(got[0], want.out, "out");
    expect_close(got[1], want.lse, "lse");
    Tensors back{g, q, k, v, got[0], got[1]};
    if (documents) back.push_back(doc);
    const Tensors grads = run_op("sdpa_backward", back, {{"window", window}});
    expect_close(grads[0], want.dq, "dq");
    expect_close(grads[1], want.dk, "dk");
    expect_close(grads[2], want.dv, "dv");
  }
}

// As context parallelism runs it (cp 2: 4 pieces in load-balanced order, each rank its rows of
// q with q_offset, k, v and the documents whole; dk and dv partial sums over the ranks): the
// natural order's masked attention in that order.
TEST(TiledAttention, ContextParallelRanksGiveTheWholeResult) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(12);
  const auto opts = at::TensorOptions().dtype(at::kDouble);
  const std::int64_t b = 2, h = 2, s = 160, d = 4, chunks = 4, ranks = 2, rows = s / ranks;
  const at::Tensor q = at::randn({b, h, s, d}, gen, opts), k = at::randn({b, h, s, d}, gen, opts), v = at::randn({b, h, s, d}, gen, opts);
  const at::Tensor g = at::randn({b, h, s, d}, gen, opts), docs = random_documents(b, s, gen);
  std::vector<std::int64_t> order;  // load-balanced row -> natural position
  for (std::int64_t r = 0; r < s; ++r) order.push_back(ir::natural_position(r, s, chunks));
  const at::Tensor index = at::tensor(order, at::kLong);
  auto p = [&](const at::Tensor& t, std::int64_t dim) { return t.index_select(dim, index); };
  for (const auto& [window, documents] : std::vector<std::pair<std::int64_t, bool>>{{30, false}, {0, true}, {50, true}}) {
    SCOPED_TRACE("window " + std::to_string(window) + (documents ? ", documents" : ""));
    const at::Tensor doc = documents ? docs : at::Tensor();
    const Reference want = reference(q, k, v, g, kept(b, s, window, doc));
    at::Tensor dk = at::zeros_like(k), dv = at::zeros_like(v);
    for (std::int64_t r = 0; r < ranks; ++r) {
      const ir::Attributes mine{{"window", window}, {"chunks", chunks}, {"q_offset", r * rows}};
      const at::Tensor qr = p(q, 2).narrow(2, r * rows, rows).contiguous(), gr = p(g, 2).narrow(2, r * rows, rows).contiguous();
      Tensors in{qr, p(k, 2), p(v, 2)};
      if (documents) in.push_back(p(doc, 1));
      const Tensors local = run_op("sdpa", in, mine);
      expect_close(local[0], p(want.out, 2).narrow(2, r * rows, rows), "out of rank " + std::to_string(r));
      expect_close(local[1], p(want.lse, 2).narrow(2, r * rows, rows), "lse of rank " + std::to_string(r));
      Tensors back{gr, qr, p(k, 2), p(v, 2), local[0], local[1]};
      if (documents) back.push_back(p(doc, 1));
      const Tensors grads = run_op("sdpa_backward", back, mine);
      expect_close(grads[0], p(want.dq, 2).narrow(2, r * rows, rows), "dq of rank " + std::to_string(r));
      dk += grads[1], dv += grads[2];
    }
    expect_close(dk, p(want.dk, 2), "dk");
    expect_close(dv, p(want.dv, 2), "dv");
  }
}

// Float32 inputs accumulate in float32: within float32's rounding of the double result.
TEST(TiledAttention, Float32IsCloseToDouble) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(13);
  const at::Tensor q = at::randn({1, 2, 130, 16}, gen, at::kDouble), k = at::randn({1, 2, 130, 16}, gen, at::kDouble), v = at::randn({1, 2, 130, 16}, gen, at::kDouble);
  const Reference want = reference(q, k, v, at::ones_like(q), kept(1, 130, 40, at::Tensor()));
  const Tensors got = run_op("sdpa", {q.to(at::kFloat), k.to(at::kFloat), v.to(at::kFloat)}, {{"window", std::int64_t{40}}});
  EXPECT_EQ(got[0].scalar_type(), at::kFloat);
  EXPECT_TRUE(at::allclose(got[0].to(at::kDouble), want.out, 1e-5, 1e-6));
}

// The tiles visit only the keys a tile may see: at seq 2048 and window 256, tiles of 64 rows
// from position p see keys [max(0, p - 255), p + 64): 64 x (64 + 128 + 192 + 256) for the first
// four, 64 x 319 for the 28 others, 29% of causal attention's 2048 x 2049 / 2 pairs.
TEST(TiledAttention, TilesVisitOnlyTheWindow) {
  ASSERT_EQ(ir::kAttentionTile, 64);
  std::int64_t pairs = 0;
  for (const auto& t : ir::attention_tiles(2048, 2048, 1, 0, 256)) pairs += t.rows * (t.key_end - t.key_begin);
  EXPECT_EQ(pairs, 64 * (64 + 128 + 192 + 256) + 28 * 64 * 319);
}

}  // namespace
}  // namespace spmdx
