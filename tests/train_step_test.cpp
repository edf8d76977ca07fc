// The static train step (forward, loss, backward, clipping, AdamW in one graph) against an
// eager LibTorch implementation of the same model: same init, same batches of text from the
// data pipeline (byte tokenizer), same schedule; the loss of every one of 20 steps within
// 3e-7 relative (float32 in another order of operations).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <filesystem>

#include "eager_trainer.h"
#include "spmdx/data/text_dataset.h"
#include "spmdx/exec/trainer.h"
#include "test_util.h"

namespace spmdx {
namespace {

using ::testing::HasSubstr;

constexpr std::int64_t kVocab = 264, kBatch = 4, kSeq = 16, kSteps = 20, kWarmup = 2;  // kVocab: the byte tokenizer's (256 bytes, BOS, EOS, padding)
constexpr double kLr = 8e-4;

// Real English text, written by the test so that it runs anywhere: the start of the README's
// own description, repeated with variations.
std::string corpus() {
  std::string text;
  for (int i = 0; i < 40; ++i) {
    text += "A user writes one config file naming a model, a data set, a device mesh and a sharding strategy. "
            "Every rank captures the same training step as a static graph, number " + std::to_string(i) + ".\n";
  }
  return text;
}

at::Tensor as_tensor(const std::vector<std::int64_t>& ids, std::int64_t rows, std::int64_t cols) {
  return at::tensor(ids, at::TensorOptions().dtype(at::kLong)).reshape({rows, cols});
}

void expect_same_losses(const std::string& name, const std::string& flavor) {
  const models::ModelArgs args = models::model_args(name, flavor, kVocab);
  models::Model model = models::build_model(args, kBatch, kSeq);
  exec::TensorMap init = exec::init_tensors(model, 42);
  train::TrainStepConfig config;  // AdamW (0.9, 0.95), eps 1e-8, wd 0.1; max_norm 1
  test::EagerTrainer eager(args, config, init, kLr);
  exec::Trainer trainer(std::move(model), config, init);

  test::TempDir dir;
  test::write_file(dir / "corpus.txt", corpus());
  data::ByteTokenizer tokenizer;
  data::TextDataset dataset({{(dir / "corpus.txt").string()}, kBatch, kSeq, 7}, tokenizer);
  double first = 0, last = 0;
  for (std::int64_t step = 1; step <= kSteps; ++step) {
    const data::Batch batch = dataset.next_batch();
    const at::Tensor tokens = as_tensor(batch.tokens, kBatch, kSeq), labels = as_tensor(batch.labels, kBatch, kSeq);
    const double lr = kLr * train::lr_factor(step, {kWarmup, kSteps});
    const double want = eager.step(lr, tokens, labels);
    const double got = trainer.step(step, lr, tokens, labels).loss;
    EXPECT_NEAR(got, want, 1e-6 * std::abs(want)) << name << " " << flavor << " step " << step;
    if (step == 1) first = got;
    last = got;
  }
  // The run trains: the loss starts near ln(vocab) and falls on this repetitive text.
  EXPECT_NEAR(first, std::log(static_cast<double>(kVocab)), 1.0);
  EXPECT_LT(last, first);
  const std::string p = name == "mlp" ? "w1.weight" : "layers.1.feed_forward.w2.weight";
  const at::Tensor got = trainer.state().at(p), want = eager.param(p);
  EXPECT_LE(((got - want).abs().max() / want.abs().max()).item<double>(), 1e-4) << p;
  std::printf("%s %s: loss %.6f -> %.6f over %lld steps, peak %lld bytes\n", name.c_str(), flavor.c_str(), first, last,
              static_cast<long long>(kSteps), static_cast<long long>(trainer.peak_bytes()));
}

TEST(TrainStep, MlpTinyMatchesEagerLibTorchFor20Steps) { expect_same_losses("mlp", "tiny"); }
TEST(TrainStep, LlamaTinyMatchesEagerLibTorchFor20Steps) { expect_same_losses("llama", "tiny"); }

// torchtitan v0.2.2's linear_warmup_stable_decay (and HEAD's: PR #1284's virtual last stable
// step, PR #2340's total_steps), computed by tests/reference/torchtitan_lr.py, a transcription of
// torchtitan's code driven by a real torch LambdaLR: spmdx's lr factor of every step of each case
// equals it. The cases cover each phase and decay type, rounding ties, cut phases and total_steps.
TEST(TrainStep, LrScheduleIsTorchtitanV022sForEveryStep) {
  const std::string python = SPMDX_PYTHON;
  if (!std::filesystem::exists(python)) GTEST_SKIP() << "no " << python << " (run scripts/setup)";
  struct Case {
    std::int64_t steps, warmup;
    double decay_ratio;  // -1: None
    std::string decay_type;
    double min_lr_factor;
    std::int64_t total_steps;  // -1: None
  };
  const std::vector<Case> cases{
      {10, 5, -1, "linear", 0.0, -1},   // the outside trial's: 8e-4 at step 6, 1.6e-4 at step 10
      {10, 2, -1, "linear", 0.0, -1},   {10, 2, 0.5, "linear", 0.0, -1},   {10, 2, 0.5, "cosine", 0.0, -1},
      {10, 2, 0.5, "sqrt", 0.0, -1},    {10, 2, -1, "linear", 0.1, -1},    {10, 2, 0.25, "linear", 0.0, -1},  // round(2.5): 2
      {10, 2, 0.35, "linear", 0.0, -1}, {10, 2, 0.95, "cosine", 0.2, -1},  // decay cut to the 8 steps after warm-up
      {4, 0, -1, "linear", 0.0, -1},    {7, 0, 0.0, "linear", 0.0, -1},    {6, 9, -1, "linear", 0.0, -1},      // no warm-up; no decay; warm-up cut
      {10, 3, -1, "cosine", 0.05, 40},  {10, 3, 0.5, "linear", 0.0, 20},   {60, 5, 0.2, "sqrt", 0.1, 60},     // total_steps
      {1, 1, -1, "linear", 0.0, -1},    {1, 0, -1, "linear", 0.0, -1},
  };
  nlohmann::json in = nlohmann::json::array();
  for (const Case& c : cases) {
    in.push_back({{"steps", c.steps}, {"warmup_steps", c.warmup}, {"decay_type", c.decay_type}, {"min_lr_factor", c.min_lr_factor},
                  {"decay_ratio", c.decay_ratio < 0 ? nlohmann::json() : nlohmann::json(c.decay_ratio)},
                  {"total_steps", c.total_steps < 0 ? nlohmann::json() : nlohmann::json(c.total_steps)}});
  }
  const auto ref = test::run_command("'" + python + "' '" SPMDX_SOURCE_DIR "/tests/reference/torchtitan_lr.py' '" + in.dump() + "'");
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  const auto want = nlohmann::json::parse(ref.output);
  ASSERT_EQ(want.size(), cases.size());
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    const train::LrSchedule schedule{c.warmup, c.total_steps > 0 ? c.total_steps : c.steps, c.decay_ratio, c.decay_type, c.min_lr_factor};
    ASSERT_EQ(want[i].size(), static_cast<std::size_t>(c.steps)) << "case " << i;
    for (std::int64_t step = 1; step <= c.steps; ++step) {
      EXPECT_NEAR(train::lr_factor(step, schedule), want[i][static_cast<std::size_t>(step - 1)].get<double>(), 1e-15) << "case " << i << ", step " << step;
    }
  }
  // The trial's numbers (optimizer.lr 8e-4, warm-up 5 of 10): the last step's lr is not 0.
  EXPECT_NEAR(8e-4 * train::lr_factor(6, {5, 10}), 8.0e-4, 1e-18);
  EXPECT_NEAR(8e-4 * train::lr_factor(10, {5, 10}), 1.6e-4, 1e-18);
}

TEST(TrainStep, UnknownModelOrFlavorIsNamed) {
  try {
    models::model_args("llama", "huge", 256);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("unknown flavor 'huge' of model 'llama'; known flavors: tiny, debugmodel"));
  }
  EXPECT_THROW(models::model_args("gpt", "tiny", 256), std::invalid_argument);
}

TEST(TrainStep, DebugmodelHasTorchtitansShape) {
  models::Model m = models::build_model(models::model_args("llama", "debugmodel", 2048), 1, 8);
  std::int64_t count = 0;
  for (const auto& spec : m.init) {
    if (!spec.trainable) continue;
    std::int64_t n = 1;
    for (auto d : spec.shape) n *= d;
    count += n;
  }
  // torchtitan's llama3 debugmodel with vocab 2048: 6.29M parameters (2 * 2048 * 256 for
  // embedding and output, 6 layers of 4 * 256^2 + 3 * 256 * 768 + 2 * 256, final norm 256).
  EXPECT_EQ(count, 2 * 2048 * 256 + 6 * (4 * 256 * 256 + 3 * 256 * 768 + 2 * 256) + 256);
  m.graph.verify();
}

}  // namespace
}  // namespace spmdx
