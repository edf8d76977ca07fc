// The whole pipeline on llama tiny, every rank in one process: strategy plugins place the
// parameters and the batch, propagation places everything else, the rewriter makes each rank's
// graph with its collectives, and SimulatedRun executes them in lock step. The losses and
// gradients must equal one rank's within what float32 gives in other reduction orders (3e-7 for
// the loss, 1e-6 for the largest gradient element), for dp, fsdp, tp and their 2-D
// compositions.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "spmdx/data/text_dataset.h"
#include "spmdx/exec/simulated.h"
#include "spmdx/exec/trainer.h"
#include "spmdx/ir/autodiff.h"
#include "spmdx/sharding/parallelize.h"
#include "spmdx/train/loss_parallel.h"
#include "test_util.h"

#include <set>

namespace spmdx {
namespace {

using sharding::Placements;
using ::testing::HasSubstr;

constexpr std::int64_t kVocab = 264, kBatch = 4, kSeq = 8;  // kVocab: the byte tokenizer's (256 bytes, BOS, EOS, padding)

struct Layout {
  std::string name;
  sharding::ParallelDims dims;
  std::int64_t world;
  bool sequence_parallel = false;
  bool loss_parallel = false;  ///< cross entropy as train::vocab_parallel_cross_entropy writes it
};

std::vector<Layout> layouts() {
  return {{"dp4", {4, 1, 1}, 4},         {"fsdp4", {1, 4, 1}, 4},           {"tp2", {1, 1, 2}, 2},
          {"fsdp2xtp2", {1, 2, 2}, 4},   {"dp2xtp2", {2, 1, 2}, 4},         {"hsdp2x2", {2, 2, 1}, 4},
          {"tp2+sp", {1, 1, 2}, 2, true}, {"tp4+sp", {1, 1, 4}, 4, true}, {"fsdp2xtp2+sp", {1, 2, 2}, 4, true},
          {"tp4+sp+lp", {1, 1, 4}, 4, true, true}, {"fsdp2xtp2+sp+lp", {1, 2, 2}, 4, true, true}, {"dp2xtp2+lp", {2, 1, 2}, 4, false, true}};
}

// The tp mesh dim's index where the layout asks for sequence parallelism, else -1.
int sp_dim(const Layout& layout, const sharding::DeviceMesh& mesh) { return layout.sequence_parallel ? mesh.dim_index("tp") : -1; }

PluginRegistry& registry() {
  static PluginRegistry* r = [] {
    auto* reg = new PluginRegistry();  // lives for the test process, as plugins do
    reg->discover(plugin_search_path({}));
    return reg;
  }();
  return *r;
}

StrategyInput strategy_input(const models::Model& m) {
  StrategyInput in;
  for (const auto& spec : m.init) {
    if (spec.trainable) in.parameters.push_back({spec.name, spec.shape});
  }
  for (const char* name : {"tokens", "labels"}) in.inputs.push_back({name, m.graph.find_input(name)->meta().shape});
  return in;
}

// `m`'s train step (appended here) placed on `mesh` by the built-in strategies: its inputs (the
// optimizer state as its parameter), the next state returned the same way, and the
// parameters' placements at use (sharding::use_placements).
struct PlacedStep {
  std::map<std::string, Placements> inputs, outputs, use;
};
PlacedStep place_train_step(models::Model& m, const sharding::DeviceMesh& mesh) {
  train::append_train_step(m.graph, m.params, {});
  PlacedStep s{sharding::parallelize(registry(), mesh, strategy_input(m)), {}, {}};
  std::map<std::string, Placements> params;
  for (const auto& p : m.params) {
    s.inputs["exp_avg." + p] = s.inputs["exp_avg_sq." + p] = s.inputs.at(p);
    params[p] = s.inputs.at(p);
  }
  for (const auto& name : train::train_state_names(m.params)) s.outputs["next." + name] = s.inputs.at(name);
  s.use = sharding::use_placements(mesh, params);
  return s;
}

// place_train_step, propagated with sequence parallelism on mesh dim `sequence_parallel_dim`
// (-1: off).
sharding::DistributedPlan plan_train_step(models::Model& m, const sharding::DeviceMesh& mesh, int sequence_parallel_dim) {
  const PlacedStep s = place_train_step(m, mesh);
  return sharding::propagate(m.graph, mesh, s.inputs, s.outputs, s.use, false, sequence_parallel_dim);
}

exec::TensorMap batch(std::uint64_t seed) {
  std::string text;
  for (int i = 0; i < 30; ++i) text += "Every rank computes what one rank computes, step " + std::to_string(i) + ".\n";
  static test::TempDir dir;
  test::write_file(dir / "text.txt", text);
  data::ByteTokenizer tok;
  data::TextDataset ds({{(dir / "text.txt").string()}, kBatch, kSeq, seed}, tok);
  auto b = ds.next_batch();
  auto t = [](const std::vector<std::int64_t>& v) { return at::tensor(v, at::kLong).reshape({kBatch, kSeq}); };
  return {{"tokens", t(b.tokens)}, {"labels", t(b.labels)}};
}

// Runs `graph` on every rank of `plan`'s mesh from full inputs; returns the outputs put
// back together by their placements.
exec::TensorMap run_distributed(const sharding::DistributedPlan& plan, const exec::TensorMap& full) {
  const auto& mesh = plan.mesh;
  std::vector<ir::Graph> graphs;
  std::vector<exec::TensorMap> inputs(static_cast<std::size_t>(mesh.size()));
  for (std::int64_t r = 0; r < mesh.size(); ++r) {
    graphs.push_back(sharding::rank_graph(plan, r));
    for (const ir::Value* v : plan.graph->inputs()) {
      inputs[static_cast<std::size_t>(r)][v->name()] = exec::shard_tensor(full.at(v->name()), plan.placement.at(v), mesh, mesh.coordinate(r));
    }
  }
  exec::SimulatedRun run(mesh, std::move(graphs));
  auto local = run.run(inputs);
  exec::TensorMap out;
  for (const auto& [name, v] : plan.graph->outputs()) {
    std::vector<at::Tensor> parts;
    for (const auto& l : local) parts.push_back(l.at(name));
    out[name] = exec::assemble_tensor(parts, plan.outputs.at(name), mesh);
  }
  return out;
}

double rel(const at::Tensor& a, const at::Tensor& b) {
  return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item<double>();
}

TEST(Distributed, LlamaTinyGradientsEqualOneRank) {
  for (const auto& layout : layouts()) {
   for (bool reshard : {false, true}) {
    SCOPED_TRACE(layout.name + (reshard ? " reshard_after_forward" : ""));
    auto with_gradients = [](models::Model& model) {
      std::vector<ir::Value*> weights;
      for (const auto& p : model.params) weights.push_back(model.graph.find_input(p));
      auto grads = ir::gradients(model.graph, model.graph.find_output("loss"), weights);
      for (std::size_t i = 0; i < grads.size(); ++i) model.graph.add_output("grad." + model.params[i], grads[i]);
      model.graph.verify();
    };
    models::Model m = models::build_model(models::model_args("llama", "tiny", kVocab), kBatch, kSeq);
    if (layout.loss_parallel) m.graph = train::vocab_parallel_cross_entropy(m.graph);
    with_gradients(m);
    models::Model one = models::build_model(models::model_args("llama", "tiny", kVocab), kBatch, kSeq);  // ATen's fused cross entropy
    with_gradients(one);

    exec::TensorMap full = exec::init_tensors(m, 42);
    for (auto& [k, v] : batch(3)) full[k] = v;
    const exec::TensorMap want = exec::Executor(one.graph).run(full);

    const auto mesh = sharding::make_mesh(layout.dims, layout.world);
    auto placements = sharding::parallelize(registry(), mesh, strategy_input(m));
    std::map<std::string, Placements> out_pl;
    for (const auto& p : m.params) out_pl["grad." + p] = placements.at(p);
    std::map<std::string, Placements> params;
    for (const auto& p : m.params) params[p] = placements.at(p);
    const auto plan = sharding::propagate(m.graph, mesh, placements, out_pl, sharding::use_placements(mesh, params), reshard, sp_dim(layout, mesh));
    const exec::TensorMap got = run_distributed(plan, full);

    EXPECT_LE(rel(got.at("loss"), want.at("loss")), 3e-7);
    // Gradients: max |diff| / max |one rank's|, at most 5.7e-7 here (float32 sums in other orders).
    for (const auto& p : m.params) EXPECT_LE(rel(got.at("grad." + p), want.at("grad." + p)), 1e-6) << p;
    std::printf("%-10s %-8s mesh %-32s comm %8.0f bytes/rank/step  loss %.6f vs %.6f\n", layout.name.c_str(), reshard ? "reshard" : "keep",
                mesh.str().c_str(), plan.comm_bytes, got.at("loss").item<double>(), want.at("loss").item<double>());
   }
  }
}

TEST(Distributed, LlamaTinyTrainStepLossesEqualOneRankFor5Steps) {
  for (const auto& layout : layouts()) {
    SCOPED_TRACE(layout.name);
    const auto args = models::model_args("llama", "tiny", kVocab);
    models::Model m = models::build_model(args, kBatch, kSeq);
    exec::TensorMap init = exec::init_tensors(m, 42);
    exec::Trainer one(models::build_model(args, kBatch, kSeq), {}, init);

    if (layout.loss_parallel) m.graph = train::vocab_parallel_cross_entropy(m.graph);
    const auto mesh = sharding::make_mesh(layout.dims, layout.world);
    const auto plan = plan_train_step(m, mesh, sp_dim(layout, mesh));

    exec::TensorMap state = one.state();
    for (std::int64_t step = 1; step <= 5; ++step) {
      exec::TensorMap feed = state;
      for (auto& [k, v] : batch(static_cast<std::uint64_t>(step))) feed[k] = v;
      const double lr = 8e-4 * train::lr_factor(step, {2, 5});
      feed["lr"] = at::scalar_tensor(lr, at::kFloat);
      feed["step"] = at::scalar_tensor(static_cast<double>(step), at::kFloat);
      const exec::TensorMap got = run_distributed(plan, feed);
      const double want = one.step(step, lr, feed.at("tokens"), feed.at("labels")).loss;
      EXPECT_NEAR(got.at("loss").item<double>(), want, 3e-7 * std::abs(want)) << "step " << step;
      for (const auto& s : train::train_state_names(m.params)) state[s] = got.at("next." + s);
    }
    for (const auto& p : m.params) EXPECT_LE(rel(state.at(p), one.state().at(p)), 1e-4) << p;
  }
}

// FSDP: each parameter is gathered once for use, AdamW runs on shards with gradients arriving
// sharded, and no more bytes move than the classic schedule's all_gather + reduce_scatter of
// every parameter (the cost model may find cheaper moves, e.g. gathering few activations).
TEST(Distributed, FsdpGathersParametersOnceAndUpdatesShards) {
  models::Model m = models::build_model(models::model_args("mlp", "tiny", kVocab), 8, 64);
  const auto mesh = sharding::make_mesh({1, 4, 1}, 4);
  const PlacedStep step = place_train_step(m, mesh);
  EXPECT_EQ(to_string(step.inputs.at("w1.weight")), "S(0)");
  EXPECT_EQ(to_string(step.inputs.at("tokens")), "S(0)");
  const auto& params = step.use;  // the parameters, by name
  double param_bytes = 0;
  for (const auto& p : m.params) param_bytes += static_cast<double>(m.graph.find_input(p)->meta().nbytes());
  const auto plan = sharding::propagate(m.graph, mesh, step.inputs, step.outputs, step.use);
  const ir::Graph g = sharding::rank_graph(plan, 1);
  std::set<std::string> gathered;  // parameters all-gathered, each once
  int gathers = 0;
  for (const auto& node : g.nodes()) {
    const ir::Value* in = node->input(0);
    if (node->op() == "all_gather" && in->producer() == nullptr && params.count(in->name()) > 0) {
      ++gathers;
      gathered.insert(node->input(0)->name());
    }
  }
  EXPECT_EQ(gathers, 3);
  EXPECT_EQ(gathered, (std::set<std::string>{"tok_embeddings.weight", "w1.weight", "output.weight"}));
  for (const auto& node : m.graph.nodes()) {
    if (node->op() != "adamw") continue;
    for (int i = 0; i < 4; ++i) EXPECT_EQ(to_string(plan.inputs.at(node.get())[static_cast<std::size_t>(i)]), "S(0)") << plan.str();
  }
  EXPECT_LE(plan.comm_bytes, 2 * 0.75 * param_bytes * 1.01) << plan.str();
  EXPECT_EQ(g.find_input("w1.weight")->meta().shape, (std::vector<std::int64_t>{48, 64}));
  std::printf("fsdp4 mlp tiny: %.0f bytes per rank per step; classic all_gather + reduce_scatter: %.0f\n", plan.comm_bytes,
              2 * 0.75 * param_bytes);
}

TEST(Distributed, ReshardAfterForwardGathersEachParameterAgainForTheBackward) {
  models::Model m = models::build_model(models::model_args("mlp", "tiny", kVocab), 8, 64);
  const auto mesh = sharding::make_mesh({1, 4, 1}, 4);
  const PlacedStep step = place_train_step(m, mesh);
  auto gathers = [&](bool reshard) {
    const auto plan = sharding::propagate(m.graph, mesh, step.inputs, step.outputs, step.use, reshard);
    const ir::Graph g = sharding::rank_graph(plan, 0);
    int n = 0;
    for (const auto& node : g.nodes()) n += node->op() == "all_gather" && step.use.count(node->input(0)->name()) > 0;
    return n;
  };
  EXPECT_EQ(gathers(false), 3);
  EXPECT_EQ(gathers(true), 5);  // tok_embeddings is not read by the backward (its gradient needs only the tokens)
}

// Sequence parallelism (Megatron-SP) by placements alone: on tp 4, every forward norm reads
// and writes its activations Shard(1) (the sequence), each row-parallel matmul's Partial output
// is reduce-scattered into the residual stream (Shard(1)) and each norm's output all-gathered
// once for the column-parallel matmuls; the forward all-reduces no activation over tp.
TEST(Distributed, SequenceParallelShardsTheNormsOnTheSequenceAndReduceScattersIntoThem) {
  models::Model m = models::build_model(models::model_args("llama", "tiny", kVocab), kBatch, kSeq);
  models::Model m_plain = models::build_model(models::model_args("llama", "tiny", kVocab), kBatch, kSeq);
  const auto mesh = sharding::make_mesh({1, 1, 4}, 4);
  const auto plan = plan_train_step(m, mesh, 0);
  const auto plain = plan_train_step(m_plain, mesh, -1);

  const auto forward = ir::producers_of(m.graph.find_output("loss"));
  int norms = 0;
  std::map<std::string, std::set<const ir::Value*>> moved;  // forward collective -> the values it moved
  for (const auto& node : m.graph.nodes()) {
    if (forward.count(node.get()) == 0) continue;
    const auto& in = plan.inputs.at(node.get());
    if (node->op() == "rms_norm") {
      ++norms;
      EXPECT_EQ(to_string(in[0]), "S(1)") << "%" << node->id();
      EXPECT_EQ(to_string(plan.placement.at(node->output())), "S(1)") << "%" << node->id();
    }
    for (std::size_t a = 0; a < in.size(); ++a) {
      const ir::Value* v = node->input(static_cast<int>(a));
      if (in[a] == plan.placement.at(v)) continue;
      for (const auto& step : sharding::redistribute_plan(mesh, v->meta(), plan.placement.at(v), in[a])) {
        if (step.op == "all_reduce") {
          EXPECT_TRUE(v->meta().shape.empty()) << "the forward all-reduces " << v->ref() << " " << v->meta().str();
        }
        if (step.op == "reduce_scatter") {
          EXPECT_EQ(step.to.dim(), 1) << v->ref();
        }
        moved[step.op].insert(v);
      }
    }
  }
  EXPECT_EQ(norms, 5);  // two a layer and the final norm
  EXPECT_EQ(moved["reduce_scatter"].size(), 4u);  // attention.wo and feed_forward.w2 of each layer
  std::set<const ir::Value*> gathered_norms;
  for (const ir::Value* v : moved["all_gather"]) {
    if (v->producer() != nullptr && v->producer()->op() == "rms_norm") gathered_norms.insert(v);
  }
  EXPECT_EQ(gathered_norms.size(), 5u);  // each norm's output once, for wq/wk/wv, w1/w3 and output
  std::printf("llama tiny tp 4, %lld x %lld tokens: sequence parallel sends %.0f bytes per rank per step, spmdx's plain TP %.0f\n",
              static_cast<long long>(kBatch), static_cast<long long>(kSeq), plan.comm_bytes, plain.comm_bytes);
}

// Loss parallelism: with cross entropy as vocab_parallel_cross_entropy writes it, the tp 4
// plan moves no value of the logits' width (the vocabulary) at all, forward or backward: only
// [n, 1] row maxima, sums of exp and picked logits. Fused cross entropy gathers them.
TEST(Distributed, LossParallelMovesNoLogits) {
  auto logit_moves = [](bool loss_parallel) {
    models::Model m = models::build_model(models::model_args("llama", "tiny", kVocab), kBatch, kSeq);
    if (loss_parallel) m.graph = train::vocab_parallel_cross_entropy(m.graph);
    const auto plan = plan_train_step(m, sharding::make_mesh({1, 1, 4}, 4), 0);
    int moves = 0, row_stats = 0;
    for (const auto& node : m.graph.nodes()) {
      const auto& in = plan.inputs.at(node.get());
      for (std::size_t a = 0; a < in.size(); ++a) {
        const ir::Value* v = node->input(static_cast<int>(a));
        if (in[a] == plan.placement.at(v) || v->producer() == nullptr) continue;
        const auto& shape = v->meta().shape;
        moves += !shape.empty() && shape.back() == kVocab;
        row_stats += shape == std::vector<std::int64_t>{kBatch * kSeq, 1};
      }
    }
    return std::pair{moves, row_stats};
  };
  const auto [fused, fused_rows] = logit_moves(false);
  const auto [parallel, rows] = logit_moves(true);
  EXPECT_GT(fused, 0);
  EXPECT_EQ(parallel, 0);
  EXPECT_GE(rows, 3);  // the row maxima, the sums of exp, the picked logits
  (void)fused_rows;
}

TEST(Distributed, DegreesThatDoNotMultiplyToWorldSizeAreRejected) {
  try {
    sharding::make_mesh({1, 2, 2}, 8);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("= 4, but world_size is 8"));
  }
}

TEST(Distributed, StrategyNamingAMissingTensorListsNearNames) {
  models::Model m = models::build_model(models::model_args("mlp", "tiny", kVocab), kBatch, kSeq);
  PluginRegistry reg;
  reg.discover({{std::string(TEST_PLUGIN_DIR) + "/test_typo", PluginSource::Origin::user}});
  try {
    sharding::parallelize(reg, sharding::make_mesh({1, 1, 2}, 2), strategy_input(m), {{"tp", "test_typo"}});
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("strategy 'test_typo' places 'w1.weigth', which is neither a parameter nor an input; nearest: w1.weight"));
  }
}

TEST(Distributed, RedistributePlansArePrintable) {
  const sharding::DeviceMesh mesh({{"a", 2}, {"b", 2}});
  const ir::TensorMeta meta{{8, 4}, ir::DType::f32, "cpu", false};
  const auto S0 = Placement::shard(0), R = Placement::replicate(), P = Placement::partial();
  EXPECT_EQ(sharding::to_string(sharding::redistribute_plan(mesh, meta, {P, R}, {R, R})),
            "mesh dim 0: P(sum) -> R all_reduce (128 bytes)");
  EXPECT_EQ(sharding::to_string(sharding::redistribute_plan(mesh, meta, {P, R}, {S0, R})),
            "mesh dim 0: P(sum) -> S(0) reduce_scatter (64 bytes)");
  EXPECT_EQ(sharding::to_string(sharding::redistribute_plan(mesh, meta, {S0, S0}, {R, R})),
            "mesh dim 1: S(0) -> R all_gather (32 bytes); mesh dim 0: S(0) -> R all_gather (64 bytes)");
  EXPECT_EQ(sharding::to_string(sharding::redistribute_plan(mesh, meta, {R, R}, {S0, Placement::shard(1)})),
            "mesh dim 0: R -> S(0) chunk; mesh dim 1: R -> S(1) chunk");
  // Nested shards of one tensor dim: an inner Partial under an outer shard that stays is
  // reduce-scattered (the local tensor is the outer block; FSDP x TP's residual stream) ...
  EXPECT_EQ(sharding::to_string(sharding::redistribute_plan(mesh, meta, {S0, P}, {S0, S0})),
            "mesh dim 1: P(sum) -> S(0) reduce_scatter (32 bytes)");
  // ... but an outer Partial under an inner shard of the same dim is not: the inner shard is
  // undone first and the blocks re-cut outer to inner.
  EXPECT_EQ(sharding::to_string(sharding::redistribute_plan(mesh, meta, {P, S0}, {S0, S0})),
            "mesh dim 1: S(0) -> R all_gather (64 bytes); mesh dim 0: P(sum) -> R all_reduce (128 bytes); "
            "mesh dim 0: R -> S(0) chunk; mesh dim 1: R -> S(0) chunk");
  // FSDP x TP's unshard of a colwise weight (dp shards dim 1, tp dim 0): the all_gather over
  // dim a moves tp's block, [4, 4] floats, half of it sent: 32 bytes, not half the whole
  // tensor's 128 (the count once took only the outer dims' shards, overstating FSDP's bytes
  // under TP by the TP degree).
  EXPECT_EQ(sharding::to_string(sharding::redistribute_plan(mesh, meta, {Placement::shard(1), S0}, {R, S0})),
            "mesh dim 0: S(1) -> R all_gather (32 bytes)");
}

}  // namespace
}  // namespace spmdx
