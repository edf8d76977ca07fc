#include "spmdx/train/auto_sharding.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>
#include <stdexcept>

#include "spmdx/core/log.h"
#include "spmdx/files.h"
#include "spmdx/launch/launcher.h"
#include "spmdx/plan/memory_plan.h"
#include "spmdx/plan/runtime_plan.h"
#include "spmdx/sharding/redistribute.h"
#include "spmdx/text.h"

namespace spmdx::train {
namespace {

using Clock = std::chrono::steady_clock;

// The layouts, best by propagation's plan, whose op placements the planner then chooses.
constexpr std::size_t kPlannerLayouts = 4;
// The planner's plan replaces propagation's only when predicted this much faster: below it the
// cost model cannot tell (bench/auto_sharding.sh: on mlp dp 4 a plan predicted 0.6% faster
// measured 20% slower), and propagation's plan is the one every other test runs.
constexpr double kPlannerGain = 0.02;

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::string layout_of(const sharding::ParallelDims& d) {
  std::string out;
  auto add = [&](const char* name, std::int64_t k) {
    if (k > 1) out += (out.empty() ? "" : " x ") + std::string(name) + " " + std::to_string(k);
  };
  add("dp_replicate", d.dp_replicate);
  add("dp_shard", d.dp_shard);
  add("cp", d.cp);
  add("tp", d.tp);
  return out.empty() ? "one rank" : out;
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

// What a plan of `job` costs on rank 0: its rank graph, memory plan and estimate; the collectives it runs.
plan::StepEstimate measure(const PlacedJob& job, const JobSpec& spec, const sharding::DistributedPlan& plan, const plan::Calibration& c,
                           std::int64_t ranks_per_host, std::int64_t cores, std::map<std::string, std::int64_t>* collectives) {
  const ir::Graph graph = rank_program(job, plan, 0, spec);
  const plan::RuntimePlan runtime = plan::make_runtime_plan(graph, run_mesh(job), spec.plan);
  const plan::MemoryPlan memory = plan::plan_memory(graph, runtime);
  if (collectives != nullptr) {
    collectives->clear();
    for (const auto& n : graph.nodes()) {
      if (sharding::is_collective(n->op())) ++(*collectives)[n->op()];
    }
  }
  return plan::estimate_step(graph, plan, c, ranks_per_host, cores, memory.peak_bytes, runtime.issues);
}

// The strategies the plan took on each mesh dim of size > 1, by node id.
std::map<std::int64_t, std::map<int, std::string>> choices_of(const sharding::DistributedPlan& plan) {
  std::map<std::int64_t, std::map<int, std::string>> out;
  for (const auto& node : plan.graph->nodes()) {
    for (int i = 0; i < plan.mesh.ndim(); ++i) {
      if (plan.mesh.size(i) > 1) out[node->id()][i] = sharding::taken_signature(plan, *node, i);
    }
  }
  return out;
}

// The layout planned by propagation alone (planner == nullptr), or refined by the planner.
AutoPlan plan_layout(const JobSpec& spec, const sharding::ParallelDims& dims, PluginRegistry& registry, const spmdx::Planner* planner,
                     const plan::Calibration& c, std::int64_t ranks_per_host, std::int64_t cores, const AutoPlan* greedy_done = nullptr) {
  const auto t0 = Clock::now();
  AutoPlan out = greedy_done != nullptr ? *greedy_done : AutoPlan{};
  out.dims = dims;
  out.layout = layout_of(dims);
  JobSpec s = spec;
  s.dims = dims;
  s.strategies.clear();
  s.fallback_strategies.clear();
  s.auto_choices.clear();
  s.auto_strategy = false;
  try {
    const PlacedJob job = place_job(s, registry);
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
        out.choices = choices_of(optimal);
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
      << m.n_kv_heads << " ffn " << m.ffn_hidden << " loss " << m.loss << " inputs " << m.inputs.size() << " world " << spec.world_size
      << " batch " << spec.global_batch_size << " seq " << spec.seq_len << " micro " << spec.step.microbatches << " cp " << spec.dims.cp << " budget "
      << spec.memory_budget << " planner " << spec.planner << " " << spec.planner_time_limit << " sp " << spec.sequence_parallel << " lp "
      << spec.loss_parallel << " ac " << spec.activation_checkpoint.mode << " mp " << spec.mixed_precision.param << " rsf " << spec.reshard_after_forward
      << " overlap " << spec.plan.overlap << " bucket " << spec.plan.bucket_bytes << " ranks/host " << planning_ranks_per_host(spec.world_size)
      << " cores " << launch::usable_cpus() << " stages " << spec.pipeline.stages << " tp_plan " << spec.tp_plan.size() << " " << c.to_json();
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

AutoReport plan_auto(const JobSpec& spec, PluginRegistry& registry, const plan::Calibration& c) {
  const auto t0 = Clock::now();
  AutoReport report;
  report.world_size = spec.world_size;
  report.ranks_per_host = planning_ranks_per_host(spec.world_size);
  report.cores = launch::usable_cpus();
  report.memory_budget = spec.memory_budget;
  report.planner = spec.planner;
  report.calibration = c;
  std::unique_ptr<spmdx::Planner> planner;
  if (spec.planner != "greedy") planner = registry.make_planner(spec.planner);
  const std::int64_t ranks = spec.world_size / std::max<std::int64_t>(1, spec.pipeline.stages) / spec.dims.cp;
  auto by_rank = [&] {
    std::stable_sort(report.plans.begin(), report.plans.end(), [](const AutoPlan& a, const AutoPlan& b) {
      if (rank_class(a) != rank_class(b)) return rank_class(a) < rank_class(b);
      return rank_class(a) < 2 && a.chosen.step_seconds < b.chosen.step_seconds;
    });
  };
  // Every layout by propagation, then the planner on the best few of them (Alpa's outer loop
  // prunes alike): the ILP of a large graph takes seconds a mesh dim.
  for (const auto& dims : layouts(ranks, spec.dims.cp)) {
    report.plans.push_back(plan_layout(spec, dims, registry, nullptr, c, report.ranks_per_host, report.cores));
    SPMDX_DEBUG("auto: " << report.plans.back().layout << " planned in " << report.plans.back().plan_seconds << " s");
  }
  by_rank();
  if (planner != nullptr) {  // within parallelism.planner_time_limit_seconds for all of them: each mesh dim's solver gets what is left
    const auto planning = Clock::now();
    for (std::size_t r = 0; r < report.plans.size() && r < kPlannerLayouts; ++r) {
      const double left = spec.planner_time_limit - since(planning);
      if (!report.plans[r].error.empty() || left <= 0) break;
      JobSpec s = spec;
      s.planner_time_limit = left;
      report.plans[r] = plan_layout(s, report.plans[r].dims, registry, planner.get(), c, report.ranks_per_host, report.cores, &report.plans[r]);
    }
    by_rank();
  }
  report.seconds = since(t0);
  return report;
}

AutoReport choose_auto(JobSpec& spec, PluginRegistry& registry) {
  const plan::Calibration c = plan::load_calibration(plan::calibration_path(spec.output.dump_folder));
  const std::string key = search_key(spec, c);
  const std::filesystem::path kept = spec.output.dump_folder / "auto_plan.json";
  AutoReport report;
  bool reused = false;
  std::error_code ec;
  if (std::filesystem::exists(kept, ec) && !std::filesystem::is_regular_file(kept, ec)) {
    throw std::invalid_argument(kept.string() + ": not a regular file (a folder, a pipe?): remove it; the auto strategy keeps its plan there");
  }
  if (std::ifstream in(kept); in) {
    try {
      const auto j = nlohmann::json::parse(in);
      if (j.at("format") != "spmdx.auto_plan/1") throw std::invalid_argument("format " + j.at("format").dump() + " is not spmdx.auto_plan/1");
      if (j.at("key") == key && j.at("check") != plan_check(j)) throw std::invalid_argument("it was changed after spmdx wrote it (its check does not match)");
      if (j.at("key") == key) {
        report.world_size = spec.world_size;
        report.planner = spec.planner;
        report.calibration = c;
        AutoPlan p;
        p.dims = {j.at("dims").at(0), j.at("dims").at(1), j.at("dims").at(2), j.at("dims").at(3)};
        if (p.dims.dp_replicate < 1 || p.dims.dp_shard < 1 || p.dims.tp < 1 || p.dims.cp != spec.dims.cp ||
            p.dims.dp_replicate * p.dims.dp_shard * p.dims.tp * p.dims.cp * std::max<std::int64_t>(1, spec.pipeline.stages) != spec.world_size) {
          throw std::invalid_argument("its degrees do not make " + std::to_string(spec.world_size) + " ranks");
        }
        p.layout = layout_of(p.dims);
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
      for (auto& p : again.plans) p.activation_checkpoint = *mode;
      if (rank_class(again.plans.front()) == 0) report = std::move(again);
      else report.tried_checkpointing = true;
    }
  }
  const AutoPlan& best = report.plans.front();
  if (!best.error.empty() || !best.fits) {
    std::string each;
    for (const auto& p : report.plans) {
      each += (each.empty() ? "" : "; ") + p.layout + ": " + (p.error.empty() ? "planned peak " + human_bytes(static_cast<double>(p.chosen.peak_bytes)) : p.error);
    }
    throw std::invalid_argument(std::string("parallelism.strategy = \"auto\": ") +
                                (best.error.empty() ? "no layout of " + std::to_string(spec.world_size) + " ranks fits parallelism.memory_budget = " +
                                                          human_bytes(static_cast<double>(spec.memory_budget)) + " (" + each +
                                                          (report.tried_checkpointing ? "; with selective or full activation checkpointing none fits either" : "") +
                                                          "). Raise the budget, add ranks, or lower the batch or sequence length"
                                                    : "no layout of " + std::to_string(spec.world_size) + " ranks can run the job (" + each + ")"));
  }
  spec.dims = best.dims;
  if (!best.activation_checkpoint.empty()) spec.activation_checkpoint = {best.activation_checkpoint, "op", spec.activation_checkpoint.keep_collective_outputs};
  spec.strategies.clear();
  spec.auto_choices = best.choices;
  if (!reused) {
    spec.auto_report = report.line();
    nlohmann::json j{{"format", "spmdx.auto_plan/1"},
                     {"key", key},
                     {"layout", best.layout},
                     {"dims", {best.dims.dp_replicate, best.dims.dp_shard, best.dims.tp, best.dims.cp}},
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
  return report;
}

std::string AutoReport::line() const {
  if (plans.empty()) return "auto: nothing planned";
  const AutoPlan& best = plans.front();
  std::string out = "auto: chose " + best.layout + " of " + std::to_string(plans.size()) + " layouts: predicted " + ms(best.chosen.step_seconds) +
                    " ms a step (compute " + ms(best.chosen.compute_seconds) + ", comm " + ms(best.chosen.comm_seconds) + "), planned peak " +
                    human_bytes(static_cast<double>(best.chosen.peak_bytes));
  if (plans.size() > 1 && plans[1].error.empty() && plans[1].fits) {
    char ratio[32];
    std::snprintf(ratio, sizeof ratio, "%.2fx", plans[1].chosen.step_seconds / std::max(1e-12, best.chosen.step_seconds));
    out += "; " + std::string(ratio) + " faster than the next, " + plans[1].layout;
  } else if (plans.size() > 1 && plans[1].error.empty()) {
    out += "; the only layout within parallelism.memory_budget";
  }
  out += best.planner_kept ? "; placements by the " + planner + " planner" : "; placements by propagation (the planner's were not predicted 2% faster)";
  if (!best.activation_checkpoint.empty()) out += "; activation_checkpoint.mode = \"" + best.activation_checkpoint + "\" (no layout fits parallelism.memory_budget without it)";
  return out;
}

std::string AutoReport::text(std::size_t top) const {
  std::ostringstream out;
  char line[512];
  out << "auto-sharding: " << plans.size() << " layouts of " << world_size << " ranks planned in " << ms(seconds / 1e3) << " s (planner "
      << planner << "; " << ranks_per_host << " ranks a host, " << cores << " cores)\n";
  out << "calibration: " << calibration.str() << "\n";
  if (memory_budget > 0) out << "memory budget: " << human_bytes(static_cast<double>(memory_budget)) << " a rank\n";
  std::snprintf(line, sizeof line, "%4s  %-34s %9s %9s %9s %11s  %-12s  %s\n", "#", "layout", "step ms", "compute", "comm", "peak", "greedy ms", "sent a rank by mesh dim; planner");
  out << line;
  for (std::size_t r = 0; r < plans.size() && r < top; ++r) {
    const AutoPlan& p = plans[r];
    if (!p.error.empty()) {
      out << "      " << p.layout << ": cannot run: " << p.error << "\n";
      continue;
    }
    std::string sent;
    const auto mesh = sharding::make_mesh(p.dims, p.dims.dp_replicate * p.dims.dp_shard * p.dims.tp * p.dims.cp);
    for (std::size_t d = 0; d < p.chosen.comm_bytes_by_dim.size() && d < static_cast<std::size_t>(mesh.ndim()); ++d) {
      sent += (sent.empty() ? "" : ", ") + mesh.dims()[d].name + " " + human_bytes(p.chosen.comm_bytes_by_dim[d]);
    }
    std::string how = p.planner_kept ? "the ILP's plan" : p.intra.empty() ? "propagation's plan" : "propagation's plan (the ILP's not predicted 2% faster for the whole step)";
    for (const auto& d : p.intra) {
      char t[160];
      std::snprintf(t, sizeof t, "; %s: %lld nodes changed, %s in %.2f s", d.mesh_dim.c_str(), static_cast<long long>(d.changed),
                    d.optimal ? "optimal" : "time limit", d.solve_seconds);
      how += t;
    }
    std::snprintf(line, sizeof line, "%4zu  %-34s %9s %9s %9s %11s  %-12s  %s; %s%s\n", r + 1, p.layout.c_str(), ms(p.chosen.step_seconds).c_str(),
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
         {"planner", planner}, {"seconds", seconds}, {"calibration", json::parse(calibration.to_json())}, {"plans", json::array()}};
  if (!plans.empty() && plans.front().error.empty() && plans.front().fits) j["chosen"] = plans.front().layout;
  for (const auto& p : plans) {
    json e{{"layout", p.layout},
           {"dims", {{"dp_replicate", p.dims.dp_replicate}, {"dp_shard", p.dims.dp_shard}, {"cp", p.dims.cp}, {"tp", p.dims.tp}}},
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
      const auto mesh = sharding::make_mesh(p.dims, p.dims.dp_replicate * p.dims.dp_shard * p.dims.tp * p.dims.cp);
      for (std::size_t d = 0; d < p.chosen.comm_bytes_by_dim.size() && d < static_cast<std::size_t>(mesh.ndim()); ++d) {
        e["comm_bytes_by_dim"][mesh.dims()[d].name] = p.chosen.comm_bytes_by_dim[d];
        e["comm_seconds_by_dim"][mesh.dims()[d].name] = p.chosen.comm_seconds_by_dim[d];
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
  const PlacedJob job = place_job(spec, registry);
  return measure(job, spec, propagate_job(job), c, planning_ranks_per_host(spec.world_size), launch::usable_cpus(), nullptr);
}

}  // namespace spmdx::train
