// Mixed precision (train/mixed_precision.h) on llama tiny: where the casts go, that the train
// step on them keeps float32 parameters and optimizer state and lands near the float32 step,
// and that sharding gathers bfloat16 parameters and reduces float32 gradients.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>

#include "spmdx/config/config.h"
#include "spmdx/core/registry.h"
#include "spmdx/exec/executor.h"
#include "spmdx/exec/trainer.h"
#include "spmdx/plan/runtime_plan.h"
#include "spmdx/sharding/rewriter.h"
#include "spmdx/job/compile.h"
#include "spmdx/job/preflight.h"
#include "spmdx/job/spec.h"
#include "spmdx/train/mixed_precision.h"
#include "spmdx/train/train_step.h"

namespace spmdx::train {
namespace {

using ir::DType;

models::Model tiny(std::int64_t batch = 2, std::int64_t seq = 32) {
  return models::build_model(models::model_args("llama", "tiny", 256), batch, seq);
}

// The first train step's inputs for a model of tiny(4, 64): initial weights, zero AdamW state, a
// random batch, lr 1e-3.
exec::TensorMap first_step_feed(const models::Model& m) {
  exec::TensorMap feed = exec::init_tensors(m, 7);
  for (const auto& p : m.params) feed["exp_avg." + p] = at::zeros_like(feed.at(p)), feed["exp_avg_sq." + p] = at::zeros_like(feed.at(p));
  at::manual_seed(1);
  feed["tokens"] = at::randint(0, 256, {4, 64}, at::kLong);
  feed["labels"] = at::randint(0, 256, {4, 64}, at::kLong);
  feed["lr"] = at::scalar_tensor(1e-3, at::kFloat);
  feed["step"] = at::scalar_tensor(1.0, at::kFloat);
  return feed;
}

TEST(MixedPrecision, MatmulsAndAttentionReadBf16NormsAndLossReadF32) {
  const models::Model m = tiny();
  const ir::Graph g = cast_for_mixed_precision(m.graph, DType::bf16);
  g.verify();
  ASSERT_EQ(g.inputs().size(), m.graph.inputs().size());
  for (std::size_t i = 0; i < g.inputs().size(); ++i) {
    EXPECT_EQ(g.inputs()[i]->name(), m.graph.inputs()[i]->name());
    EXPECT_EQ(g.inputs()[i]->meta().dtype, m.graph.inputs()[i]->meta().dtype) << "inputs stay as stored";
  }
  std::map<std::string, int> checked;
  for (const auto& n : g.nodes()) {
    const std::string& op = n->op();
    for (const ir::Value* v : n->inputs()) {
      if (!ir::is_floating(v->meta().dtype)) continue;
      if (op == "matmul" || op == "linear" || op == "sdpa" || op == "embedding") {
        EXPECT_EQ(v->meta().dtype, DType::bf16) << op << " reads " << v->ref();
        ++checked[op];
      } else if (op == "rms_norm" || op == "cross_entropy") {
        EXPECT_EQ(v->meta().dtype, DType::f32) << op << " reads " << v->ref();
        ++checked[op];
      }
    }
    if (op == "rms_norm") {  // torchtitan's type_as(x): what reads a norm reads bf16
      for (const auto& u : n->output()->uses()) EXPECT_EQ(u.user->op(), "cast");
    }
    if (op == "cast" && n->input(0)->producer() == nullptr) {  // a parameter, cast where it is read: once
      EXPECT_EQ(checked["param casts of " + n->input(0)->name()]++, 0) << n->input(0)->name() << " cast twice";
    }
  }
  EXPECT_GT(checked["matmul"] + checked["linear"], 0);
  EXPECT_GT(checked["sdpa"], 0);
  EXPECT_GT(checked["embedding"], 0);
  EXPECT_GT(checked["rms_norm"], 0);
  EXPECT_GT(checked["cross_entropy"], 0);
  EXPECT_EQ(g.find_output("loss")->meta().dtype, DType::f32);
}

TEST(MixedPrecision, OneTrainStepKeepsF32StateAndLandsNearTheF32Step) {
  models::Model f32 = tiny(4, 64), bf16 = tiny(4, 64);
  bf16.graph = cast_for_mixed_precision(bf16.graph, DType::bf16);
  append_train_step(f32.graph, f32.params, {});
  append_train_step(bf16.graph, bf16.params, {});
  exec::TensorMap feed = first_step_feed(f32);
  const exec::TensorMap want = exec::Executor(f32.graph).run(feed);
  const exec::TensorMap got = exec::Executor(bf16.graph).run(feed);
  ASSERT_EQ(got.size(), want.size());
  const double loss = want.at("loss").item<double>();
  EXPECT_NE(got.at("loss").item<double>(), loss) << "the bf16 step computed in float32";
  EXPECT_NEAR(got.at("loss").item<double>(), loss, 1e-2 * loss);
  EXPECT_NEAR(got.at("grad_norm").item<double>(), want.at("grad_norm").item<double>(), 2e-2 * want.at("grad_norm").item<double>());
  for (const auto& [name, t] : want) {
    EXPECT_EQ(got.at(name).scalar_type(), t.scalar_type()) << name;
    if (name.rfind("next.", 0) == 0 && name.find("exp_avg") == std::string::npos) {
      // One AdamW step moves each element by about lr: the two agree far closer than that.
      const double moved = (t - feed.at(name.substr(5))).abs().mean().item<double>();
      EXPECT_LT((got.at(name) - t).abs().mean().item<double>(), 0.2 * moved) << name;
    }
  }
}

// FSDP on 4 ranks as `spmdx run` places it: parameters all_gathered as bf16 (half the bytes),
// gradients reduce_scattered as f32, and the gathers still prefetched a layer ahead.
TEST(MixedPrecision, FsdpGathersBf16ParametersAndReducesF32Gradients) {
  struct Counted {
    double gather_bytes = 0;
    std::map<std::string, int> by_dtype;  // "all_gather bf16", "reduce_scatter f32", ...
    std::size_t prefetched = 0;
  };
  auto plan_for = [](const std::string& param) {
    config::Config cfg = config::Config::load(SPMDX_SOURCE_DIR "/configs/llama_fsdp.toml");
    cfg.override_value("training.mixed_precision_param", param);
    PluginRegistry registry;
    registry.discover({{BUILTIN_PLUGIN_DIR, PluginSource::Origin::builtin}});
    const job::PlacedJob job = job::place_job(job::job_spec(cfg, 4, 256), registry);
    const auto plan = job::propagate_job(job);
    const ir::Graph rank0 = sharding::rank_graph(plan, 0);
    Counted c;
    for (const auto& n : rank0.nodes()) {
      if (n->op() != "all_gather" && n->op() != "reduce_scatter" && n->op() != "all_reduce") continue;
      ++c.by_dtype[n->op() + " " + std::string(ir::to_string(n->input(0)->meta().dtype))];
      if (n->op() == "all_gather") c.gather_bytes += static_cast<double>(n->input(0)->meta().nbytes());
    }
    c.prefetched = plan::make_runtime_plan(rank0, job.mesh, {}).prefetched.size();
    return c;
  };
  Counted f32 = plan_for("float32"), bf16 = plan_for("bfloat16");
  EXPECT_EQ(f32.by_dtype.count("all_gather bf16"), 0u);
  EXPECT_GT(bf16.by_dtype.at("all_gather bf16"), 0);
  // Only the norm weights (read by float32 norms) are still gathered in float32.
  EXPECT_LT(bf16.by_dtype["all_gather f32"], bf16.by_dtype.at("all_gather bf16") / 2);
  EXPECT_EQ(bf16.by_dtype["reduce_scatter bf16"], 0) << "a gradient was reduced in bf16";
  EXPECT_EQ(bf16.by_dtype.at("reduce_scatter f32"), f32.by_dtype.at("reduce_scatter f32"));
  EXPECT_LT(bf16.gather_bytes, 0.55 * f32.gather_bytes);
  EXPECT_GT(bf16.gather_bytes, 0.45 * f32.gather_bytes);
  EXPECT_EQ(bf16.prefetched, f32.prefetched);
}


// float16 with dynamic loss scaling (TrainStepConfig::loss_scaling): at a scale the float16
// backward can hold, one step lands near float32's; at a scale it cannot, the gradients
// overflow, found_inf says so and AdamW leaves every state tensor as it was, bit for bit.
TEST(MixedPrecision, Float16LossScalingStepsNearF32AndSkipsAnOverflowingStep) {
  models::Model f32 = tiny(4, 64), f16 = tiny(4, 64);
  f16.graph = cast_for_mixed_precision(f16.graph, DType::f16);
  append_train_step(f32.graph, f32.params, {});
  TrainStepConfig scaled;
  scaled.loss_scaling = true;
  append_train_step(f16.graph, f16.params, scaled);
  ASSERT_NE(f16.graph.find_input("loss_scale"), nullptr);
  ASSERT_NE(f16.graph.find_output("found_inf"), nullptr);
  exec::TensorMap feed = first_step_feed(f32);
  const exec::TensorMap want = exec::Executor(f32.graph).run(feed);
  feed["loss_scale"] = at::scalar_tensor(1024.0, at::kFloat);
  const exec::TensorMap got = exec::Executor(f16.graph).run(feed);
  EXPECT_EQ(got.at("found_inf").item<float>(), 0.0f);
  const double loss = want.at("loss").item<double>();
  EXPECT_NE(got.at("loss").item<double>(), loss) << "the float16 step computed in float32";
  EXPECT_NEAR(got.at("loss").item<double>(), loss, 2e-3 * loss);
  EXPECT_NEAR(got.at("grad_norm").item<double>(), want.at("grad_norm").item<double>(), 1e-2 * want.at("grad_norm").item<double>())
      << "the gradients were not unscaled";
  for (const auto& p : f32.params) {
    const at::Tensor& w = want.at("next." + p);
    EXPECT_EQ(got.at("next." + p).scalar_type(), at::kFloat) << p;
    const double moved = (w - feed.at(p)).abs().mean().item<double>();
    EXPECT_LT((got.at("next." + p) - w).abs().mean().item<double>(), 0.1 * moved) << p;
  }
  // 2^40: float16's largest value is 65504, so the scaled gradients overflow.
  feed["loss_scale"] = at::scalar_tensor(std::ldexp(1.0, 40), at::kFloat);
  const exec::TensorMap skipped = exec::Executor(f16.graph).run(feed);
  EXPECT_EQ(skipped.at("found_inf").item<float>(), 1.0f);
  EXPECT_FALSE(std::isfinite(skipped.at("grad_norm").item<double>()));
  EXPECT_TRUE(std::isfinite(skipped.at("loss").item<double>())) << "the forward does not see the scale";
  for (const auto& name : train_state_names(f16.params)) EXPECT_TRUE(at::equal(skipped.at("next." + name), feed.at(name))) << name << " changed";
}

// GradScaler.update as torch.amp's _amp_update_scale_: halve and restart on overflow, double
// after growth_interval clean steps in a row.
TEST(MixedPrecision, GradScalerHalvesOnOverflowAndDoublesAfterTheGrowthInterval) {
  GradScaler s{65536.0, 3};
  EXPECT_EQ(s.update(true), 32768.0);
  EXPECT_EQ(s.update(false), 32768.0);
  EXPECT_EQ(s.update(false), 32768.0);
  EXPECT_EQ(s.update(true), 16384.0) << "an overflow restarts the count";
  EXPECT_EQ(s.growth_tracker, 0);
  for (int i = 0; i < 2; ++i) EXPECT_EQ(s.update(false), 16384.0);
  EXPECT_EQ(s.update(false), 32768.0);
  EXPECT_EQ(s.growth_tracker, 0);
}

}  // namespace
}  // namespace spmdx::train
