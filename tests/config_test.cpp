// The job config: schema checks with file:line:column, did-you-mean, overrides, and the
// derived job (degrees, batch sizes) with its errors.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>

#include "spmdx/config/config.h"
#include "spmdx/job/compile.h"
#include "spmdx/job/preflight.h"
#include "spmdx/job/spec.h"
#include "test_util.h"

namespace spmdx::config {
namespace {

using ::testing::HasSubstr;

std::string error_of(const std::string& toml) {
  try {
    Config::parse(toml, "job.toml");
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Config, ReadsTorchtitanNamesAndKeepsDefaults) {
  Config c = Config::parse("[training]\nsteps = 7\nseq_len = 32\n[optimizer]\nlr = 1e-3\n[parallelism]\ntensor_parallel_degree = 2\n",
                           "job.toml");
  EXPECT_EQ(c.get_int("training.steps"), 7);
  EXPECT_EQ(c.get_int("training.seq_len"), 32);
  EXPECT_DOUBLE_EQ(c.get_float("optimizer.lr"), 1e-3);
  EXPECT_EQ(c.get_int("parallelism.tensor_parallel_degree"), 2);
  EXPECT_EQ(c.get_string("model.name"), "llama");                 // default
  EXPECT_DOUBLE_EQ(c.get_float("optimizer.weight_decay"), 0.1);  // default
}

// Every comm backend spec of a job (comm.backend, comm.fallback, comm.swap_to) is parsed once, into
// JobSpec's typed form, which the ranks make their backends from.
TEST(Config, CommBackendSpecsAreParsedOnceIntoTheJobSpec) {
  Config c = Config::parse("[model]\nname = \"mlp\"\n[comm]\nbackend = \"ucx:tls=tcp,self;chunk_bytes=64K\"\nfallback = [\"auto\", \"local\"]\n"
                           "swap_to = \"ucx:shm=off\"\nswap_at_step = 2\n",
                           "job.toml");
  const job::JobSpec spec = job::job_spec(c, 1, 256);
  EXPECT_EQ(spec.comm.chain, (std::vector<std::string>{"ucx:tls=tcp,self;chunk_bytes=64K", "auto", "local"}));
  ASSERT_EQ(spec.comm.parsed.size(), 4u);
  const PluginSpec* first = spec.comm.find_parsed("ucx:tls=tcp,self;chunk_bytes=64K");
  ASSERT_NE(first, nullptr);
  EXPECT_EQ(first->name, "ucx");
  EXPECT_EQ(first->options.at("tls"), "tcp,self");
  EXPECT_EQ(first->options.at("chunk_bytes"), "64K");
  ASSERT_NE(spec.comm.find_parsed("ucx:shm=off"), nullptr);
  EXPECT_EQ(spec.comm.find_parsed("ucx:shm=off")->options.at("shm"), "off");
  ASSERT_NE(spec.comm.find_parsed("auto"), nullptr);
  EXPECT_TRUE(spec.comm.find_parsed("auto")->options.empty());
  EXPECT_EQ(spec.comm.find_parsed("local")->name, "local");
}

TEST(Config, ErrorsNameFileLineColumnKeyAndExpectation) {
  EXPECT_EQ(error_of("[training]\nsteps = 3\nstpes = 4\n"),
            "job.toml:3:9: unknown key 'training.stpes'; did you mean 'training.steps'?");
  EXPECT_EQ(error_of("[trainig]\nsteps = 3\n"), "job.toml:1:1: unknown section 'trainig'; did you mean 'training'?");
  EXPECT_EQ(error_of("[training]\nsteps = \"ten\"\n"), "job.toml:2:9: training.steps must be an integer");
  EXPECT_EQ(error_of("[training]\nsteps = 0\n"), "job.toml:2:9: training.steps is 0, must be between 1 and 1e+09");
  EXPECT_EQ(error_of("[model]\nname = \"lama\"\n"), "job.toml:2:8: model.name is \"lama\", expected one of llama, mlp, qwen3, deepseek_v3, pt2; did you mean 'llama'?");
  EXPECT_EQ(error_of("[model]\nname = \"LLAMA\"\n"), "job.toml:2:8: model.name is \"LLAMA\", expected one of llama, mlp, qwen3, deepseek_v3, pt2; did you mean 'llama'?");
  EXPECT_THAT(error_of("[training\nsteps = 3\n"), HasSubstr("job.toml:1:"));
  EXPECT_THAT(error_of("[data]\npaths = [1, 2]\n"), HasSubstr("data.paths must be a list of strings"));
}

TEST(Config, MissingFileIsNamed) {
  try {
    Config::load("/nonexistent/job.toml");
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("/nonexistent/job.toml: no such config file"));
  }
}

TEST(Config, CommandLineOverridesAreTypedAndChecked) {
  Config c;
  c.override_value("training.steps", "20");
  c.override_value("data.paths", "a.txt,b.jsonl");
  c.override_value("checkpoint.enable", "true");
  EXPECT_EQ(c.get_int("training.steps"), 20);
  EXPECT_EQ(c.get_list("data.paths"), (std::vector<std::string>{"a.txt", "b.jsonl"}));
  EXPECT_TRUE(c.get_bool("checkpoint.enable"));
  try {
    c.override_value("training.steps", "2x");
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("command line: --training.steps 2x: training.steps must be an integer"));
  }
  EXPECT_THROW(c.override_value("training.stpes", "2"), ConfigError);
}

TEST(Config, EffectiveConfigRoundTrips) {
  Config c;
  c.override_value("training.steps", "5");
  c.override_value("data.paths", "x.txt");
  const std::string separator = "%\n\t\r\"\\ \x01\x7F";  // control characters print escaped
  c.override_value("data.document_separator", separator);
  Config back = Config::parse(c.to_toml(), "printed");
  EXPECT_EQ(back.to_toml(), c.to_toml());
  EXPECT_EQ(back.get_int("training.steps"), 5);
  EXPECT_EQ(back.get_string("data.document_separator"), separator);
  EXPECT_THAT(c.to_toml(), HasSubstr("\ndocument_separator = \"%\\n\\t\\r\\\"\\\\ \\u0001\\u007F\"  # "));
  // model.name = "pt2"'s keys, inapplicable to the default llama, commented out: the printed
  // file loads back as the same job; every other key printed as is.
  EXPECT_THAT(c.to_toml(), HasSubstr("\nsteps = 5  # "));
  EXPECT_THAT(c.to_toml(), HasSubstr("\n# path = \"\"  # "));
  EXPECT_FALSE(back.is_set("model.path"));
  EXPECT_THAT(c.to_toml(), HasSubstr("\nseq_len = 256  # "));
}

TEST(Config, ShippedConfigsAreValid) {
  int n = 0;
  for (const char* folder : {"configs", "examples/export"}) {
    for (const auto& f : std::filesystem::directory_iterator(std::filesystem::path(SPMDX_SOURCE_DIR) / folder)) {
      if (f.path().extension() != ".toml") continue;
      ++n;
      EXPECT_NO_THROW(Config::load(f.path().string())) << f.path();
    }
  }
  EXPECT_GE(n, 7);
}

// [parallelism.tp_plan]: glob keys (quoted in TOML) -> styles, tensor_parallel's options; from
// the command line as --parallelism.tp_plan.<glob>; printed back with the keys quoted.
TEST(Config, TpPlanTableAndImportKeys) {
  Config c = Config::parse(
      "[model]\nname = \"pt2\"\npath = \"m.pt2\"\ninputs = [\"idx\", \"targets\"]\nloss = \"output\"\n"
      "[parallelism.tp_plan]\n\"layers.*.wq.weight\" = \"colwise\"\n\"output.weight\" = \"shard(0)\"\n",
      "job.toml");
  EXPECT_EQ(c.get_string("model.name"), "pt2");
  EXPECT_EQ(c.get_list("model.inputs"), (std::vector<std::string>{"idx", "targets"}));
  EXPECT_TRUE(c.is_set("model.path"));
  EXPECT_FALSE(c.is_set("training.seq_len"));
  c.override_value("parallelism.tp_plan.layers.*.wo.weight", "rowwise");
  c.override_value("training.seq_len", "64");
  EXPECT_TRUE(c.is_set("training.seq_len"));
  const auto& plan = c.plugin_options("parallelism.tp_plan");
  EXPECT_EQ(plan, (std::map<std::string, std::string>{{"layers.*.wq.weight", "colwise"}, {"output.weight", "shard(0)"}, {"layers.*.wo.weight", "rowwise"}}));
  Config back = Config::parse(c.to_toml(), "printed");
  EXPECT_EQ(back.plugin_options("parallelism.tp_plan"), plan);
  EXPECT_THAT(error_of("[model]\nloss = \"mse\"\n"), HasSubstr("model.loss is \"mse\", expected one of auto, cross_entropy, output"));
}

TEST(Job, DerivesDegreesAndBatchAndRejectsWhatCannotWork) {
  Config c;
  c.override_value("model.flavor", "tiny");
  c.override_value("parallelism.tensor_parallel_degree", "2");
  c.override_value("training.local_batch_size", "3");
  job::JobSpec s = job::job_spec(c, 8, 256);
  EXPECT_EQ(s.dims.dp_shard, 4);  // -1: the ranks tp leaves
  EXPECT_EQ(s.global_batch_size, 12);
  auto error = [&](const std::string& key, const std::string& value, std::int64_t world) {
    Config bad = c;
    bad.override_value(key, value);
    try {
      job::job_spec(bad, world, 256);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_THAT(error("parallelism.tensor_parallel_degree", "3", 6), HasSubstr("tensor_parallel_degree 3 does not divide the 4 attention heads"));
  EXPECT_THAT(error("parallelism.data_parallel_shard_degree", "3", 8), HasSubstr("multiply to 6 (1 x 3 x 2), but world_size is 8"));
  EXPECT_THAT(error("training.global_batch_size", "6", 8), HasSubstr("training.global_batch_size 6 does not split over the 4 data-parallel ranks"));
}

// An error says where the values it is about came from: the file, the command line, or both.
TEST(Config, ErrorsSayWhetherAValueCameFromTheFileOrTheCommandLine) {
  Config c = Config::parse("[training]\nsteps = 7\n[parallelism]\ntensor_parallel_degree = 3\n", "job.toml");
  EXPECT_EQ(c.where({"training.steps"}), "job.toml:2:9");  // where the file sets it
  c.override_value("training.steps", "5");
  c.override_value("parallelism.data_parallel_shard_degree", "2");
  EXPECT_EQ(c.where({"training.steps"}), "command line --training.steps 5");
  EXPECT_EQ(c.where({"parallelism.tensor_parallel_degree", "parallelism.data_parallel_shard_degree"}),
            "job.toml with command line --parallelism.data_parallel_shard_degree 2");  // several keys: the file
  try {
    job::job_spec(c, 4, 256);
    FAIL() << "3 x 2 ranks on 4";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("job.toml with command line --parallelism.data_parallel_shard_degree 2: parallelism degrees multiply to 6"));
  }
  EXPECT_EQ(Config().where({"training.steps"}), "config");
}

// Every problem of a config in one message, in file order, each with its line and column;
// command-line ones after.
TEST(Config, EveryProblemIsListedInOneMessageInFileOrder) {
  test::TempDir dir;
  test::write_file(dir / "job.toml", "[training]\nsteps = \"ten\"\nseq_len = 0\nstpes = 3\n[optimizer]\nlr = -1.0\n[nonsense]\nx = 1\n");
  try {
    Config::load((dir / "job.toml").string(), {"--training.max_norm", "big", "--parallelism.tensor_parallel_degree", "2", "stray"});
    FAIL() << "loaded";
  } catch (const ConfigError& e) {
    const std::string f = (dir / "job.toml").string();
    EXPECT_EQ(std::string(e.what()), f + ": 7 problems (every one found):\n"
                                         "  " + f + ":2:9: training.steps must be an integer\n"
                                         "  " + f + ":3:11: training.seq_len is 0, must be between 1 and 1e+07\n"
                                         "  " + f + ":4:9: unknown key 'training.stpes'; did you mean 'training.steps'?\n"
                                         "  " + f + ":6:6: optimizer.lr is -1, must be between 0 and 1000\n"
                                         "  " + f + ":7:1: unknown section 'nonsense'\n"
                                         "  command line: --training.max_norm big: training.max_norm must be a number\n"
                                         "  command line: unexpected argument 'stray' (overrides look like --section.key value)");
  }
  // Without throwing: the problems, and the good values taken.
  const Config c = Config::load((dir / "job.toml").string(), {"--parallelism.tensor_parallel_degree", "2"}, false);
  EXPECT_EQ(c.problems().size(), 5u);
  EXPECT_TRUE(c.has_problem("training."));
  EXPECT_FALSE(c.has_problem("parallelism."));
  EXPECT_EQ(c.get_int("parallelism.tensor_parallel_degree"), 2);
  EXPECT_EQ(c.get_int("training.steps"), 10);  // the default, since "ten" was refused
}

// A hint only when it is likely right: a typo in the same section, or the same name in another
// section; never a different feature that happens to be spelled alike.
TEST(Config, SuggestionsAreOnlyTheLikelyOnes) {
  EXPECT_EQ(error_of("[training]\ndevise = \"cpu\"\n"), "job.toml:2:10: unknown key 'training.devise'; did you mean 'training.device'?");
  EXPECT_EQ(error_of("[optimizer]\nwarmup_steps = 3\n"), "job.toml:2:16: unknown key 'optimizer.warmup_steps'; spmdx has it as 'lr_scheduler.warmup_steps'");
  EXPECT_EQ(error_of("[training]\ndatasets = \"x\"\n"), "job.toml:2:12: unknown key 'training.datasets'");  // not 'device'
  EXPECT_EQ(error_of("[parallelism]\npipe_degree = 2\n"), "job.toml:2:15: unknown key 'parallelism.pipe_degree'");
  EXPECT_THAT(error_of("[training]\ndataset = \"c4_test\"\n"), ::testing::Not(HasSubstr("did you mean")));
  EXPECT_EQ(error_of("[lr_scheduler]\ndecay_ratio = 0.8\n"), "(no error)");  // torchtitan's warmup-stable-decay: spmdx has it
  EXPECT_EQ(error_of("[lr_scheduler]\ndecay_raito = 0.8\n"), "job.toml:2:15: unknown key 'lr_scheduler.decay_raito'; did you mean 'lr_scheduler.decay_ratio'?");
  EXPECT_EQ(error_of("[job]\nname = \"x\"\n"), "job.toml:2:8: unknown key 'job.name'");  // not model.name: a generic name
  EXPECT_EQ(error_of("[optimizer]\nname = \"Adam\"\n"), "job.toml:2:8: optimizer.name is \"Adam\", expected one of AdamW");  // another optimizer, not a typo
  EXPECT_EQ(error_of("[[training]]\nsteps = 3\n"), "job.toml:1:1: [[training]] is an array of tables; a section is one table: write [training]");
}

// torchtitan's keys: its names for spmdx's settings are read as those; features spmdx does not
// have are refused unless off, naming the feature; the rest is ignored, each with its reason.
TEST(Config, TorchtitanKeysAreReadAsTorchtitanMeansThem) {
  Config c = Config::parse("[model]\nname = \"llama3\"\nhf_assets_path = \"/tok\"\n[checkpoint]\nenable_checkpoint = true\n"
                           "[training]\nwarmup_steps = 5\n[lr_scheduler]\nlr_min = 0.1\n[parallelism]\nexpert_tensor_parallel_degree = 1\n"
                           "[activation_checkpoint]\nmode = \"selective\"\nearly_stop = true\n[quantize.linear.float8]\nfilter_fqns = [\"output\"]\n",
                           "titan.toml");
  EXPECT_EQ(c.get_string("model.name"), "llama");
  EXPECT_EQ(c.get_string("model.tokenizer"), "/tok");
  EXPECT_EQ(c.given_as("model.tokenizer"), "model.hf_assets_path (torchtitan's name for model.tokenizer)");
  EXPECT_TRUE(c.get_bool("checkpoint.enable"));
  EXPECT_EQ(c.get_int("lr_scheduler.warmup_steps"), 5);
  EXPECT_DOUBLE_EQ(c.get_float("lr_scheduler.min_lr_factor"), 0.1);
  ASSERT_EQ(c.ignored().size(), 3u);
  EXPECT_EQ(c.ignored()[0], "titan.toml:11:33: parallelism.expert_tensor_parallel_degree = 1: expert tensor parallelism is off (spmdx does not have it yet)");
  EXPECT_EQ(c.get_string("activation_checkpoint.mode"), "selective");  // spmdx's key too
  EXPECT_THAT(c.ignored()[1], HasSubstr("activation_checkpoint.early_stop = true: it tunes torchtitan's checkpoint wrapper"));
  EXPECT_THAT(c.ignored()[2], HasSubstr("quantize.linear.float8.filter_fqns = [\"output\"]: options of torchtitan's quantization converters"));
  EXPECT_THAT(c.ignored_text(), HasSubstr("spmdx ignores 3 keys of torchtitan's that change nothing it computes:\n"
                                          "  parallelism.expert_tensor_parallel_degree = 1 (line 11): expert tensor parallelism is off"));

  EXPECT_EQ(error_of("[parallelism]\nexpert_tensor_parallel_degree = 2\n"),
            "job.toml:2:33: parallelism.expert_tensor_parallel_degree = 2 is torchtitan's; spmdx does not support expert tensor parallelism yet: set it to 1 or remove it");
  EXPECT_EQ(Config::parse("[parallelism]\nexpert_parallel_degree = 2\n", "ep.toml").get_int("parallelism.expert_parallel_degree"), 2);  // spmdx's key too
  EXPECT_THAT(error_of("[training]\nmixed_precision_param = \"float8\"\n"), HasSubstr("expected one of float32, bfloat16, float16"));
  EXPECT_THAT(error_of("[checkpoint]\nenable = true\nenable_checkpoint = true\n"),
              HasSubstr("checkpoint.enable_checkpoint is torchtitan's name for checkpoint.enable, which is set too: keep one"));
  EXPECT_THAT(error_of("[checkpoint]\nenable_checkpoint = 3\n"), HasSubstr("checkpoint.enable_checkpoint (spmdx's checkpoint.enable) must be true or false"));
  Config cli;
  cli.override_value("checkpoint.enable_checkpoint", "true");
  cli.override_value("model.name", "llama3");
  EXPECT_TRUE(cli.get_bool("checkpoint.enable"));
  EXPECT_EQ(cli.get_string("model.name"), "llama");
  EXPECT_EQ(cli.where({"checkpoint.enable"}), "command line --checkpoint.enable_checkpoint true");  // as the user wrote it
  EXPECT_THROW(cli.override_value("parallelism.expert_tensor_parallel_degree", "2"), ConfigError);
  // On the command line too, a key and its torchtitan name are one setting: both is a mistake.
  try {
    Config::load(SPMDX_SOURCE_DIR "/configs/mlp_dp.toml", {"--checkpoint.enable_checkpoint", "true", "--checkpoint.enable", "false"});
    FAIL() << "loaded";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("--checkpoint.enable and --checkpoint.enable_checkpoint both set checkpoint.enable"));
  }
  // A command-line value replaces the file's, and what the file's had ignored is no longer said.
  test::TempDir dir;
  test::write_file(dir / "t.toml", "[parallelism]\nexpert_tensor_parallel_degree = 1\n");
  try {
    Config::load((dir / "t.toml").string(), {"--parallelism.expert_tensor_parallel_degree", "2"});
    FAIL() << "loaded";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("expert_tensor_parallel_degree = 2 is torchtitan's"));
    EXPECT_THAT(e.what(), ::testing::Not(HasSubstr("expert tensor parallelism is off")));
  }
  EXPECT_NO_THROW(cli.override_value("parallelism.expert_tensor_parallel_degree", "1"));
}

// torchtitan's own llama3 debug_model.toml, read as is (when the shared data is here): one
// message with what spmdx refuses and why, and what it ignores.
TEST(Config, TorchtitansDebugModelTomlGivesOneMessage) {
  const std::filesystem::path file = std::filesystem::path(SPMDX_SOURCE_DIR) / ".." / "shared" / "data" / "torchtitan_reference" / "debug_model.toml";
  if (!std::filesystem::exists(file)) GTEST_SKIP() << file << " is absent (shared data not on this machine)";
  try {
    Config::load(file.string());
    FAIL() << "loaded";
  } catch (const ConfigError& e) {
    const std::string m = e.what();
    EXPECT_THAT(m, HasSubstr("1 problem:"));
    EXPECT_THAT(m, HasSubstr("training.dataset = \"c4_test\" is torchtitan's; spmdx does not support torchtitan's named data sets"));
    EXPECT_THAT(m, HasSubstr("spmdx ignores 16 keys of torchtitan's"));  // its pipeline_parallel_degree, _schedule and context_parallel_degree are spmdx's keys
  }
}

}  // namespace
}  // namespace spmdx::config
