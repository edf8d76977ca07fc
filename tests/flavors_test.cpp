// torchtitan's Llama 3 flavors and grouped-query attention in the built-in model (issue 23,
// item 1), as a user runs them: `spmdx compile --fake` plans 8B/70B/405B without memory, and a
// GQA llama trains under tensor parallelism with the one-rank losses.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <regex>
#include <string>
#include <vector>

#include "run_util.h"
#include "spmdx/text.h"

namespace spmdx {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

using test::spmdx;

const std::string kConfig = "'" SPMDX_SOURCE_DIR "/configs/llama_debug.toml'";

// `spmdx compile --fake` of a flavor with Llama 3's vocabulary on fsdp `world`.
test::CommandResult plan(const std::string& flavor, int world) {
  return spmdx("compile " + kConfig + " --model.flavor " + flavor + " --model.vocab_size 128256 --training.seq_len 2048 --training.global_batch_size " +
               std::to_string(world) + " --training.local_batch_size 1 --parallelism.data_parallel_shard_degree " + std::to_string(world) +
               " --parallelism.tensor_parallel_degree 1 --world-size " + std::to_string(world) + " --fake");
}

// The counts of a plain PyTorch definition of torchtitan's llama3 on the meta device
// (tests/reference/llama3_param_count.py): 8B is 8.03 x 10^9 with the 128256 vocabulary, as published.
TEST(Flavors, ParameterCountsEqualTorchtitansAndFsdpSplitsThem) {
  const std::string python = SPMDX_PYTHON;
  if (!fs::exists(python)) GTEST_SKIP() << "no " << python << " (run scripts/setup)";
  auto ref = test::run_command("'" + python + "' '" SPMDX_SOURCE_DIR "/tests/reference/llama3_param_count.py' --vocab 128256");
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  const auto want = nlohmann::json::parse(ref.output.substr(ref.output.find('{')));
  EXPECT_EQ(want.at("8B").get<std::int64_t>(), 8030261248);
  for (const std::string flavor : {"8B", "70B", "405B"}) {
    auto r = plan(flavor, 64);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const std::int64_t n = want.at(flavor).get<std::int64_t>();
    EXPECT_THAT(r.output, HasSubstr("model llama " + flavor + " (vocab 128256, " + std::to_string(n) + " parameters")) << r.output;
    // FSDP over 64 ranks: each holds a 64th of every parameter (the dims all divide by 64).
    EXPECT_EQ(n % 64, 0);
    EXPECT_THAT(r.output, HasSubstr("per rank (rank 0): parameters " + human_bytes(static_cast<double>(n * 4 / 64)) + ",")) << flavor;
  }
}

// A llama with 2 key/value heads for 4 query heads trains on tp 2 and on fsdp x tp 2 x 2 with the
// losses of one rank; a TP degree that does not divide the KV heads is refused, naming both.
TEST(Flavors, GroupedQueryAttentionTrainsUnderTensorParallelismWithTheOneRankLosses) {
  test::TempDir dir;
  const std::string job = kConfig + " --data.paths '" + test::corpus_file(dir) + "' --model.flavor tiny_gqa --training.seq_len 32 --training.steps 4 "
                          "--training.global_batch_size 8 --training.local_batch_size 8";
  auto run = [&](const std::string& name, const std::string& mesh) {
    auto r = spmdx("run " + job + " " + mesh + " --job.dump_folder '" + (dir / name).string() + "'");
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return test::losses(dir / name / "metrics.jsonl");
  };
  const auto one = run("one", "--nproc 1 --parallelism.data_parallel_shard_degree 1 --parallelism.tensor_parallel_degree 1");
  ASSERT_EQ(one.size(), 4u);
  for (const auto& [name, mesh] : std::vector<std::pair<std::string, std::string>>{
           {"tp2", "--nproc 2 --parallelism.data_parallel_shard_degree 1 --parallelism.tensor_parallel_degree 2 --training.local_batch_size 8"},
           {"fsdp2tp2", "--nproc 4 --parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 2 --training.local_batch_size 4"}}) {
    const auto got = run(name, mesh);
    ASSERT_EQ(got.size(), one.size()) << name;
    for (std::size_t i = 0; i < one.size(); ++i) EXPECT_NEAR(got[i], one[i], 1e-5 * one[i]) << name << " step " << i + 1;
  }
  // Its wk and wv hold the KV heads only: 2 x 16 rows each of 64.
  auto c = spmdx("compile " + job + " --parallelism.data_parallel_shard_degree 1 --parallelism.tensor_parallel_degree 1 --world-size 1 --dump '" + (dir / "plan").string() + "'");
  ASSERT_EQ(c.exit_code, 0) << c.output;
  std::ifstream in(dir / "plan" / "logical.txt");
  const std::string logical((std::istreambuf_iterator<char>(in)), {});
  EXPECT_THAT(logical, HasSubstr("%layers.0.attention.wk.weight: f32[32, 64]"));
  EXPECT_THAT(logical, HasSubstr("%layers.0.attention.wq.weight: f32[64, 64]"));
  auto tp4 = spmdx("run " + job + " --nproc 4 --parallelism.data_parallel_shard_degree 1 --parallelism.tensor_parallel_degree 4 --job.dump_folder '" +
                   (dir / "tp4").string() + "'");
  EXPECT_NE(tp4.exit_code, 0);
  EXPECT_THAT(tp4.output, HasSubstr("parallelism.tensor_parallel_degree 4 does not divide the 2 key/value heads of llama tiny_gqa"));
}

// A Hugging Face export of a GQA checkpoint permutes wk's rows by the KV heads: loading it back
// gives the losses of loading spmdx's own names.
TEST(Flavors, AGqaExportUnderHuggingFaceNamesLoadsBackToTheSameLosses) {
  test::TempDir dir;
  const std::string job = kConfig + " --data.paths '" + test::corpus_file(dir) + "' --model.flavor tiny_gqa --training.seq_len 32 --training.global_batch_size 8 " +
                          "--nproc 2 --parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 1";
  auto t = spmdx("run " + job + " --training.steps 2 --checkpoint.enable true --checkpoint.interval 2 --job.dump_folder '" + (dir / "t").string() + "'");
  ASSERT_EQ(t.exit_code, 0) << t.output;
  const fs::path step = dir / "t" / "checkpoint" / "step-2";
  for (const auto& [file, names] : std::vector<std::pair<std::string, std::string>>{{"own.safetensors", ""}, {"hf.safetensors", " --names hf"}}) {
    auto e = spmdx("export '" + step.string() + "' '" + (dir / file).string() + "'" + names);
    ASSERT_EQ(e.exit_code, 0) << e.output;
  }
  std::vector<std::vector<double>> losses;
  for (const std::string file : {"own.safetensors", "hf.safetensors"}) {
    auto r = spmdx("run " + job + " --training.steps 2 --checkpoint.initial_load_path '" + (dir / file).string() + "' --job.dump_folder '" + (dir / file).string() + ".run'");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    losses.push_back(test::losses(dir / (file + ".run") / "metrics.jsonl"));
  }
  ASSERT_EQ(losses[0].size(), 2u);
  EXPECT_EQ(losses[1], losses[0]);
}

// `spmdx compile --fake --json` on `replicate` x `shard` x `tp` ranks, one row per rank.
nlohmann::json plan_json(const std::string& flavor, int replicate, int shard, int tp, int seq_len, const std::string& extra = "") {
  auto r = spmdx("compile " + kConfig + " --fake --json --model.flavor " + flavor + " --model.vocab_size 128256 --training.seq_len " + std::to_string(seq_len) +
                 " --training.global_batch_size " + std::to_string(replicate * shard) + " --training.local_batch_size 1" +
                 " --parallelism.data_parallel_replicate_degree " + std::to_string(replicate) + " --parallelism.data_parallel_shard_degree " +
                 std::to_string(shard) + " --parallelism.tensor_parallel_degree " + std::to_string(tp) + extra);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  const auto brace = r.output.find('{');
  if (r.exit_code != 0 || brace == std::string::npos) return nlohmann::json::object();
  return nlohmann::json::parse(r.output.substr(brace));
}

// The numbers a user checks before buying GPUs (issue 23, item 3), for 8B on HSDP 8 x 8:
// torchtitan's FLOPs per token, the per-rank state and the bytes each mesh dim moves, which are
// what FSDP2 and HSDP send: per step, an all_gather in the forward and one in the backward
// (reshard_after_forward) and a reduce_scatter over dp_shard, and an all_reduce of each shard
// over dp_replicate. Before the planner read a gradient's reduce_scatter as a source, an HSDP
// plan all-reduced the output layer's gradients over both dims (75 GiB over dp_replicate).
TEST(Flavors, CompileJsonGivesFlopsPerTokenPerRankBytesAndTheBytesOfEachMeshDim) {
  const auto j = plan_json("8B", 8, 8, 1, 2048);
  ASSERT_FALSE(j.empty());
  EXPECT_EQ(j.at("format"), "spmdx.compile");
  const double n = 8030261248.0, embedding = 128256.0 * 4096;
  EXPECT_EQ(j.at("model").at("parameters").get<std::int64_t>(), 8030261248);
  EXPECT_EQ(j.at("model").at("embedding_parameters").get<double>(), embedding);
  // torchtitan: 6 x (nparams - nparams_embedding) + 12 x l x h x q x t.
  const double flops = 6 * (n - embedding) + 12.0 * 32 * 32 * 128 * 2048;
  EXPECT_NEAR(j.at("flops_per_token").get<double>(), flops, flops * 1e-12);
  EXPECT_NEAR(j.at("flops_per_step").get<double>(), flops * 64 * 2048, flops * 64 * 2048 * 1e-12);
  const auto& r0 = j.at("rank0");
  const double shard = n * 4 / 8;  // every dim of every parameter divides by 8
  EXPECT_EQ(r0.at("parameter_bytes").get<double>(), shard);
  EXPECT_EQ(r0.at("optimizer_state_bytes").get<double>(), 2 * shard);
  const auto& by_dim = r0.at("comm_bytes_per_step_by_dim");
  ASSERT_EQ(by_dim.size(), 2u);
  EXPECT_NEAR(by_dim.at("dp_replicate").get<double>() + by_dim.at("dp_shard").get<double>(), r0.at("comm_bytes_per_step").get<double>(), 1.0);
  // dp_replicate: the ring all_reduce of the rank's gradient shard, 2 x 7/8 of it (and the
  // loss's scalars and a few small activations: within 1%).
  EXPECT_NEAR(by_dim.at("dp_replicate").get<double>(), 2 * 7.0 / 8 * shard, 2 * 7.0 / 8 * shard * 1e-2);
  // dp_shard: two all_gathers (forward, and backward after resharding) and one reduce_scatter
  // of every parameter, 7/8 of it each; the embedding table is gathered once, its gradient
  // being made without it (embedding_backward reads the tokens), and moved as a shard.
  EXPECT_GE(by_dim.at("dp_shard").get<double>(), 7.0 / 8 * 4 * (3 * n - 2 * embedding) * 0.99);
  EXPECT_LE(by_dim.at("dp_shard").get<double>(), 3 * 7.0 / 8 * n * 4 * 1.01);
  // The planned peak splits into its parts, also where the peak is inside a node that goes
  // on releasing (fsdp 8 x tp 8: the parts once missed a 2 GiB gathered gradient).
  auto parts = [](const nlohmann::json& peak) {
    return peak.at("parameters").get<std::int64_t>() + peak.at("gradients").get<std::int64_t>() + peak.at("optimizer_state").get<std::int64_t>() +
           peak.at("activations").get<std::int64_t>() + peak.at("communication").get<std::int64_t>() + peak.at("state_copy").get<std::int64_t>();
  };
  const auto& peak = j.at("planned_peak");
  EXPECT_EQ(peak.at("bytes").get<std::int64_t>(), parts(peak));
  EXPECT_GE(peak.at("parameters").get<double>(), shard);
  auto r = spmdx("compile " + kConfig + " --model.flavor 8B --model.vocab_size 128256 --world-size 64 --parallelism.data_parallel_shard_degree -1 "
                 "--parallelism.tensor_parallel_degree 8 --fake --json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto tp = nlohmann::json::parse(r.output.substr(r.output.find('{')));
  EXPECT_EQ(tp.at("planned_peak").at("bytes").get<std::int64_t>(), parts(tp.at("planned_peak")));
}

// Gradient accumulation on HSDP: each microbatch's gradients are reduce-scattered over dp_shard
// as they are made (FSDP2), the shards summed and all-reduced over dp_replicate in every
// microbatch; never summed whole (the rank's unsharded gradients) and never re-cut more finely
// than the parameter and gathered back for AdamW (which once sent 48 GiB a step over
// dp_replicate for 8B on 4 x 128).
TEST(Flavors, HsdpAccumulationReduceScattersEachMicrobatchAndHoldsNoWholeGradients) {
  const int microbatches = 2;
  const auto j = plan_json("8B", 4, 8, 1, 512, " --training.global_batch_size " + std::to_string(4 * 8 * microbatches));
  ASSERT_FALSE(j.empty());
  ASSERT_EQ(j.at("microbatches").get<int>(), microbatches);
  const double n = 8030261248.0, shard = n * 4 / 8;
  const auto& by_dim = j.at("rank0").at("comm_bytes_per_step_by_dim");
  // A ring all_reduce of the shard per microbatch (the embedding's gradient shard, 1/16 of
  // it, is summed first and all-reduced once: within 5%).
  const double replicate = microbatches * 2 * 3.0 / 4 * shard;
  EXPECT_NEAR(by_dim.at("dp_replicate").get<double>(), replicate, replicate * 0.05);
  // At the planned peak: the summed gradient shards and a layer's whole gradients in flight,
  // not the model's 32 GB of unsharded gradients.
  EXPECT_LT(j.at("planned_peak").at("gradients").get<double>(), 2 * shard);
  // The model reads the parameters gathered, as FSDP does: the activations are not gathered
  // instead and held from the forward to the backward (the peak was 47.6 GiB, now 24.9).
  EXPECT_LT(j.at("planned_peak").at("bytes").get<double>(), 8 * shard);
}

// Planning 70B on 16,384 fake ranks (dp_replicate 16 x dp_shard 128 x tp 8) is part of the
// suite (issue 23: < 30 s; the time is printed, the bench/plan_scale.sh table compares it). Each
// rank holds a 1024th of the parameters, within the rounding of the uneven splits (the
// vocabulary, 128256, does not divide by 1024).
TEST(Flavors, A70BPlanOn16384RanksHoldsA1024thOfTheParametersPerRank) {
  const auto j = plan_json("70B", 16, 128, 8, 8192);
  ASSERT_FALSE(j.empty());
  EXPECT_EQ(j.at("world_size").get<std::int64_t>(), 16384);
  const double n = j.at("model").at("parameters").get<double>();
  EXPECT_EQ(n, 70553706496.0);
  EXPECT_NEAR(j.at("rank0").at("parameter_bytes").get<double>(), n * 4 / 1024, n * 4 / 1024 * 1e-3);
  std::printf("70B on 16384 fake ranks planned in %.1f s, peak RSS %.0f MiB\n", j.at("planner_seconds").get<double>(),
              j.at("planner_peak_rss_bytes").get<double>() / 1048576);
}

// A checkpoint saved by a deeper model is refused on resume, naming a tensor the run's model
// has not, instead of dropping those layers and their AdamW state.
TEST(Flavors, ResumingACheckpointOfMoreLayersIsRefusedNotTruncated) {
  test::TempDir dir;
  const std::string job = kConfig + " --data.paths '" + test::corpus_file(dir) + "' --model.flavor tiny --training.seq_len 32 --training.global_batch_size 8 " +
                          "--nproc 1 --parallelism.data_parallel_shard_degree 1 --parallelism.tensor_parallel_degree 1 --checkpoint.enable true " +
                          "--checkpoint.interval 2 --job.dump_folder '" + (dir / "t").string() + "'";
  auto saved = spmdx("run " + job + " --training.steps 2 --model.n_layers 2");
  ASSERT_EQ(saved.exit_code, 0) << saved.output;
  auto resumed = spmdx("run " + job + " --training.steps 4 --model.n_layers 1");
  EXPECT_NE(resumed.exit_code, 0) << resumed.output;
  EXPECT_THAT(resumed.output, HasSubstr("tensor(s) this run's model has not, e.g. 'exp_avg.layers.1."));
  EXPECT_THAT(resumed.output, HasSubstr("model.n_layers"));
  EXPECT_THAT(resumed.output, ::testing::Not(HasSubstr("resumed from")));
}

// model.n_layers plans a flavor's width at another depth; the label says so.
TEST(Flavors, NLayersChangesTheDepthAndIsRefusedWhereItCannotApply) {
  const auto j = plan_json("8B", 1, 8, 1, 512, " --model.n_layers 4");
  ASSERT_FALSE(j.empty());
  EXPECT_EQ(j.at("model").at("label"), "llama 8B (4 layers)");
  const std::int64_t per_layer = (8030261248 - 2 * 128256 * 4096 - 4096) / 32;  // without the embedding, output and final norm
  EXPECT_EQ(j.at("model").at("parameters").get<std::int64_t>(), 2 * 128256 * 4096 + 4096 + 4 * per_layer);
  EXPECT_EQ(plan_json("8B", 1, 8, 1, 512, " --model.n_layers 1").at("model").at("label"), "llama 8B (1 layer)");
  for (const auto& [flags, message] : std::vector<std::pair<std::string, std::string>>{
           {"--model.n_layers 0", "model.n_layers must be positive, or -1"},
           {"--model.n_layers 1025", "model.n_layers"},
           {"--json --print-config", "excludes --json"},
           {"--fake --parallelism.data_parallel_replicate_degree 65536 --parallelism.data_parallel_shard_degree 65536 --parallelism.tensor_parallel_degree 1",
            "more than the 100,000,000 spmdx plans"},
           {"--dump '" SPMDX_SOURCE_DIR "/README.md'", "is a file: give a folder"},
           {"--model.name mlp --model.flavor tiny --model.n_layers 3", "model.n_layers applies to llama, qwen3 and deepseek_v3 only, not mlp"}}) {
    auto r = spmdx("compile " + kConfig + " " + flags);
    EXPECT_NE(r.exit_code, 0) << flags;
    EXPECT_THAT(r.output, HasSubstr(message)) << r.output;
  }
}

// fsdp keeps whole a parameter with fewer rows than ranks (FSDP2 pads it instead): on 1000
// ranks none of debugmodel's (at most 768 rows) is sharded, so every rank holds the whole model;
// on 512 the 12 feed-forward w1/w3 [768, 256] are and the other 45 not; on 2 all are. `compile`
// says which, why and the cost (4 x their bytes, less 1/degree of it), in text and in --json.
TEST(Flavors, ParametersShorterThanTheFsdpDegreeAreSaidToBeKeptWhole) {
  auto plan_on = [](int degree, const std::string& extra = "") {
    const std::string d = std::to_string(degree);
    return spmdx("compile " + kConfig + " --parallelism.data_parallel_shard_degree " + d + " --parallelism.tensor_parallel_degree 1 --training.local_batch_size 1 --world-size " +
                 d + " --fake" + extra);
  };
  auto r = plan_on(1000);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("per rank (rank 0): parameters 20.0 MiB,"));  // the whole model
  EXPECT_THAT(r.output, HasSubstr("warning: fsdp on dp_shard (1000 ranks) keeps every parameter (57 parameters, the whole model, 20.0 MiB) whole on every rank, "
                                  "not sharded: their dim 0 is shorter than 1000 (tok_embeddings.weight [264, 256], layers.0.attention_norm.weight [256], "
                                  "layers.0.attention.wq.weight [256, 256], layers.0.attention.wk.weight [256, 256], and 53 more); that costs each rank 80.0 MiB "
                                  "more than an even share of them (parameters, gradients and AdamW state: 4 x 20.0 MiB, less 1/1000 of it; FSDP2 would pad them and "
                                  "leave some ranks an empty shard); a degree of at most 256 shards them all"));
  r = plan_on(512);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("warning: fsdp on dp_shard (512 ranks) keeps 45 parameters (11.0 MiB) whole on every rank, not sharded: their dim 0 is shorter than 512"));
  r = plan_on(512, " --json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto kept = nlohmann::json::parse(r.output.substr(r.output.find('{'))).at("parameters_kept_whole");
  ASSERT_EQ(kept.size(), 1u);
  EXPECT_EQ(kept[0].at("mesh_dim"), "dp_shard");
  EXPECT_EQ(kept[0].at("strategy"), "fsdp");
  EXPECT_EQ(kept[0].at("parameters").size(), 45u);
  for (const auto& p : kept[0].at("parameters")) EXPECT_EQ(p.get<std::string>().find("w1"), std::string::npos) << p;
  const std::int64_t bytes = (5250304 - 12 * 768 * 256) * 4;  // all but the 12 w1/w3 [768, 256], f32
  EXPECT_EQ(kept[0].at("extra_bytes").get<std::int64_t>(), 4 * (bytes - bytes / 512));
  r = plan_on(2);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, ::testing::Not(HasSubstr("keeps")));
}

TEST(Flavors, AVocabularySmallerThanTheTokenizersIsRefused) {
  auto r = spmdx("compile " + kConfig + " --model.flavor tiny --model.vocab_size 100");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.output, HasSubstr("model.vocab_size 100 is fewer than the 264 ids of the tokenizer 'byte'"));
}

}  // namespace
}  // namespace spmdx
