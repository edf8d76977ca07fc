// The memory plan (plan/memory_plan.h) against what really happens: the executor's in-place
// writes and state donation change no bit and hold less; the planned peak agrees with the CPU
// allocator's count, in this process and in `spmdx run` for three models under dp, fsdp and tp;
// parallelism.memory_budget picks what fits, or stops before any rank starts naming tensors.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>
#include <regex>

#include "run_util.h"
#include "spmdx/exec/device.h"
#include "spmdx/exec/distributed.h"
#include "spmdx/exec/kernels.h"
#include "spmdx/exec/trainer.h"
#include "spmdx/plan/memory_plan.h"
#include "spmdx/sharding/mesh.h"
#include "spmdx/train/train_step.h"

namespace spmdx {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;

TEST(MemoryPlan, EveryInPlaceOpHasAnInPlaceKernel) {
  for (const auto& [op, inputs] : plan::in_place_ops()) {
    EXPECT_NE(exec::find_in_place_kernel(op), nullptr) << op;
    EXPECT_NE(exec::find_kernel(op), nullptr) << op;
    EXPECT_FALSE(inputs.empty()) << op;
  }
}

// llama tiny's one-rank train step, and a feed for it (fresh tensors each call: donation
// overwrites them). A small batch: the state outweighs the activations, so that the peak is
// where AdamW makes the new state.
struct TinyStep {
  static constexpr std::int64_t kBatch = 1, kSeq = 16;
  models::Model model = models::build_model(models::model_args("llama", "tiny", 256), kBatch, kSeq);
  TinyStep() { train::append_train_step(model.graph, model.params, {}); }
  exec::TensorMap feed() const {
    exec::TensorMap f = exec::init_tensors(model, 7);
    for (const auto& p : model.params) f["exp_avg." + p] = at::zeros_like(f.at(p)), f["exp_avg_sq." + p] = at::zeros_like(f.at(p));
    at::manual_seed(1);
    f["tokens"] = at::randint(0, 256, {kBatch, kSeq}, at::kLong);
    f["labels"] = at::randint(0, 256, {kBatch, kSeq}, at::kLong);
    f["lr"] = at::scalar_tensor(1e-3, at::kFloat);
    f["step"] = at::scalar_tensor(1.0, at::kFloat);
    return f;
  }
};

struct Ran {
  exec::TensorMap out;
  std::int64_t measured = 0, planned = 0, in_place_bytes = 0, fallbacks = 0;
};

Ran run_step(const TinyStep& s, const exec::TensorMap& feed, bool in_place, bool donate) {
  auto device = exec::make_device({"cpu", 0, false});
  const sharding::DeviceMesh mesh({{"dp", 1}});
  plan::PlanOptions o;
  o.in_place = in_place;
  o.donate_state = donate;
  exec::DistributedExecutor ex(s.model.graph, mesh, 0, nullptr, 60, o, device.get());
  // The allocator counts every tensor of the process: those of other runs held here too. The
  // step's own: its peak less what was held before it, plus its inputs (which the plan counts).
  device->reset_peak_memory();
  std::int64_t inputs = 0;
  for (const ir::Value* v : s.model.graph.inputs()) inputs += v->meta().nbytes();
  const std::int64_t before = device->peak_memory_bytes() - inputs;
  Ran r;
  r.out = ex.run(feed);
  r.measured = ex.stats().peak_bytes - before;
  r.fallbacks = ex.stats().in_place_fallbacks;
  r.planned = ex.memory().peak_bytes;
  r.in_place_bytes = ex.memory().in_place_bytes;
  return r;
}

// In-place writes and donation are the same arithmetic: every output bit for bit as a run that
// allocates each one; donation lowers the plan's peak by about a copy of the state, and the
// allocator measures what the plan says.
TEST(MemoryPlan, InPlaceWritesAndDonationChangeNoBitLowerThePeakAndAreMeasuredAsPlanned) {
  const TinyStep s;
  const exec::TensorMap base_feed = s.feed();
  const Ran plain = run_step(s, base_feed, false, false);
  const Ran in_place = run_step(s, s.feed(), true, false);
  exec::TensorMap donated_feed = s.feed();
  const at::Tensor weight = donated_feed.at(s.model.params.front());
  const Ran donated = run_step(s, donated_feed, true, true);
  for (const Ran* r : {&in_place, &donated}) {
    ASSERT_EQ(r->out.size(), plain.out.size());
    for (const auto& [name, t] : plain.out) EXPECT_TRUE(at::equal(t, r->out.at(name))) << name << " differs";
    EXPECT_EQ(r->fallbacks, 0) << "the plan wrote in place where the tensors did not allow it";
    EXPECT_GT(r->in_place_bytes, 0);
  }
  EXPECT_EQ(plain.in_place_bytes, 0);
  // Donated: the parameter's update is in the tensor the caller gave.
  EXPECT_EQ(donated.out.at("next." + s.model.params.front()).data_ptr(), weight.data_ptr());
  EXPECT_TRUE(at::equal(weight, plain.out.at("next." + s.model.params.front())));
  EXPECT_NE(in_place.out.at("next." + s.model.params.front()).data_ptr(), base_feed.at(s.model.params.front()).data_ptr());
  // Elementwise writes in place save allocations, not this peak (at AdamW, where the old and
  // the new state coexist unless the caller donates the old).
  EXPECT_LE(in_place.planned, plain.planned);
  std::int64_t state = 0;
  for (const auto& name : train::train_state_names(s.model.params)) state += s.model.graph.find_input(name)->meta().nbytes();
  EXPECT_LE(donated.planned, in_place.planned - state / 2) << "donation did not save most of a copy of the state";
  for (const Ran* r : {&plain, &in_place, &donated}) {
    EXPECT_NEAR(static_cast<double>(r->measured), static_cast<double>(r->planned), 0.02 * static_cast<double>(r->planned))
        << "planned " << r->planned << " bytes, measured " << r->measured;
  }
}

// The plan's breakdown at its peak adds up, and names the largest buffers held there.
TEST(MemoryPlan, ThePeaksBreakdownAddsUpAndNamesTheLargestBuffers) {
  const TinyStep s;
  const sharding::DeviceMesh mesh({{"dp", 1}});
  plan::PlanOptions o;
  o.donate_state = true;
  const auto runtime = plan::make_runtime_plan(s.model.graph, mesh, o);
  const plan::MemoryPlan m = plan::plan_memory(s.model.graph, runtime);
  EXPECT_EQ(m.parameters + m.gradients + m.optimizer_state + m.communication + m.activations, m.peak_bytes);
  std::int64_t params = 0;
  for (const auto& p : s.model.params) params += s.model.graph.find_input(p)->meta().nbytes();
  EXPECT_EQ(m.optimizer_state, 2 * params) << "both AdamW moments are held all step, once (donated)";
  EXPECT_GE(m.parameters, params);
  EXPECT_GT(m.activations, 0);
  ASSERT_FALSE(m.largest.empty());
  for (std::size_t i = 1; i < m.largest.size(); ++i) EXPECT_GE(m.largest[i - 1].bytes, m.largest[i].bytes);
  EXPECT_EQ(m.held.size(), runtime.order.size());
  EXPECT_EQ(*std::max_element(m.held.begin(), m.held.end()) <= m.peak_bytes, true);
  EXPECT_THAT(m.str(), HasSubstr("parameters"));
}

using test::spmdx;

// Every row's planned and measured peak (rank 0's), from a metrics.jsonl.
std::vector<std::pair<double, double>> peaks(const fs::path& metrics) {
  std::vector<std::pair<double, double>> out;
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) {
    const auto row = nlohmann::json::parse(line);
    out.emplace_back(row.at("planned_peak_mem_bytes").get<double>(), row.at("peak_mem_bytes").get<double>());
  }
  return out;
}

// spmdx run's ranks, each with its comm thread, the batch and the comm buffers: the CPU
// allocator's peak of rank 0's step against the plan, within 2% (the issue asks 10%), for each
// model and strategy.
TEST(MemoryPlan, PlannedPeakIsTheMeasuredPeakForEachModelAndStrategy) {
  test::TempDir dir;
  const std::string common = " --nproc 2 --data.paths '" + test::corpus_file(dir) + "' --training.steps 2 --training.global_batch_size 8 --training.seq_len 64";
  const std::vector<std::pair<std::string, std::string>> models = {
      {"mlp", "--model.name mlp --model.flavor tiny"}, {"llama_tiny", "--model.flavor tiny"}, {"debugmodel", "--model.flavor debugmodel"}};
  const std::vector<std::pair<std::string, std::string>> strategies = {
      {"dp", "--parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 1 --parallelism.tensor_parallel_degree 1"},
      {"fsdp", "--parallelism.data_parallel_replicate_degree 1 --parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 1"},
      {"tp", "--parallelism.data_parallel_replicate_degree 1 --parallelism.data_parallel_shard_degree 1 --parallelism.tensor_parallel_degree 2"}};
  for (const auto& [model, model_flags] : models) {
    for (const auto& [strategy, flags] : strategies) {
      const fs::path out = dir / (model + "_" + strategy);
      auto r = spmdx("run '" SPMDX_SOURCE_DIR "/configs/llama_debug.toml' " + model_flags + " " + flags + " --job.dump_folder '" + out.string() + "'" + common);
      ASSERT_EQ(r.exit_code, 0) << model << " " << strategy << "\n" << r.output;
      EXPECT_THAT(r.output, HasSubstr("planned peak memory (rank 0): "));
      const auto rows = peaks(out / "metrics.jsonl");
      ASSERT_EQ(rows.size(), 2u);
      for (const auto& [planned, measured] : rows) {
        EXPECT_GT(planned, 0);
        EXPECT_NEAR(measured / planned, 1.0, 0.02) << model << " under " << strategy << ": planned " << planned << " bytes, measured " << measured;
      }
      std::printf("%-10s %-4s planned %10.0f measured %10.0f (%.4f)\n", model.c_str(), strategy.c_str(), rows.back().first, rows.back().second,
                  rows.back().second / rows.back().first);
    }
  }
}

// The number `spmdx compile` prints for rank 0's planned peak, in bytes.
double compiled_peak(const std::string& args) {
  auto r = spmdx("compile '" SPMDX_SOURCE_DIR "/configs/llama_debug.toml' " + args);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  std::smatch m;
  if (!std::regex_search(r.output, m, std::regex("planned peak memory \\(rank 0\\): ([0-9.]+) (B|KiB|MiB|GiB)"))) {
    ADD_FAILURE() << "no planned peak in:\n" << r.output;
    return 0;
  }
  const double unit = m[2] == "B" ? 1 : m[2] == "KiB" ? 1024 : m[2] == "MiB" ? 1024.0 * 1024 : 1024.0 * 1024 * 1024;
  return std::stod(m[1]) * unit;
}

// A budget between full and selective checkpointing's peaks: spmdx turns on full activation
// checkpointing before the ranks start, says so, and the run holds no more than the budget.
TEST(MemoryBudget, ABudgetThatOnlyFullCheckpointingMeetsTurnsItOn) {
  test::TempDir dir;
  const std::string job = "--training.seq_len 256 --training.local_batch_size 8";
  const double none = compiled_peak(job), selective = compiled_peak(job + " --activation_checkpoint.mode selective"),
               full = compiled_peak(job + " --activation_checkpoint.mode full");
  ASSERT_LT(full, selective);
  ASSERT_LT(selective, none);
  const auto budget = static_cast<long long>((full + selective) / 2);
  auto c = spmdx("compile '" SPMDX_SOURCE_DIR "/configs/llama_debug.toml' " + job + " --parallelism.memory_budget " + std::to_string(budget));
  ASSERT_EQ(c.exit_code, 0) << c.output;
  EXPECT_THAT(c.output, HasSubstr("chose activation_checkpoint.mode = \"full\""));
  auto r = spmdx("run '" SPMDX_SOURCE_DIR "/configs/llama_debug.toml' --nproc 4 " + job + " --training.steps 2 --data.paths '" + test::corpus_file(dir) +
                 "' --parallelism.memory_budget " + std::to_string(budget) + " --job.dump_folder '" + (dir / "out").string() + "'");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("chose activation_checkpoint.mode = \"full\""));
  EXPECT_THAT(r.output, HasSubstr("activation checkpointing full"));
  for (const auto& [planned, measured] : peaks(dir / "out" / "metrics.jsonl")) {
    EXPECT_LE(planned, static_cast<double>(budget));
    EXPECT_LE(measured, 1.02 * static_cast<double>(budget)) << "the budget's run held more than the budget";
  }
}

TEST(MemoryBudget, AnImpossibleBudgetFailsBeforeAnyRankStartsNamingTheLargestTensors) {
  auto r = spmdx("run '" SPMDX_SOURCE_DIR "/configs/llama_debug.toml' --nproc 4 --parallelism.memory_budget 1MiB");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("parallelism.memory_budget"));
  EXPECT_THAT(r.output, HasSubstr("is over the budget 1.0 MiB"));
  EXPECT_THAT(r.output, HasSubstr("Largest tensors held"));
  EXPECT_THAT(r.output, HasSubstr("activation_checkpoint.mode = \"full\""));
  EXPECT_THAT(r.output, Not(HasSubstr("[rank")));
  auto bad = spmdx("run '" SPMDX_SOURCE_DIR "/configs/llama_debug.toml' --nproc 4 --parallelism.memory_budget lots");
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_THAT(bad.output, HasSubstr("parallelism.memory_budget = \"lots\""));
}

}  // namespace
}  // namespace spmdx
