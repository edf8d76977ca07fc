// Pipeline parallelism (train/pipeline.h): the schedules' order and bubble, how a train step is
// cut into stages, and the stages run for real, one thread and one in-process comm backend
// ("local") per rank, against one rank running the whole step: the same loss, gradient norm and
// updated parameters (so the same gradients through AdamW) after each of 3 steps.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <set>
#include <thread>

#include "spmdx/core/registry.h"
#include "spmdx/exec/distributed.h"
#include "spmdx/exec/executor.h"
#include "spmdx/exec/trainer.h"
#include "spmdx/models/model.h"
#include "spmdx/train/mixed_precision.h"
#include "spmdx/train/pipeline.h"
#include "spmdx/train/train_step.h"

namespace spmdx {
namespace {

using train::PipelineAction;
using train::PipelineSpec;
using ::testing::HasSubstr;

std::string order(const std::vector<PipelineAction>& actions) {
  std::string out;
  for (const auto& a : actions) out += (out.empty() ? "" : " ") + std::string(a.forward ? "F" : "B") + std::to_string(a.microbatch);
  return out;
}

TEST(Pipeline, LayerIndexComesFromTheParameterName) {
  EXPECT_EQ(train::layer_of("layers.3.attention.wq.weight"), 3);
  EXPECT_EQ(train::layer_of("model.layers.12.mlp.up_proj.weight"), 12);
  EXPECT_EQ(train::layer_of("tok_embeddings.weight"), -1);
  EXPECT_EQ(train::layer_of("output.weight"), -1);
  EXPECT_EQ(train::layer_of("transformer.h.5.attn.c_attn.weight"), 5);  // GPT-2's numbered blocks too
  EXPECT_EQ(train::layer_of("exp_avg.layers.2.feed_forward.w1.weight"), 2);
  EXPECT_EQ(train::layer_of("layers.x.w"), -1);
  PipelineSpec spec;
  spec.first_layer = {0, 3, 5};
  EXPECT_EQ(spec.chunk_of_layer(0), 0);
  EXPECT_EQ(spec.chunk_of_layer(2), 0);
  EXPECT_EQ(spec.chunk_of_layer(3), 1);
  EXPECT_EQ(spec.chunk_of_layer(4), 1);
  EXPECT_EQ(spec.chunk_of_layer(9), 2);
  spec = {2, "Interleaved1F1B", 4, 2, {0, 2, 4, 5}};  // 2 stages of 2 chunks: stage 0 holds chunks 0 and 2
  EXPECT_EQ(train::stage_layers(spec, 0), "layers 0 to 1, layer 4");
  EXPECT_EQ(train::stage_layers(spec, 1), "layers 2 to 3, layers 5 on");
}

// GPipe runs every forward first; 1F1B (PipeDream-Flush) warms up with stages - 1 - s forwards,
// then alternates, as torch.distributed.pipelining.Schedule1F1B.
TEST(Pipeline, SchedulesRunEachMicrobatchForwardThenBackwardInTheirOrder) {
  PipelineSpec spec{2, "GPipe", 4, 1, {0, 1}};
  auto s = train::pipeline_schedule(spec);
  EXPECT_EQ(order(s[0]), "F0 F1 F2 F3 B0 B1 B2 B3");
  EXPECT_EQ(order(s[1]), "F0 F1 F2 F3 B0 B1 B2 B3");
  spec.schedule = "1F1B";
  s = train::pipeline_schedule(spec);
  EXPECT_EQ(order(s[0]), "F0 F1 B0 F2 B1 F3 B2 B3");
  EXPECT_EQ(order(s[1]), "F0 B0 F1 B1 F2 B2 F3 B3");
  spec = {4, "1F1B", 8, 1, {0, 1, 2, 3}};
  s = train::pipeline_schedule(spec);
  EXPECT_EQ(order(s[0]), "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7");
  EXPECT_EQ(order(s[3]), "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7");
  spec.microbatches = 2;  // fewer microbatches than stages: the warm-up is cut short
  EXPECT_EQ(order(train::pipeline_schedule(spec)[0]), "F0 F1 B0 B1");
  // Interleaved1F1B, 2 stages of 2 chunks, 4 microbatches (chunk after the microbatch): groups
  // of 2 microbatches through chunk 0 then chunk 1 of the stage; stage 0 warms up with 4
  // forwards, stage 1 with 2; every chunk's forward and backward of every microbatch once.
  spec = {2, "Interleaved1F1B", 4, 2, {0, 1, 2, 3}};
  s = train::pipeline_schedule(spec);
  auto chunked = [](const std::vector<PipelineAction>& actions) {
    std::string out;
    for (const auto& a : actions) out += (out.empty() ? "" : " ") + std::string(a.forward ? "F" : "B") + std::to_string(a.microbatch) + "c" + std::to_string(a.chunk);
    return out;
  };
  EXPECT_EQ(chunked(s[0]), "F0c0 F1c0 F0c2 F1c2 F2c0 B0c2 F3c0 B1c2 F2c2 B0c0 F3c2 B1c0 B2c2 B3c2 B2c0 B3c0");
  EXPECT_EQ(chunked(s[1]), "F0c1 F1c1 F0c3 B0c3 F1c3 B1c3 F2c1 B0c1 F3c1 B1c1 F2c3 B2c3 F3c3 B3c3 B2c1 B3c1");
  EXPECT_DOUBLE_EQ(train::bubble_fraction(spec), 1.0 / 9.0);
  EXPECT_DOUBLE_EQ(train::bubble_fraction({4, "1F1B", 8, 1, {0, 1, 2, 3}}), 3.0 / 11.0);
  EXPECT_DOUBLE_EQ(train::bubble_fraction({2, "GPipe", 4, 1, {0, 1}}), 1.0 / 5.0);
}

// The tick table: forwards 1 tick, backwards 2; with 2 stages and 2 microbatches, stage 1 starts
// a tick late and stage 0 waits for stage 1's backwards: 9 ticks, 3 of them idle on each stage.
TEST(Pipeline, ScheduleTableShowsEachStagesTicksAndIdleShare) {
  const std::string table = train::schedule_table({2, "GPipe", 2, 1, {0, 1}}, 1);
  EXPECT_THAT(table, HasSubstr("theoretical bubble (stages - 1) / (microbatches + stages - 1) = 0.333; 9 ticks"));
  EXPECT_THAT(table, HasSubstr(" stage 0 (idle 0.333) | F0  F1  .   .   .   B0  B0  B1  B1\n"));
  EXPECT_THAT(table, HasSubstr("*stage 1 (idle 0.333) | .   F0  F1  B0  B0  B1  B1  .   .\n"));
  EXPECT_THAT(table, HasSubstr("# order of stage 1: F0 F1 B0 B1"));
}

models::Model llama(std::int64_t layers, std::int64_t rows) {
  models::ModelArgs args = models::model_args("llama", "tiny", 264);
  args.n_layers = layers;
  return models::build_model(args, rows, 8);
}

std::set<std::string> input_names(const ir::Graph& g) {
  std::set<std::string> out;
  for (const ir::Value* v : g.inputs()) out.insert(v->name());
  return out;
}

// Stage 0 holds the embedding and its layers, the last stage the final norm and the output;
// what one stage sends the next receives (same tags, shapes, dtypes); each stage returns its
// own state's updates and every stage the loss and the gradient norm.
TEST(Pipeline, StagesHoldTheirLayersAndExchangeWhatTheyRead) {
  models::Model m = llama(4, 2);
  train::TrainStepConfig step;
  step.microbatches = 2;
  train::append_train_step(m.graph, m.params, step);
  const PipelineSpec spec{2, "1F1B", 2, 1, {0, 2}};
  const auto stages = train::node_stages(m.graph, spec, m.params);
  ASSERT_EQ(stages.size(), m.graph.num_nodes());
  std::vector<train::StageGraph> parts;
  for (std::int64_t r = 0; r < 2; ++r) parts.push_back(train::stage_graph(m.graph, spec, m.params, r, 1));
  for (auto& p : parts) EXPECT_NO_THROW(p.graph.verify());
  const auto in0 = input_names(parts[0].graph), in1 = input_names(parts[1].graph);
  EXPECT_TRUE(in0.count("tok_embeddings.weight") && in0.count("layers.1.attention.wq.weight") && in0.count("exp_avg.layers.0.feed_forward.w1.weight"));
  EXPECT_FALSE(in0.count("output.weight") || in0.count("layers.2.attention.wq.weight") || in0.count("norm.weight"));
  EXPECT_TRUE(in1.count("output.weight") && in1.count("norm.weight") && in1.count("layers.3.attention.wo.weight") && in1.count("labels.1"));
  EXPECT_FALSE(in1.count("tok_embeddings.weight") || in1.count("layers.1.attention.wq.weight") || in1.count("tokens"));
  // Sends of one stage are the other's receives.
  auto p2p = [](const ir::Graph& g, const std::string& op) {
    std::multiset<std::pair<std::int64_t, std::string>> out;
    for (const auto& n : g.nodes()) {
      if (n->op() != op) continue;
      out.emplace(n->attr_int("tag"), (op == "send" ? n->input(0) : n->output())->meta().str());
    }
    return out;
  };
  EXPECT_EQ(p2p(parts[0].graph, "send"), p2p(parts[1].graph, "recv"));
  EXPECT_EQ(p2p(parts[1].graph, "send"), p2p(parts[0].graph, "recv"));
  EXPECT_EQ(parts[0].bytes_sent, 2 * 2 * 8 * 64 * 4 + 4);
  // Per microbatch: the residual stream forward, its gradient back; once a step, the partial sum
  // of squared gradients forward, and the clip coefficient, loss and norm back.
  EXPECT_EQ(parts[0].sends, 3);  // 2 activations, the partial sum of squares
  EXPECT_EQ(parts[1].sends, 5);  // 2 gradients, the clip coefficient, the loss, the grad norm
  for (const auto& p : parts) {
    EXPECT_NE(p.graph.find_output("loss"), nullptr);
    EXPECT_NE(p.graph.find_output("grad_norm"), nullptr);
  }
  std::size_t next = 0;
  for (const auto& p : parts) {
    for (const auto& [name, v] : p.graph.outputs()) next += name.rfind("next.", 0) == 0;
  }
  EXPECT_EQ(next, 3 * m.params.size());
}

// Under bf16 mixed precision the residual stream is bf16 and each layer's norm reads its float32
// cast. The cast runs on the stage that reads it: only the bf16 residual crosses forward, not
// the float32 copy beside it (it had: 3 bytes an element where 2 do, the same numbers either way).
TEST(Pipeline, UnderBf16OnlyTheBf16ResidualCrossesStages) {
  models::Model m = llama(4, 2);
  m.graph = train::cast_for_mixed_precision(m.graph, ir::DType::bf16);
  train::TrainStepConfig step;
  step.microbatches = 2;
  train::append_train_step(m.graph, m.params, step);
  const PipelineSpec spec{2, "1F1B", 2, 1, {0, 2}};
  const train::StageGraph first = train::stage_graph(m.graph, spec, m.params, 0, 1);
  std::vector<std::string> forward;
  for (const auto& n : first.graph.nodes()) {
    if (n->op() == "send" && n->input(0)->meta().numel() > 1) forward.push_back(n->input(0)->meta().str());
  }
  EXPECT_THAT(forward, ::testing::ElementsAre("bf16[2, 8, 64]", "bf16[2, 8, 64]"));  // one a microbatch
  EXPECT_EQ(first.bytes_sent, 2 * 2 * 8 * 64 * 2 + 4);  // and the partial sum of squares
  EXPECT_NO_THROW(first.graph.verify());
}

TEST(Pipeline, MoreStagesThanParameterHoldersAreRefused) {
  models::Model m = llama(2, 2);
  train::append_train_step(m.graph, m.params, {});
  // Stage 1 of 3 would begin at layer 5 of 2: no parameter there.
  EXPECT_THROW(train::stage_graph(m.graph, {3, "1F1B", 1, 1, {0, 5, 6}}, m.params, 0, 1), std::invalid_argument);
}

// Runs `graphs` (one per rank) on threads with in-process comm backends; returns each rank's
// outputs.
std::vector<exec::TensorMap> run_ranks(const std::vector<ir::Graph>& graphs, const sharding::DeviceMesh& mesh, const std::vector<exec::TensorMap>& feeds,
                                       int steps, std::vector<std::vector<exec::TensorMap>>* per_step) {
  const int n = static_cast<int>(graphs.size());
  PluginRegistry registry;
  registry.discover({{BUILTIN_PLUGIN_DIR, PluginSource::Origin::builtin}});
  std::vector<std::unique_ptr<CommBackend>> backends;
  for (int r = 0; r < n; ++r) backends.push_back(registry.make_comm_backend("local", {{"job", "pipeline_test"}}));
  std::vector<exec::TensorMap> out(static_cast<std::size_t>(n));
  per_step->assign(static_cast<std::size_t>(steps), std::vector<exec::TensorMap>(static_cast<std::size_t>(n)));
  std::vector<std::string> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        const auto i = static_cast<std::size_t>(r);
        backends[i]->init({r, n, 0, nullptr, 60});
        exec::DistributedExecutor ex(graphs[i], mesh, r, backends[i].get(), 60);
        exec::TensorMap feed = feeds[i];
        for (int s = 0; s < steps; ++s) {
          feed["step"] = at::scalar_tensor(static_cast<double>(s + 1), at::kFloat);
          out[i] = ex.run(feed, s + 1);
          (*per_step)[static_cast<std::size_t>(s)][i] = out[i];
          for (const auto& [name, t] : out[i]) {
            if (name.rfind("next.", 0) == 0) feed[name.substr(5)] = t;
          }
        }
        backends[i]->finalize();
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[static_cast<std::size_t>(r)], "") << "rank " << r;
  return out;
}

double rel(const at::Tensor& a, const at::Tensor& b) { return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item<double>(); }

// Every schedule and stage count gives, step after step, the loss, gradient norm and updated
// parameters of one rank running the whole step (the gradients summed over the same
// microbatches in another order: within 1e-5).
TEST(Pipeline, StagesGiveTheUpdatesOfOneRank) {
  struct Case {
    std::int64_t stages, microbatches;
    std::string schedule;
    std::int64_t virtual_stages = 1;
  };
  for (const Case& c : {Case{2, 4, "1F1B"}, Case{2, 4, "GPipe"}, Case{4, 8, "1F1B"}, Case{4, 2, "GPipe"}, Case{2, 4, "Interleaved1F1B", 2},
                        Case{2, 8, "Interleaved1F1B", 2}}) {
    SCOPED_TRACE(std::to_string(c.stages) + " stages, " + std::to_string(c.microbatches) + " microbatches, " + c.schedule);
    const std::int64_t rows = 8 / c.microbatches;
    models::Model m = llama(4, rows);
    train::TrainStepConfig step;
    step.microbatches = c.microbatches;
    train::append_train_step(m.graph, m.params, step);
    exec::TensorMap full = exec::init_tensors(m, 7);
    for (const auto& s : train::train_state_names(m.params)) {
      if (full.count(s) == 0) full[s] = at::zeros_like(full.at(s.substr(s.find('.') + 1)));
    }
    at::manual_seed(c.stages * 100 + c.microbatches);  // the tokens, so that a failure can be run again
    for (std::int64_t k = 0; k < c.microbatches; ++k) {
      full[train::microbatch_input("tokens", k)] = at::randint(0, 264, {rows, 8}, at::kLong);
      full[train::microbatch_input("labels", k)] = at::randint(0, 264, {rows, 8}, at::kLong);
    }
    full["lr"] = at::scalar_tensor(1e-2, at::kFloat);
    full["step"] = at::scalar_tensor(1.0, at::kFloat);
    // One rank, three steps.
    std::vector<exec::TensorMap> want;
    {
      exec::Executor one(m.graph);
      exec::TensorMap feed = full;
      for (int s = 0; s < 3; ++s) {
        feed["step"] = at::scalar_tensor(static_cast<double>(s + 1), at::kFloat);
        want.push_back(one.run(feed));
        for (const auto& [name, t] : want.back()) {
          if (name.rfind("next.", 0) == 0) feed[name.substr(5)] = t;
        }
      }
    }
    PipelineSpec spec{c.stages, c.schedule, c.microbatches, c.virtual_stages, {}};
    for (std::int64_t s = 0; s < spec.chunks(); ++s) spec.first_layer.push_back(s * 4 / spec.chunks());
    std::vector<ir::Graph> graphs;
    std::vector<exec::TensorMap> feeds;
    for (std::int64_t r = 0; r < c.stages; ++r) {
      graphs.push_back(train::stage_graph(m.graph, spec, m.params, r, 1).graph);
      exec::TensorMap feed;
      for (const ir::Value* v : graphs.back().inputs()) feed[v->name()] = full.at(v->name()).clone();
      feeds.push_back(std::move(feed));
    }
    const auto mesh = train::pipeline_mesh(sharding::DeviceMesh({{"dp_replicate", 1}}, 1), c.stages);
    std::vector<std::vector<exec::TensorMap>> got;
    run_ranks(graphs, mesh, feeds, 3, &got);
    for (int s = 0; s < 3; ++s) {
      for (std::int64_t r = 0; r < c.stages; ++r) {
        const auto& out = got[static_cast<std::size_t>(s)][static_cast<std::size_t>(r)];
        ASSERT_TRUE(out.count("loss")) << "rank " << r;
        EXPECT_LE(rel(out.at("loss"), want[static_cast<std::size_t>(s)].at("loss")), 1e-6) << "step " << s + 1 << " rank " << r;
        EXPECT_LE(rel(out.at("grad_norm"), want[static_cast<std::size_t>(s)].at("grad_norm")), 1e-5) << "step " << s + 1 << " rank " << r;
        for (const auto& [name, t] : out) {
          if (name.rfind("next.", 0) == 0) {
            EXPECT_LE(rel(t, want[static_cast<std::size_t>(s)].at(name)), 1e-5) << name << " step " << s + 1;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace spmdx
