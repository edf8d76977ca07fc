// The training loop's essentials a torchtitan user expects (issue 24, items 2-4): validation,
// TensorBoard event files and profiler traces, through `spmdx run` with real rank processes.
// The event files are read back by the `tensorboard` package (tests/reference/read_tensorboard.py).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "run_util.h"

namespace spmdx {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

using test::spmdx;

const std::string kConfig = "'" SPMDX_SOURCE_DIR "/configs/llama_debug.toml'";

std::string job(const std::string& data) { return "--data.paths '" + data + "' --training.seq_len 32 --model.flavor tiny --training.global_batch_size 8"; }
const std::string kFsdp = " --nproc 2 --parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 1";
const std::string kFsdpTp = " --nproc 4 --parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 2";

using test::rows;

test::CommandResult run(const fs::path& dump, const std::string& args) {
  auto r = spmdx("run " + kConfig + " " + args + " --job.dump_folder '" + dump.string() + "'");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return r;
}

// Validation on the training data at lr 0 (the weights never change) is the loss of the first
// training batch: the held-out batches are the training data's first ones, read from their
// start at each validation.
TEST(Validation, OnTheTrainingDataAtLrZeroItIsTheTrainingLoss) {
  test::TempDir dir;
  const std::string data = test::corpus_file(dir);
  const auto r = run(dir / "v", job(data) + kFsdp + " --training.steps 3 --optimizer.lr 0 --validation.enable true --validation.paths '" + data +
                                   "' --validation.freq 1 --validation.steps 1 --validation.local_batch_size 4");
  EXPECT_THAT(r.output, HasSubstr("validation: every 1 steps, the mean loss of 1 held-out batches of 8 x 32 tokens"));
  EXPECT_THAT(r.output, HasSubstr("warning: a validation file is also in data.paths, so its text is trained on"));
  EXPECT_THAT(r.output, HasSubstr("| val_loss "));
  const auto m = rows(dir / "v" / "metrics.jsonl");
  ASSERT_EQ(m.size(), 3u);
  const double first = m[0].at("loss").get<double>();
  EXPECT_GT(std::abs(m[2].at("loss").get<double>() - first), 1e-3);  // other batches: other losses
  for (const auto& row : m) {
    EXPECT_NEAR(row.at("val_loss").get<double>(), first, 1e-6 * first) << row.dump();
    EXPECT_NEAR(row.at("val_perplexity").get<double>(), std::exp(row.at("val_loss").get<double>()), 1e-9 * row.at("val_perplexity").get<double>());
  }
}

// Validation reads the state and changes nothing: with it, fsdp x tp trains to the same losses
// bit for bit; held-out text gives a loss of its own, only every freq steps.
TEST(Validation, NeverChangesTheTrainingLosses) {
  test::TempDir dir;
  const std::string data = test::corpus_file(dir);
  std::string held_out;
  for (int i = 0; i < 60; ++i) held_out += "Held-out text differs from the training corpus in every line, number " + std::to_string(i) + ".\n";
  test::write_file(dir / "held_out.txt", held_out);
  run(dir / "plain", job(data) + kFsdpTp + " --training.steps 4");
  const auto r = run(dir / "val", job(data) + kFsdpTp + " --training.steps 4 --validation.enable true --validation.paths '" + (dir / "held_out.txt").string() +
                                      "' --validation.freq 2 --validation.local_batch_size 2");
  EXPECT_THAT(r.output, ::testing::Not(HasSubstr("warning: a validation file")));
  const auto plain = rows(dir / "plain" / "metrics.jsonl"), val = rows(dir / "val" / "metrics.jsonl");
  ASSERT_EQ(plain.size(), 4u);
  ASSERT_EQ(val.size(), 4u);
  for (std::size_t i = 0; i < plain.size(); ++i) {
    EXPECT_EQ(val[i].at("loss").get<double>(), plain[i].at("loss").get<double>()) << "step " << i + 1;
    EXPECT_EQ(val[i].contains("val_loss"), (i + 1) % 2 == 0) << "step " << i + 1;
  }
  // -1 steps: as many batches as the held-out tokens fill once.
  const std::int64_t tokens = static_cast<std::int64_t>(held_out.size());  // bytes, plus BOS and EOS
  EXPECT_THAT(r.output, HasSubstr("the mean loss of " + std::to_string((tokens + 2) / (4 * 32)) + " held-out batches of 4 x 32 tokens"));
  EXPECT_NE(val[1].at("val_loss").get<double>(), val[3].at("val_loss").get<double>());  // the weights changed between
}

TEST(Validation, BadSettingsAreRefusedBeforeAnyRankStarts) {
  test::TempDir dir;
  const std::string data = test::corpus_file(dir);
  auto refused = [&](const std::string& args) {
    auto r = spmdx("run " + kConfig + " " + job(data) + kFsdp + " --validation.enable true " + args + " --job.dump_folder '" + (dir / "bad").string() + "'");
    EXPECT_NE(r.exit_code, 0);
    EXPECT_FALSE(fs::exists(dir / "bad" / "metrics.jsonl"));
    return r.output;
  };
  EXPECT_THAT(refused(""), HasSubstr("validation.enable = true needs held-out text: set validation.paths"));
  EXPECT_THAT(refused("--validation.paths '" + (dir / "missing.txt").string() + "'"), HasSubstr("validation.paths: '" + (dir / "missing.txt").string() + "': no such file"));
  EXPECT_THAT(refused("--validation.paths '" + data + "' --validation.seq_len 64"), HasSubstr("validation.seq_len 64 differs from training.seq_len 32"));
  test::write_file(dir / "short.txt", "too short");
  EXPECT_THAT(refused("--validation.paths '" + (dir / "short.txt").string() + "'"), HasSubstr("validation.paths"));
  EXPECT_THAT(refused("--validation.paths '" + data + "' --validation.steps 0"), HasSubstr("validation.steps must be >= 1, or -1"));
  // More batches than the held-out text fills once would read it twice (a huge count ran for ever).
  EXPECT_THAT(refused("--validation.paths '" + data + "' --validation.steps 100000"),
              HasSubstr("validation.steps 100000 asks for more batches than validation.paths hold "));
  test::write_file(dir / "small.txt", std::string(100, 'x'));  // a row's 33 tokens, not a batch's 16 x 32
  EXPECT_THAT(refused("--validation.paths '" + (dir / "small.txt").string() + "'"),
              HasSubstr("0 batches of validation.local_batch_size x 2 data-parallel ranks x seq_len 32 = 512 tokens: a validation needs one at least"));
}

// What can run but does nothing is said at start: validation or profiling less often than the
// run's steps, and a document separator that occurs nowhere (a command line's "\n" is two
// characters).
TEST(TrainingLoop, SettingsThatWouldDoNothingAreWarnedOf) {
  test::TempDir dir;
  const std::string data = test::corpus_file(dir);
  const auto r = run(dir / "w", job(data) + kFsdp + " --training.steps 2 --validation.enable true --validation.paths '" + data +
                                 "' --validation.freq 5 --profiling.enable_profiling true --profiling.profile_freq 3 --data.document_separator '@@'");
  EXPECT_THAT(r.output, HasSubstr("validation.freq 5 is more than training.steps 2: validation never runs"));
  EXPECT_THAT(r.output, HasSubstr("profiling.profile_freq 3 is more than training.steps 2: no step is profiled"));
  EXPECT_THAT(r.output, HasSubstr("data.document_separator \"@@\" occurs nowhere in the text files of data.paths"));
  EXPECT_FALSE(fs::exists(dir / "w" / "profile_traces" / "iteration_3"));
}

// An output folder that cannot be made fails before any rank starts, naming its key.
TEST(TrainingLoop, OutputFoldersThatCannotBeMadeAreRefusedBeforeAnyRankStarts) {
  test::TempDir dir;
  const std::string data = test::corpus_file(dir);
  test::write_file(dir / "a_file", "");  // a folder cannot be made under a file, not even by root
  for (const auto& [flags, key] : std::vector<std::pair<std::string, std::string>>{
           {"--metrics.enable_tensorboard true --metrics.save_tb_folder '" + (dir / "a_file" / "tb").string() + "'", "metrics.save_tb_folder"},
           {"--profiling.enable_profiling true --profiling.save_traces_folder '" + (dir / "a_file" / "traces").string() + "'", "profiling.save_traces_folder"}}) {
    auto r = spmdx("run " + kConfig + " " + job(data) + kFsdp + " " + flags + " --job.dump_folder '" + (dir / "out").string() + "'");
    EXPECT_NE(r.exit_code, 0) << key;
    EXPECT_THAT(r.output, HasSubstr(key + " '" + (dir / "a_file").string())) << key;
    EXPECT_THAT(r.output, HasSubstr("cannot be made or written")) << key;
    EXPECT_THAT(r.output, ::testing::Not(HasSubstr("[rank 0]"))) << key;  // no rank started
    EXPECT_FALSE(fs::exists(dir / "out" / "metrics.jsonl")) << key;
  }
}

// A checkpoint.folder that is a file, a FIFO or under a file fails before any rank starts (not at
// the first save, after training), naming the key and the path.
TEST(TrainingLoop, ACheckpointFolderThatIsNoFolderIsRefusedBeforeAnyRankStarts) {
  test::TempDir dir;
  const std::string data = test::corpus_file(dir);
  test::write_file(dir / "a_file", "");
  ASSERT_EQ(::mkfifo((dir / "a_fifo").c_str(), 0600), 0);
  for (const auto& [path, why] : std::vector<std::pair<fs::path, std::string>>{{dir / "a_file", "is a file, not a folder"},
                                                                              {dir / "a_fifo", "is a FIFO, not a folder"},
                                                                              {dir / "a_file" / "ckpt", "cannot be made: " + (dir / "a_file").string() + " is not a folder"}}) {
    auto r = spmdx("run " + kConfig + " " + job(data) + kFsdp + " --training.steps 2 --checkpoint.enable true --checkpoint.folder '" + path.string() +
                   "' --job.dump_folder '" + (dir / "out").string() + "'");
    EXPECT_NE(r.exit_code, 0) << path;
    EXPECT_THAT(r.output, HasSubstr("checkpoint.folder '" + path.string() + "': " + path.string() + " " + why +
                                    ": checkpoints are saved there; name a folder this user may write, or a new one")) << r.output;
    EXPECT_THAT(r.output, ::testing::Not(HasSubstr("[rank 0]"))) << path;  // no rank started
    EXPECT_FALSE(fs::exists(dir / "out" / "metrics.jsonl")) << path;
  }
  EXPECT_TRUE(fs::is_fifo(dir / "a_fifo"));
  EXPECT_EQ(fs::file_size(dir / "a_file"), 0u);
}

// Every scalar of metrics.jsonl, under its TensorBoard tag, read back by TensorBoard's own
// event-file reader.
TEST(TensorBoard, EventFilesHoldEveryScalarOfMetricsJsonl) {
  const std::string python = SPMDX_PYTHON;
  if (!fs::exists(python)) GTEST_SKIP() << "no " << python << " (run scripts/setup)";
  if (test::run_command("'" + python + "' -c 'import tensorboard'").exit_code != 0) GTEST_SKIP() << "the Python package tensorboard is missing (run scripts/setup)";
  test::TempDir dir;
  const std::string data = test::corpus_file(dir);
  run(dir / "tb", job(data) + kFsdp + " --training.steps 4 --metrics.enable_tensorboard true --metrics.save_tb_folder board --validation.enable true "
                  "--validation.paths '" + data + "' --validation.freq 2 --validation.steps 1");
  std::vector<fs::path> runs;
  for (const auto& e : fs::directory_iterator(dir / "tb" / "board")) runs.push_back(e.path());
  ASSERT_EQ(runs.size(), 1u);  // board/YYYYmmdd-HHMM, as torchtitan
  EXPECT_EQ(runs[0].filename().string().size(), 13u);
  auto r = test::run_command("'" + python + "' '" SPMDX_SOURCE_DIR "/tests/reference/read_tensorboard.py' '" + runs[0].string() + "'");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto board = nlohmann::json::parse(r.output.substr(r.output.find('{')));
  const std::map<std::string, std::pair<std::string, double>> tags = {
      {"loss_metrics/global_avg_loss", {"loss", 1.0}}, {"grad_norm", {"grad_norm", 1.0}}, {"lr", {"lr", 1.0}},
      {"throughput(tps)", {"tokens_per_s", 1.0}}, {"time_metrics/end_to_end(s)", {"step_ms", 1e-3}}, {"time_metrics/comm(s)", {"comm_ms", 1e-3}},
      {"time_metrics/exposed_comm(s)", {"exposed_comm_ms", 1e-3}}, {"memory/max_active(GiB)", {"peak_mem_bytes", 1.0 / (1 << 30)}},
      {"memory/planned_peak(GiB)", {"planned_peak_mem_bytes", 1.0 / (1 << 30)}}, {"validation_metrics/loss", {"val_loss", 1.0}},
      {"validation_metrics/perplexity", {"val_perplexity", 1.0}}};
  const auto m = rows(dir / "tb" / "metrics.jsonl");
  ASSERT_EQ(m.size(), 4u);
  for (const auto& [tag, key_scale] : tags) {
    const auto& [key, scale] = key_scale;
    ASSERT_TRUE(board.contains(tag)) << tag << " in " << r.output;
    std::size_t n = 0;
    for (const auto& row : m) {
      const std::string step = std::to_string(row.at("step").get<int>());
      if (!row.contains(key)) {
        EXPECT_FALSE(board.at(tag).contains(step)) << tag << " step " << step;
        continue;
      }
      ++n;
      const double want = static_cast<float>(row.at(key).get<double>() * scale);  // TensorBoard keeps float32
      ASSERT_TRUE(board.at(tag).contains(step)) << tag << " step " << step;
      EXPECT_NEAR(board.at(tag).at(step).get<double>(), want, 1e-6 * std::abs(want)) << tag << " step " << step;
    }
    EXPECT_EQ(board.at(tag).size(), n) << tag;
  }
  EXPECT_EQ(board.at("validation_metrics/loss").size(), 2u);
}

// The trace of every profile_freq-th step per rank: Chrome trace JSON with the step's ATen
// kernels (no other step's) and spmdx's compute and comm spans on the same clock.
TEST(Profiler, TracesOnlyTheChosenStepsWithKernelsAndCollectives) {
  test::TempDir dir;
  const std::string data = test::corpus_file(dir);
  const auto r = run(dir / "p", job(data) + kFsdp + " --training.steps 4 --profiling.enable_profiling true --profiling.profile_freq 2");
  EXPECT_THAT(r.output, HasSubstr("profiler: step 2 traced in "));
  EXPECT_THAT(r.output, ::testing::Not(HasSubstr("USDT")));  // Kineto's own log lines stay quiet
  const fs::path traces = dir / "p" / "profile_traces";
  std::vector<std::string> found;
  for (const auto& e : fs::recursive_directory_iterator(traces)) {
    if (e.is_regular_file()) found.push_back(fs::relative(e.path(), traces).string());
  }
  std::sort(found.begin(), found.end());
  EXPECT_THAT(found, ::testing::ElementsAre("iteration_2/rank0_trace.json", "iteration_2/rank1_trace.json", "iteration_4/rank0_trace.json",
                                            "iteration_4/rank1_trace.json"));
  std::ifstream in(traces / "iteration_2" / "rank1_trace.json");
  const auto trace = nlohmann::json::parse(in);
  double first = 1e300, last = 0;
  int kernels = 0, comm = 0, compute = 0;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.value("cat", "") == "spmdx") {
      first = std::min(first, e.at("ts").get<double>());
      last = std::max(last, e.at("ts").get<double>() + e.at("dur").get<double>());
      if (e.at("tid") == "spmdx comm") {
        ++comm;
        EXPECT_GT(e.at("args").at("bytes").get<double>(), 0) << e.dump();
      } else {
        ++compute;
      }
    }
  }
  ASSERT_GT(compute, 100);
  EXPECT_GT(comm, 20);  // FSDP's all_gathers and reduce_scatters of one step
  // No other step's kernels: counted, not timed (a loaded machine stretches the gaps between a
  // step's kernels and its spans, not their number). The ATen ops outside the step's spans are
  // run_step's own few before the executor starts (50 of 2478 here); another step traced
  // along would put a whole step's worth there.
  int outside = 0;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.value("cat", "") != "cpu_op") continue;
    ++kernels;
    const double ts = e.at("ts").get<double>();
    outside += ts < first || ts > last;
  }
  EXPECT_GT(kernels, compute / 2);  // ATen ops, e.g. aten::mm
  EXPECT_LT(outside * 4, kernels) << outside << " of " << kernels << " ATen ops before the step's first span or after its last";
}

}  // namespace
}  // namespace spmdx
