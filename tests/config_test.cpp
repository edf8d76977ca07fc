// The job config: schema checks with file:line:column, did-you-mean, overrides, and the
// derived job (degrees, batch sizes) with its errors.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>

#include "spmdx/config/config.h"
#include "spmdx/train/job.h"

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

TEST(Config, ErrorsNameFileLineColumnKeyAndExpectation) {
  EXPECT_EQ(error_of("[training]\nsteps = 3\nstpes = 4\n"),
            "job.toml:3:9: unknown key 'training.stpes'; did you mean 'training.steps'?");
  EXPECT_EQ(error_of("[trainig]\nsteps = 3\n"), "job.toml:1:1: unknown section 'trainig'; did you mean 'training'?");
  EXPECT_EQ(error_of("[training]\nsteps = \"ten\"\n"), "job.toml:2:9: training.steps must be an integer");
  EXPECT_EQ(error_of("[training]\nsteps = 0\n"), "job.toml:2:9: training.steps is 0, must be between 1 and 1e+09");
  EXPECT_EQ(error_of("[model]\nname = \"lama\"\n"), "job.toml:2:8: model.name is \"lama\", expected one of llama, mlp; did you mean 'llama'?");
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
  Config back = Config::parse(c.to_toml(), "printed");
  EXPECT_EQ(back.to_toml(), c.to_toml());
  EXPECT_EQ(back.get_int("training.steps"), 5);
}

TEST(Config, ShippedConfigsAreValid) {
  const std::filesystem::path dir = std::filesystem::path(SPMDX_SOURCE_DIR) / "configs";
  int n = 0;
  for (const auto& f : std::filesystem::directory_iterator(dir)) {
    if (f.path().extension() != ".toml") continue;
    ++n;
    EXPECT_NO_THROW(Config::load(f.path().string())) << f.path();
  }
  EXPECT_GE(n, 4);
}

TEST(Job, DerivesDegreesAndBatchAndRejectsWhatCannotWork) {
  Config c;
  c.override_value("model.flavor", "tiny");
  c.override_value("parallelism.tensor_parallel_degree", "2");
  c.override_value("training.local_batch_size", "3");
  train::JobSpec s = train::job_spec(c, 8, 256);
  EXPECT_EQ(s.dims.dp_shard, 4);  // -1: the ranks tp leaves
  EXPECT_EQ(s.global_batch_size, 12);
  auto error = [&](const std::string& key, const std::string& value, std::int64_t world) {
    Config bad = c;
    bad.override_value(key, value);
    try {
      train::job_spec(bad, world, 256);
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
  EXPECT_EQ(c.where({"training.steps"}), "job.toml");
  c.override_value("training.steps", "5");
  c.override_value("parallelism.data_parallel_shard_degree", "2");
  EXPECT_EQ(c.where({"training.steps"}), "command line --training.steps 5");
  EXPECT_EQ(c.where({"parallelism.tensor_parallel_degree", "parallelism.data_parallel_shard_degree"}),
            "job.toml with command line --parallelism.data_parallel_shard_degree 2");
  try {
    train::job_spec(c, 4, 256);
    FAIL() << "3 x 2 ranks on 4";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("job.toml with command line --parallelism.data_parallel_shard_degree 2: parallelism degrees multiply to 6"));
  }
  EXPECT_EQ(Config().where({"training.steps"}), "config");
}

}  // namespace
}  // namespace spmdx::config
