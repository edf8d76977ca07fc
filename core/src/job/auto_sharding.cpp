#include "spmdx/job/auto_sharding.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <limits>
#include <set>
#include <tuple>
#include <sstream>
#include <stdexcept>

#include "spmdx/core/log.h"
#include "spmdx/files.h"
#include "spmdx/launch/launcher.h"
#include "spmdx/plan/memory_plan.h"
#include "spmdx/plan/runtime_plan.h"
#include "spmdx/sharding/redistribute.h"
#include "spmdx/text.h"
#include "spmdx/job/compile.h"
#include "spmdx/job/memory_budget.h"
#include "spmdx/train/pipeline.h"

namespace spmdx::job {
using namespace spmdx::train;
namespace {

using Clock = std::chrono::steady_clock;

// The layouts, best by propagation's plan, whose op placements the planner then chooses.
constexpr std::size_t kPlannerLayouts = 4;
// The planner's plan replaces propagation's only when predicted this much faster: below it the
// cost model cannot tell (bench/auto_sharding.sh: on mlp dp 4 a plan predicted 0.6% faster
// measured 20% slower), and propagation's plan is the one every other test runs.
constexpr double kPlannerGain = 0.02;
// A pipelined layout of more microbatches than this is priced at 2 and 3 and extrapolated (its
// step graph unrolls every microbatch: 1,024 ranks make hundreds), and keeps propagation's plan.
constexpr std::int64_t kPricedMicrobatches = 4;
// The most microbatches of a pipelined layout auto considers: its step graph unrolls each, and
// 1,024 ranks of a 32-layer model at 256 ran out of memory (24 GB) when priced exactly.
constexpr std::int64_t kMostPipelineMicrobatches = 32;
// Pipelined layouts priced when some layout fits the budget (each takes a second at 1,024 ranks
// of a 32-layer model, against 0.1 s for one without stages).
constexpr std::size_t kPipelineLayouts = 4;

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::string layout_of(const sharding::ParallelDims& d, std::int64_t stages) {
  std::string out;
  auto add = [&](const char* name, std::int64_t k) {
    if (k > 1) out += (out.empty() ? "" : " x ") + std::string(name) + " " + std::to_string(k);
  };
  add("pp", stages);
  add("dp_replicate", d.dp_replicate);
  add("dp_shard", d.dp_shard);
  add("cp", d.cp);
  add("tp", d.tp);
  return out.empty() ? "one rank" : out;
}

// The mesh a layout's ranks run on (pp outermost with stages), for its dims' names.
sharding::DeviceMesh layout_mesh(const AutoPlan& p) {
  const auto mesh = sharding::make_mesh(p.dims, p.dims.dp_replicate * p.dims.dp_shard * p.dims.tp * p.dims.cp);
  return p.stages > 1 ? pipeline_mesh(mesh, p.stages) : mesh;
}

std::string ms(double seconds) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f", seconds * 1e3);
  return text;
}

// The layouts of `ranks` ranks: every dp_replicate x dp_shard x tp (tp innermost), fewest
// tensor-parallel ranks first.
std::vector<sharding::ParallelDims> layouts(std::int64_t ranks, std::int64_t cp) {
  std::vector<sharding::ParallelDims> out;
  for (std::int64_t tp = 1; tp <= ranks; ++tp) {
    if (ranks % tp != 0) continue;
    for (std::int64_t shard = 1; shard <= ranks / tp; ++shard) {
      if ((ranks / tp) % shard != 0) continue;
      out.push_back({ranks / tp / shard, shard, tp, cp});
    }
  }
  return out;
}

// What a plan of `job` costs: rank 0's program, its memory plan and estimate, and the collectives
// it runs; with pipeline stages, a rank's of each stage (of the first, the second and the last
// when more than 3 stages split the layers evenly: the middle stages hold no more layers and no
// more microbatches in flight than the second), by stage.
std::map<std::int64_t, plan::StepEstimate> measure_stages(const PlacedJob& job, const JobSpec& spec, const sharding::DistributedPlan& plan,
                                                          const plan::Calibration& c, std::int64_t ranks_per_host, std::int64_t cores,
                                                          std::map<std::string, std::int64_t>* collectives, bool every_stage = false) {
  const sharding::DeviceMesh mesh = run_mesh(job);
  const std::int64_t last = job.pipeline.stages - 1;
  std::set<std::int64_t> priced;
  for (std::int64_t stage = 0; stage <= last; ++stage) {
    if (every_stage || last < 3 || !spec.pipeline_split_points.empty() || stage <= 1 || stage == last) priced.insert(stage);
  }
  std::map<std::int64_t, plan::StepEstimate> out;
  if (collectives != nullptr) collectives->clear();
  auto price = [&](const ir::Graph& graph, std::int64_t stage) {
    const plan::RuntimePlan runtime = plan::make_runtime_plan(graph, mesh, spec.plan);
    const plan::MemoryPlan memory = plan::plan_memory(graph, runtime);
    if (collectives != nullptr && stage == 0) {
      for (const auto& n : graph.nodes()) {
        if (sharding::is_collective(n->op())) ++(*collectives)[n->op()];
      }
    }
    out[stage] = plan::estimate_step(graph, mesh, plan::rank_traffic(graph, mesh), c, ranks_per_host, cores, memory.peak_bytes, runtime.issues);
  };
  // Each stage's first rank holds position 0 of its stage's mesh: one rank graph, cut per stage (rank_program).
  const ir::Graph whole = rank_step_graph(plan, 0, spec);
  for (const std::int64_t stage : priced) {
    if (job.pipeline.stages == 1) price(whole, stage);
    else price(stage_graph(whole, job.pipeline, job.model.params, stage * job.mesh.size(), job.mesh.size()).graph, stage);
  }
  return out;
}

plan::StepEstimate combine(const PipelineSpec& pipeline, const std::map<std::int64_t, plan::StepEstimate>& stages) {
  if (pipeline.stages <= 1) return stages.begin()->second;
  std::vector<plan::StepEstimate> each;
  for (const auto& [stage, e] : stages) each.push_back(e);
  plan::StepEstimate e = plan::pipeline_step(each, bubble_fraction(pipeline));
  e.stages = pipeline.stages;
  for (const auto& [stage, one] : stages) e.priced_stages.push_back(stage);
  return e;
}

plan::StepEstimate measure(const PlacedJob& job, const JobSpec& spec, const sharding::DistributedPlan& plan, const plan::Calibration& c,
                           std::int64_t ranks_per_host, std::int64_t cores, std::map<std::string, std::int64_t>* collectives, bool every_stage = false) {
  return combine(job.pipeline, measure_stages(job, spec, plan, c, ranks_per_host, cores, collectives, every_stage));
}

// The most microbatches `stage` holds activations of at once under `pipeline`'s schedule.
std::int64_t in_flight(const PipelineSpec& pipeline, std::int64_t stage) {
  std::int64_t alive = 0, most = 0;
  const auto schedule = pipeline_schedule(pipeline);
  for (const auto& a : schedule.at(static_cast<std::size_t>(stage))) {
    alive += a.forward ? 1 : -1;
    most = std::max(most, alive);
  }
  return most;
}

// The two microbatch counts a pipelined layout of many is priced at: 2 and 3, or for
// Interleaved1F1B (microbatches in groups of the stages) the stages and twice them.
std::pair<std::int64_t, std::int64_t> priced_microbatches(const PipelineSpec& pipeline) {
  return pipeline.schedule == "Interleaved1F1B" ? std::pair{pipeline.stages, 2 * pipeline.stages} : std::pair<std::int64_t, std::int64_t>{2, 3};
}

// A pipelined layout of `pipeline.microbatches` microbatches priced from the same layout at the
// two counts of priced_microbatches (`at_a`, `at_b`, of the same rows each, planned alike): every
// microbatch adds the same nodes and collectives, so time, bytes and calls grow linearly in the
// microbatches, and the peak in the microbatches a stage holds in flight (in_flight).
std::map<std::int64_t, plan::StepEstimate> extrapolate(const PipelineSpec& pipeline, const std::map<std::int64_t, plan::StepEstimate>& at_a,
                                                       const std::map<std::int64_t, plan::StepEstimate>& at_b) {
  PipelineSpec pa = pipeline, pb = pipeline;
  std::tie(pa.microbatches, pb.microbatches) = priced_microbatches(pipeline);
  const double m = static_cast<double>(pipeline.microbatches - pa.microbatches) / static_cast<double>(pb.microbatches - pa.microbatches);
  auto line = [&](double a, double b, double k) { return a + k * (b - a); };
  std::map<std::int64_t, plan::StepEstimate> out;
  for (const auto& [stage, a] : at_a) {
    const plan::StepEstimate& b = at_b.at(stage);
    plan::StepEstimate e = b;
    e.compute_seconds = line(a.compute_seconds, b.compute_seconds, m);
    e.comm_seconds = line(a.comm_seconds, b.comm_seconds, m);
    e.step_seconds = e.compute_seconds + e.comm_seconds;
    for (std::size_t d = 0; d < e.comm_seconds_by_dim.size(); ++d) {
      e.comm_seconds_by_dim[d] = line(a.comm_seconds_by_dim[d], b.comm_seconds_by_dim[d], m);
      e.comm_bytes_by_dim[d] = line(a.comm_bytes_by_dim[d], b.comm_bytes_by_dim[d], m);
    }
    e.issues = static_cast<std::int64_t>(std::llround(line(static_cast<double>(a.issues), static_cast<double>(b.issues), m)));
    e.nodes = static_cast<std::int64_t>(std::llround(line(static_cast<double>(a.nodes), static_cast<double>(b.nodes), m)));
    const std::int64_t k2 = in_flight(pa, stage), k3 = in_flight(pb, stage), k = in_flight(pipeline, stage);
    e.peak_bytes = k3 > k2 ? static_cast<std::int64_t>(std::llround(line(static_cast<double>(a.peak_bytes), static_cast<double>(b.peak_bytes),
                                                                         static_cast<double>(k - k2) / static_cast<double>(k3 - k2))))
                           : b.peak_bytes;
    out[stage] = e;
  }
  return out;
}

// `s` with `stages` pipeline stages over its data-parallel degree (s.dims): the microbatches are
// the global batch over the data-parallel ranks in pipeline_microbatch_size rows, as read_pipeline
// makes them (an exported program's are fixed); stages the search chose split the layers evenly.
// Throws std::invalid_argument when the batch does not split so.
void pipeline_layout(JobSpec& s, std::int64_t stages) {
  if (stages == s.pipeline.stages && stages == 1) return;
  if (stages != s.pipeline.stages) {  // chosen, not configured: an even split
    s.pipeline_split_points.clear();
    s.pipeline_layers_per_stage = -1;
  }
  s.pipeline.stages = stages;
  if (stages == 1 || s.model.name == "pt2") {
    s.pipeline.microbatches = s.step.microbatches;
    return;
  }
  const std::int64_t dp = s.dims.dp_replicate * s.dims.dp_shard, rows = std::max<std::int64_t>(1, s.pipeline_microbatch_size);
  if (s.global_batch_size % (dp * rows) != 0) {
    throw std::invalid_argument("training.global_batch_size " + std::to_string(s.global_batch_size) + " does not split into microbatches of " +
                                std::to_string(rows) + " rows (parallelism.pipeline_parallel_microbatch_size) on " + std::to_string(dp) + " data-parallel ranks");
  }
  s.step.microbatches = s.pipeline.microbatches = std::max<std::int64_t>(1, s.global_batch_size / (dp * rows));
  if (s.pipeline.microbatches > kMostPipelineMicrobatches) {
    throw std::invalid_argument(std::to_string(s.pipeline.microbatches) + " microbatches of " + std::to_string(rows) +
                                " rows (parallelism.pipeline_parallel_microbatch_size), more than the " + std::to_string(kMostPipelineMicrobatches) +
                                " the auto strategy plans (the step graph unrolls each): raise pipeline_parallel_microbatch_size");
  }
  if (s.pipeline.schedule == "Interleaved1F1B" && s.pipeline.microbatches % stages != 0) {
    throw std::invalid_argument("Interleaved1F1B runs microbatches in groups of the " + std::to_string(stages) + " stages, and the global batch makes " +
                                std::to_string(s.pipeline.microbatches));
  }
}

// The layout planned by propagation alone (planner == nullptr), or refined by the planner.
AutoPlan plan_layout(const JobSpec& spec, const sharding::ParallelDims& dims, std::int64_t stages, PluginRegistry& registry, const spmdx::Planner* planner,
                     const plan::Calibration& c, std::int64_t ranks_per_host, std::int64_t cores, const AutoPlan* greedy_done = nullptr,
                     bool may_extrapolate = true) {
  const auto t0 = Clock::now();
  AutoPlan out = greedy_done != nullptr ? *greedy_done : AutoPlan{};
  out.dims = dims;
  out.stages = stages;
  out.layout = layout_of(dims, stages);
  JobSpec s = spec;
  s.dims = dims;
  s.strategies.clear();
  s.fallback_strategies.clear();
  s.auto_choices.clear();
  s.auto_strategy = false;
  try {
    pipeline_layout(s, stages);
    out.microbatches = s.step.microbatches;
    out.schedule = s.pipeline.schedule;
    const auto [ma, mb] = priced_microbatches(s.pipeline);
    out.extrapolated = may_extrapolate && stages > 1 && out.microbatches > std::max(kPricedMicrobatches, mb);
    if (out.extrapolated && greedy_done == nullptr) {  // priced at ma and mb microbatches of the same rows
      std::map<std::int64_t, plan::StepEstimate> at[2];
      std::map<std::string, std::int64_t> collectives[2];
      PipelineSpec pipeline;
      for (int i = 0; i < 2; ++i) {
        JobSpec few = s;
        few.step.microbatches = few.pipeline.microbatches = i == 0 ? ma : mb;
        few.global_batch_size = s.global_batch_size / s.step.microbatches * few.step.microbatches;
        const CompiledJob compiled = compile_job(few, registry);
        const PlacedJob& job = compiled.job;
        for (const auto& p : job.model.params) out.layers = std::max(out.layers, layer_of(p) + 1);
        at[i] = measure_stages(job, few, compiled.plan, c, ranks_per_host, cores, &collectives[i]);
        pipeline = job.pipeline;
      }
      pipeline.microbatches = out.microbatches;
      out.greedy = out.chosen = combine(pipeline, extrapolate(pipeline, at[0], at[1]));
      for (const auto& [op, kb] : collectives[1]) {
        out.collectives[op] = collectives[0][op] + (out.microbatches - ma) * (kb - collectives[0][op]) / (mb - ma);
      }
      out.fits = spec.memory_budget <= 0 || out.chosen.peak_bytes <= spec.memory_budget;
      out.plan_seconds += since(t0);
      return out;
    }
    if (out.extrapolated) return out;  // the planner's node choices would not name the nodes of the step the ranks build
    const PlacedJob job = place_job(s, registry);
    for (const auto& p : job.model.params) out.layers = std::max(out.layers, layer_of(p) + 1);
    if (greedy_done == nullptr) {
      const sharding::DistributedPlan greedy = propagate_job(job);
      out.greedy = measure(job, s, greedy, c, ranks_per_host, cores, &out.collectives);
      out.chosen = out.greedy;
    }
    if (planner != nullptr && job.mesh.size() > 1) {
      const plan::StepEstimate shape = out.greedy;
      sharding::IntraOpCostModel model;
      model.links = plan::mesh_links(job.mesh, ranks_per_host, c);
      const double speed = static_cast<double>(shape.threads) / shape.core_sharing;
      model.flops_per_second = c.matmul_flops_per_second * speed;
      model.bytes_per_second = c.memory_bytes_per_second * speed;
      model.time_limit_seconds = spec.planner_time_limit;
      model.collective_seconds = c.collective_seconds;
      const sharding::DistributedPlan optimal = propagate_job(job, *planner, model, &out.intra);
      std::map<std::string, std::int64_t> collectives;
      const plan::StepEstimate e = measure(job, s, optimal, c, ranks_per_host, cores, &collectives);
      if (e.step_seconds < out.greedy.step_seconds * (1 - kPlannerGain)) {
        out.chosen = e;
        out.planner_kept = true;
        out.collectives = std::move(collectives);
        out.choices = plan_choices(optimal);
      }
    }
    out.fits = spec.memory_budget <= 0 || out.chosen.peak_bytes <= spec.memory_budget;
  } catch (const std::invalid_argument& e) {
    out.error = e.what();
  } catch (const ir::IrError& e) {
    out.error = e.what();
  }
  out.plan_seconds += since(t0);
  return out;
}

// A check of auto_plan.json's content (every field but itself), so that a file edited by hand
// is planned again rather than trusted: the same binary reads what it wrote.
std::string plan_check(nlohmann::json j) {
  j.erase("check");
  return std::to_string(std::hash<std::string>{}(j.dump()));
}

int rank_class(const AutoPlan& p) { return !p.error.empty() ? 2 : p.fits ? 0 : 1; }

// The job's identity for auto_plan.json: what the search depends on besides the layouts.
std::string search_key(const JobSpec& spec, const plan::Calibration& c) {
  std::ostringstream key;
  const auto& m = spec.model;
  key << m.name << "/" << m.flavor << "/" << m.path << "/" << m.vocab_size << " dim " << m.dim << " layers " << m.n_layers << " heads " << m.n_heads << "/"
      << m.n_kv_heads << " ffn " << m.ffn_hidden << " mask " << m.attn_mask_type << " loss " << m.loss << " inputs " << m.inputs.size() << " world " << spec.world_size
      << " batch " << spec.global_batch_size << " seq " << spec.seq_len << " micro " << spec.step.microbatches << " cp " << spec.dims.cp << " budget "
      << spec.memory_budget << " planner " << spec.planner << " " << spec.planner_time_limit << " sp " << spec.sequence_parallel << " lp "
      << spec.loss_parallel << " ac " << spec.activation_checkpoint.mode << " mp " << spec.mixed_precision.param << " rsf " << spec.reshard_after_forward
      << " overlap " << spec.plan.overlap << " bucket " << spec.plan.bucket_bytes << " ranks/host " << planning_ranks_per_host(spec.world_size)
      << " cores " << launch::usable_cpus() << " stages " << spec.pipeline.stages << " schedule " << spec.pipeline.schedule << " rows "
      << spec.pipeline_microbatch_size << " layers/stage " << spec.pipeline_layers_per_stage << " tp_plan " << spec.tp_plan.size() << " balance " << spec.balance.speed << " " << c.to_json();
  for (const auto& split : spec.pipeline_split_points) key << " split " << split;
  for (const auto& [glob, how] : spec.tp_plan) key << " " << glob << "=" << how;
  return key.str();
}

}  // namespace

std::int64_t planning_ranks_per_host(std::int64_t world_size) {
  if (const char* v = std::getenv("LOCAL_WORLD_SIZE"); v != nullptr && *v != '\0') {
    char* end = nullptr;
    const long n = std::strtol(v, &end, 10);
    if (*end == '\0' && n >= 1) return n;
  }
  return world_size <= 64 ? world_size : 8;
}

PlanningMachine planning_machine(const JobSpec& spec, const plan::Calibration& measured) {
  if (const plan::TargetProfile* t = plan::find_target(spec.planning_target)) {
    return {t->calibration(spec.mixed_precision.param, spec.device.allow_tf32), t->devices_per_host, t->devices_per_host, t};
  }
  return {measured, planning_ranks_per_host(spec.world_size), launch::usable_cpus(), nullptr};
}

AutoReport plan_auto(const JobSpec& spec, PluginRegistry& registry, const plan::Calibration& measured) {
  const auto t0 = Clock::now();
  const PlanningMachine machine = planning_machine(spec, measured);
  const plan::Calibration& c = machine.calibration;
  AutoReport report;
  report.world_size = spec.world_size;
  report.ranks_per_host = machine.ranks_per_host;
  report.cores = machine.cores;
  report.memory_budget = spec.memory_budget;
  report.planner = spec.planner;
  report.calibration = c;
  std::unique_ptr<spmdx::Planner> planner;
  if (spec.planner != "greedy") planner = registry.make_planner(spec.planner);
  const std::int64_t ranks = spec.world_size / spec.dims.cp;
  auto by_rank = [&] {
    std::stable_sort(report.plans.begin(), report.plans.end(), [](const AutoPlan& a, const AutoPlan& b) {
      if (rank_class(a) != rank_class(b)) return rank_class(a) < rank_class(b);
      return rank_class(a) < 2 && a.chosen.step_seconds < b.chosen.step_seconds;
    });
  };
  // Every layout by propagation, then the planner on the best few of them (Alpa's outer loop
  // prunes alike): the ILP of a large graph takes seconds a mesh dim.
  // Without pipeline stages (or with the configured ones), every layout.
  const bool configured_stages = spec.pipeline.stages > 1;
  std::int64_t layers = 0;
  for (const auto& dims : layouts(ranks / spec.pipeline.stages, spec.dims.cp)) {
    report.plans.push_back(plan_layout(spec, dims, spec.pipeline.stages, registry, nullptr, c, report.ranks_per_host, report.cores));
    layers = std::max(layers, report.plans.back().layers);
    SPMDX_DEBUG("auto: " << report.plans.back().layout << " planned in " << report.plans.back().plan_seconds << " s");
  }
  // Then pipelined layouts: every stage count the model's layers allow (a stage holds at least
  // one layer, two with Interleaved1F1B), tensor parallel within a host (as Megatron-LM places
  // it), in the order of the layout whose data-parallel replicas the stages replace (pp x
  // dp_replicate x dp_shard x tp against pp.dp_replicate x dp_shard x tp), the first
  // kPipelineLayouts of them; the rest only when none of those fits the budget.
  // parallelism.balance = "speed" splits the batch over data-parallel ranks, which pipeline
  // stages cannot do yet: no pipelined layout then.
  if (!configured_stages && !spec.balance.speed) {
    std::map<std::string, double> flat;
    for (const auto& p : report.plans) {
      if (p.error.empty()) flat[layout_of(p.dims, 1)] = p.chosen.step_seconds;
    }
    const std::int64_t per_chunk = spec.pipeline.schedule == "Interleaved1F1B" ? 2 : 1;
    std::vector<std::tuple<double, std::int64_t, sharding::ParallelDims>> piped;
    for (std::int64_t stages = 2; stages <= ranks && stages * per_chunk <= layers; ++stages) {
      if (ranks % stages != 0) continue;
      for (const auto& dims : layouts(ranks / stages, spec.dims.cp)) {
        if (dims.tp > report.ranks_per_host) continue;
        sharding::ParallelDims replicas = dims;
        replicas.dp_replicate *= stages;
        const auto it = flat.find(layout_of(replicas, 1));
        piped.emplace_back(it == flat.end() ? std::numeric_limits<double>::infinity() : it->second, stages, dims);
      }
    }
    std::stable_sort(piped.begin(), piped.end(), [](const auto& a, const auto& b) { return std::get<0>(a) < std::get<0>(b); });
    for (std::size_t i = 0; i < piped.size(); ++i) {
      if (i == kPipelineLayouts && std::any_of(report.plans.begin(), report.plans.end(), [](const AutoPlan& p) { return rank_class(p) == 0; })) {
        report.pipeline_layouts_skipped = piped.size() - i;
        break;
      }
      const auto& [proxy, stages, dims] = piped[i];
      report.plans.push_back(plan_layout(spec, dims, stages, registry, nullptr, c, report.ranks_per_host, report.cores));
      SPMDX_DEBUG("auto: " << report.plans.back().layout << " planned in " << report.plans.back().plan_seconds << " s");
    }
  }
  // A pipelined layout priced by extrapolation that ranks first is priced again with every
  // microbatch (its extrapolated peak can be 10% low: llama tiny pp 4), until the first is exact.
  auto exact_first = [&] {
    for (by_rank(); report.plans.front().extrapolated && report.plans.front().error.empty(); by_rank()) {
      AutoPlan& p = report.plans.front();
      p = plan_layout(spec, p.dims, p.stages, registry, nullptr, c, report.ranks_per_host, report.cores, nullptr, false);
    }
  };
  exact_first();
  // The planner on the best layouts within the budget (it has no memory term: it cannot make
  // one fit), within parallelism.planner_time_limit_seconds for all of them: each mesh dim's
  // solver gets what is left.
  if (planner != nullptr) {
    const auto planning = Clock::now();
    std::size_t planned = 0;
    for (std::size_t r = 0; r < report.plans.size() && planned < kPlannerLayouts; ++r) {
      const double left = spec.planner_time_limit - since(planning);
      if (rank_class(report.plans[r]) != 0 || left <= 0) break;
      if (report.plans[r].extrapolated) continue;
      JobSpec s = spec;
      s.planner_time_limit = left;
      report.plans[r] = plan_layout(s, report.plans[r].dims, report.plans[r].stages, registry, planner.get(), c, report.ranks_per_host, report.cores,
                                    &report.plans[r]);
      ++planned;
    }
    exact_first();
  }
  report.seconds = since(t0);
  return report;
}

namespace {

// balance_speeds given per rank (the data-parallel ranks were not known before the layout)
// become one per data-parallel rank of the chosen layout: its slowest rank's, as the balancer
// measures it (a rank's index is rank / (cp x tp) in the mesh's order dp_replicate, dp_shard,
// cp, tp).
void fold_rank_speeds(JobSpec& spec) {
  if (spec.balance.speeds.empty()) return;
  const std::int64_t dp = spec.dims.dp_replicate * spec.dims.dp_shard, inner = spec.dims.cp * spec.dims.tp;
  std::vector<double> per_index(static_cast<std::size_t>(dp), std::numeric_limits<double>::infinity());
  for (std::size_t r = 0; r < spec.balance.speeds.size(); ++r) {
    double& v = per_index[static_cast<std::size_t>(static_cast<std::int64_t>(r) / inner)];
    v = std::min(v, spec.balance.speeds[r]);
  }
  spec.balance.speeds = per_index;
}

}  // namespace

std::string auto_balance_line(const JobSpec& spec, PluginRegistry& registry) {
  if (spec.dims.dp_replicate * spec.dims.dp_shard == 1) return "parallelism.balance = \"speed\": this layout has one data-parallel rank, so there is no batch to split";
  if (spec.balance.speeds.empty()) return "parallelism.balance = \"speed\": the split follows the ranks' measured speeds from the first steps";
  const BalanceEstimate b = estimate_balance(spec, registry, plan::load_calibration(plan::calibration_path(spec.output.dump_folder)));
  char out[512];
  std::snprintf(out, sizeof out, "balanced for data-parallel speeds %s (parallelism.balance_speeds; a data-parallel rank at its slowest rank's): rows %s, "
                "predicted %.2f ms a step against %.2f ms even (%.2fx)", speeds_text(b.speeds).c_str(), split_text(b.balanced).c_str(), b.balanced_seconds * 1e3,
                b.even_seconds * 1e3, b.balanced_seconds / std::max(1e-12, b.even_seconds));
  std::string text = out;
  if (b.start != b.balanced) {
    std::snprintf(out, sizeof out, "; the run starts from %s (rows in proportion to the speeds: %.2f ms predicted) and re-plans from measured steps",
                  split_text(b.start).c_str(), b.start_seconds * 1e3);
    text += out;
  }
  return text;
}

AutoReport choose_auto(JobSpec& spec, PluginRegistry& registry) {
  const plan::Calibration c = planning_machine(spec, plan::load_calibration(plan::calibration_path(spec.output.dump_folder))).calibration;
  const std::string key = search_key(spec, c);
  const std::filesystem::path kept = spec.output.dump_folder / "auto_plan.json";
  AutoReport report;
  bool reused = false;
  std::error_code ec;
  if (std::filesystem::exists(kept, ec) && !std::filesystem::is_regular_file(kept, ec)) {
    throw std::invalid_argument(kept.string() + ": not a regular file (a folder, a pipe?): remove it; the auto strategy keeps its plan there");
  }
  if (std::filesystem::exists(kept, ec)) {
    try {
      const std::string text = read_file_bytes(kept);
      check_json_nesting(text);
      const auto j = nlohmann::json::parse(text);
      if (j.at("format") != "spmdx.auto_plan/2") throw std::invalid_argument("format " + j.at("format").dump() + " is not spmdx.auto_plan/2");
      if (j.at("key") == key && j.at("check") != plan_check(j)) throw std::invalid_argument("it was changed after spmdx wrote it (its check does not match)");
      if (j.at("key") == key) {
        report.world_size = spec.world_size;
        report.planner = spec.planner;
        report.calibration = c;
        AutoPlan p;
        p.dims = {j.at("dims").at(0), j.at("dims").at(1), j.at("dims").at(2), j.at("dims").at(3)};
        p.stages = j.at("stages");
        p.microbatches = j.at("microbatches");
        // Each degree within the world first: their product must not overflow (a forged file).
        const auto degree = [&](std::int64_t d) { return d >= 1 && d <= spec.world_size; };
        if (!degree(p.dims.dp_replicate) || !degree(p.dims.dp_shard) || !degree(p.dims.tp) || p.dims.cp != spec.dims.cp || !degree(p.stages) ||
            (spec.pipeline.stages > 1 && p.stages != spec.pipeline.stages) || p.microbatches < 1 ||
            p.dims.dp_replicate * p.dims.dp_shard * p.dims.tp * p.dims.cp * p.stages != spec.world_size) {
          throw std::invalid_argument("its degrees do not make " + std::to_string(spec.world_size) + " ranks");
        }
        JobSpec s = spec;  // the microbatches its layout makes
        s.dims = p.dims;
        pipeline_layout(s, p.stages);
        if (s.step.microbatches != p.microbatches) throw std::invalid_argument("its microbatches are not those of its layout");
        p.layout = layout_of(p.dims, p.stages);
        p.planner_kept = j.at("planner_kept");
        p.activation_checkpoint = j.at("activation_checkpoint").get<std::string>();
        if (!p.activation_checkpoint.empty() && p.activation_checkpoint != "selective" && p.activation_checkpoint != "full") {
          throw std::invalid_argument("activation_checkpoint \"" + p.activation_checkpoint + "\" is not selective or full");
        }
        for (const auto& [id, dims] : j.at("choices").items()) {
          for (const auto& [dim, sig] : dims.items()) p.choices[std::stoll(id)][std::stoi(dim)] = sig.get<std::string>();
        }
        p.chosen.step_seconds = j.at("step_seconds");
        p.chosen.peak_bytes = j.at("peak_bytes");
        report.plans.push_back(std::move(p));
        spec.auto_report = j.at("line").get<std::string>();
        reused = true;
      }
    } catch (const std::exception& e) {
      SPMDX_WARN(kept.string() << ": not the auto strategy's plan (" << e.what() << "): planning again");
    }
  }
  if (!reused) {
    report = plan_auto(spec, registry, c);
    // Over the budget everywhere: activation checkpointing, as the budget does for a manual
    // layout, each mode recomputing more than the configured one.
    const std::vector<std::string> modes{"none", "selective", "full"};
    auto mode = std::find(modes.begin(), modes.end(), spec.activation_checkpoint.mode);
    while (spec.memory_budget > 0 && rank_class(report.plans.front()) != 0 && mode != modes.end() && ++mode != modes.end()) {
      JobSpec s = spec;
      s.activation_checkpoint = {*mode, "op", spec.activation_checkpoint.keep_collective_outputs};
      AutoReport again = plan_auto(s, registry, c);
      again.seconds += report.seconds;  // the whole search
      for (auto& p : again.plans) p.activation_checkpoint = *mode;
      if (rank_class(again.plans.front()) == 0) report = std::move(again);
      else report.tried_checkpointing = true;
    }
  }
  const AutoPlan& best = report.plans.front();
  if (!best.error.empty() || !best.fits) {
    // The nearest layouts, the smallest peaks first, then those that cannot run: a few, not the
    // hundreds of a large world (1,024 ranks made a 15 KB line).
    std::vector<const AutoPlan*> nearest;
    for (const auto& p : report.plans) nearest.push_back(&p);
    std::stable_sort(nearest.begin(), nearest.end(), [](const AutoPlan* a, const AutoPlan* b) {
      if (a->error.empty() != b->error.empty()) return a->error.empty();
      return a->error.empty() && a->chosen.peak_bytes < b->chosen.peak_bytes;
    });
    constexpr std::size_t kNamed = 6;
    std::string each;
    for (std::size_t i = 0; i < std::min(kNamed, nearest.size()); ++i) {
      const AutoPlan& p = *nearest[i];
      each += (each.empty() ? "" : "; ") + p.layout + ": " + (p.error.empty() ? "planned peak " + human_bytes(static_cast<double>(p.chosen.peak_bytes)) : p.error);
    }
    if (nearest.size() > kNamed) each += "; and " + std::to_string(nearest.size() - kNamed) + " more layouts";
    throw std::invalid_argument(std::string("parallelism.strategy = \"auto\": ") +
                                (best.error.empty() ? "no layout of " + std::to_string(spec.world_size) + " ranks fits parallelism.memory_budget = " +
                                                          human_bytes(static_cast<double>(spec.memory_budget)) +
                                                          (spec.memory_budget_source.empty() ? "" : ", " + spec.memory_budget_source) + " (" + each +
                                                          (report.tried_checkpointing ? "; with selective or full activation checkpointing none fits either" : "") +
                                                          "). Raise the budget, add ranks, or lower the batch or sequence length"
                                                    : "no layout of " + std::to_string(spec.world_size) + " ranks can run the job (" + each + ")"));
  }
  spec.auto_reused = reused;
  spec.dims = best.dims;
  pipeline_layout(spec, best.stages);
  if (!best.activation_checkpoint.empty()) spec.activation_checkpoint = {best.activation_checkpoint, "op", spec.activation_checkpoint.keep_collective_outputs};
  spec.strategies.clear();
  spec.auto_choices = best.choices;
  if (!reused) {
    spec.auto_report = report.line();
    nlohmann::json j{{"format", "spmdx.auto_plan/2"},
                     {"key", key},
                     {"layout", best.layout},
                     {"dims", {best.dims.dp_replicate, best.dims.dp_shard, best.dims.tp, best.dims.cp}},
                     {"stages", best.stages},
                     {"microbatches", best.microbatches},
                     {"planner_kept", best.planner_kept},
                     {"activation_checkpoint", best.activation_checkpoint},
                     {"step_seconds", best.chosen.step_seconds},
                     {"peak_bytes", best.chosen.peak_bytes},
                     {"line", spec.auto_report},
                     {"choices", nlohmann::json::object()}};
    for (const auto& [id, dims] : best.choices) {
      for (const auto& [dim, sig] : dims) j["choices"][std::to_string(id)][std::to_string(dim)] = sig;
    }
    j["check"] = plan_check(j);
    try {
      std::filesystem::create_directories(spec.output.dump_folder);
      write_file_atomic(kept, j.dump() + "\n");
      write_file_atomic(spec.output.dump_folder / "auto_report.txt", report.text(report.plans.size()));
      write_file_atomic(spec.output.dump_folder / "auto_report.json", report.json());
    } catch (const std::exception& e) {
      SPMDX_WARN("the auto strategy's plan could not be kept in " << kept.string() << " (" << e.what() << "): every rank plans again");
    }
  }
  if (spec.balance.speed) fold_rank_speeds(spec);
  return report;
}

std::string AutoReport::line() const {
  if (plans.empty()) return "auto: nothing planned";
  const AutoPlan& best = plans.front();
  std::string out = "auto: chose " + best.layout + " of " + std::to_string(plans.size()) + (plans.size() == 1 ? " layout" : " layouts") + ": predicted " + ms(best.chosen.step_seconds) +
                    " ms a step (compute " + ms(best.chosen.compute_seconds) + ", comm " + ms(best.chosen.comm_seconds) +
                    (best.stages > 1 ? ", pipeline bubble " + ms(best.chosen.bubble_seconds) : std::string()) + "), planned peak " +
                    human_bytes(static_cast<double>(best.chosen.peak_bytes));
  if (plans.size() > 1 && plans[1].error.empty() && plans[1].fits) {
    char ratio[32];
    std::snprintf(ratio, sizeof ratio, "%.2fx", plans[1].chosen.step_seconds / std::max(1e-12, best.chosen.step_seconds));
    out += "; " + std::string(ratio) + " faster than the next, " + plans[1].layout;
  } else if (plans.size() > 1 && plans[1].error.empty()) {
    out += "; the only layout within parallelism.memory_budget";
  }
  if (best.planner_kept) out += "; placements by the " + planner + " planner";
  else if (!best.intra.empty()) out += "; placements by propagation (the planner's were not predicted 2% faster)";
  else if (planner == "greedy") out += "; placements by propagation (parallelism.planner = \"greedy\")";
  else out += "; placements by propagation (the planner did not run on it: its time limit was spent, or a single rank)";
  if (!best.activation_checkpoint.empty()) out += "; activation_checkpoint.mode = \"" + best.activation_checkpoint + "\" (no layout fits parallelism.memory_budget without it)";
  return out;
}

std::string AutoReport::text(std::size_t top) const {
  std::ostringstream out;
  char line[512];
  out << "auto-sharding: " << plans.size() << (plans.size() == 1 ? " layout of " : " layouts of ") << world_size << " ranks planned in " << ms(seconds / 1e3) << " s (planner "
      << planner << "; " << ranks_per_host << " ranks a host, " << cores << " cores)\n";
  out << "calibration: " << calibration.str() << "\n";
  if (memory_budget > 0) out << "memory budget: " << human_bytes(static_cast<double>(memory_budget)) << " a rank\n";
  if (pipeline_layouts_skipped > 0) {
    out << pipeline_layouts_skipped << " more pipelined layouts not priced (the first " << kPipelineLayouts
        << " were, by the layout whose data-parallel replicas their stages replace, and a layout fits)\n";
  }
  std::snprintf(line, sizeof line, "%4s  %-44s %9s %9s %9s %11s  %-12s  %s\n", "#", "layout", "step ms", "compute", "comm", "peak", "greedy ms", "sent a rank by mesh dim; planner");
  out << line;
  for (std::size_t r = 0; r < plans.size() && r < top; ++r) {
    const AutoPlan& p = plans[r];
    if (!p.error.empty()) {
      out << "      " << p.layout << ": cannot run: " << p.error << "\n";
      continue;
    }
    std::string sent;
    const auto mesh = layout_mesh(p);
    for (std::size_t d = 0; d < p.chosen.comm_bytes_by_dim.size() && d < static_cast<std::size_t>(mesh.ndim()); ++d) {
      sent += (sent.empty() ? "" : ", ") + mesh.dims()[d].name + " " + human_bytes(p.chosen.comm_bytes_by_dim[d]);
    }
    std::string how = p.planner_kept ? "the ILP's plan" : p.intra.empty() ? "propagation's plan" : "propagation's plan (the ILP's not predicted 2% faster for the whole step)";
    if (p.stages > 1) {
      char t[160];
      std::snprintf(t, sizeof t, "; %s, %lld microbatches, bubble %.2f (%s ms) after the slowest stage's %s ms", p.schedule.c_str(), static_cast<long long>(p.microbatches),
                    p.chosen.bubble_fraction, ms(p.chosen.bubble_seconds).c_str(), ms(p.chosen.step_seconds - p.chosen.bubble_seconds).c_str());
      how += t;
      if (p.extrapolated) how += " (priced at fewer microbatches of the same rows and extrapolated; the planner is not run on it)";
    }
    for (const auto& d : p.intra) {
      char t[160];
      std::snprintf(t, sizeof t, "; %s: %lld nodes changed, %s in %.2f s", d.mesh_dim.c_str(), static_cast<long long>(d.changed),
                    d.optimal ? "optimal" : "time limit", d.solve_seconds);
      how += t;
    }
    std::snprintf(line, sizeof line, "%4zu  %-44s %9s %9s %9s %11s  %-12s  %s; %s%s\n", r + 1, p.layout.c_str(), ms(p.chosen.step_seconds).c_str(),
                  ms(p.chosen.compute_seconds).c_str(), ms(p.chosen.comm_seconds).c_str(), human_bytes(static_cast<double>(p.chosen.peak_bytes)).c_str(),
                  ms(p.greedy.step_seconds).c_str(), sent.empty() ? "nothing sent" : sent.c_str(), how.c_str(), p.fits ? "" : "; OVER THE BUDGET");
    out << line;
  }
  if (!plans.empty() && plans.front().error.empty()) out << why() << "\n";
  return out.str();
}

std::string AutoReport::why() const {
  const AutoPlan& best = plans.front();
  std::string out = line();
  if (plans.size() < 2 || !plans[1].error.empty() || !plans[1].fits) return out;
  const AutoPlan& next = plans[1];
  std::string fewer, more;
  std::set<std::string> ops;
  for (const auto& [op, k] : best.collectives) ops.insert(op);
  for (const auto& [op, k] : next.collectives) ops.insert(op);
  for (const auto& op : ops) {
    const auto count = [&](const AutoPlan& p) { const auto it = p.collectives.find(op); return it == p.collectives.end() ? std::int64_t{0} : it->second; };
    const std::int64_t d = count(next) - count(best);
    if (d > 0) fewer += (fewer.empty() ? "" : ", ") + std::to_string(d) + " " + op;
    if (d < 0) more += (more.empty() ? "" : ", ") + std::to_string(-d) + " " + op;
  }
  double sent_best = 0, sent_next = 0;
  for (double b : best.chosen.comm_bytes_by_dim) sent_best += b;
  for (double b : next.chosen.comm_bytes_by_dim) sent_next += b;
  out += ".\nwhy: against " + next.layout + " it ";
  if (!fewer.empty()) out += "avoids " + fewer + (more.empty() ? "" : " (and runs " + more + " more)");
  else out += more.empty() ? "runs the same collectives" : "runs more collectives (" + more + ")";
  out += " a step, " + std::to_string(best.chosen.issues) + " collective calls after bucketing against " + std::to_string(next.chosen.issues) + ", sends " + human_bytes(sent_best) + " a rank instead of " + human_bytes(sent_next) + " (comm " + ms(best.chosen.comm_seconds) + " against " +
         ms(next.chosen.comm_seconds) + " ms) and computes " + ms(best.chosen.compute_seconds) + " against " + ms(next.chosen.compute_seconds) + " ms";
  return out;
}

std::string AutoReport::json() const {
  using nlohmann::json;
  json j{{"format", "spmdx.auto/1"}, {"world_size", world_size}, {"ranks_per_host", ranks_per_host}, {"cores", cores}, {"memory_budget", memory_budget},
         {"planner", planner}, {"seconds", seconds}, {"pipeline_layouts_skipped", pipeline_layouts_skipped}, {"calibration", json::parse(calibration.to_json())}, {"plans", json::array()}};
  if (!plans.empty() && plans.front().error.empty() && plans.front().fits) j["chosen"] = plans.front().layout;
  for (const auto& p : plans) {
    json e{{"layout", p.layout},
           {"dims", {{"pp", p.stages}, {"dp_replicate", p.dims.dp_replicate}, {"dp_shard", p.dims.dp_shard}, {"cp", p.dims.cp}, {"tp", p.dims.tp}}},
           {"error", p.error}};
    if (p.error.empty()) {
      e["fits"] = p.fits;
      e["step_seconds"] = p.chosen.step_seconds;
      e["compute_seconds"] = p.chosen.compute_seconds;
      e["comm_seconds"] = p.chosen.comm_seconds;
      e["greedy_step_seconds"] = p.greedy.step_seconds;
      e["peak_bytes"] = p.chosen.peak_bytes;
      e["comm_bytes_by_dim"] = json::object();
      e["comm_seconds_by_dim"] = json::object();
      const auto mesh = layout_mesh(p);
      for (std::size_t d = 0; d < p.chosen.comm_bytes_by_dim.size() && d < static_cast<std::size_t>(mesh.ndim()); ++d) {
        e["comm_bytes_by_dim"][mesh.dims()[d].name] = p.chosen.comm_bytes_by_dim[d];
        e["comm_seconds_by_dim"][mesh.dims()[d].name] = p.chosen.comm_seconds_by_dim[d];
      }
      e["stages"] = p.stages;
      e["extrapolated"] = p.extrapolated;
      e["microbatches"] = p.microbatches;
      e["bubble_fraction"] = p.chosen.bubble_fraction;
      e["bubble_seconds"] = p.chosen.bubble_seconds;
      e["stage_seconds"] = json::object();  // by stage: the stages priced
      for (std::size_t i = 0; i < p.chosen.stage_seconds.size() && i < p.chosen.priced_stages.size(); ++i) {
        e["stage_seconds"][std::to_string(p.chosen.priced_stages[i])] = p.chosen.stage_seconds[i];
      }
      e["collective_calls"] = p.chosen.issues;
      e["activation_checkpoint"] = p.activation_checkpoint;
      e["planner_kept"] = p.planner_kept;
      e["collectives"] = p.collectives;
      e["plan_seconds"] = p.plan_seconds;
      e["planner"] = json::array();
      for (const auto& d : p.intra) {
        e["planner"].push_back({{"mesh_dim", d.mesh_dim}, {"greedy_seconds", d.greedy_seconds}, {"chosen_seconds", d.chosen_seconds},
                                {"bound_seconds", d.bound_seconds}, {"optimal", d.optimal}, {"changed", d.changed}, {"kept", d.forced_kept},
                                {"solve_seconds", d.solve_seconds}, {"solver", d.solver}});
      }
    }
    j["plans"].push_back(std::move(e));
  }
  return j.dump(1) + "\n";
}

plan::StepEstimate estimate_job(const JobSpec& spec, PluginRegistry& registry, const plan::Calibration& c) {
  const CompiledJob compiled = compile_job(spec, registry);
  const PlanningMachine machine = planning_machine(spec, c);
  return measure(compiled.job, spec, compiled.plan, machine.calibration, machine.ranks_per_host, machine.cores, nullptr, true);
}

BalanceEstimate estimate_balance(const JobSpec& spec, PluginRegistry& registry, const plan::Calibration& c) {
  BalanceEstimate out;
  const std::int64_t dp = spec.dims.dp_replicate * spec.dims.dp_shard;
  out.speeds = spec.balance.speeds.empty() ? std::vector<double>(static_cast<std::size_t>(dp), 1.0) : spec.balance.speeds;
  out.even = balanced_rows(spec.global_batch_size, std::vector<RankCost>(static_cast<std::size_t>(dp)));
  const auto choices = balance_choices(spec, registry);
  const std::int64_t rows = out.even.front(), fewer = std::max<std::int64_t>(1, rows / 2);
  const plan::StepEstimate at_rows = estimate_job(rows_spec(spec, rows, choices), registry, c);
  out.comm_seconds = at_rows.comm_seconds;
  out.line = {0, at_rows.compute_seconds / static_cast<double>(rows)};
  if (fewer < rows) {
    const double at_fewer = estimate_job(rows_spec(spec, fewer, choices), registry, c).compute_seconds;
    const double per_row = (at_rows.compute_seconds - at_fewer) / static_cast<double>(rows - fewer);
    if (per_row > 0 && at_rows.compute_seconds - per_row * static_cast<double>(rows) >= 0) out.line = {at_rows.compute_seconds - per_row * static_cast<double>(rows), per_row};
  }
  std::vector<RankCost> costs;
  for (double v : out.speeds) costs.push_back({out.line.fixed / v, out.line.per_row / v});
  out.max_rows = balance_max_rows(spec, registry, choices);
  out.balanced = balanced_rows(spec.global_batch_size, costs, out.max_rows);
  std::vector<RankCost> proportional;
  for (double v : out.speeds) proportional.push_back({0, 1 / v});
  out.start = balanced_rows(spec.global_batch_size, proportional, out.max_rows);
  out.even_seconds = predicted_seconds(out.even, costs) + out.comm_seconds;
  out.balanced_seconds = predicted_seconds(out.balanced, costs) + out.comm_seconds;
  out.start_seconds = predicted_seconds(out.start, costs) + out.comm_seconds;
  return out;
}

}  // namespace spmdx::job
