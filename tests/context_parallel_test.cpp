// Context parallelism (train/context_parallel.h): the attention kernel with a load-balanced
// sequence and a rank's query rows is causal attention in natural order (forward and
// backward, against ATen's fused kernel); the graph pass changes no loss; and spmdx compile's
// plan for cp moves keys and values only (all_gather forward, reduce_scatter backward).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <regex>

#include "run_util.h"
#include "spmdx/exec/executor.h"
#include "spmdx/exec/kernels.h"
#include "spmdx/exec/trainer.h"
#include "spmdx/models/model.h"
#include "spmdx/train/context_parallel.h"
#include "spmdx/train/mixed_precision.h"
#include "kernel_util.h"

namespace spmdx {
namespace {

using ::testing::HasSubstr;
using Tensors = std::vector<at::Tensor>;

using test::run_op;

at::Tensor permuted(const at::Tensor& t, std::int64_t dim, std::int64_t chunks, bool inverse = false) {
  return run_op("seq_permute", {t}, {{"dim", dim}, {"chunks", chunks}, {"inverse", inverse}})[0];
}

TEST(ContextParallel, SeqPermuteDealsPiecesHeadAndTail) {
  const at::Tensor x = at::arange(8, at::kLong).reshape({1, 8});
  EXPECT_TRUE(at::equal(permuted(x, 1, 4), at::tensor({0, 1, 6, 7, 2, 3, 4, 5}, at::kLong).reshape({1, 8})));
  EXPECT_TRUE(at::equal(permuted(permuted(x, 1, 4), 1, 4, true), x));
  // cp 2 (4 pieces): rank 0 holds pieces 0 and 3, rank 1 pieces 1 and 2.
  EXPECT_TRUE(at::equal(permuted(at::arange(4, at::kLong), 0, 4), at::tensor({0, 3, 1, 2}, at::kLong)));
}

// Causal attention over a sequence in load-balanced order, whole or by a rank's query rows,
// is the natural order's causal attention in that order; and so are its gradients.
TEST(ContextParallel, BalancedAttentionIsCausalAttentionInAnotherOrder) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const auto opts = at::TensorOptions().dtype(at::kDouble);
  const at::Tensor q = at::randn({2, 3, 16, 8}, gen, opts), k = at::randn({2, 3, 16, 8}, gen, opts), v = at::randn({2, 3, 16, 8}, gen, opts);
  const at::Tensor g = at::randn({2, 3, 16, 8}, gen, opts);
  auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, true);
  auto [gq, gk, gv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(g, q, k, v, out, lse, 0.0, true);
  for (const std::int64_t chunks : {2, 4, 8}) {
    SCOPED_TRACE("chunks " + std::to_string(chunks));
    auto p = [&](const at::Tensor& t) { return permuted(t, 2, chunks); };
    const ir::Attributes whole{{"chunks", chunks}};
    const Tensors got = run_op("sdpa", {p(q), p(k), p(v)}, whole);
    EXPECT_TRUE(at::allclose(got[0], p(out), 1e-10, 1e-12));
    EXPECT_TRUE(at::allclose(got[1], p(lse), 1e-10, 1e-12));
    const Tensors grads = run_op("sdpa_backward", {p(g), p(q), p(k), p(v), got[0], got[1]}, whole);
    EXPECT_TRUE(at::allclose(grads[0], p(gq), 1e-10, 1e-12));
    EXPECT_TRUE(at::allclose(grads[1], p(gk), 1e-10, 1e-12));
    EXPECT_TRUE(at::allclose(grads[2], p(gv), 1e-10, 1e-12));
    // As cp = chunks / 2 ranks run it: each its rows of q (two pieces), k and v whole; dk and
    // dv are partial sums over the ranks.
    const std::int64_t ranks = chunks / 2, rows = 16 / ranks;
    at::Tensor dk = at::zeros_like(k), dv = at::zeros_like(v);
    for (std::int64_t r = 0; r < ranks; ++r) {
      const ir::Attributes mine{{"chunks", chunks}, {"q_offset", r * rows}};
      const at::Tensor qr = p(q).narrow(2, r * rows, rows).contiguous();
      const Tensors local = run_op("sdpa", {qr, p(k), p(v)}, mine);
      EXPECT_TRUE(at::allclose(local[0], p(out).narrow(2, r * rows, rows), 1e-10, 1e-12)) << "rank " << r;
      const Tensors lg = run_op("sdpa_backward", {p(g).narrow(2, r * rows, rows).contiguous(), qr, p(k), p(v), local[0], local[1]}, mine);
      EXPECT_TRUE(at::allclose(lg[0], p(gq).narrow(2, r * rows, rows), 1e-10, 1e-12)) << "rank " << r;
      dk += lg[1], dv += lg[2];
    }
    EXPECT_TRUE(at::allclose(dk, p(gk), 1e-10, 1e-12));
    EXPECT_TRUE(at::allclose(dv, p(gv), 1e-10, 1e-12));
  }
}

// In natural order (no load balancing): the rows from q_offset on see every key before them.
TEST(ContextParallel, QueryRowsFromAnOffsetSeeEveryKeyBeforeThem) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(8);
  const auto opts = at::TensorOptions().dtype(at::kDouble);
  const at::Tensor q = at::randn({1, 2, 12, 4}, gen, opts), k = at::randn({1, 2, 12, 4}, gen, opts), v = at::randn({1, 2, 12, 4}, gen, opts);
  auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, true);
  for (const std::int64_t offset : {0, 3, 8}) {
    const Tensors got = run_op("sdpa", {q.narrow(2, offset, 4).contiguous(), k, v}, {{"q_offset", offset}});
    EXPECT_TRUE(at::allclose(got[0], out.narrow(2, offset, 4), 1e-10, 1e-12)) << offset;
    EXPECT_TRUE(at::allclose(got[1], lse.narrow(2, offset, 4), 1e-10, 1e-12)) << offset;
  }
}

// The pass adds the permutations and the sequence-major loss, and the loss is unchanged.
TEST(ContextParallel, ThePassChangesNoLoss) {
  models::ModelArgs args = models::model_args("llama", "tiny", 64);
  const models::Model m = models::build_model(args, 3, 16);
  const ir::Graph cp = train::context_parallel(m.graph, 16, 4);
  std::map<std::string, int> ops;
  for (const auto& n : cp.nodes()) {
    ++ops[n->op()];
    if (n->op() == "sdpa") {
      EXPECT_EQ(n->attr_int("chunks"), 4);
    }
  }
  EXPECT_EQ(ops["seq_permute"], 4);  // tokens, labels, the two rotary tables
  EXPECT_EQ(ops["transpose"], [&] {
    int t = 0;
    for (const auto& n : m.graph.nodes()) t += n->op() == "transpose";
    return t + 2;  // the logits' and the labels' flattening, sequence-major
  }());
  exec::TensorMap feed = exec::init_tensors(m, 5);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(3);
  feed["tokens"] = at::randint(64, {3, 16}, gen, at::kLong);
  feed["labels"] = at::randint(64, {3, 16}, gen, at::kLong);
  const double want = exec::Executor(m.graph).run(feed).at("loss").item<double>();
  const double got = exec::Executor(cp).run(feed).at("loss").item<double>();
  EXPECT_NEAR(got, want, 1e-6 * std::abs(want));
  EXPECT_THROW(train::context_parallel(m.graph, 16, 3), ir::IrError);

  // Mixed precision casts the flattened logits before cross entropy: both they and the labels
  // still go sequence-major (the labels alone did, pairing wrong rows: a helper's trial).
  const ir::Graph bf16 = train::context_parallel(train::cast_for_mixed_precision(m.graph, ir::DType::bf16), 16, 4);
  int flattened = 0;
  for (const auto& n : bf16.nodes()) {
    if (n->op() != "reshape" || n->output()->meta().shape.empty() || n->output()->meta().shape[0] != 3 * 16) continue;
    ++flattened;
    EXPECT_EQ(n->input(0)->producer()->op(), "transpose") << n->output()->ref();
  }
  EXPECT_EQ(flattened, 2);
  const double want16 = exec::Executor(train::cast_for_mixed_precision(m.graph, ir::DType::bf16)).run(feed).at("loss").item<double>();
  EXPECT_NEAR(exec::Executor(bf16).run(feed).at("loss").item<double>(), want16, 1e-3 * std::abs(want16));
}

int count(const std::string& text, const std::string& word) {
  int n = 0;
  for (std::size_t at = text.find(word); at != std::string::npos; at = text.find(word, at + 1)) ++n;
  return n;
}

// The plan on cp (a sequence long enough that activations outweigh the weights: on short ones
// the greedy cost model may split a weight gradient by columns instead): per layer, k and v all-gathered in the forward and their gradients
// reduce-scattered in the backward; no activation moved by all_to_all; the parameters'
// gradients all-reduced over cp (it is a data-parallel dim for them).
TEST(ContextParallel, ThePlanMovesKeysAndValuesOnly) {
  test::TempDir dir;
  const std::string base = "'" SPMDX_EXE "' compile '" SPMDX_SOURCE_DIR "/configs/llama_debug.toml' --parallelism.data_parallel_shard_degree 1 "
                           "--parallelism.tensor_parallel_degree 1 --training.seq_len 128 --model.n_layers 3 --parallelism.context_parallel_degree ";
  auto r = test::run_command(base + "2 --dump '" + (dir / "cp2").string() + "'");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("context parallel: cp 2, 64 of 128 tokens a rank, load-balanced (4 pieces: rank r of cp holds pieces r and 3 - r); "
                                  "attention: 3 of 3 split their query rows and all-gather k and v"));
  std::ifstream in(dir / "cp2" / "rank0.txt");
  const std::string graph((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(count(graph, "all_to_all("), 1);  // the embedding's gradient, split by columns (the cost model's choice)
  EXPECT_EQ(count(graph, "= all_gather("), 2 * 3 + 1);  // k and v a layer, and that embedding gradient
  EXPECT_EQ(count(graph, "= reduce_scatter("), 2 * 3);  // dk and dv a layer
  // spmdx diff names the setting that differs (load balancing), beside the graphs it changes.
  ASSERT_EQ(test::run_command(base + "2 --parallelism.context_parallel_load_balance false --dump '" + (dir / "in-order").string() + "'").exit_code, 0);
  auto diff = test::run_command("'" SPMDX_EXE "' diff '" + (dir / "cp2").string() + "' '" + (dir / "in-order").string() + "'");
  EXPECT_THAT(diff.output, HasSubstr("[plan] context_parallel: {\"degree\":2,\"load_balance\":true,\"rotate_method\":\"allgather\"} in A, "
                                     "{\"degree\":2,\"load_balance\":false,\"rotate_method\":\"allgather\"} in B"));
  auto j = test::run_command(base + "4 --json");
  ASSERT_EQ(j.exit_code, 0) << j.output;
  const auto summary = nlohmann::json::parse(j.output.substr(j.output.find('{')));
  EXPECT_EQ(summary.at("context_parallel").at("degree"), 4);
  EXPECT_EQ(summary.at("context_parallel").at("tokens_per_rank"), 32);
  EXPECT_EQ(summary.at("context_parallel").at("pieces"), 8);
  EXPECT_EQ(summary.at("context_parallel").at("query_rows"), 3);
  // "auto": the batch or heads split by all_to_all where that moves fewer bytes (cp 4).
  auto a = test::run_command(base + "4 --parallelism.context_parallel_rotate_method auto");
  ASSERT_EQ(a.exit_code, 0) << a.output;
  EXPECT_THAT(a.output, HasSubstr("attention: 0 of 3 split their query rows and all-gather k and v, 3 split batch or heads by all_to_all"));
}

TEST(ContextParallel, BadConfigsAreRefusedNamingTheKey) {
  const std::string base = "'" SPMDX_EXE "' compile '" SPMDX_SOURCE_DIR "/configs/llama_debug.toml' --parallelism.data_parallel_shard_degree 1 "
                           "--parallelism.tensor_parallel_degree 1 --parallelism.context_parallel_degree ";
  auto r = test::run_command(base + "4 --training.seq_len 36");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.output, HasSubstr("parallelism.context_parallel_degree 4 splits the sequence into 8 pieces (2 a rank: load balancing), but training.seq_len 36 "
                                  "is not a multiple of 8: make seq_len a multiple of 8, or set parallelism.context_parallel_load_balance = false (then of 4)"));
  EXPECT_EQ(test::run_command(base + "4 --training.seq_len 36 --parallelism.context_parallel_load_balance false").exit_code, 0);
  auto w = test::run_command(base + "3 --world-size 4");
  EXPECT_NE(w.exit_code, 0);
  EXPECT_THAT(w.output, HasSubstr("parallelism degrees multiply to 3 (dp_replicate 1 x dp_shard 1 x cp 3 x tp 1), but world_size is 4"));
  auto m = test::run_command(base + "2 --parallelism.context_parallel_rotate_method alltoall");
  EXPECT_NE(m.exit_code, 0);
  EXPECT_THAT(m.output, HasSubstr("parallelism.context_parallel_rotate_method is \"alltoall\": torchtitan's ring attention"));
  EXPECT_THAT(test::run_command(base + "2 --parallelism.context_parallel_rotate_method allgathr").output, HasSubstr("expected one of allgather, auto; did you mean 'allgather'?"));
}

}  // namespace
}  // namespace spmdx
