// The static train step (forward, loss, backward, clipping, AdamW in one graph) against an
// eager LibTorch implementation of the same model: same init, same batches of text from the
// data pipeline (byte tokenizer), same schedule; the loss of every one of 20 steps within
// 3e-7 relative (float32 in another order of operations).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

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

// torchtitan's linear_warmup_stable_decay (torchtitan/components/lr_scheduler.py since mid-2025):
// warm-up (c+1)/warmup, then stable, then decay over round(steps x decay_ratio) steps.
TEST(TrainStep, LrScheduleIsTorchtitansWarmupStableDecay) {
  using train::lr_factor;
  const train::LrSchedule plain{2, 10};  // decay_ratio unset: every step after warm-up decays
  EXPECT_DOUBLE_EQ(lr_factor(1, plain), 0.5);
  EXPECT_DOUBLE_EQ(lr_factor(2, plain), 1.0);
  EXPECT_DOUBLE_EQ(lr_factor(3, plain), 1.0 - 1.0 / 8.0);
  EXPECT_DOUBLE_EQ(lr_factor(10, plain), 0.0);
  const train::LrSchedule wsd{2, 10, 0.5};  // 2 warm-up, 3 stable, 5 decay
  for (int step : {3, 4, 5}) EXPECT_DOUBLE_EQ(lr_factor(step, wsd), 1.0) << step;
  EXPECT_DOUBLE_EQ(lr_factor(6, wsd), 0.8);
  EXPECT_DOUBLE_EQ(lr_factor(10, wsd), 0.0);
  EXPECT_DOUBLE_EQ(lr_factor(8, {2, 10, 0.5, "cosine"}), 0.5 * (1.0 + std::cos(M_PI * 0.6)));
  EXPECT_DOUBLE_EQ(lr_factor(8, {2, 10, 0.5, "sqrt"}), 1.0 - std::sqrt(0.6));
  EXPECT_DOUBLE_EQ(lr_factor(10, {2, 10, -1, "linear", 0.1}), 0.1);
  EXPECT_DOUBLE_EQ(lr_factor(3, {2, 10, 0.25}), 1.0);        // round(2.5) is 2 (ties to even): 6 stable steps
  EXPECT_DOUBLE_EQ(lr_factor(9, {2, 10, 0.25}), 0.5);
  EXPECT_DOUBLE_EQ(lr_factor(5, {2, 10, 0.95}), 1.0 - 3.0 / 8.0);  // 10 decay steps cut to the 8 after warm-up
  EXPECT_DOUBLE_EQ(lr_factor(1, {0, 4}), 0.75);              // no warm-up
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
