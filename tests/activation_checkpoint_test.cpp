// Activation checkpointing (train/activation_checkpoint.h) on llama tiny's one-rank train step:
// every output bit for bit as without it, the executor's peak lower, the right nodes recomputed
// and placed just before the backward that reads them.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>

#include "spmdx/config/config.h"
#include "spmdx/core/registry.h"
#include "spmdx/exec/executor.h"
#include "spmdx/exec/trainer.h"
#include "spmdx/sharding/rewriter.h"
#include "spmdx/train/activation_checkpoint.h"
#include "spmdx/job/compile.h"
#include "spmdx/job/preflight.h"
#include "spmdx/job/spec.h"
#include "spmdx/train/train_step.h"

namespace spmdx::train {
namespace {

using ::testing::HasSubstr;

struct Step {
  models::Model model;
  std::size_t forward_nodes = 0;
  std::int64_t batch, seq;
  explicit Step(const std::string& flavor = "tiny", std::int64_t b = 2, std::int64_t t = 32)
      : model(models::build_model(models::model_args("llama", flavor, 256), b, t)), batch(b), seq(t) {
    forward_nodes = model.graph.num_nodes();
    append_train_step(model.graph, model.params, {});
  }
  // One step's feed: the initial state, a batch and the schedule's scalars.
  exec::TensorMap feed() const {
    exec::TensorMap f = exec::init_tensors(model, 7);
    for (const auto& p : model.params) f["exp_avg." + p] = at::zeros_like(f.at(p)), f["exp_avg_sq." + p] = at::zeros_like(f.at(p));
    at::manual_seed(1);
    f["tokens"] = at::randint(0, 256, {batch, seq}, at::kLong);
    f["labels"] = at::randint(0, 256, {batch, seq}, at::kLong);
    f["lr"] = at::scalar_tensor(1e-3, at::kFloat);
    f["step"] = at::scalar_tensor(1.0, at::kFloat);
    return f;
  }
};

// Runs `graph` and returns its outputs and the executor's peak bytes.
std::pair<exec::TensorMap, std::int64_t> run(const ir::Graph& graph, const exec::TensorMap& feed) {
  exec::Executor ex(graph);
  exec::TensorMap out = ex.run(feed);
  return {std::move(out), ex.peak_bytes()};
}

void expect_identical(const exec::TensorMap& a, const exec::TensorMap& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) EXPECT_TRUE(at::equal(t, b.at(name))) << name << " differs";
}

// A batch whose activations outweigh the state (parameters, gradients, AdamW's outputs), as in
// real jobs: the peak is then the forward's values at the loss.
TEST(ActivationCheckpoint, FullRecomputesEveryLayerWithIdenticalOutputsAndALowerPeak) {
  Step s("tiny", 8, 128);
  CheckpointReport report;
  const ir::Graph full = checkpoint_activations(s.model.graph, s.forward_nodes, s.model.params, {"full", "op"}, &report);
  full.verify();
  EXPECT_EQ(report.layers, 2);
  EXPECT_GT(report.recomputed_nodes, 2 * 10);
  EXPECT_GT(report.freed_bytes, 0);
  EXPECT_EQ(full.num_nodes(), s.model.graph.num_nodes() + static_cast<std::size_t>(report.recomputed_nodes));
  const exec::TensorMap feed = s.feed();
  const auto [want, peak_none] = run(s.model.graph, feed);
  const auto [got, peak_full] = run(full, feed);
  expect_identical(want, got);
  EXPECT_LT(static_cast<double>(peak_full), 0.75 * static_cast<double>(peak_none)) << peak_full << " vs " << peak_none << " bytes";
}

TEST(ActivationCheckpoint, SelectiveOpKeepsMatmulsAndAttentionAndRecomputesTheRest) {
  Step s;
  CheckpointReport report;
  const ir::Graph sel = checkpoint_activations(s.model.graph, s.forward_nodes, s.model.params, {"selective", "op"}, &report);
  sel.verify();
  EXPECT_EQ(report.layers, 2);
  // The recomputed nodes are the ones added after the forward: none is a matmul or attention.
  std::size_t i = 0, recomputed = 0;
  for (const auto& n : sel.nodes()) {
    if (i++ < s.forward_nodes) continue;
    if (n->op() == "rms_norm" || n->op() == "silu" || n->op() == "rotary_embedding") ++recomputed;
    EXPECT_FALSE(n->op() == "sdpa") << "attention ran again";
  }
  EXPECT_GT(recomputed, 0u);
  const exec::TensorMap feed = s.feed();
  expect_identical(run(s.model.graph, feed).first, run(sel, feed).first);
}

TEST(ActivationCheckpoint, SelectiveEveryNthLayerCountsLayersFromOneAsTorchtitan) {
  Step s("debugmodel");
  CheckpointReport every2, every4;
  checkpoint_activations(s.model.graph, s.forward_nodes, s.model.params, {"selective", "2"}, &every2);
  checkpoint_activations(s.model.graph, s.forward_nodes, s.model.params, {"selective", "4"}, &every4);
  EXPECT_EQ(every2.layers, 3);  // layers 2, 4, 6 of 6
  EXPECT_EQ(every4.layers, 1);  // layer 4
}

TEST(ActivationCheckpoint, RecomputationRunsRightBeforeItsLayersBackward) {
  Step s;
  const ir::Graph full = checkpoint_activations(s.model.graph, s.forward_nodes, s.model.params, {"full", "op"});
  // Each recomputed layer's block starts with its attention norm: the last layer's comes first
  // in the backward, and both after the loss.
  std::vector<std::size_t> norms;
  std::size_t i = 0, loss_at = 0;
  const ir::Value* loss = full.find_output("loss");
  for (const auto& n : full.nodes()) {
    if (n.get() == loss->producer()) loss_at = i;
    if (i >= s.forward_nodes && n->op() == "rms_norm") norms.push_back(i);
    ++i;
  }
  ASSERT_EQ(norms.size(), 4u);  // two norms per layer, two layers
  EXPECT_GT(norms.front(), loss_at);
}

TEST(ActivationCheckpoint, NoneChangesNothingAndBadOptionsAreRefused) {
  Step s;
  CheckpointReport report;
  const ir::Graph same = checkpoint_activations(s.model.graph, s.forward_nodes, s.model.params, {"none", "op"}, &report);
  ASSERT_EQ(same.num_nodes(), s.model.graph.num_nodes());
  for (auto a = same.nodes().begin(), b = s.model.graph.nodes().begin(); a != same.nodes().end(); ++a, ++b) EXPECT_EQ((*a)->op(), (*b)->op());
  EXPECT_EQ(report.recomputed_nodes, 0);
  try {
    checkpoint_activations(s.model.graph, s.forward_nodes, s.model.params, {"selective", "0"});
    FAIL() << "selective_ac_option 0 was taken";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("use \"op\" or a positive integer N"));
  }
  EXPECT_THROW(checkpoint_activations(s.model.graph, s.forward_nodes, s.model.params, {"partial", "op"}), std::invalid_argument);
}


// The main job's rank 0 (FSDP x TP, as spmdx run places it): without checkpointing no two
// collectives move what the same ops made from the same values (the backward's views of a
// linear's input are shared, so TP gathers it once for q, k and v); with full checkpointing the
// recomputation issues each layer's collectives again, and keep_collective_outputs reads the
// forward's instead: as many collectives as without checkpointing, not one of the parameters'.
TEST(ActivationCheckpoint, KeepCollectiveOutputsMergesOnlyTheRecomputationsCollectives) {
  auto rank0 = [](const std::string& mode, bool keep, std::int64_t* kept) {
    config::Config cfg = config::Config::load(SPMDX_SOURCE_DIR "/configs/llama_debug.toml");
    cfg.override_value("activation_checkpoint.mode", mode);
    cfg.override_value("activation_checkpoint.keep_collective_outputs", keep ? "true" : "false");
    PluginRegistry registry;
    registry.discover({{BUILTIN_PLUGIN_DIR, PluginSource::Origin::builtin}});
    const job::JobSpec spec = job::job_spec(cfg, 4, 256);
    const job::PlacedJob job = job::place_job(spec, registry);
    const auto plan = job::propagate_job(job);
    return job::rank_step_graph(plan, 0, spec, kept);
  };
  auto collectives = [](const ir::Graph& g) {
    std::map<std::string, int> n;
    for (const auto& node : g.nodes()) {
      if (sharding::is_collective(node->op())) ++n[node->op() + (node->input(0)->producer() == nullptr ? " of a parameter" : "")];
    }
    return n;
  };
  std::int64_t kept = -1;
  ir::Graph none = rank0("none", false, nullptr);
  const auto plain = collectives(none);
  EXPECT_EQ(keep_collective_outputs(none), 0) << "the rank graph moves one value twice";
  const auto full = collectives(rank0("full", false, nullptr));
  const auto keep = collectives(rank0("full", true, &kept));
  EXPECT_GT(kept, 0);
  int recomputed = 0;
  for (const auto& [what, count] : full) recomputed += count - (plain.count(what) > 0 ? plain.at(what) : 0);
  EXPECT_EQ(kept, recomputed);
  EXPECT_EQ(keep, plain) << "keeping the forward's outputs leaves the collectives of no checkpointing";
  EXPECT_EQ(keep.at("all_gather of a parameter"), full.at("all_gather of a parameter")) << "FSDP's gathers are issued again as before";
}

}  // namespace
}  // namespace spmdx::train
