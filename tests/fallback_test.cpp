// Fallbacks (issue 20, item 2) as a user runs them, real rank processes over real backends:
// comm.fallback at start and during the run (the test_flaky transport is killed under one
// backend), parallelism.fallback_strategies, strict, and the reasons in the log and metrics.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <string>
#include <vector>

#include "run_util.h"

namespace spmdx {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;
using nlohmann::json;

test::CommandResult spmdx_run(const std::string& args) { return test::run_command("'" SPMDX_EXE "' run " + args); }

using test::rows;

const std::string kFlaky = "--plugins.paths '" TEST_PLUGIN_DIR "/test_flaky'";
// Llama tiny as FSDP x TP 2 x 2: ranks stuck on the dead one learn of it from the store.
const std::string kLlama = "'" SPMDX_SOURCE_DIR "/configs/llama_debug.toml' --nproc 4 --model.flavor tiny --training.seq_len 32 --training.local_batch_size 2";

// The issue's fault-injection test: the transport of rank 3 dies mid-run under the first
// backend; every rank agrees, the failed step runs again on ucx from the state before it, and
// the job ends with the losses of a run that was never interrupted, each step once in metrics.
TEST(Fallback, ATransportKilledMidRunFinishesOnTheNextBackendWithTheLossesOfAnUninterruptedRun) {
  test::TempDir dir;
  auto ref = spmdx_run(kLlama + " --training.steps 6 --job.dump_folder '" + (dir / "ref").string() + "'");
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  const std::string flaky = "test_flaky:shm=off;kill_rank=3;kill_after=300";
  auto r = spmdx_run(kLlama + " --training.steps 6 --job.dump_folder '" + (dir / "run").string() + "' " + kFlaky + " --comm.backend '" + flaky +
                     "' --comm.fallback ucx --comm.timeout_seconds 60");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("comm test_flaky (")) << r.output;
  EXPECT_THAT(r.output, HasSubstr("fallback: comm backend \"" + flaky + "\" failed at step ")) << r.output;
  EXPECT_THAT(r.output, HasSubstr("test_flaky: the transport of rank 3 is dead")) << r.output;
  EXPECT_THAT(r.output, HasSubstr("using \"ucx\" and ran the step again")) << r.output;
  EXPECT_EQ(test::losses(dir / "run" / "metrics.jsonl"), test::losses(dir / "ref" / "metrics.jsonl"));
  const auto m = rows(dir / "run" / "metrics.jsonl");
  ASSERT_EQ(m.size(), 6u);
  std::int64_t failed_at = 0;
  for (std::size_t i = 0; i < m.size(); ++i) {
    EXPECT_EQ(m[i]["step"], static_cast<int>(i) + 1);
    if (m[i].contains("fallback")) {
      failed_at = m[i]["step"].get<std::int64_t>();
      const json& e = m[i]["fallback"].at(0);
      EXPECT_EQ(e["what"], "comm");
      EXPECT_EQ(e["from"], flaky);
      EXPECT_EQ(e["to"], "ucx");
      EXPECT_EQ(e["step"], failed_at);
      EXPECT_THAT(e["reason"].get<std::string>(), HasSubstr("is dead"));
    }
    EXPECT_EQ(m[i]["comm_backend"], failed_at > 0 ? "ucx" : flaky) << "step " << i + 1;
  }
  EXPECT_GT(failed_at, 1) << "the transport must die mid-run, not at the first step";
}

// Below comm.max_failures the failed step runs again on the same backend, rejoined; at it, the
// next backend takes over.
TEST(Fallback, BelowMaxFailuresTheBackendIsRejoinedAndAtItReplaced) {
  test::TempDir dir;
  const std::string job = "'" SPMDX_SOURCE_DIR "/configs/mlp_dp.toml' --nproc 2 --data.paths '" + test::corpus_file(dir) +
                          "' --training.global_batch_size 8 --training.seq_len 32 --training.steps 10 --job.dump_folder '";
  auto ref = spmdx_run(job + (dir / "ref").string() + "'");
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  auto r = spmdx_run(job + (dir / "run").string() + "' " + kFlaky +
                     " --comm.backend 'test_flaky:shm=off;kill_rank=1;kill_after=20' --comm.fallback ucx --comm.max_failures 2 --comm.timeout_seconds 60");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("; rejoined it and ran the step again")) << r.output;
  EXPECT_THAT(r.output, HasSubstr("; using \"ucx\" and ran the step again")) << r.output;
  EXPECT_LT(r.output.find("rejoined it"), r.output.find("using \"ucx\"")) << r.output;
  EXPECT_EQ(test::losses(dir / "run" / "metrics.jsonl"), test::losses(dir / "ref" / "metrics.jsonl"));
}

// A chain whose last backend fails too stops the job naming it and the reason.
TEST(Fallback, WhenNoBackendIsLeftTheJobStopsNamingTheLastAndWhy) {
  test::TempDir dir;
  auto r = spmdx_run("'" SPMDX_SOURCE_DIR "/configs/mlp_dp.toml' --nproc 2 --data.paths '" + test::corpus_file(dir) +
                     "' --training.global_batch_size 8 --training.seq_len 32 --training.steps 10 --job.dump_folder '" + dir.path().string() + "' " +
                     kFlaky + " --comm.backend 'test_flaky:shm=off;kill_rank=1;kill_after=20' --comm.fallback 'test_flaky:shm=off;kill_rank=0;kill_after=5'");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("comm backend \"test_flaky:shm=off;kill_rank=0;kill_after=5\" failed 1 time within 100 steps (comm.max_failures 1) "
                                  "and comm.fallback has no backend after it: rank 0: "))
      << r.output;
}

// At start: a backend that cannot start on one rank, and a plugin whose capabilities are
// malformed, are passed over with the reason, in the log and in the first metrics row;
// comm.strict stops instead.
TEST(Fallback, AtStartABackendThatCannotStartOrFailsItsChecksIsPassedOverSayingWhy) {
  test::TempDir dir;
  const std::string job = "'" SPMDX_SOURCE_DIR "/configs/mlp_dp.toml' --nproc 2 --data.paths '" + test::corpus_file(dir) +
                          "' --training.global_batch_size 8 --training.seq_len 32 --training.steps 2 --comm.timeout_seconds 30 --job.dump_folder '";
  auto r = spmdx_run(job + (dir / "refused").string() + "' " + kFlaky + " --comm.backend 'test_flaky:shm=off;refuse_rank=1' --comm.fallback ucx");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("fallback: comm backend \"test_flaky:shm=off;refuse_rank=1\" passed over at start (rank 1: test_flaky: rank 1 "
                                  "refuses to connect (refuse_rank)); using \"ucx\""));
  const auto first = rows(dir / "refused" / "metrics.jsonl").at(0);
  EXPECT_EQ(first["comm_backend"], "ucx");
  EXPECT_EQ(first["fallback"].at(0)["from"], "test_flaky:shm=off;refuse_rank=1");
  EXPECT_EQ(first["fallback"].at(0)["step"], 0);

  // comm.backend "" on the command line unsets the config's: the fallback list alone is the chain.
  r = spmdx_run(job + (dir / "unset").string() + "' " + kFlaky + " --comm.backend '' --comm.fallback 'test_flaky:shm=off;refuse_rank=0',ucx");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("fallback: comm backend \"test_flaky:shm=off;refuse_rank=0\" passed over at start (rank 0: ")) << r.output;
  EXPECT_THAT(r.output, Not(HasSubstr("comm backend \"\""))) << r.output;

  r = spmdx_run(job + (dir / "typo").string() + "' --plugins.paths '" TEST_PLUGIN_DIR "/test_comm_typo' --comm.backend test_comm_typo --comm.fallback ucx");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // Every rank finds it malformed; the first to vote gives the reason.
  EXPECT_THAT(r.output, ::testing::ContainsRegex("fallback: comm backend \"test_comm_typo\" passed over at start \\(rank [01]: \"test_comm_typo\": the "
                                                 "test_comm_typo plugin's capabilities are malformed"));

  // A plugin that does not load (built for ABI 2) is passed over with its own reason.
  r = spmdx_run(job + (dir / "abi").string() + "' --plugins.paths '" TEST_PLUGIN_DIR "/test_abi_2' --comm.backend test_abi_2 --comm.fallback ucx");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("was built for ABI 2, this host supports 4")) << r.output;
  EXPECT_THAT(r.output, HasSubstr("the job goes on: it has fallbacks")) << r.output;
  EXPECT_THAT(r.output, HasSubstr("fallback: comm backend \"test_abi_2\" passed over at start")) << r.output;

  // comm.strict: the first alone, refused before any rank starts when its checks fail, and
  // failing the job when it cannot start.
  r = spmdx_run(job + (dir / "strict").string() + "' --plugins.paths '" TEST_PLUGIN_DIR "/test_comm_typo' --comm.backend test_comm_typo --comm.fallback ucx --comm.strict true");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("comm.backend = \"test_comm_typo\": the test_comm_typo plugin's capabilities are malformed"));
  EXPECT_THAT(r.output, Not(HasSubstr("[rank")));
  r = spmdx_run(job + (dir / "strict2").string() + "' " + kFlaky + " --comm.backend 'test_flaky:shm=off;refuse_rank=1' --comm.fallback ucx --comm.strict true");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("rank 1 refuses to connect")) << r.output;
  EXPECT_THAT(r.output, Not(HasSubstr("fallback:")));
}

// Bad fallback settings are refused before any rank starts: no backend of the chain can serve
// the job (each named with its reason), a fallback with a hot-swap, an empty name, a layout
// that is not dim=plugin.
TEST(Fallback, BadFallbackSettingsAreRefusedBeforeAnyRankStarts) {
  test::TempDir dir;
  const std::string job = "'" SPMDX_SOURCE_DIR "/configs/mlp_dp.toml' --nproc 2 --data.paths '" + test::corpus_file(dir) + "' --job.dump_folder '" +
                          dir.path().string() + "'";
  auto r = spmdx_run(job + " --plugins.paths '" TEST_PLUGIN_DIR "/test_comm_typo' --comm.backend test_comm_typo --comm.fallback nccl");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("no comm backend of comm.backend and comm.fallback can serve this job: \"test_comm_typo\": the test_comm_typo "
                                  "plugin's capabilities are malformed"));
  EXPECT_THAT(r.output, HasSubstr("; \"nccl\": nccl: "));
  // A typo is not a fallback: it could never serve; an entry split off by the command line's
  // commas is named as such.
  r = spmdx_run(job + " --comm.backend ucx --comm.fallback ucxx");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("\"ucxx\" is not a comm plugin found here; found: auto, "));
  EXPECT_THAT(r.output, HasSubstr("(did you mean ucx?)"));
  r = spmdx_run(job + " --comm.backend auto --comm.fallback 'ucx:tls=tcp,self'");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("\"self\" is not a comm plugin found here"));
  EXPECT_THAT(r.output, HasSubstr("on the command line, commas separate comm.fallback's entries"));
  r = spmdx_run(job + " --comm.fallback ucx --comm.backend auto --comm.swap_at_step 2 --comm.swap_to ucx");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("comm.fallback and comm.swap_at_step both change the comm backend during the run"));
  r = spmdx_run(job + " --parallelism.fallback_strategies 'dp_replicate fsdp'");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("parallelism.fallback_strategies entry \"dp_replicate fsdp\" is not \"dim=plugin[ dim=plugin]\""));
  for (const std::string entry : {"pp=fsdp", "dp_shard=fsdp dp_shard=data_parallel", "dp_shard==fsdp"}) {
    r = spmdx_run(job + " --parallelism.fallback_strategies '" + entry + "'");
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_THAT(r.output, HasSubstr("parallelism.fallback_strategies entry \"" + entry + "\" is not")) << entry;
  }
  // The failure counters count for a fallback: without one they are a mistake.
  r = spmdx_run(job + " --comm.max_failures 3");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("comm.max_failures is set, but comm.fallback is empty"));
  EXPECT_THAT(r.output, Not(HasSubstr("[rank")));
}

// A strategy plugin that cannot place the job falls back to the next layout, which trains with
// the losses of that layout chosen by hand; with parallelism.strict the job stops; a layout a
// validator hook refuses (partition_validator's memory budget) is passed over too.
TEST(Fallback, AStrategyThatCannotPlaceTheJobOrThatAValidatorRefusesFallsBackToTheNextLayout) {
  test::TempDir dir;
  const std::string job = kLlama + " --training.steps 3 --plugins.paths '" TEST_PLUGIN_DIR "/test_typo' --job.dump_folder '";
  auto ref = spmdx_run(job + (dir / "ref").string() + "'");
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  auto r = spmdx_run(job + (dir / "run").string() + "' --parallelism.strategies.dp_shard test_typo --parallelism.fallback_strategies dp_shard=fsdp");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("fallback: strategies dp_shard=test_typo passed over at start (strategy 'test_typo' places 'w1.weigth', which is "
                                  "neither a parameter nor an input"));
  EXPECT_THAT(r.output, HasSubstr("using dp_shard=fsdp\n"));
  EXPECT_EQ(test::losses(dir / "run" / "metrics.jsonl"), test::losses(dir / "ref" / "metrics.jsonl"));
  const auto first = rows(dir / "run" / "metrics.jsonl").at(0);
  EXPECT_EQ(first["fallback"].at(0)["what"], "strategies");
  EXPECT_EQ(first["fallback"].at(0)["from"], "dp_shard=test_typo");
  EXPECT_EQ(first["fallback"].at(0)["to"], "dp_shard=fsdp");

  r = spmdx_run(job + (dir / "strict").string() + "' --parallelism.strategies.dp_shard test_typo --parallelism.fallback_strategies dp_shard=fsdp "
                "--parallelism.strict true");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("strategy 'test_typo' places 'w1.weigth'"));
  EXPECT_THAT(r.output, Not(HasSubstr("[rank")));

  // Replicated parameters (data_parallel on dp_shard) hold twice fsdp's bytes per rank: a
  // validator budget between the two refuses the first layout only.
  r = spmdx_run(job + (dir / "validated").string() + "' --parallelism.strategies.dp_shard data_parallel --parallelism.fallback_strategies dp_shard=fsdp "
                "--hooks.enable partition_validator --hooks.partition_validator.memory_budget 1MiB");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("fallback: strategies dp_shard=data_parallel passed over at start (")) << r.output;
  EXPECT_THAT(r.output, HasSubstr("memory")) << r.output;
  EXPECT_EQ(test::losses(dir / "validated" / "metrics.jsonl"), test::losses(dir / "ref" / "metrics.jsonl"));

  r = spmdx_run(job + (dir / "none").string() + "' --parallelism.strategies.dp_shard test_typo --parallelism.fallback_strategies 'tp=test_typo'");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("no layout of [parallelism.strategies] and parallelism.fallback_strategies can place the job: dp_shard=test_typo: "
                                  "strategy 'test_typo' places 'w1.weigth'"));
  EXPECT_THAT(r.output, HasSubstr("; dp_shard=test_typo, tp=test_typo: strategy 'test_typo' places"));
  EXPECT_THAT(r.output, Not(HasSubstr("[rank")));

  // A plugin no file here has is a typo, refused before anything is tried.
  r = spmdx_run(job + (dir / "typo").string() + "' --parallelism.fallback_strategies dp_shard=fsd");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("parallelism.fallback_strategies names 'fsd' for dp_shard, which is no strategy plugin found here"));
  EXPECT_THAT(r.output, HasSubstr("(did you mean fsdp?)"));
}

}  // namespace
}  // namespace spmdx
