// strategy = "auto": the planner plugin's ILP (auto, COIN-OR CBC) against hand-checked problems,
// propagate_optimal against the greedy propagation, the calibration file, and the layout search
// under a memory budget. The real-process run (losses of one rank) is in run_test.cpp.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <set>

#include <nlohmann/json.hpp>

#include "spmdx/config/config.h"
#include "spmdx/core/registry.h"
#include "spmdx/plan/estimate.h"
#include "spmdx/plan/memory_plan.h"
#include "spmdx/plan/runtime_plan.h"
#include "spmdx/plan/target.h"
#include "spmdx/sharding/rewriter.h"
#include "spmdx/job/auto_sharding.h"
#include "spmdx/job/compile.h"
#include "spmdx/job/memory_budget.h"
#include "spmdx/job/preflight.h"
#include "spmdx/job/spec.h"
#include "spmdx/train/pipeline.h"
#include "test_util.h"

namespace spmdx {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

PluginRegistry& registry() {
  static PluginRegistry* r = [] {
    auto* out = new PluginRegistry;  // never unloaded, as the host keeps plugins
    out->discover({{BUILTIN_PLUGIN_DIR, PluginSource::Origin::builtin}});
    return out;
  }();
  return *r;
}

std::unique_ptr<Planner> cbc() { return registry().make_planner("auto"); }

// A chain a -> b -> c of 2 candidates each: running a's cheap candidate forces an expensive
// move into b; the optimum pays a little more at a to move nothing (cost 1 + 0 + 1 + 0 + 1 = 3
// against the greedy 0 + 10 + ...).
TEST(AutoPlanner, SolvesAChainToItsOptimum) {
  PlannerProblem p;
  p.mesh_dim = "tp";
  p.node_cost = {{0, 1}, {1, 5}, {1, 1}};
  p.edges = {{0, 1, {10, 10, 0, 10}}, {1, 2, {0, 10, 10, 10}}};  // a0->b*: 10; a1->b0: 0; b0->c0: 0
  p.start = {0, 0, 0};
  const PlannerSolution s = cbc()->solve(p);
  EXPECT_EQ(s.choice, (std::vector<std::int32_t>{1, 0, 0}));
  EXPECT_DOUBLE_EQ(s.objective, 3.0);
  EXPECT_DOUBLE_EQ(planner_cost(p, s.choice), 3.0);
  EXPECT_TRUE(s.optimal);
  EXPECT_THAT(s.solver, HasSubstr("CBC"));
}

// A choice at or above `forbidden` is never taken while another exists.
TEST(AutoPlanner, NeverTakesAForbiddenCandidate) {
  PlannerProblem p;
  p.node_cost = {{0, 5}, {0, 0}};
  p.node_cost[0][0] = p.forbidden;
  p.edges = {{0, 1, {0, 100, 100, 0}}};
  const PlannerSolution s = cbc()->solve(p);
  EXPECT_EQ(s.choice, (std::vector<std::int32_t>{1, 1}));
  EXPECT_DOUBLE_EQ(s.objective, 5.0);
}

// Costs far beyond CBC's limits (its simplex aborts at 1e25) are clamped, not passed on.
TEST(AutoPlanner, SurvivesAbsurdCosts) {
  PlannerProblem p;
  p.forbidden = 1e305;
  p.node_cost = {{1e300, 0}, {0, 1e299}};
  p.edges = {{0, 1, {0, 1e300, 1e300, 0}}};
  const PlannerSolution s = cbc()->solve(p);
  EXPECT_EQ(s.choice, (std::vector<std::int32_t>{1, 1}));
}

TEST(AutoPlanner, RefusesAMalformedProblemNamingTheEdge) {
  PlannerProblem p;
  p.mesh_dim = "dp_shard";
  p.node_cost = {{0, 1}, {0}};
  p.edges = {{0, 1, {1, 2, 3}}};
  try {
    cbc()->solve(p);
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("edge 0 of mesh dim dp_shard has 3 costs for 2 pairs"));
  }
  p.edges = {{0, 5, {1, 2}}};
  EXPECT_THROW(cbc()->solve(p), std::invalid_argument);
}

TEST(AutoPlanner, AnUnknownPlannerIsNamed) {
  try {
    registry().make_planner("gurobi");
    FAIL() << "no error";
  } catch (const PluginError& e) {
    EXPECT_THAT(e.what(), HasSubstr("no planner named 'gurobi'"));
    EXPECT_THAT(e.what(), HasSubstr("auto"));
  }
}

job::JobSpec spec_of(const std::string& config, std::int64_t replicate, std::int64_t shard, std::int64_t tp) {
  config::Config cfg = config::Config::load(std::string(SPMDX_SOURCE_DIR "/configs/") + config);
  cfg.override_value("parallelism.data_parallel_replicate_degree", std::to_string(replicate));
  cfg.override_value("parallelism.data_parallel_shard_degree", std::to_string(shard));
  cfg.override_value("parallelism.tensor_parallel_degree", std::to_string(tp));
  return job::job_spec(cfg, replicate * shard * tp, 256);
}

// The ILP's plan costs no more than the greedy one in the problem it solves, every choice it
// made is taken by the propagation, and the plan computes what the greedy plan does: the same
// graph outputs in the placements they must end in.
TEST(PropagateOptimal, NeverCostsMoreThanGreedyAndKeepsTheOutputs) {
  for (const auto& [config, r, s, t] : {std::tuple{"mlp_dp.toml", 4, 1, 1}, std::tuple{"mlp_dp.toml", 1, 2, 2}, std::tuple{"llama_fsdp.toml", 1, 2, 2},
                                        std::tuple{"llama_fsdp.toml", 2, 2, 1}}) {
    SCOPED_TRACE(std::string(config) + " " + std::to_string(r) + "x" + std::to_string(s) + "x" + std::to_string(t));
    const job::JobSpec spec = spec_of(config, r, s, t);
    const job::PlacedJob job = job::place_job(spec, registry());
    const auto greedy = job::propagate_job(job);
    std::vector<sharding::IntraOpDim> report;
    const auto planner = cbc();
    const auto optimal = job::propagate_job(job, *planner, sharding::IntraOpCostModel{}, &report);
    ASSERT_FALSE(report.empty());
    for (const auto& d : report) {
      EXPECT_LE(d.chosen_seconds, d.greedy_seconds * (1 + 1e-9)) << d.mesh_dim;
      EXPECT_GE(d.chosen_seconds, d.bound_seconds * (1 - 1e-6) - 1e-12) << d.mesh_dim;
      EXPECT_EQ(d.forced_kept, job.model.graph.num_nodes()) << d.mesh_dim << ": choices the propagation refused";
    }
    EXPECT_EQ(optimal.outputs, greedy.outputs);
    // Both plans run: rank 0's program has the same outputs and shapes.
    const ir::Graph a = job::rank_program(job, greedy, 0, spec), b = job::rank_program(job, optimal, 0, spec);
    for (const auto& [name, v] : a.outputs()) {
      ASSERT_NE(b.find_output(name), nullptr) << name;
      EXPECT_EQ(b.find_output(name)->meta().shape, v->meta().shape) << name;
    }
  }
}

TEST(Calibration, RoundTripsAndRefusesBadFilesNamingThem) {
  test::TempDir dir;
  plan::Calibration c;
  c.matmul_flops_per_second = 12.5e9;
  c.intra_host = {3e-6, 4e9};
  c.compute_source = "measured";
  plan::save_calibration(plan::calibration_path(dir.path()), c);
  const plan::Calibration back = plan::load_calibration(plan::calibration_path(dir.path()));
  EXPECT_DOUBLE_EQ(back.matmul_flops_per_second, 12.5e9);
  EXPECT_DOUBLE_EQ(back.intra_host.alpha, 3e-6);
  EXPECT_DOUBLE_EQ(back.intra_host.beta, 4e9);
  EXPECT_EQ(back.compute_source, "measured");
  std::ofstream(dir / "bad.json") << R"({"compute": {"matmul_flops_per_second": -1}})";
  try {
    plan::load_calibration(dir / "bad.json");
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("bad.json: compute.matmul_flops_per_second must be a number from 1000 to 1e+16; delete the file"));
  }
  std::ofstream(dir / "huge.json") << R"({"step": {"collective_seconds": 1e300}})";
  EXPECT_THROW(plan::load_calibration(dir / "huge.json"), std::invalid_argument);
  std::ofstream(dir / "null_links.json") << R"({"links": {"intra_host": null}})";  // was read as "not measured"
  try {
    plan::load_calibration(dir / "null_links.json");
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("null_links.json: links.intra_host is null, not an object; delete the file"));
  }
  std::ofstream(dir / "array.json") << "[1, 2]";
  EXPECT_THROW(plan::load_calibration(dir / "array.json"), std::invalid_argument);
  std::filesystem::create_directory(dir / "folder.json");
  EXPECT_THROW(plan::load_calibration(dir / "folder.json"), std::invalid_argument);
  EXPECT_DOUBLE_EQ(plan::load_calibration(dir / "missing.json").matmul_flops_per_second, plan::Calibration{}.matmul_flops_per_second);
}

// t = m alpha + b / beta, exactly: the fit gives alpha and beta back.
TEST(Calibration, FitsAlphaAndBetaOfTheRingModel) {
  std::vector<double> m, b, t;
  for (double bytes = 1024; bytes <= 64 << 20; bytes *= 4) m.push_back(6), b.push_back(bytes), t.push_back(6 * 8e-6 + bytes / 5e9);
  const auto fit = plan::fit_alpha_beta(m, b, t);
  EXPECT_NEAR(fit.alpha, 8e-6, 1e-9);
  EXPECT_NEAR(fit.beta, 5e9, 1e3);
  EXPECT_THROW(plan::fit_alpha_beta({1}, {8}, {1e-6}), std::invalid_argument);
}

// A run's exposed communication, less its bytes at the host link's beta, over its collectives.
TEST(Calibration, FitsTheCostOfACollectiveToARun) {
  test::TempDir dir;
  plan::Calibration c;
  c.intra_host.beta = 1e9;
  std::ofstream out(dir / "metrics.jsonl");
  out << R"({"step": 1, "exposed_comm_ms": 99, "comm_bytes": 0, "collectives": 1})" << "\n";  // warm-up, dropped
  for (int s = 2; s <= 6; ++s) out << R"({"step": )" << s << R"(, "exposed_comm_ms": 12.0, "comm_bytes": 2000000, "collectives": 10})" << "\n";
  out.close();
  const auto fitted = plan::fit_collective_seconds(c, dir / "metrics.jsonl", 1);
  EXPECT_NEAR(fitted.collective_seconds, (12e-3 - 2e-3) / 10, 1e-12);
  EXPECT_THAT(fitted.collective_source, HasSubstr("10 collectives a step"));
  std::ofstream(dir / "one.jsonl") << R"({"step": 1, "loss": 3})" << "\n";
  EXPECT_THROW(plan::fit_collective_seconds(c, dir / "one.jsonl"), std::invalid_argument);
}

// Mesh dims whose ranks span hosts take the inter-host link.
TEST(Calibration, LinksFollowTheHosts) {
  plan::Calibration c;
  const auto mesh = sharding::make_mesh({2, 4, 2, 1}, 16);  // dp_replicate 2 x dp_shard 4 x tp 2
  const auto links = plan::mesh_links(mesh, 8, c);
  ASSERT_EQ(links.size(), 3u);
  EXPECT_EQ(links[0].beta, c.inter_host.beta);  // stride 8: across the 2 hosts
  EXPECT_EQ(links[1].beta, c.intra_host.beta);
  EXPECT_EQ(links[2].beta, c.intra_host.beta);
}

// A rank's traffic counted from its program's collective nodes is what propagation's plan
// counted as it placed them (per mesh dim, bytes and ring messages; the program has up to 5%
// less with tp: llama tiny's program has one 16 KiB all_reduce fewer than the plan counted), so that a
// pipeline stage's program (which has only its own nodes) is priced as a whole step is.
TEST(Estimate, RankTrafficIsThePlansOwn) {
  for (const auto& [config, r, s, t] : {std::tuple{"mlp_dp.toml", 4, 1, 1}, std::tuple{"mlp_dp.toml", 1, 2, 2}, std::tuple{"llama_fsdp.toml", 1, 2, 2},
                                        std::tuple{"llama_fsdp.toml", 2, 2, 1}, std::tuple{"llama_fsdp.toml", 1, 1, 4}}) {
    SCOPED_TRACE(std::string(config) + " " + std::to_string(r) + "x" + std::to_string(s) + "x" + std::to_string(t));
    const job::JobSpec spec = spec_of(config, r, s, t);
    const job::PlacedJob job = job::place_job(spec, registry());
    const auto plan = job::propagate_job(job);
    const plan::Traffic traffic = plan::rank_traffic(job::rank_program(job, plan, 0, spec), job.mesh);
    ASSERT_EQ(traffic.bytes_by_dim.size(), plan.comm_bytes_by_dim.size());
    for (std::size_t d = 0; d < traffic.bytes_by_dim.size(); ++d) {
      EXPECT_LE(traffic.bytes_by_dim[d], plan.comm_bytes_by_dim[d] * (1 + 1e-9)) << "mesh dim " << d;
      EXPECT_GE(traffic.bytes_by_dim[d], plan.comm_bytes_by_dim[d] * 0.95) << "mesh dim " << d;
      EXPECT_LE(traffic.messages_by_dim[d], plan.comm_messages_by_dim[d]) << "mesh dim " << d;
      EXPECT_GE(traffic.messages_by_dim[d], plan.comm_messages_by_dim[d] * 0.95) << "mesh dim " << d;
      EXPECT_GT(traffic.bytes_by_dim[d], 0) << "mesh dim " << d;
    }
  }
}

// planning.target: a GPU's datasheet figures (dense: half the sparse headline) price a plan.
// A matmul in bfloat16 costs 2MNK at the tensor cores' peak, in float32 at the FP32 rate (TF32's
// with allow_tf32), a memory-bound op its bytes at the HBM bandwidth, each plus a launch; 8
// GPUs a host on NVLink, the dims past them on the NIC; 90% of the device's memory is the budget.
TEST(Estimate, AGpuTargetPricesAPlanAtItsDatasheetRates) {
  const plan::TargetProfile* h100 = plan::find_target("H100_SXM");
  ASSERT_NE(h100, nullptr);
  EXPECT_EQ(h100, plan::find_target("h100"));
  EXPECT_EQ(h100, plan::target_for_device_name("NVIDIA H100 80GB HBM3"));
  EXPECT_EQ(plan::target_for_device_name("NVIDIA H100 PCIe"), nullptr) << "another part, another peak";
  EXPECT_EQ(plan::find_target("this-machine"), nullptr);
  EXPECT_EQ(plan::find_target("a100"), nullptr);
  EXPECT_DOUBLE_EQ(h100->peak_flops("bfloat16", false), 989.4e12);  // the whitepaper's dense figure (datasheet: "1,979 teraFLOPS*", * with sparsity)
  EXPECT_DOUBLE_EQ(h100->peak_flops("float32", true), 494.7e12);
  EXPECT_DOUBLE_EQ(h100->peak_flops("float32", false), 66.9e12);
  EXPECT_DOUBLE_EQ(plan::find_target("b200")->peak_flops("bfloat16", false), 2.25e15);
  EXPECT_DOUBLE_EQ(plan::find_target("h200")->memory_bytes, 141e9);
  ir::Graph g;
  ir::Value* x = g.add_input("x", ir::TensorMeta{{64, 4096}, ir::DType::bf16, "cpu", false});
  ir::Value* w = g.add_input("w", ir::TensorMeta{{8192, 4096}, ir::DType::bf16, "cpu", false});
  g.add_output("y", g.add("linear", {x, w}));
  const double flops = 2.0 * 64 * 8192 * 4096;
  EXPECT_DOUBLE_EQ(plan::compute_seconds(g, h100->calibration("bfloat16", false)), 4e-6 + flops / 989.4e12);
  ir::Graph f;
  ir::Value* xf = f.add_input("x", ir::TensorMeta{{64, 4096}, ir::DType::f32, "cpu", false});
  ir::Value* wf = f.add_input("w", ir::TensorMeta{{8192, 4096}, ir::DType::f32, "cpu", false});
  f.add_output("y", f.add("linear", {xf, wf}));
  f.add_output("z", f.add("add", {xf, xf}));
  EXPECT_DOUBLE_EQ(plan::compute_seconds(f, h100->calibration("float32", false)), 4e-6 + flops / 66.9e12 + 4e-6 + 3.0 * 64 * 4096 * 4 / 3.35e12);
  EXPECT_DOUBLE_EQ(plan::compute_seconds(f, h100->calibration("float32", true)), 4e-6 + flops / 494.7e12 + 4e-6 + 3.0 * 64 * 4096 * 4 / 3.35e12);
  // 16 ranks as dp 2 x fsdp 8: fsdp within a host's NVLink, dp across hosts' NICs.
  const auto links = plan::mesh_links(sharding::DeviceMesh({{"dp_replicate", 2}, {"dp_shard", 8}}), h100->devices_per_host, h100->calibration("bfloat16", false));
  EXPECT_DOUBLE_EQ(links.at(0).beta, 50e9);   // 400 Gb/s
  EXPECT_DOUBLE_EQ(links.at(1).beta, 450e9);  // NVLink's 900 GB/s, both directions
  // A job's spec takes the target's memory as its budget, unless one is set.
  config::Config cfg = config::Config::load(SPMDX_SOURCE_DIR "/configs/llama_fsdp.toml");
  cfg.override_value("planning.target", "h200");
  EXPECT_EQ(job::job_spec(cfg, 4, 256).memory_budget, 126900000000) << "90% of its 141 GB";
  EXPECT_EQ(job::job_spec(cfg, 4, 256).planning_target, "h200");
  cfg.override_value("parallelism.memory_budget", "1GiB");
  EXPECT_EQ(job::job_spec(cfg, 4, 256).memory_budget, 1 << 30);
  const job::PlanningMachine m = job::planning_machine(job::job_spec(cfg, 4, 256), plan::Calibration{});
  EXPECT_EQ(m.ranks_per_host, 8);
  EXPECT_EQ(m.target, plan::find_target("h200"));
  EXPECT_THAT(m.calibration.compute_source, HasSubstr("target h200"));
}

// A pipelined step: the slowest stage's busy time stretched by the schedule's bubble, the
// largest stage's peak; the sends of each stage's program counted on pp, as stage_graph made them.
TEST(Estimate, APipelineStepIsTheSlowestStageOverItsBusyShare) {
  plan::StepEstimate a, b;
  a.compute_seconds = 2e-3, a.comm_seconds = 1e-3, a.step_seconds = 3e-3, a.peak_bytes = 500;
  b.compute_seconds = 4e-3, b.comm_seconds = 1e-3, b.step_seconds = 5e-3, b.peak_bytes = 300;
  const plan::StepEstimate e = plan::pipeline_step({a, b}, 0.2);
  EXPECT_DOUBLE_EQ(e.step_seconds, 5e-3 / 0.8);
  EXPECT_DOUBLE_EQ(e.bubble_seconds, 5e-3 * 0.25);
  EXPECT_DOUBLE_EQ(e.compute_seconds, 4e-3);
  EXPECT_EQ(e.peak_bytes, 500);
  EXPECT_EQ(e.stages, 2);
  EXPECT_EQ(e.stage_seconds, (std::vector<double>{3e-3, 5e-3}));
  EXPECT_THROW(plan::pipeline_step({a}, 1.0), std::invalid_argument);
  EXPECT_THROW(plan::pipeline_step({}, 0.0), std::invalid_argument);

  config::Config cfg = config::Config::load(SPMDX_SOURCE_DIR "/configs/llama_fsdp.toml");
  cfg.override_value("parallelism.pipeline_parallel_degree", "2");
  cfg.override_value("parallelism.data_parallel_shard_degree", "2");
  const job::JobSpec spec = job::job_spec(cfg, 4, 256);
  const job::PlacedJob job = job::place_job(spec, registry());
  const auto plan = job::propagate_job(job);
  const auto mesh = job::run_mesh(job);
  ASSERT_EQ(mesh.dims()[0].name, "pp");
  for (std::int64_t stage = 0; stage < 2; ++stage) {
    train::StageGraph staged;
    const ir::Graph g = job::rank_program(job, plan, stage * job.mesh.size(), spec, nullptr, &staged);
    const plan::Traffic t = plan::rank_traffic(g, mesh);
    EXPECT_EQ(t.bytes_by_dim[0], static_cast<double>(staged.bytes_sent)) << "stage " << stage;
    EXPECT_EQ(t.messages_by_dim[0], static_cast<double>(staged.sends)) << "stage " << stage;
    EXPECT_GT(t.bytes_by_dim[1], 0) << "stage " << stage << ": its gradients' reduce_scatter over dp_shard";
  }
  const plan::StepEstimate whole = job::estimate_job(spec, registry(), plan::Calibration{});
  EXPECT_EQ(whole.stages, 2);
  EXPECT_DOUBLE_EQ(whole.bubble_fraction, train::bubble_fraction(job.pipeline));
  EXPECT_NEAR(whole.step_seconds, *std::max_element(whole.stage_seconds.begin(), whole.stage_seconds.end()) / (1 - whole.bubble_fraction), 1e-12);
}

// Pipeline stages are enumerated up to the model's layers (llama tiny: 2), each layout with the
// microbatches of its data-parallel degree; a configured degree is kept; a model without
// layers (mlp) gets none.
TEST(AutoSharding, EnumeratesPipelineStagesUpToTheLayers) {
  test::TempDir dir;
  config::Config cfg = config::Config::load(SPMDX_SOURCE_DIR "/configs/llama_fsdp.toml");
  cfg.override_value("parallelism.strategy", "auto");
  cfg.override_value("parallelism.planner", "greedy");
  cfg.override_value("training.global_batch_size", "8");
  cfg.override_value("job.dump_folder", dir.path().string());
  const job::JobSpec spec = job::job_spec(cfg, 4, 256);
  ASSERT_EQ(spec.model.n_layers, 2);
  std::set<std::string> names;
  for (const auto& p : job::plan_auto(spec, registry(), plan::Calibration{}).plans) {
    SCOPED_TRACE(p.layout);
    ASSERT_EQ(p.error, "");
    names.insert(p.layout);
    EXPECT_EQ(p.stages * p.dims.dp_replicate * p.dims.dp_shard * p.dims.tp, 4);
    EXPECT_EQ(p.chosen.stages, p.stages);
    EXPECT_EQ(p.layers, 2);
    if (p.stages == 1) continue;
    EXPECT_EQ(p.microbatches, 8 / (p.dims.dp_replicate * p.dims.dp_shard));
    EXPECT_DOUBLE_EQ(p.chosen.bubble_fraction, 1.0 / (static_cast<double>(p.microbatches) + 1));
    EXPECT_EQ(p.chosen.stage_seconds.size(), 2u);
    EXPECT_GT(p.chosen.comm_bytes_by_dim.at(0), 0) << "the activations sent between the stages";
    EXPECT_EQ(p.extrapolated, p.microbatches > 4);
    // Priced as the ranks would run it (every microbatch unrolled): an extrapolated layout agrees.
    job::JobSpec exact = spec;
    exact.auto_strategy = false;
    exact.dims = p.dims;
    exact.pipeline.stages = 2;
    exact.step.microbatches = exact.pipeline.microbatches = p.microbatches;
    const plan::StepEstimate e = job::estimate_job(exact, registry(), plan::Calibration{});
    EXPECT_NEAR(p.chosen.step_seconds, e.step_seconds, 0.02 * e.step_seconds);
    EXPECT_NEAR(static_cast<double>(p.chosen.peak_bytes), static_cast<double>(e.peak_bytes), 0.05 * static_cast<double>(e.peak_bytes));
    EXPECT_EQ(p.chosen.comm_bytes_by_dim, e.comm_bytes_by_dim);
  }
  EXPECT_EQ(names, (std::set<std::string>{"dp_replicate 4", "dp_shard 4", "tp 4", "dp_replicate 2 x dp_shard 2", "dp_replicate 2 x tp 2", "dp_shard 2 x tp 2",
                                          "pp 2 x dp_replicate 2", "pp 2 x dp_shard 2", "pp 2 x tp 2"}));

  // A budget only pipelined layouts meet: auto chooses one, its stages and microbatches become
  // the job's, and auto_plan.json gives them back.
  std::int64_t flat = 0, piped = 0;
  for (const auto& p : job::plan_auto(spec, registry(), plan::Calibration{}).plans) {
    std::int64_t& least = p.stages == 1 ? flat : piped;
    least = least == 0 ? p.chosen.peak_bytes : std::min(least, p.chosen.peak_bytes);
  }
  ASSERT_LT(piped, flat);
  job::JobSpec budgeted = spec;
  budgeted.memory_budget = flat - 1;
  const job::AutoReport report = job::choose_auto(budgeted, registry());
  EXPECT_EQ(report.plans.front().stages, 2);
  EXPECT_FALSE(report.plans.front().extrapolated) << "the first is priced with every microbatch";
  {
    job::JobSpec exact = budgeted;
    exact.auto_strategy = false;
    exact.auto_choices.clear();
    EXPECT_EQ(report.plans.front().chosen.peak_bytes, job::estimate_job(exact, registry(), plan::Calibration{}).peak_bytes);
  }
  for (const auto& p : report.plans) EXPECT_TRUE(p.intra.empty() || p.fits) << p.layout << ": the planner ran on a layout over the budget";
  EXPECT_EQ(budgeted.pipeline.stages, 2);
  EXPECT_EQ(budgeted.step.microbatches, report.plans.front().microbatches);
  EXPECT_EQ(budgeted.pipeline.microbatches, report.plans.front().microbatches);
  EXPECT_THAT(budgeted.auto_report, HasSubstr("auto: chose pp 2 x "));
  EXPECT_THAT(budgeted.auto_report, HasSubstr("pipeline bubble"));
  job::JobSpec again = spec;
  again.memory_budget = flat - 1;
  job::choose_auto(again, registry());
  EXPECT_EQ(again.pipeline.stages, 2);
  EXPECT_EQ(again.dims.tp, budgeted.dims.tp);
  EXPECT_EQ(again.step.microbatches, budgeted.step.microbatches);
  const job::PlacedJob job = job::place_job(budgeted, registry());
  EXPECT_EQ(job::run_mesh(job).size(), 4);

  cfg.override_value("parallelism.pipeline_parallel_degree", "2");
  for (const auto& p : job::plan_auto(job::job_spec(cfg, 4, 256), registry(), plan::Calibration{}).plans) EXPECT_EQ(p.stages, 2) << p.layout;

  // More than 32 microbatches (global batch 128 over 2 data-parallel ranks in rows of 1): the
  // pipelined layout cannot run, naming the key that raises the rows.
  config::Config big = cfg;
  big.override_value("parallelism.pipeline_parallel_degree", "1");
  big.override_value("training.global_batch_size", "128");
  bool named = false;
  for (const auto& p : job::plan_auto(job::job_spec(big, 4, 256), registry(), plan::Calibration{}).plans) {
    if (p.layout == "pp 2 x dp_replicate 2") {
      EXPECT_THAT(p.error, HasSubstr("64 microbatches of 1 rows (parallelism.pipeline_parallel_microbatch_size), more than the 32"));
      named = true;
    }
  }
  EXPECT_TRUE(named) << "pp 2 x dp_replicate 2 was not listed";

  // Split points without a stage count: auto would split evenly over the stages it chooses, so
  // the key is refused rather than dropped.
  config::Config split = config::Config::load(SPMDX_SOURCE_DIR "/configs/llama_fsdp.toml");
  split.override_value("parallelism.strategy", "auto");
  split.override_value("parallelism.pipeline_parallel_split_points", "layers.1");
  try {
    job::job_spec(split, 4, 256);
    ADD_FAILURE() << "no error";
  } catch (const std::exception& e) {
    EXPECT_THAT(e.what(), HasSubstr("parallelism.pipeline_parallel_split_points is set, but parallelism.strategy = \"auto\" chooses the pipeline stages"));
  }

  config::Config mlp = config::Config::load(SPMDX_SOURCE_DIR "/configs/mlp_dp.toml");
  mlp.override_value("parallelism.strategy", "auto");
  mlp.override_value("parallelism.planner", "greedy");
  for (const auto& p : job::plan_auto(job::job_spec(mlp, 4, 256), registry(), plan::Calibration{}).plans) EXPECT_EQ(p.stages, 1) << p.layout;
}

// A budget under the data-parallel layouts' peak (parameters, gradients and AdamW state whole on
// every rank) makes auto pick a sharded one; an impossible one names every layout's peak.
TEST(AutoSharding, ABudgetThatExcludesDataParallelIsNotMetByIt) {
  test::TempDir dir;
  config::Config cfg = config::Config::load(SPMDX_SOURCE_DIR "/configs/llama_fsdp.toml");
  cfg.override_value("parallelism.strategy", "auto");
  cfg.override_value("job.dump_folder", dir.path().string());
  job::JobSpec spec = job::job_spec(cfg, 4, 256);
  const job::AutoReport all = job::plan_auto(spec, registry(), plan::Calibration{});
  std::int64_t dp_peak = 0, best_other = 0;
  for (const auto& p : all.plans) {
    ASSERT_EQ(p.error, "") << p.layout;
    if (p.layout == "dp_replicate 4") dp_peak = p.chosen.peak_bytes;
    else if (best_other == 0 || p.chosen.peak_bytes < best_other) best_other = p.chosen.peak_bytes;
  }
  ASSERT_GT(dp_peak, best_other);
  spec.memory_budget = (dp_peak + best_other) / 2;
  job::JobSpec chosen = spec;
  const job::AutoReport report = job::choose_auto(chosen, registry());
  EXPECT_NE(report.plans.front().layout, "dp_replicate 4");
  EXPECT_LE(report.plans.front().chosen.peak_bytes, spec.memory_budget);
  EXPECT_EQ(chosen.pipeline.stages * chosen.dims.dp_replicate * chosen.dims.dp_shard * chosen.dims.tp, 4);
  EXPECT_TRUE(std::filesystem::exists(dir / "auto_plan.json"));
  EXPECT_THAT(report.text(), HasSubstr("why: against"));
  // Kept and reused as written; edited by hand, planned again.
  job::JobSpec again = spec;
  job::choose_auto(again, registry());
  EXPECT_FALSE(chosen.auto_reused);
  EXPECT_TRUE(again.auto_reused) << "the second choice is read from auto_plan.json";
  EXPECT_EQ(again.dims.tp, chosen.dims.tp);
  EXPECT_EQ(again.dims.dp_shard, chosen.dims.dp_shard);
  EXPECT_EQ(again.auto_choices, chosen.auto_choices);
  {
    std::ifstream in(dir / "auto_plan.json");
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const auto at = text.find("\"dims\":[");
    ASSERT_NE(at, std::string::npos);
    text.replace(at, std::string("\"dims\":[").size(), "\"dims\":[4,1,1,1],\"old\":[");
    test::write_file(dir / "auto_plan.json", text);
  }
  job::JobSpec edited = spec;
  job::choose_auto(edited, registry());
  EXPECT_EQ(edited.dims.dp_replicate, chosen.dims.dp_replicate);
  EXPECT_EQ(edited.dims.dp_shard, chosen.dims.dp_shard);
  // Forged, the check recomputed as spmdx computes it: degrees whose product makes 4 ranks only
  // by overflowing (7 x 0x6DB6DB6DB6DB6DB7 is 1 modulo 2^64), then a value nested 100,000 deep
  // (the check's copy of it overflowed the stack). Each is refused and the job planned again.
  auto forged = [&](const std::function<std::string(nlohmann::json)>& forge, const std::string& why) {
    std::ifstream in(dir / "auto_plan.json");
    test::write_file(dir / "auto_plan.json", forge(nlohmann::json::parse(in)));
    job::JobSpec s = spec;
    testing::internal::CaptureStderr();
    job::choose_auto(s, registry());
    EXPECT_THAT(testing::internal::GetCapturedStderr(), HasSubstr("auto_plan.json: not the auto strategy's plan (" + why));
    EXPECT_EQ(s.dims.dp_replicate, chosen.dims.dp_replicate);
    EXPECT_EQ(s.dims.dp_shard, chosen.dims.dp_shard);
    EXPECT_EQ(s.dims.tp, chosen.dims.tp);
  };
  forged([](nlohmann::json j) {
    j["dims"] = {4, 1, 7, 1};
    j["stages"] = 0x6DB6DB6DB6DB6DB7LL;
    j.erase("check");
    j["check"] = std::to_string(std::hash<std::string>{}(j.dump()));
    return j.dump();
  }, "its degrees do not make 4 ranks");
  forged([](nlohmann::json j) { return "{\"deep\": " + std::string(100'000, '[') + std::string(100'000, ']') + ", " + j.dump().substr(1); },
         "JSON nested more than 256 arrays or objects deep");

  // Under every layout's peak but over one with full activation checkpointing: auto turns it on.
  job::JobSpec full = spec;
  full.activation_checkpoint = {"full", "op", false};
  std::int64_t least = 0, least_full = 0;
  for (const auto& p : all.plans) least = least == 0 ? p.chosen.peak_bytes : std::min(least, p.chosen.peak_bytes);
  for (const auto& p : job::plan_auto(full, registry(), plan::Calibration{}).plans) {
    least_full = least_full == 0 ? p.chosen.peak_bytes : std::min(least_full, p.chosen.peak_bytes);
  }
  ASSERT_LT(least_full, least);
  job::JobSpec checkpointed = spec;
  checkpointed.memory_budget = least - 1;
  std::filesystem::remove(dir / "auto_plan.json");
  const job::AutoReport with_ac = job::choose_auto(checkpointed, registry());
  EXPECT_NE(checkpointed.activation_checkpoint.mode, "none");
  EXPECT_LE(with_ac.plans.front().chosen.peak_bytes, checkpointed.memory_budget);
  EXPECT_THAT(checkpointed.auto_report, HasSubstr("activation_checkpoint.mode"));

  job::JobSpec tiny = spec;
  tiny.memory_budget = 1024;
  std::filesystem::remove(dir / "auto_plan.json");
  try {
    job::choose_auto(tiny, registry());
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("no layout of 4 ranks fits parallelism.memory_budget"));
    // The nearest layout first, six named, the rest counted (the search choose_auto made).
    const job::AutoReport searched = job::plan_auto(tiny, registry(), plan::Calibration{});
    ASSERT_GT(searched.plans.size(), 6u);
    const job::AutoPlan* least_peak = &searched.plans.front();
    for (const auto& p : searched.plans) {
      if (p.error.empty() && p.chosen.peak_bytes < least_peak->chosen.peak_bytes) least_peak = &p;
    }
    EXPECT_THAT(e.what(), HasSubstr("fits parallelism.memory_budget = 1.0 KiB (" + least_peak->layout + ": planned peak "));
    EXPECT_THAT(e.what(), HasSubstr("; and " + std::to_string(searched.plans.size() - 6) + " more layouts"));
  }
}

// The FSDP config as DDP over 3 ranks, 12 rows of 32 tokens, balance = "speed" at `speeds`.
config::Config ddp3_balanced(const std::string& speeds) {
  config::Config cfg = config::Config::load(SPMDX_SOURCE_DIR "/configs/llama_fsdp.toml");
  cfg.override_value("parallelism.data_parallel_replicate_degree", "3");
  cfg.override_value("parallelism.data_parallel_shard_degree", "1");
  cfg.override_value("training.global_batch_size", "12");
  cfg.override_value("training.local_batch_size", "4");
  cfg.override_value("training.seq_len", "32");
  cfg.override_value("parallelism.balance", "speed");
  cfg.override_value("parallelism.balance_speeds", speeds);
  return cfg;
}

// parallelism.balance = "speed" planned (spmdx compile --estimate): a rank's compute at speed 1
// is the line through the estimates of its plan at the even rows and at half of them, each
// rank's is that over its speed, and the balanced split is balanced_rows' of those, predicted
// shorter than the even one, whose slowest rank (speed 0.5) it gives the fewest rows.
TEST(AutoSharding, BalancePlansTheSplitOfTheGivenSpeeds) {
  config::Config cfg = ddp3_balanced("1,1,0.5");
  const job::JobSpec spec = job::job_spec(cfg, 3, 256);
  ASSERT_EQ(spec.balance.speeds, (std::vector<double>{1, 1, 0.5}));
  const plan::Calibration c{};
  const job::BalanceEstimate b = job::estimate_balance(spec, registry(), c);
  EXPECT_EQ(b.even, (std::vector<std::int64_t>{4, 4, 4}));
  const auto choices = job::balance_choices(spec, registry());
  const double at4 = job::estimate_job(job::rows_spec(spec, 4, choices), registry(), c).compute_seconds;
  const double at2 = job::estimate_job(job::rows_spec(spec, 2, choices), registry(), c).compute_seconds;
  EXPECT_GT(b.line.per_row, 0);
  EXPECT_NEAR(b.line.at(4), at4, 1e-9 * at4);
  EXPECT_NEAR(b.line.at(2), at2, 1e-9 * at2);
  std::vector<job::RankCost> costs;
  for (double v : b.speeds) costs.push_back({b.line.fixed / v, b.line.per_row / v});
  EXPECT_EQ(b.balanced, job::balanced_rows(12, costs));
  EXPECT_LT(b.balanced[2], b.balanced[0]);
  EXPECT_NEAR(b.even_seconds, costs[2].at(4) + b.comm_seconds, 1e-12);
  EXPECT_NEAR(b.balanced_seconds, job::predicted_seconds(b.balanced, costs) + b.comm_seconds, 1e-12);
  EXPECT_LT(b.balanced_seconds, b.even_seconds);
  // A speed per data-parallel rank, each a number > 0, and only with balance = "speed".
  cfg.override_value("parallelism.balance_speeds", "1,1");
  EXPECT_THROW(job::job_spec(cfg, 3, 256), config::ConfigError);
  cfg.override_value("parallelism.balance_speeds", "1,1,fast");
  EXPECT_THROW(job::job_spec(cfg, 3, 256), config::ConfigError);
  cfg.override_value("parallelism.balance_speeds", "1,1,0");
  EXPECT_THROW(job::job_spec(cfg, 3, 256), config::ConfigError);
  cfg.override_value("parallelism.balance_speeds", "1,1,1");
  cfg.override_value("parallelism.balance", "even");
  EXPECT_THROW(job::job_spec(cfg, 3, 256), config::ConfigError);
  // A speed may name a target profile: its peak FLOP/s (float32 here) over planning.target's,
  // or over the fastest named one without it.
  cfg.override_value("parallelism.balance", "speed");
  const double b200 = plan::find_target("b200")->peak_flops("float32", false), h100 = plan::find_target("h100-sxm")->peak_flops("float32", false);
  ASSERT_GT(b200, h100);
  cfg.override_value("parallelism.balance_speeds", "b200,h100-sxm,h100");
  EXPECT_THAT(job::job_spec(cfg, 3, 256).balance.speeds, ElementsAre(1.0, h100 / b200, h100 / b200));
  cfg.override_value("planning.target", "h100-sxm");
  cfg.override_value("parallelism.balance_speeds", "1,b200,0.5");
  EXPECT_THAT(job::job_spec(cfg, 3, 256).balance.speeds, ElementsAre(1.0, b200 / h100, 0.5));
  cfg.override_value("planning.target", "this-machine");
  EXPECT_THAT([&] { job::job_spec(cfg, 3, 256); }, ::testing::ThrowsMessage<config::ConfigError>(HasSubstr("mixes numbers and target names: set planning.target")));
}

// strategy = "auto" with balance = "speed": a speed per rank, folded to one per data-parallel
// rank of the layout auto chose (its slowest rank's); no pipelined layout; the line says the
// balanced split and its predicted step.
TEST(AutoSharding, AutoWithSpeedBalanceFoldsEachRanksSpeedAndReportsTheSplit) {
  test::TempDir dir;
  config::Config cfg = config::Config::load(SPMDX_SOURCE_DIR "/configs/llama_fsdp.toml");
  cfg.override_value("job.dump_folder", dir.path().string());
  cfg.override_value("parallelism.strategy", "auto");
  cfg.override_value("training.global_batch_size", "16");
  cfg.override_value("training.local_batch_size", "4");
  cfg.override_value("training.seq_len", "32");
  cfg.override_value("parallelism.balance", "speed");
  cfg.override_value("parallelism.balance_speeds", "1,0.8,0.5,1");
  job::JobSpec spec = job::job_spec(cfg, 4, 256);
  const job::AutoReport report = job::choose_auto(spec, registry());
  for (const auto& p : report.plans) EXPECT_EQ(p.stages, 1) << p.layout << ": a pipelined layout planned under balance = \"speed\"";
  const std::int64_t dp = spec.dims.dp_replicate * spec.dims.dp_shard, inner = spec.dims.tp * spec.dims.cp;
  ASSERT_EQ(static_cast<std::int64_t>(spec.balance.speeds.size()), dp);
  const std::vector<double> given{1, 0.8, 0.5, 1};
  for (std::int64_t i = 0; i < dp; ++i) {
    double slowest = 1e9;
    for (std::int64_t r = i * inner; r < (i + 1) * inner; ++r) slowest = std::min(slowest, given[static_cast<std::size_t>(r)]);
    EXPECT_EQ(spec.balance.speeds[static_cast<std::size_t>(i)], slowest) << "data-parallel rank " << i << " of " << spec.dims.dp_replicate << " x "
                                                                          << spec.dims.dp_shard << " x tp " << spec.dims.tp;
  }
  const job::BalanceEstimate b = job::estimate_balance(spec, registry(), plan::Calibration{});
  const std::string line = job::auto_balance_line(spec, registry());  // what rank 0 adds to the auto line, after "; "
  EXPECT_THAT(line, HasSubstr("balanced for data-parallel speeds "));
  EXPECT_THAT(line, HasSubstr("rows " + job::split_text(b.balanced) + ", predicted "));
  // Under auto the data-parallel ranks are not known before the layout: one speed a rank.
  cfg.override_value("parallelism.balance_speeds", "1,0.5");
  EXPECT_THAT([&] { job::job_spec(cfg, 4, 256); },
              ::testing::ThrowsMessage<config::ConfigError>(HasSubstr("with parallelism.strategy = \"auto\", give one a rank")));
}

// Under parallelism.memory_budget no data-parallel rank takes more rows than its plan fits:
// balance_max_rows bisects rank 0's planned peak; the estimate's splits keep to it.
TEST(AutoSharding, TheBalancedSplitKeepsEachRankWithinTheMemoryBudget) {
  config::Config cfg = ddp3_balanced("1,0.25,0.25");
  job::JobSpec spec = job::job_spec(cfg, 3, 256);
  const auto choices = job::balance_choices(spec, registry());
  auto peak = [&](std::int64_t rows) {
    const job::JobSpec s = job::rows_spec(spec, rows, choices);
    return job::plan_step(job::place_job(s, registry()), s, 0).memory.peak_bytes;
  };
  ASSERT_LT(peak(4), peak(6));
  ASSERT_LT(peak(6), peak(7)) << "the bound is meaningful only where a row more costs memory";
  const job::BalanceEstimate free = job::estimate_balance(spec, registry(), plan::Calibration{});
  EXPECT_EQ(free.max_rows, 0);
  ASSERT_GT(free.balanced[0], 6) << job::split_text(free.balanced) << ": without a budget the fast rank takes more than 6 rows";
  spec.memory_budget = peak(6);
  EXPECT_EQ(job::balance_max_rows(spec, registry(), choices), 6);
  const job::BalanceEstimate b = job::estimate_balance(spec, registry(), plan::Calibration{});
  EXPECT_EQ(b.max_rows, 6);
  for (const auto& split : {b.balanced, b.start}) {
    std::int64_t sum = 0;
    for (auto r : split) {
      EXPECT_LE(r, 6) << job::split_text(split);
      sum += r;
    }
    EXPECT_EQ(sum, 12);
  }
  spec.memory_budget = peak(12);
  EXPECT_EQ(job::balance_max_rows(spec, registry(), choices), 0) << "every count fits: no bound";
}

}  // namespace
}  // namespace spmdx
