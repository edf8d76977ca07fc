// A third party's strategy as a user runs it: fsdp_except_embeddings (tests/plugins), bound to
// dp_shard with options through [parallelism.strategies], trains Llama tiny on 2 ranks to
// fsdp's losses where it shards what fsdp shards, and the run and `spmdx compile` say which
// plugin placed each mesh dim.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "run_util.h"

namespace spmdx {
namespace {

using ::testing::HasSubstr;

const std::string kJob = "'" SPMDX_SOURCE_DIR "/configs/llama_debug.toml' --model.flavor tiny --training.seq_len 32 --training.local_batch_size 2 "
                         "--parallelism.tensor_parallel_degree 1 --plugins.paths '" TEST_PLUGIN_DIR "/fsdp_except_embeddings'";

test::CommandResult run(const test::TempDir& dir, const std::string& name, const std::string& strategy) {
  return test::spmdx("run " + kJob + " --nproc 2 --training.steps 3 --data.paths '" + test::corpus_file(dir) + "' --job.dump_folder '" +
                     (dir / name).string() + "' --parallelism.strategies.dp_shard '" + strategy + "'");
}

TEST(StrategyPlugins, FsdpExceptEmbeddingsTrainsAsFsdpWhereItShardsTheSameTensors) {
  test::TempDir dir;
  const auto fsdp = run(dir, "fsdp", "fsdp");
  ASSERT_EQ(fsdp.exit_code, 0) << fsdp.output;
  EXPECT_THAT(fsdp.output, HasSubstr("mesh dim dp_shard (2): strategy 'fsdp' (plugin fsdp ")) << fsdp.output;
  // keep= keeps nothing whole: fsdp's placements, so fsdp's losses bit for bit.
  const auto same = run(dir, "same", "fsdp_except_embeddings:keep=");
  ASSERT_EQ(same.exit_code, 0) << same.output;
  EXPECT_THAT(same.output, HasSubstr("mesh dim dp_shard (2): strategy 'fsdp_except_embeddings' (plugin fsdp_except_embeddings 0.1.0, " TEST_PLUGIN_DIR
                                     "/fsdp_except_embeddings/libspmdx_fsdp_except_embeddings.so)"))
      << same.output;
  const auto want = test::losses(dir / "fsdp" / "metrics.jsonl");
  ASSERT_EQ(want.size(), 3u);
  EXPECT_EQ(test::losses(dir / "same" / "metrics.jsonl"), want);
  // The default keeps the embedding and the output projection whole: the same model, its
  // gradients summed in another order, so the same losses to rounding.
  const auto kept = run(dir, "kept", "fsdp_except_embeddings");
  ASSERT_EQ(kept.exit_code, 0) << kept.output;
  const auto got = test::losses(dir / "kept" / "metrics.jsonl");
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-5 * std::abs(want[i])) << "step " << i + 1;
}

TEST(StrategyPlugins, CompileSaysWhichPluginPlacedEachMeshDimAndRefusesABadOption) {
  const auto r = test::spmdx("compile " + kJob + " --world-size 2 --parallelism.strategies.dp_shard 'fsdp_except_embeddings:keep=embedding'");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("mesh dim dp_shard (2): strategy 'fsdp_except_embeddings' (plugin fsdp_except_embeddings 0.1.0, ")) << r.output;
  const auto bad = test::spmdx("compile " + kJob + " --world-size 2 --parallelism.strategies.dp_shard 'fsdp_except_embeddings:colour=red'");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_THAT(bad.output, HasSubstr("fsdp_except_embeddings: no option 'colour'; it takes keep=<roles, comma-separated>")) << bad.output;
  const auto role = test::spmdx("compile " + kJob + " --world-size 2 --parallelism.strategies.dp_shard 'fsdp_except_embeddings:keep=embeddings'");
  EXPECT_NE(role.exit_code, 0);
  EXPECT_THAT(role.output, HasSubstr("'embeddings' is no parameter role (embedding, output, norm, linear, unknown)")) << role.output;
  const auto spec = test::spmdx("compile " + kJob + " --world-size 2 --parallelism.strategies.dp_shard 'fsdp_except_embeddings:keep'");
  EXPECT_NE(spec.exit_code, 0);
  EXPECT_THAT(spec.output, HasSubstr("[parallelism.strategies] dp_shard 'fsdp_except_embeddings:keep': option 'keep' is not key=value")) << spec.output;
}

}  // namespace
}  // namespace spmdx
