// Mixture of Experts (issue 46) as a user meets it: torchtitan's Qwen3 and DeepSeek-V3 flavors
// with their published sizes, `spmdx compile --fake` of the largest at 2,048 ranks, the load
// balance in the step line and metrics.jsonl, and the expert biases kept across a resume. The
// numbers of training (losses, gradients, parameters, biases against torchtitan's MoE in plain
// PyTorch) are tests/reference/moe_reference.py's, registered in tests/CMakeLists.txt.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "run_util.h"
#include "spmdx/models/model.h"

namespace spmdx {
namespace {

using ::testing::HasSubstr;
using test::spmdx;

const std::string kConfig = "'" SPMDX_SOURCE_DIR "/configs/qwen3_moe.toml'";

models::Model build(const std::string& name, const std::string& flavor, std::int64_t vocab) {
  return models::build_model(models::model_args(name, flavor, vocab), 1, 8);
}

std::vector<std::int64_t> shape_of(const models::Model& m, const std::string& name) {
  for (const auto& init : m.init) {
    if (init.name == name) return init.shape;
  }
  return {};
}

// The sizes Qwen publishes for Qwen3 (its model cards: 0.6B with 0.44B non-embedding; 30B-A3B
// with 30.5B total and 3.3B activated; 235B-A22B with 235B and 22B), from torchtitan's flavor
// shapes and Qwen3's 151,936-token vocabulary; and the parameters' shapes (torchtitan's names).
TEST(Moe, Qwen3FlavorsHaveThePublishedSizesAndTorchtitansNames) {
  const std::int64_t vocab = 151936;
  const models::Model small = build("qwen3", "0.6B", vocab);
  EXPECT_NEAR(static_cast<double>(models::parameter_count(small)), 0.596e9, 0.005e9);  // tied: one embedding
  EXPECT_NEAR(static_cast<double>(models::parameter_count(small) - models::embedding_parameter_count(small)), 0.44e9, 0.005e9);
  EXPECT_TRUE(shape_of(small, "output.weight").empty()) << "0.6B ties its output projection to tok_embeddings.weight";
  const models::Model a3b = build("qwen3", "30B-A3B", vocab);
  EXPECT_NEAR(static_cast<double>(models::parameter_count(a3b)), 30.5e9, 0.1e9);
  EXPECT_NEAR(static_cast<double>(models::active_parameter_count(a3b)), 3.3e9, 0.1e9);
  const models::Model a22b = build("qwen3", "235B-A22B", vocab);
  EXPECT_NEAR(static_cast<double>(models::parameter_count(a22b)), 235e9, 1e9);
  EXPECT_NEAR(static_cast<double>(models::active_parameter_count(a22b)), 22e9, 0.5e9);

  const models::Model debug = build("qwen3", "debugmodel_moe", 2048);
  EXPECT_EQ(shape_of(debug, "layers.7.moe.experts.w1"), (std::vector<std::int64_t>{64, 768, 256}));
  EXPECT_EQ(shape_of(debug, "layers.7.moe.experts.w2"), (std::vector<std::int64_t>{64, 256, 768}));
  EXPECT_EQ(shape_of(debug, "layers.0.moe.router.gate.weight"), (std::vector<std::int64_t>{64, 256}));
  EXPECT_EQ(shape_of(debug, "layers.0.attention.wq.weight"), (std::vector<std::int64_t>{16 * 128, 256}));
  EXPECT_EQ(shape_of(debug, "layers.0.attention.wk.weight"), (std::vector<std::int64_t>{8 * 128, 256}));
  EXPECT_EQ(shape_of(debug, "layers.0.attention.q_norm.weight"), (std::vector<std::int64_t>{128}));
  EXPECT_EQ(shape_of(debug, "layers.0.moe.expert_bias"), (std::vector<std::int64_t>{64}));
  EXPECT_NE(debug.graph.find_output("layers.7.moe.tokens_per_expert"), nullptr);
  EXPECT_TRUE(shape_of(debug, "layers.0.feed_forward.w1.weight").empty());
}

// DeepSeek-V3's flavors: dense first layers, shared experts, sigmoid scores over 8 groups of which
// 4 are chosen (671B); the attention is plain multi-head attention, said so by name.
TEST(Moe, DeepSeekV3FlavorsKeepDenseLayersSharedExpertsAndGroupsAndNameTheMissingMla) {
  const models::ModelArgs big = models::model_args("deepseek_v3", "671B", 129280);
  EXPECT_EQ(big.moe.experts, 256);
  EXPECT_EQ(big.moe.top_k, 8);
  EXPECT_EQ(big.moe.dense_layers, 3);
  EXPECT_EQ(big.moe.expert_groups, 8);
  EXPECT_EQ(big.moe.limited_groups, 4);
  EXPECT_EQ(big.moe.score_func, "sigmoid");
  EXPECT_DOUBLE_EQ(big.moe.route_scale, 2.5);
  EXPECT_THAT(models::mla_note(big), HasSubstr("multi-head latent attention (MLA) is not built"));
  const models::Model tiny = build("deepseek_v3", "tiny_moe", 256);
  EXPECT_EQ(shape_of(tiny, "layers.0.feed_forward.w1.weight"), (std::vector<std::int64_t>{128, 64}));  // the dense layer
  EXPECT_EQ(shape_of(tiny, "layers.1.moe.shared_experts.w1.weight"), (std::vector<std::int64_t>{32, 64}));
  EXPECT_TRUE(shape_of(tiny, "layers.0.moe.experts.w1").empty());
  EXPECT_THROW(models::model_args("deepseek_v3", "8B", 256), std::invalid_argument);
}

// torchtitan's configs name these models: `qwen3` and `deepseek_v3` are known, a wrong flavor is
// refused listing the known ones; `compile --fake` plans Qwen3 235B-A22B and DeepSeek-V3 671B at
// 2,048 ranks, with the active parameters (FLOPs per token count them, as torchtitan's MFU).
TEST(Moe, CompileFakePlansTheLargestFlavorsAt2048RanksWithActiveParameters) {
  auto wrong = spmdx("compile " + kConfig + " --model.flavor 7B --fake");
  EXPECT_NE(wrong.exit_code, 0);
  EXPECT_THAT(wrong.output, HasSubstr("model.flavor is \"7B\"")) << wrong.output;
  const std::string big = " --training.seq_len 4096 --training.global_batch_size 2048 --training.local_batch_size 1 --world-size 2048 --fake --json";
  auto qwen = spmdx("compile " + kConfig + " --model.flavor 235B-A22B --model.vocab_size 151936 --parallelism.data_parallel_replicate_degree 16 "
                    "--parallelism.data_parallel_shard_degree 128" + big);
  ASSERT_EQ(qwen.exit_code, 0) << qwen.output;
  const auto q = nlohmann::json::parse(qwen.output.substr(qwen.output.find('{')));
  EXPECT_EQ(q.at("model").at("parameters").get<std::int64_t>(), 235093634560);
  EXPECT_NEAR(q.at("model").at("active_parameters").get<double>(), 22e9, 0.5e9);
  auto deepseek = spmdx("compile " + kConfig + " --model.name deepseek_v3 --model.flavor 671B --model.vocab_size 129280 "
                        "--parallelism.data_parallel_replicate_degree 8 --parallelism.data_parallel_shard_degree 256" + big.substr(0, big.size() - 7));
  ASSERT_EQ(deepseek.exit_code, 0) << deepseek.output;
  EXPECT_THAT(deepseek.output, HasSubstr("active per token, top 8 of 256 experts")) << deepseek.output;
  EXPECT_THAT(deepseek.output, HasSubstr("note: deepseek_v3: multi-head latent attention (MLA) is not built"));
}

// Every step says how evenly the experts were loaded: metrics.jsonl's moe_load_mean is the step's
// slots over the experts (rows x seq x top_k / experts, all ranks'), moe_load_max the busiest
// expert's, moe_load_imbalance their worst ratio over the layers, and the step line shows it.
TEST(Moe, StepLineAndMetricsReportTheLoadBalanceOfTheWholeBatch) {
  test::TempDir dir;
  auto r = spmdx("run " + kConfig + " --data.paths '" + test::corpus_file(dir) + "' --nproc 2 --training.steps 3 --job.dump_folder '" + dir.path().string() + "'");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("| moe load max/mean "));
  for (const auto& row : test::rows(dir / "metrics.jsonl")) {
    EXPECT_DOUBLE_EQ(row.at("moe_load_mean").get<double>(), 8.0 * 64 * 2 / 8);  // 2 ranks x 4 rows of 64, top 2 of 8 experts
    EXPECT_GE(row.at("moe_load_max").get<double>(), row.at("moe_load_mean").get<double>());
    ASSERT_TRUE(row.at("moe_load_layers").contains("layers.1"));
    EXPECT_DOUBLE_EQ(row.at("moe_load_imbalance").get<double>(), std::max(row.at("moe_load_layers").at("layers.0").get<double>(),
                                                                          row.at("moe_load_layers").at("layers.1").get<double>()));
  }
}

// Expert parallelism (parallelism.expert_parallel_degree, torchtitan's key) takes the dp_shard
// dim: each rank keeps its experts (no all_gather of them, no reduce_scatter of their gradients)
// and the tokens move, 8 all_to_all_v a step for 2 MoE layers (dispatch and combine, forward and
// backward); compile prices them; degrees it cannot take are refused naming the keys.
TEST(Moe, ExpertParallelismKeepsTheExpertsAndMovesTheTokens) {
  test::TempDir dir;
  auto r = spmdx("run " + kConfig + " --data.paths '" + test::corpus_file(dir) + "' --nproc 2 --training.steps 1 --parallelism.expert_parallel_degree 2 "
                 "--hooks.enable graphviz --job.dump_folder '" + dir.path().string() + "'");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream in(dir / "hooks" / "graphviz" / "rank0.dot");
  const std::string dot((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::size_t exchanges = 0, expert_moves = 0;
  for (std::size_t at = dot.find("label=\""); at != std::string::npos; at = dot.find("label=\"", at + 1)) {
    const std::string label = dot.substr(at, dot.find('"', at + 7) - at);
    if (label.find("all_to_all_v (dp_shard)") != std::string::npos) ++exchanges;
    if ((label.find("all_gather") != std::string::npos || label.find("reduce_scatter") != std::string::npos) && label.find("[8, 32, 64]") != std::string::npos) ++expert_moves;
  }
  EXPECT_EQ(exchanges, 8U) << dot;
  EXPECT_EQ(expert_moves, 0U) << "an expert weight or gradient moved whole";

  auto plan = spmdx("compile " + kConfig + " --world-size 4 --parallelism.expert_parallel_degree 4 --json");
  ASSERT_EQ(plan.exit_code, 0) << plan.output;
  const auto j = nlohmann::json::parse(plan.output.substr(plan.output.find('{')));
  // 16 x 64 tokens over 4 ranks, top 2, 64 float32 features: 128 KiB a dispatch or combine, 4 a
  // layer, 2 layers, 3/4 of it to other ranks.
  EXPECT_DOUBLE_EQ(j.at("model").at("expert_parallel").at("all_to_all_v_bytes_even_routing").get<double>(), 4.0 * 2 * 512 * 64 * 4 * 3 / 4);

  // EP 2 inside dp_shard 4 (torchtitan's efsdp 2): the mesh splits dp_shard.
  auto carved = spmdx("compile " + kConfig + " --world-size 4 --parallelism.expert_parallel_degree 2");
  ASSERT_EQ(carved.exit_code, 0) << carved.output;
  EXPECT_THAT(carved.output, HasSubstr("mesh efsdp=2 x dp_shard=2 (4 ranks)")) << carved.output;
  EXPECT_THAT(carved.output, HasSubstr("expert parallelism: ep 2 over dp_shard, 4 of 8 experts a rank")) << carved.output;
  auto partial = spmdx("compile " + kConfig + " --world-size 4 --parallelism.expert_parallel_degree 3");
  EXPECT_NE(partial.exit_code, 0);
  EXPECT_THAT(partial.output, HasSubstr("expert_parallel_degree 3: spmdx's expert parallelism is carved from the dp_shard dim (ep must divide data_parallel_shard_degree, here 4")) << partial.output;
  auto with_cp = spmdx("compile " + kConfig + " --world-size 4 --parallelism.context_parallel_degree 2 --parallelism.expert_parallel_degree 2");
  EXPECT_NE(with_cp.exit_code, 0);
  EXPECT_THAT(with_cp.output, HasSubstr("expert_parallel_degree 2 with context_parallel_degree 2: expert parallelism with context parallelism")) << with_cp.output;
  auto dense = spmdx("compile " + kConfig + " --model.name llama --model.flavor tiny --world-size 2 --parallelism.expert_parallel_degree 2");
  EXPECT_NE(dense.exit_code, 0);
  EXPECT_THAT(dense.output, HasSubstr("applies to Mixture-of-Experts models")) << dense.output;
  auto uneven = spmdx("compile " + kConfig + " --world-size 3 --parallelism.expert_parallel_degree 3");
  EXPECT_NE(uneven.exit_code, 0);
  EXPECT_THAT(uneven.output, HasSubstr("does not divide the 8 experts")) << uneven.output;
}

// Collectives of rank 0's step (graphviz hook) by what they move: `exchanges` all_to_all_v over
// dp_shard; of the local expert blocks ([4, 32, 64] / [4, 64, 32]: 4 of tiny_moe's 8 experts),
// those moved over dp_shard (none may be: EP keeps them there) and over `other` mesh dim.
struct ExpertTraffic {
  std::size_t exchanges = 0, over_dp_shard = 0, over_other = 0;
};
ExpertTraffic expert_traffic(const std::string& flags, const std::string& other, std::string* output) {
  test::TempDir dir;
  auto r = spmdx("run " + kConfig + " --data.paths '" + test::corpus_file(dir) + "' --nproc 4 --training.steps 1 " + flags +
                 " --hooks.enable graphviz --job.dump_folder '" + dir.path().string() + "'");
  *output = r.output;
  ExpertTraffic t;
  if (r.exit_code != 0) return t;
  std::ifstream in(dir / "hooks" / "graphviz" / "rank0.dot");
  const std::string dot((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (std::size_t at = dot.find("label=\""); at != std::string::npos; at = dot.find("label=\"", at + 1)) {
    const std::string label = dot.substr(at, dot.find('"', at + 7) - at);
    const bool expert_block = label.find("[4, 32, 64]") != std::string::npos || label.find("[4, 64, 32]") != std::string::npos;
    if (label.find("all_to_all_v (dp_shard)") != std::string::npos) ++t.exchanges;
    if (label.find("(dp_shard)") != std::string::npos && label.find("all_to_all_v") == std::string::npos && expert_block) ++t.over_dp_shard;
    if (label.find("(" + other + ")") != std::string::npos && expert_block) ++t.over_other;
  }
  return t;
}

// HSDP with expert parallelism: each of 2 replicas (dp_replicate) runs its own EP 2 over its
// dp_shard ranks: the tokens are exchanged only inside a replica (all_to_all_v over dp_shard), the
// experts stay where dp_shard stores them (no dp_shard all_gather or reduce_scatter of an expert
// block), and their gradients are summed over the replicas (dp_replicate), as HSDP's.
// tests/reference (reference_moe_*_hsdp_expert_parallel) checks the numbers.
TEST(Moe, HsdpReplicasEachRunTheirOwnExpertParallelism) {
  std::string out;
  const ExpertTraffic t = expert_traffic("--parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 2 --parallelism.expert_parallel_degree 2",
                                         "dp_replicate", &out);
  EXPECT_THAT(out, HasSubstr("expert parallelism: ep 2 over dp_shard, 4 of 8 experts a rank"));
  EXPECT_EQ(t.exchanges, 8U) << out;
  EXPECT_EQ(t.over_dp_shard, 0U) << "an expert block moved over dp_shard";
  EXPECT_GT(t.over_other, 0U) << "expert gradients not summed over the replicas";
}

// EP 2 carved from dp_shard 4 (torchtitan's efsdp 2): the mesh holds dp_shard as efsdp 2 x
// dp_shard 2; the tokens move inside each efsdp group (all_to_all_v over the inner dp_shard), each
// rank's experts are FSDP-sharded over efsdp (all_gather there, their gradients reduce_scatter
// there) and never move over dp_shard. reference_moe_qwen3_expert_parallel_2_efsdp_2 checks the numbers.
TEST(Moe, ExpertParallelismCarvedFromDpShardShardsTheExpertsOverEfsdp) {
  std::string out;
  const ExpertTraffic t = expert_traffic("--parallelism.expert_parallel_degree 2", "efsdp", &out);
  EXPECT_THAT(out, HasSubstr("mesh efsdp=2 x dp_shard=2 (4 ranks"));
  EXPECT_EQ(t.exchanges, 8U) << out;
  EXPECT_EQ(t.over_dp_shard, 0U) << "an expert block moved over dp_shard";
  EXPECT_GT(t.over_other, 0U) << "the experts are not FSDP-sharded over efsdp";
}

// all_to_all_v in `spmdx bench comm` (the op expert parallelism's dispatch runs): every element
// and every learnt split size right, size by size.
TEST(Moe, BenchCommTimesAndChecksAllToAllV) {
  auto r = spmdx("bench comm --nproc 2 --op all_to_all_v --min-bytes 1K --max-bytes 64K --iters 2 --warmup 1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("# spmdx bench comm: all_to_all_v, 2 ranks"));
  EXPECT_THAT(r.output, HasSubstr("        65536        16384  float   none"));
  EXPECT_THAT(r.output, HasSubstr("# wrong results: 0"));
}

// The expert biases are state: a job stopped at step 3 and resumed trains steps 4 to 6 to the
// losses of one that never stopped, bit for bit (biases reset to zero would route differently).
TEST(Moe, AResumedJobKeepsItsExpertBiases) {
  test::TempDir dir;
  const std::string job = "run " + kConfig + " --data.paths '" + test::corpus_file(dir) + "' --nproc 1 --checkpoint.enable true --checkpoint.interval 3 --lr_scheduler.total_steps 6";
  auto whole = spmdx(job + " --training.steps 6 --job.dump_folder '" + (dir / "whole").string() + "'");
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  auto first = spmdx(job + " --training.steps 3 --job.dump_folder '" + (dir / "resumed").string() + "'");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  auto second = spmdx(job + " --training.steps 6 --job.dump_folder '" + (dir / "resumed").string() + "'");
  ASSERT_EQ(second.exit_code, 0) << second.output;
  EXPECT_THAT(second.output, HasSubstr("resumed from"));
  const auto want = test::losses(dir / "whole" / "metrics.jsonl"), got = test::losses(dir / "resumed" / "metrics.jsonl");
  ASSERT_EQ(want.size(), 6U);
  ASSERT_EQ(got.size(), 6U);
  for (std::size_t i = 3; i < 6; ++i) EXPECT_EQ(got[i], want[i]) << "step " << i + 1;
}

}  // namespace
}  // namespace spmdx
