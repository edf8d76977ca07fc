// `spmdx plugins` as a user runs it: each plugin error prints its message and exits 1, never
// crashing; the JSON lists the built plugins.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <map>
#include <regex>
#include <sstream>

#include "spmdx/plugin.h"
#include "run_util.h"
#include "test_util.h"

namespace spmdx {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;
using test::run_command;

fs::path plugin_dir(const std::string& target) { return fs::path(TEST_PLUGIN_DIR) / target; }

test::CommandResult spmdx(const std::string& args) {
  return run_command("env -u SPMDX_PLUGIN_PATH '" SPMDX_EXE "' " + args);
}

TEST(Cli, PluginsJsonListsTheBuiltPlugins) {
  auto r = spmdx("plugins --json 2>/dev/null");
  ASSERT_TRUE(r.exited);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto list = nlohmann::json::parse(r.output);
  ASSERT_TRUE(list.is_array());
  const nlohmann::json* dp = nullptr;
  for (const auto& p : list) {
    if (p.at("name") == "data_parallel") dp = &p;
  }
  ASSERT_NE(dp, nullptr) << r.output;
  EXPECT_EQ(dp->at("kind"), "strategy");
  EXPECT_EQ(dp->at("abi"), "4.1");
  EXPECT_EQ(dp->at("version"), "0.2.0");
  EXPECT_EQ(dp->at("registered"), true);
  EXPECT_EQ(dp->at("toolchain"), SPMDX_TOOLCHAIN);
  EXPECT_EQ(dp->at("in_process_only"), false);
  EXPECT_FALSE(dp->contains("capabilities"));
  EXPECT_EQ(fs::path(dp->at("path").get<std::string>()),
            fs::canonical(BUILTIN_PLUGIN_DIR) / "libspmdx_data_parallel.so");
  // Comm plugins show what comm.backend = "auto" scores.
  std::map<std::string, const nlohmann::json*> by_name;
  for (const auto& p : list) by_name[p.at("name").get<std::string>()] = &p;
  ASSERT_TRUE(by_name.count("ucx") && by_name.count("local")) << r.output;
  EXPECT_EQ(by_name["ucx"]->at("capabilities"),
            nlohmann::json::parse(R"({"ucx": [{"op": "*", "memory": "host", "min_bytes": 0, "max_bytes": 18446744073709551615, "score": 10}]})"));
  EXPECT_EQ(by_name["local"]->at("capabilities").at("local").at(0).at("score"), 1);
  EXPECT_EQ(by_name["local"]->at("in_process_only"), true);
  EXPECT_EQ(by_name["ucx"]->at("options").at("ucx"),
            nlohmann::json::parse(R"(["tls", "chunk_bytes", "direct_max_bytes", "shm", "shm_chunk_bytes"])"));
  EXPECT_EQ(by_name["ucx"]->at("in_process_only"), false);
}

TEST(Cli, PluginsRefusesACommBackendWithMalformedCapabilities) {
  auto r = spmdx("plugins --plugin-path '" + plugin_dir("test_comm_typo").string() + "' 2>&1");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("capabilities of test_comm_typo: all_reduse host up to 64 B score 50"));
  EXPECT_THAT(r.output, HasSubstr("error: comm backend 'test_comm_typo' of plugin 'test_comm_typo' (" +
                                  (plugin_dir("test_comm_typo") / "libspmdx_test_comm_typo.so").lexically_normal().string() +
                                  ") has malformed capabilities: capability 0 (all_reduse, host) names operation 'all_reduse', which is neither "
                                  "\"*\" nor one of all_reduce, all_gather, reduce_scatter, all_to_all, all_to_all_v, broadcast, send, recv, barrier (did you "
                                  "mean all_reduce?); fix the plugin"));
  EXPECT_THAT(r.output, HasSubstr("capabilities of ucx: * host any size score 10"));
  EXPECT_THAT(r.output, HasSubstr("options of ucx: tls, chunk_bytes, direct_max_bytes, shm, shm_chunk_bytes"));
}

TEST(Cli, PluginsTableNamesEachPlugin) {
  auto r = spmdx("plugins");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("data_parallel"));
  EXPECT_THAT(r.output, HasSubstr("strategy"));
}

TEST(Cli, VersionPrintsTheAbi) {
  auto r = spmdx("--version");
  ASSERT_EQ(r.exit_code, 0);
  EXPECT_THAT(r.output, HasSubstr("plugin ABI 4.1"));
}

struct ErrorCase {
  const char* what;
  std::string path;
  std::string message;
};

TEST(Cli, EachPluginErrorPrintsItsMessageAndExitsOne) {
  test::TempDir dir;
  test::write_file(dir / "libspmdx_text.so", "not ELF");
  const std::vector<ErrorCase> cases = {
      {"missing", "/nonexistent/libspmdx_x.so", "'/nonexistent/libspmdx_x.so' (from plugins.paths or --plugin-path) does not exist"},
      {"not ELF", (dir / "libspmdx_text.so").string(), "not a shared object"},
      {"no entry", plugin_dir("test_no_entry").string(), "has no 'spmdx_plugin' entry point"},
      {"ABI major", plugin_dir("test_abi_major").string(), "was built for ABI 5, this host supports 4"},
      {"throws", plugin_dir("test_throws").string(), "plugin 'test_throws' (" + plugin_dir("test_throws").string() +
                                                        "/libspmdx_test_throws.so) failed to register"},
  };
  for (const auto& c : cases) {
    auto r = spmdx("plugins --plugin-path '" + c.path + "'");
    EXPECT_TRUE(r.exited) << c.what << ": crashed\n" << r.output;
    EXPECT_EQ(r.exit_code, 1) << c.what << "\n" << r.output;
    EXPECT_THAT(r.output, HasSubstr("error: ")) << c.what;
    EXPECT_THAT(r.output, HasSubstr(c.message)) << c.what;
  }
}

TEST(Cli, UntrustedPluginIsRefused) {
  test::TempDir dir;
  fs::copy_file(plugin_dir("test_strategy") / "libspmdx_test_strategy.so", dir / "libspmdx_test_strategy.so");
  fs::permissions(dir / "libspmdx_test_strategy.so", fs::perms::others_write, fs::perm_options::add);
  auto r = spmdx("plugins --plugin-path '" + dir.path().string() + "'");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("refusing to load plugin"));
  EXPECT_THAT(r.output, HasSubstr("writable by others"));
}

TEST(Cli, DuplicateNameWarnsNamingBothPathsAndSucceeds) {
  auto r = spmdx("plugins --plugin-path '" + plugin_dir("test_strategy").string() + "' --plugin-path '" +
                 plugin_dir("test_strategy_dup").string() + "'");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("plugin 'test_strategy' found twice: using " + plugin_dir("test_strategy").string()));
  EXPECT_THAT(r.output, HasSubstr("ignoring " + plugin_dir("test_strategy_dup").string()));
}

TEST(Cli, UsageErrorsExitTwo) {
  EXPECT_EQ(spmdx("plugins --no-such-flag").exit_code, 2);
  EXPECT_EQ(spmdx("frobnicate").exit_code, 2);
  auto r = spmdx("--version plugins");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.output, HasSubstr("--version takes no subcommand"));
  EXPECT_EQ(spmdx("--help").exit_code, 0);
}

TEST(Cli, GraphPrintsTheTrainStep) {
  auto r = spmdx("graph --model mlp --flavor tiny --vocab 32 --batch 2 --seq 4");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("graph(%tokens: i64[2, 4], %labels: i64[2, 4], %tok_embeddings.weight: f32[32, 64]"));
  EXPECT_THAT(r.output, HasSubstr("= cross_entropy("));
  EXPECT_THAT(r.output, HasSubstr("= embedding_backward("));
  EXPECT_THAT(r.output, HasSubstr("= adamw("));
  EXPECT_THAT(r.output, HasSubstr("next.exp_avg_sq.output.weight="));
  auto j = spmdx("graph --model llama --flavor tiny --json --forward-only 2>/dev/null");
  ASSERT_EQ(j.exit_code, 0);
  EXPECT_EQ(nlohmann::json::parse(j.output).at("format"), "spmdx.graph");
  auto bad = spmdx("graph --model gpt");
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_THAT(bad.output, HasSubstr("unknown model 'gpt'; known models: mlp, llama"));
}

// [parallelism.strategies] binds a mesh dim to a strategy plugin: DDP's data_parallel on
// dp_shard keeps whole parameters on every rank, where fsdp keeps a quarter.
TEST(Cli, StrategiesTableBindsAMeshDimToAPlugin) {
  const std::string config = "compile '" SPMDX_SOURCE_DIR "/configs/llama_fsdp.toml' --world-size 4";
  auto fsdp = spmdx(config);
  ASSERT_EQ(fsdp.exit_code, 0) << fsdp.output;
  EXPECT_THAT(fsdp.output, HasSubstr("parameters 137.3 KiB"));
  auto ddp = spmdx(config + " --parallelism.strategies.dp_shard data_parallel");
  ASSERT_EQ(ddp.exit_code, 0) << ddp.output;
  EXPECT_THAT(ddp.output, HasSubstr("parameters 549.2 KiB"));
  auto typo = spmdx(config + " --parallelism.strategies.dp_shrad data_parallel");
  EXPECT_EQ(typo.exit_code, 1);
  EXPECT_THAT(typo.output, HasSubstr("names mesh dim 'dp_shrad'; strategies decide the mesh dims dp_replicate, dp_shard and tp; did you mean 'dp_shard'?"));
  auto pipeline = spmdx(config + " --parallelism.strategies.pp data_parallel");  // another feature, not a typo of tp
  EXPECT_EQ(pipeline.exit_code, 1);
  EXPECT_THAT(pipeline.output, HasSubstr("names mesh dim 'pp'; strategies decide the mesh dims dp_replicate, dp_shard and tp; pipeline stages are cut by parallelism.pipeline_parallel_degree"));
  EXPECT_THAT(pipeline.output, ::testing::Not(HasSubstr("did you mean 'tp'")));
  auto unknown = spmdx(config + " --parallelism.strategies.dp_shard nonesuch");
  EXPECT_EQ(unknown.exit_code, 1);
  EXPECT_THAT(unknown.output, HasSubstr("no strategy plugin named 'nonesuch'"));
  auto wrong_kind = spmdx(config + " --parallelism.strategies.tp ucx");  // checked whatever the dim's degree
  EXPECT_EQ(wrong_kind.exit_code, 1);
  EXPECT_THAT(wrong_kind.output, HasSubstr("parallelism.strategies.tp = \"ucx\": 'ucx' is a comm plugin, not a strategy plugin; found: "));
}

TEST(Cli, CompilePlansWithoutStartingRanks) {
  test::TempDir dir;
  auto r = spmdx("compile '" SPMDX_SOURCE_DIR "/configs/llama_tp.toml' --dump '" + dir.path().string() + "'");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("mesh tp=2 (2 ranks)"));
  EXPECT_THAT(r.output, HasSubstr("per rank (rank 0): parameters"));
  for (const char* f : {"logical.txt", "logical.json", "plan.txt", "plan.json", "rank0.txt", "rank1.json"}) {
    EXPECT_TRUE(fs::exists(dir / f)) << f;
  }
  auto big = spmdx("compile '" SPMDX_SOURCE_DIR "/configs/llama_debug.toml' --world-size 1024 --fake "
                   "--parallelism.data_parallel_replicate_degree 8 --parallelism.data_parallel_shard_degree 16 "
                   "--parallelism.tensor_parallel_degree 8 --training.local_batch_size 1");
  ASSERT_EQ(big.exit_code, 0) << big.output;
  EXPECT_THAT(big.output, HasSubstr("mesh dp_replicate=8 x dp_shard=16 x tp=8 (1024 ranks)"));
  auto typo = spmdx("compile '" SPMDX_SOURCE_DIR "/configs/llama_tp.toml' --training.stpes 3");
  EXPECT_EQ(typo.exit_code, 1);
  EXPECT_THAT(typo.output, HasSubstr("unknown key 'training.stpes'; did you mean 'training.steps'?"));
  auto printed = spmdx("compile '" SPMDX_SOURCE_DIR "/configs/llama_tp.toml' --print-config");
  EXPECT_THAT(printed.output, HasSubstr("tensor_parallel_degree = 2"));
}

// A tp_plan that shards only the embeddings leaves every layer's matrices whole: each is under
// 1% of a model with a large vocabulary (not named alone), but together they are a sixth of
// it, and that is said, with a glob that would shard them. The built-in plan says nothing.
TEST(Cli, ManySmallReplicatedMatricesAreNamedTogether) {
  test::TempDir dir;
  test::write_file(dir / "plan.toml", "[model]\nname = \"llama\"\nflavor = \"debugmodel\"\ntokenizer = \"byte\"\n[data]\npaths = [\"" +
                                          test::corpus_file(dir) + "\"]\n[parallelism.tp_plan]\n\"tok_embeddings.weight\" = \"rowwise\"\n\"output.weight\" = \"colwise\"\n");
  const std::string args = " --parallelism.tensor_parallel_degree 2 --parallelism.data_parallel_shard_degree 1 --world-size 2 --model.vocab_size 50000 --fake";
  auto r = spmdx("compile '" + (dir / "plan.toml").string() + "'" + args);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, ::testing::ContainsRegex("warning: tensor_parallel on tp \\(2 ranks\\) keeps 42 weight matrices, each under 1% but 1[0-9]\\.[0-9]% of "
                                                 "the model's parameters together, whole on every tp rank \\(layers.0.attention.wq.weight, "
                                                 "layers.0.attention.wk.weight, layers.0.attention.wv.weight, and 39 more\\)"));
  EXPECT_THAT(r.output, HasSubstr("(globs such as \"*.wq.weight\" = \"colwise\")"));
  auto built_in = spmdx("compile '" SPMDX_SOURCE_DIR "/configs/llama_debug.toml'" + args);
  ASSERT_EQ(built_in.exit_code, 0) << built_in.output;
  EXPECT_THAT(built_in.output, Not(HasSubstr("whole on every tp rank")));
}

// parallelism.enable_sequence_parallel says where it acts and, where it cannot, that it is off
// and why, in `spmdx compile` as in `spmdx run`: tp 1, a model without norms, a sequence
// shorter than tp.
TEST(Cli, SequenceParallelSaysWhereItIsOffAndWhy) {
  const std::string llama = "compile '" SPMDX_SOURCE_DIR "/configs/llama_tp.toml' --parallelism.enable_sequence_parallel true";
  auto on = spmdx(llama + " --json 2>&1");
  ASSERT_EQ(on.exit_code, 0) << on.output;
  EXPECT_TRUE(nlohmann::json::parse(on.output.substr(on.output.find('{'))).at("sequence_parallel").get<bool>()) << on.output;
  EXPECT_THAT(spmdx(llama).output, HasSubstr("(2 ranks, sequence parallel over tp)"));
  auto tp1 = spmdx(llama + " --parallelism.tensor_parallel_degree 1");
  EXPECT_THAT(tp1.output, HasSubstr("sequence parallel: off, parallelism.enable_sequence_parallel acts only with parallelism.tensor_parallel_degree > 1"));
  auto short_seq = spmdx(llama + " --training.seq_len 1");
  EXPECT_THAT(short_seq.output, HasSubstr("sequence parallel: off, the model has no rms_norm or layer_norm op over a sequence of at least tensor_parallel_degree (2)"));
  EXPECT_THAT(short_seq.output, Not(HasSubstr("sequence parallel over tp")));
  auto mlp = spmdx("compile '" SPMDX_SOURCE_DIR "/configs/mlp_dp.toml' --parallelism.data_parallel_replicate_degree 1 --parallelism.tensor_parallel_degree 2 "
                   "--parallelism.enable_sequence_parallel true");
  EXPECT_EQ(mlp.exit_code, 0) << mlp.output;
  EXPECT_THAT(mlp.output, HasSubstr("sequence parallel: off, the model has no rms_norm or layer_norm op"));
}

// Pipeline stages: compile says what each stage holds, sends and receives, --dump writes each
// rank's schedule; configs the stages cannot serve fail before any rank starts, naming the key.
TEST(Cli, PipelineStagesArePlannedAndBadOnesRefused) {
  test::TempDir dir;
  const std::string llama = "compile '" SPMDX_SOURCE_DIR "/configs/llama_fsdp.toml' --parallelism.pipeline_parallel_degree 2 "
                            "--parallelism.data_parallel_shard_degree 2 --training.global_batch_size 8 --model.n_layers 4";
  auto pp = spmdx(llama + " --dump '" + (dir / "dump").string() + "'");
  ASSERT_EQ(pp.exit_code, 0) << pp.output;
  EXPECT_THAT(pp.output, HasSubstr("mesh pp=2 x dp_shard=2 (4 ranks)"));
  EXPECT_THAT(pp.output, HasSubstr("pipeline: 2 stages, schedule 1F1B, 4 microbatches, theoretical bubble 0.200"));
  EXPECT_THAT(pp.output, HasSubstr("  stage 0 (ranks 0-1): the embedding, layers 0 to 1, 5 sends (")) << pp.output;
  EXPECT_THAT(pp.output, HasSubstr("  stage 1 (ranks 2-3): layers 2 on, the final norm and output, 7 sends ("));
  const std::string schedule = test::read_file(dir / "dump" / "rank3.schedule.txt");
  EXPECT_THAT(schedule, HasSubstr("*stage 1 (idle 0.200) |"));
  EXPECT_THAT(schedule, HasSubstr("# order of stage 1: F0 B0 F1 B1 F2 B2 F3 B3"));
  EXPECT_THAT(test::read_file(dir / "dump" / "rank0.txt"), HasSubstr("= send("));
  // spmdx diff tells two schedules apart, and names the rank graphs' mesh dims with pp.
  ASSERT_EQ(spmdx(llama + " --parallelism.pipeline_parallel_schedule GPipe --dump '" + (dir / "gpipe").string() + "'").exit_code, 0);
  auto diff = spmdx("diff '" + (dir / "dump").string() + "' '" + (dir / "gpipe").string() + "'");
  EXPECT_EQ(diff.exit_code, 1) << diff.output;
  EXPECT_THAT(diff.output, HasSubstr("\"schedule\":\"1F1B\""));
  EXPECT_THAT(diff.output, Not(HasSubstr("over dim 1")));
  auto split = spmdx(llama + " --parallelism.pipeline_parallel_split_points layers.3 --parallelism.pipeline_parallel_schedule GPipe --json 2>&1");
  ASSERT_EQ(split.exit_code, 0) << split.output;
  const auto j = nlohmann::json::parse(split.output.substr(split.output.find('{')));
  EXPECT_EQ(j.at("pipeline").at("per_stage").at(1).at("first_layer").get<int>(), 3);
  EXPECT_EQ(j.at("pipeline").at("schedule").get<std::string>(), "GPipe");

  auto refused = [&](const std::string& flags, const std::string& why) {
    auto r = spmdx(llama + " " + flags);
    EXPECT_EQ(r.exit_code, 1) << flags << "\n" << r.output;
    EXPECT_THAT(r.output, HasSubstr(why)) << flags;
  };
  refused("--parallelism.pipeline_parallel_degree 8 --parallelism.data_parallel_shard_degree 1",
          "parallelism.pipeline_parallel_degree 8 is more stages than the model's 4 layers: use at most 4 stages");
  refused("--parallelism.pipeline_parallel_microbatch_size 3",
          "training.global_batch_size 8 does not split into microbatches of 3 rows on each of the 2 data-parallel ranks");
  refused("--parallelism.pipeline_parallel_split_points layers.9", "\"layers.9\" names no layer a stage can begin at: use \"layers.N\" with N from 1 to 3");
  refused("--parallelism.pipeline_parallel_split_points norm", "\"norm\" names no layer a stage can begin at");
  refused("--parallelism.pipeline_parallel_split_points layers.1,layers.2",
          "parallelism.pipeline_parallel_split_points makes 4 layers into 3 stages, not pipeline_parallel_degree 2 (more are virtual stages");
  refused("--parallelism.pipeline_parallel_layers_per_stage 1",
          "parallelism.pipeline_parallel_layers_per_stage 1 makes 4 layers into 4 stages, not pipeline_parallel_degree 2 (more are virtual stages: "
          "pipeline_parallel_schedule = \"Interleaved1F1B\"): use 2, or unset it");
  auto ceil = spmdx(llama + " --parallelism.pipeline_parallel_layers_per_stage 3 --json 2>&1");  // torchtitan's count: 3 + 1
  ASSERT_EQ(ceil.exit_code, 0) << ceil.output;
  EXPECT_EQ(nlohmann::json::parse(ceil.output.substr(ceil.output.find('{'))).at("pipeline").at("per_stage").at(1).at("first_layer").get<int>(), 3);
  refused("--parallelism.pipeline_parallel_schedule_csv x.csv", "pipeline schedules from a CSV file");
  // Interleaved1F1B: two chunks a stage by default (4 layers: stage 0 holds layers 0 and 2).
  auto interleaved = spmdx(llama + " --parallelism.pipeline_parallel_schedule Interleaved1F1B --json 2>&1");
  ASSERT_EQ(interleaved.exit_code, 0) << interleaved.output;
  const auto ij = nlohmann::json::parse(interleaved.output.substr(interleaved.output.find('{')));
  EXPECT_EQ(ij.at("pipeline").at("per_stage").at(0).at("layers").get<std::string>(), "layer 0, layer 2");
  EXPECT_NEAR(ij.at("pipeline").at("bubble_fraction").get<double>(), 1.0 / 9.0, 1e-12);  // (2 - 1) / (2 x 4 + 2 - 1)
  refused("--parallelism.pipeline_parallel_schedule Interleaved1F1B --training.global_batch_size 6", "runs microbatches in groups of pipeline_parallel_degree 2");
  refused("--parallelism.pipeline_parallel_schedule Interleaved1F1B --parallelism.pipeline_parallel_layers_per_stage 3",
          "makes 4 layers into 2 chunks, not a multiple of pipeline_parallel_degree 2, at least twice it (Interleaved1F1B): use 1, or unset it");
  refused("--world-size 5", "parallelism.pipeline_parallel_degree 2 does not divide world_size 5");
  // A memory budget holds for every stage: stage 0 plans the most here (embedding, 2 microbatches
  // of activations in flight), so a budget just under its peak is refused.
  auto fits = spmdx(llama + " --parallelism.memory_budget 8MiB");
  EXPECT_THAT(fits.output, HasSubstr("fits as configured")) << fits.output;
  refused("--parallelism.memory_budget 1MiB", "is over the budget 1.0 MiB, and nothing spmdx tries fits");
}

// Degrees that do not multiply to the ranks started: the message says what to change, as the
// flags to give, and each flag it names fixes the job.
TEST(Cli, DegreesThatDoNotFitTheRanksSayWhichFlagsFixThem) {
  const std::string config = SPMDX_SOURCE_DIR "/configs/llama_debug.toml";
  auto run = spmdx("run '" + config + "' --nproc 2");
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_EQ(run.output, "error: " + config + ": parallelism degrees multiply to 4 (1 x 2 x 2), but world_size is 2: start 4 ranks (--nproc 4), or make the degrees "
                        "fit 2 ranks: --parallelism.data_parallel_shard_degree -1 (the ranks the other degrees leave) or --parallelism.tensor_parallel_degree 1\n");
  EXPECT_THAT(run.output, Not(HasSubstr("[rank")));  // refused before any rank started
  // spmdx compile counts the ranks with --world-size, and says so.
  auto compile = spmdx("compile '" + config + "' --world-size 2");
  EXPECT_EQ(compile.exit_code, 1) << compile.output;
  EXPECT_THAT(compile.output, HasSubstr("but world_size is 2: start 4 ranks (--world-size 4), or make the degrees fit 2 ranks: "));
  for (const std::string fix : {"--parallelism.data_parallel_shard_degree -1", "--parallelism.tensor_parallel_degree 1", ""}) {
    auto fixed = spmdx("compile '" + config + "' --world-size " + (fix.empty() ? "4" : "2 " + fix));
    EXPECT_EQ(fixed.exit_code, 0) << fix << "\n" << fixed.output;
  }
  auto three = spmdx("compile '" + config + "' --world-size 3");  // no one degree fits 3 ranks
  EXPECT_THAT(three.output, HasSubstr("but world_size is 3: start 4 ranks (--world-size 4), or set degrees that multiply to 3\n"));
}

// data_parallel_shard_degree -1 where the other degrees do not divide the ranks: the message
// says which flags would fit, as the degrees' product does, and each flag it names fixes the job.
TEST(Cli, AShardDegreeOfMinusOneThatCannotFitSaysWhichFlagsFix) {
  const std::string config = SPMDX_SOURCE_DIR "/configs/llama_debug.toml";
  const std::string rest = " --parallelism.data_parallel_shard_degree -1";
  auto run = spmdx("run '" + config + "' --nproc 3" + rest);
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_EQ(run.output, "error: " + config + " with command line" + rest + ": parallelism.data_parallel_replicate_degree x tensor_parallel_degree = 2 does not divide world_size 3: start "
                        "a multiple of 2 ranks (--nproc 4), or make the degrees fit 3 ranks: --parallelism.tensor_parallel_degree 1\n");
  auto compile = spmdx("compile '" + config + "' --world-size 3" + rest);
  EXPECT_EQ(compile.exit_code, 1) << compile.output;
  EXPECT_THAT(compile.output, HasSubstr("does not divide world_size 3: start a multiple of 2 ranks (--world-size 4), or make the degrees fit 3 ranks: "
                                        "--parallelism.tensor_parallel_degree 1\n"));
  for (const std::string fix : {"3 --parallelism.tensor_parallel_degree 1", "4"}) {
    auto fixed = spmdx("compile '" + config + "'" + rest + " --world-size " + fix);
    EXPECT_EQ(fixed.exit_code, 0) << fix << "\n" << fixed.output;
  }
  // Against 6 ranks: tp 4 fits as 2 (dp_shard takes 3); dp_replicate 2 x tp 2 fits with either at 1.
  auto tp4 = spmdx("compile '" + config + "' --world-size 6 --parallelism.tensor_parallel_degree 4" + rest);
  EXPECT_THAT(tp4.output, HasSubstr("tensor_parallel_degree = 4 does not divide world_size 6: start a multiple of 4 ranks (--world-size 8), or make the "
                                    "degrees fit 6 ranks: --parallelism.tensor_parallel_degree 2\n"));
  const std::string two_by_two = "' --world-size 6 --parallelism.data_parallel_replicate_degree 2" + rest;
  auto both = spmdx("compile '" + config + two_by_two);
  EXPECT_THAT(both.output, HasSubstr("= 4 does not divide world_size 6: start a multiple of 4 ranks (--world-size 8), or make the degrees fit 6 ranks: "
                                     "--parallelism.tensor_parallel_degree 1 or --parallelism.data_parallel_replicate_degree 1\n"));
  for (const std::string fix : {"--parallelism.tensor_parallel_degree 1", "--parallelism.data_parallel_replicate_degree 1"}) {
    auto fixed = spmdx("compile '" + config + two_by_two + " " + fix);
    EXPECT_THAT(fixed.output, Not(HasSubstr("does not divide"))) << fix << "\n" << fixed.output;
  }
  auto none = spmdx("compile '" + config + "' --world-size 3 --parallelism.data_parallel_replicate_degree 2" + rest);  // no one degree fits 3 ranks
  EXPECT_THAT(none.output, HasSubstr("= 4 does not divide world_size 3: start a multiple of 4 ranks (--world-size 4), or set degrees whose product divides 3\n"));
}

// One form for errors: spmdx's "error: ...", CLI11's parse errors included (no "Error:", no
// "Run with --help").
TEST(Cli, EveryErrorSaysErrorTheSameWay) {
  auto range = spmdx("run '" SPMDX_SOURCE_DIR "/configs/llama_debug.toml' --nproc 0");
  EXPECT_EQ(range.exit_code, 2);
  EXPECT_EQ(range.output, "error: --nproc: Value 0 not in range 1 to 4096\nspmdx run --help describes its options\n");
  auto flag = spmdx("plugins --no-such-flag");
  EXPECT_EQ(flag.exit_code, 2);
  EXPECT_EQ(flag.output, "error: The following argument was not expected: --no-such-flag\nspmdx plugins --help describes its options\n");
  auto top = spmdx("--log-level loud");
  EXPECT_EQ(top.exit_code, 2);
  EXPECT_THAT(top.output, ::testing::StartsWith("error: --log-level: loud not in {trace,debug,info,warn,warning,error,off}\nspmdx --help describes"));
}

// A typo on the command line gets the hint a typo in the file gets: the same words.
TEST(Cli, ATypoOnTheCommandLineGetsTheHintOfTheSameTypoInAFile) {
  test::TempDir dir;
  const std::string config = SPMDX_SOURCE_DIR "/configs/llama_debug.toml";
  auto section = spmdx("run '" + config + "' --nproc 4 --optimzer.lr 1e-3 --optimizer.lrr 1");
  EXPECT_EQ(section.exit_code, 1) << section.output;
  EXPECT_THAT(section.output, HasSubstr("  command line: --optimzer.lr: unknown section 'optimzer'; did you mean 'optimizer'?\n"));
  EXPECT_THAT(section.output, HasSubstr("  command line: --optimizer.lrr: unknown key 'optimizer.lrr'; did you mean 'optimizer.lr'?"));
  test::write_file(dir / "job.toml", "[optimzer]\nlr = 1e-3\n[optimizer]\nlrr = 1\n");
  auto file = spmdx("compile '" + (dir / "job.toml").string() + "'");
  EXPECT_EQ(file.exit_code, 1) << file.output;
  EXPECT_THAT(file.output, HasSubstr((dir / "job.toml").string() + ":1:1: unknown section 'optimzer'; did you mean 'optimizer'?"));
  EXPECT_THAT(file.output, HasSubstr((dir / "job.toml").string() + ":4:7: unknown key 'optimizer.lrr'; did you mean 'optimizer.lr'?"));
  // Without --nproc, the typo is named with the ranks the job needs, not hidden behind them.
  auto alone = spmdx("run '" + config + "' --optimzer.lr 1e-3");
  EXPECT_EQ(alone.exit_code, 1);
  EXPECT_THAT(alone.output, HasSubstr("unknown section 'optimzer'; did you mean 'optimizer'?"));
  EXPECT_THAT(alone.output, HasSubstr("its parallelism degrees make 4 ranks: start them with --nproc 4"));
  // A torchtitan section spmdx reads as torchtitan's is not a typo.
  EXPECT_THAT(spmdx("compile '" + config + "' --float8.enable_fsdp_float8_all_gather false").output, Not(HasSubstr("unknown section")));
}

// Commands: an unknown one gets a hint and the list; a missing one the usage; exit 2 as CLI11's
// usage errors, git and torchrun (argparse).
TEST(Cli, UnknownAndMissingCommandsListTheCommands) {
  auto typo = spmdx("runn x.toml");
  EXPECT_EQ(typo.exit_code, 2);
  EXPECT_THAT(typo.output, ::testing::StartsWith("error: unknown command 'runn'; did you mean 'run'?\nCommands of spmdx:\n  plugins   List the plugins"));
  EXPECT_THAT(typo.output, HasSubstr("\n  run       Train: the job its config describes"));
  EXPECT_THAT(typo.output, Not(HasSubstr("not expected")));
  auto none = spmdx("");
  EXPECT_EQ(none.exit_code, 2);
  EXPECT_THAT(none.output, ::testing::StartsWith("spmdx: SPMD distributed training"));
  EXPECT_THAT(none.output, HasSubstr("Usage: spmdx [OPTIONS] [SUBCOMMAND]"));
  EXPECT_THAT(none.output, HasSubstr("error: spmdx needs a command (spmdx COMMAND --help describes one)\n"));
  auto bench = spmdx("bench");
  EXPECT_EQ(bench.exit_code, 2);
  EXPECT_THAT(bench.output, ::testing::StartsWith("Usage: spmdx bench COMMAND [OPTIONS]\n"));
  EXPECT_THAT(bench.output, HasSubstr("Commands:\n  comm     Time one collective over a backend"));
  EXPECT_THAT(bench.output, HasSubstr("\n  compare  Is run B slower than run A"));
  EXPECT_THAT(bench.output, HasSubstr("\n  fit      Fit the cost model's per-collective cost"));
  EXPECT_THAT(bench.output, HasSubstr("error: spmdx bench needs a command"));
  auto sub = spmdx("bench compar a b");
  EXPECT_EQ(sub.exit_code, 2);
  EXPECT_THAT(sub.output, ::testing::StartsWith("error: unknown command 'compar'; did you mean 'compare'?\nCommands of spmdx bench:\n  comm "));
  auto far = spmdx("frobnicate");
  EXPECT_EQ(far.exit_code, 2);
  EXPECT_THAT(far.output, ::testing::StartsWith("error: unknown command 'frobnicate'\n"));  // no hint when none is likely
  // A command's own words are its arguments, not commands: a config named like one is a config.
  auto word = spmdx("--log-level info run plugins");
  EXPECT_EQ(word.exit_code, 2);
  EXPECT_THAT(word.output, ::testing::StartsWith("error: config: "));  // CLI11's check of the config file
  EXPECT_THAT(word.output, Not(HasSubstr("unknown command")));
  auto help = spmdx("run --help");
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_THAT(help.output, HasSubstr("Usage: spmdx run [OPTIONS] config"));
  EXPECT_THAT(help.output, HasSubstr("Any config key can be given after the config as --section.key value"));
  EXPECT_THAT(help.output, HasSubstr("e.g. --training.steps 3 --optimizer.lr 1e-3"));
  EXPECT_THAT(help.output, HasSubstr("Every key, with its default and meaning: spmdx run CONFIG --print-config (docs/configuration.md)."));
  EXPECT_THAT(spmdx("compile --help").output, HasSubstr("--section.key value"));
}

// spmdx graph draws the model a run trains: the tokenizer's vocabulary (the byte tokenizer's 264
// ids without a config), and with a config its model, global batch and seq_len.
TEST(Cli, GraphUsesTheVocabularyARunUses) {
  auto plain = spmdx("graph --forward-only");
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  EXPECT_THAT(plain.output, HasSubstr("%tok_embeddings.weight: f32[264, 64]"));
  const std::string config = "'" SPMDX_SOURCE_DIR "/configs/llama_debug.toml'";
  auto graph = spmdx("graph " + config + " --forward-only");
  ASSERT_EQ(graph.exit_code, 0) << graph.output;
  EXPECT_THAT(graph.output, ::testing::StartsWith("graph(%tokens: i64[8, 128], %labels: i64[8, 128], %tok_embeddings.weight: f32[264, 256]"));
  auto compile = spmdx("compile " + config + " --json 2>/dev/null");
  ASSERT_EQ(compile.exit_code, 0) << compile.output;
  const auto j = nlohmann::json::parse(compile.output);
  EXPECT_EQ(j.at("model").at("vocab_size"), 264);
  EXPECT_EQ(j.at("global_batch_size"), 8);
  EXPECT_EQ(j.at("seq_len"), 128);
  auto flags = spmdx("graph " + config + " --forward-only --vocab 300 --batch 2 --flavor tiny");  // flags replace the config's values
  ASSERT_EQ(flags.exit_code, 0) << flags.output;
  EXPECT_THAT(flags.output, ::testing::StartsWith("graph(%tokens: i64[2, 128], %labels: i64[2, 128], %tok_embeddings.weight: f32[300, 64]"));
}

// A run's output: each line carries one "[rank R]" (the launcher's), a hook's line is said
// once (by rank 0, not also by the launcher's preflight), and no line has a timestamp; a
// warning says "warning:" as the program's other warnings do.
TEST(Cli, EachLineOfARunHasOneRankPrefixAndHookLinesComeOnce) {
  test::TempDir dir;
  auto r = spmdx("run '" SPMDX_SOURCE_DIR "/configs/mlp_dp.toml' --nproc 2 --training.steps 2 --data.paths '" + test::corpus_file(dir) + "' --job.dump_folder '" +
                 (dir / "out").string() + "' --hooks.enable partition_validator,timeline --hooks.timeline.start_step 100");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::istringstream lines(r.output);
  int validator = 0, warnings = 0;
  for (std::string line; std::getline(lines, line);) {
    EXPECT_THAT(line, ::testing::MatchesRegex("\\[rank [01]\\] .*")) << r.output;
    EXPECT_THAT(line.substr(1), Not(HasSubstr("[rank "))) << line;
    EXPECT_FALSE(std::regex_search(line, std::regex("[0-9][0-9]:[0-9][0-9]:[0-9][0-9]"))) << line;
    EXPECT_THAT(line, Not(HasSubstr("[info]"))) << line;
    validator += line.find("partition_validator: passed (2 ranks") != std::string::npos;
    warnings += line.find("] warning: timeline: no step recorded (start_step 100") != std::string::npos;
  }
  EXPECT_EQ(validator, 1) << r.output;
  EXPECT_EQ(warnings, 2) << r.output;  // each rank's, each under its own prefix
  EXPECT_THAT(r.output, HasSubstr("[rank 0] partition_validator: passed (2 ranks"));
  EXPECT_THAT(r.output, HasSubstr("[rank 0] waiting for 2 ranks to join at "));  // the rank named once
  EXPECT_THAT(r.output, Not(HasSubstr("rank 0: waiting")));
}

TEST(Cli, EnvironmentPathIsSearched) {
  auto r = run_command("SPMDX_PLUGIN_PATH='" + plugin_dir("test_comm_a").string() + "' '" SPMDX_EXE "' plugins --json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("\"test_comm_a\""));
}

}  // namespace
}  // namespace spmdx
