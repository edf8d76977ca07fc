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

TEST(Flavors, AVocabularySmallerThanTheTokenizersIsRefused) {
  auto r = spmdx("compile " + kConfig + " --model.flavor tiny --model.vocab_size 100");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.output, HasSubstr("model.vocab_size 100 is fewer than the 264 ids of the tokenizer 'byte'"));
}

}  // namespace
}  // namespace spmdx
