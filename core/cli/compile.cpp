// `spmdx compile CONFIG`: plans a job without starting ranks: checks its config (every problem
// at once), places and propagates it, and prints the model, the mesh, each rank's bytes and
// communication, the planned peak memory, the pipeline stages, with --strategy auto the
// ranking of layouts and with --estimate the calibrated step time; --dump writes the graphs
// and plans (compile_dump.h) that `spmdx diff` compares. Exit 0 when it plans, 1 when the job
// cannot be planned, 2 on a usage error.
#include <nlohmann/json.hpp>

#include <sys/resource.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <optional>

#include "command.h"
#include "compile_dump.h"
#include "job_calibration.h"
#include "usage.h"
#include "spmdx/config/config.h"
#include "spmdx/core/registry.h"
#include "spmdx/data/tokenizer.h"
#include "spmdx/files.h"
#include "spmdx/hooks/hook_set.h"
#include "spmdx/models/model.h"
#include "spmdx/plan/estimate.h"
#include "spmdx/plan/memory_plan.h"
#include "spmdx/plan/runtime_plan.h"
#include "spmdx/sharding/rewriter.h"
#include "spmdx/text.h"
#include "spmdx/job/auto_sharding.h"
#include "spmdx/job/compile.h"
#include "spmdx/job/preflight.h"
#include "spmdx/job/spec.h"
#include "spmdx/job/memory_budget.h"
#include "spmdx/plan/target.h"
#ifdef SPMDX_HAVE_EXEC
#include "spmdx/exec/calibrate.h"
#endif

namespace spmdx::cli {
namespace {

struct CompileOptions {
  std::string config;
  std::int64_t world_size = 0;
  std::string dump;
  std::string strategy;   ///< --strategy: parallelism.strategy ("auto": print the ranking)
  bool estimate = false;  ///< --estimate: the calibrated step time
  std::string target;     ///< --target: planning.target
  bool fake = false;
  bool print_config = false;
  bool json = false;
  std::vector<std::string> overrides;
};

// This process's peak resident set (getrusage's ru_maxrss, KiB on Linux), bytes.
std::int64_t peak_rss_bytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<std::int64_t>(usage.ru_maxrss) * 1024;
}

// The text of a file, or "" when it cannot be read.
std::string file_text(const std::filesystem::path& file) {
  try {
    return spmdx::read_file_bytes(file);
  } catch (const std::runtime_error&) {
    return "";
  }
}

// The predicted MFU of an estimate (percent), and the peak it divides by, in words: FLOPs per
// token x tokens per rank per predicted second over one rank's peak (planning.target's datasheet
// peak, or this machine's measured GEMM peak of a core times the cores a rank has).
std::pair<double, std::string> predicted_mfu(const spmdx::job::JobSpec& spec, const spmdx::plan::StepEstimate& e, double flops_per_token, double tokens,
                                             std::int64_t world) {
  const std::string& dtype = spec.mixed_precision.param;
  double peak = 0;
  std::string what;
  char text[256];
  if (const spmdx::plan::TargetProfile* t = spmdx::plan::find_target(spec.planning_target)) {
    peak = t->peak_flops(dtype, spec.device.allow_tf32);
    std::snprintf(text, sizeof text, "%.0f TFLOP/s %s a device, %s's datasheet", peak / 1e12, dtype.c_str(), t->label.c_str());
    what = text;
  } else {
#ifdef SPMDX_HAVE_EXEC
    const spmdx::exec::GemmPeak p = spmdx::exec::gemm_peak();
    const double cores = static_cast<double>(e.threads) / std::max(1.0, e.core_sharing);
    peak = p.of(dtype) * cores;
    std::snprintf(text, sizeof text, "%.1f GFLOP/s %s a rank, this machine's GEMM peak of a core x %.3g", peak / 1e9, dtype.c_str(), cores);
    what = text;
#else
    return {-1, "no GEMM peak (spmdx built without LibTorch)"};
#endif
  }
  if (peak <= 0 || e.step_seconds <= 0) return {-1, what};
  return {100.0 * flops_per_token * tokens / static_cast<double>(std::max<std::int64_t>(1, world)) / e.step_seconds / peak, what};
}

int run_compile(const CompileOptions& o) {
  namespace fs = std::filesystem;
  std::vector<std::string> overrides = o.overrides;
  if (!o.strategy.empty()) overrides.insert(overrides.end(), {"--parallelism.strategy", o.strategy});
  if (!o.target.empty()) overrides.insert(overrides.end(), {"--planning.target", o.target});
  spmdx::config::Config cfg = spmdx::config::Config::load(o.config, overrides, /*throw_on_problems=*/false);
  std::optional<spmdx::plan::Calibration> calibration;
  if (!cfg.has_problem("parallelism.strategy") && !cfg.has_problem("job.dump_folder") && (o.estimate || cfg.get_string("parallelism.strategy") == "auto")) {
    // A GPU target is priced by its datasheet: this machine's rates are not measured for it.
    const bool here = cfg.has_problem("planning.target") || cfg.get_string("planning.target") == "this-machine";
    calibration = here ? job_calibration(cfg) : spmdx::plan::load_calibration(spmdx::plan::calibration_path(cfg.get_string("job.dump_folder")));
  }
  if (o.print_config) {
    cfg.check();
    std::cout << cfg.to_toml();
    return 0;
  }
  const auto start = std::chrono::steady_clock::now();
  if (o.world_size < 0 || o.world_size > 100000000) throw std::invalid_argument("--world-size must be between 1 and 1e8");
  const std::int64_t world = o.world_size > 0 ? o.world_size : spmdx::job::degree_product(cfg);
  // Every problem at once: the config's, the tokenizer's, the degrees', the placements'. With
  // none, the preflight's tokenizer, job spec and plugins are the ones to plan with.
  spmdx::PluginRegistry registry;
  std::unique_ptr<spmdx::data::Tokenizer> tokenizer;
  std::optional<spmdx::job::JobSpec> checked_spec;
  cfg.check(spmdx::job::preflight(cfg, world, registry, &tokenizer, &checked_spec, spmdx::job::Preflight::plan, "--world-size"));
  if (!cfg.ignored().empty()) std::cerr << cfg.ignored_text() << "\n";
  const spmdx::job::JobSpec& spec = checked_spec.value();
  spmdx::job::CompiledJob compiled = spmdx::job::compile_job(spec, registry);
  const spmdx::job::PlacedJob& job = compiled.job;
  const spmdx::sharding::DistributedPlan& plan = compiled.plan;
  const std::int64_t dumped_ranks = o.dump.empty() ? 0 : (o.fake ? 1 : world);
  if (!o.dump.empty()) {
    std::error_code ec;
    if (fs::exists(o.dump, ec) && !fs::is_directory(o.dump, ec)) {
      throw std::invalid_argument("--dump " + o.dump + " is a file: give a folder (it is made if missing)");
    }
    fs::create_directories(o.dump);
    for (const auto& [name, text] : dump_documents(job, plan, spec, dumped_ranks, /*everything=*/true)) {
      std::ofstream out(fs::path(o.dump) / name);
      out << text;
      out.flush();
      if (!out) throw std::runtime_error("cannot write " + (fs::path(o.dump) / name).string() + ": " + std::strerror(errno));
    }
  } else {
    spmdx::sharding::rank_graph(plan, 0);  // checks that the local shapes work out
  }
  if (!spec.hooks.enabled.empty()) {  // compile-stage hooks: pictures, partition checks
    spmdx::HookContext base;
    base.world_size = static_cast<int>(world);
    base.mesh = job.mesh.dims();
    base.coordinate = job.mesh.coordinate(0);
    base.compile_only = true;
    spmdx::hooks::HookSet hooks = spmdx::hooks::make_hooks(spec.hooks, registry, base);
    std::vector<std::int64_t> ranks;
    for (std::int64_t r = 0; r < (o.fake ? 1 : job.mesh.size()); ++r) ranks.push_back(r);
    hooks.compile(plan, ranks, spec.plan);
    (o.json ? std::cerr : std::cout) << "hooks (" << spmdx::join(spec.hooks.enabled) << ") ran on the compile stages; their files are under "
              << (fs::path(cfg.get_string("job.dump_folder")) / "hooks").string() << "\n";
  }
  const spmdx::job::PlannedStep planned = spmdx::job::plan_step(job, spec);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double param = static_cast<double>(spmdx::job::local_parameter_bytes(job, 0));
  const std::int64_t count = spmdx::models::parameter_count(job.model);
  const std::int64_t embedding = spmdx::models::embedding_parameter_count(job.model);
  const std::int64_t active = spmdx::models::active_parameter_count(job.model);
  // Expert parallelism's all_to_all_v per rank and step: each MoE layer's dispatch and combine,
  // forward and backward, move this rank's slots (tokens x top_k rows of dim elements); with even
  // routing (ep - 1) / ep of them leave the rank; at most ep x that arrive (all at one rank).
  // The model's MoE arguments: an imported model's experts are counted when it is read. Every
  // expert_dispatch and expert_combine node of the step (forward, and each one's VJP, the other)
  // moves a rank's slots (of its microbatch): dispatch's input, combine's output [ep, slots, dim].
  const spmdx::models::MoEArgs& moe = job.model.args.moe;
  double ep_bytes = 0;
  if (moe.expert_parallel > 1) {
    const double element = spec.mixed_precision.param == "float32" ? 4.0 : 2.0;
    for (const auto& n : job.model.graph.nodes()) {
      if (n->op() != "expert_dispatch" && n->op() != "expert_combine") continue;
      const auto& shape = (n->op() == "expert_dispatch" ? n->input(0) : n->output(0))->meta().shape;
      ep_bytes += static_cast<double>(shape[1] * shape[2]) * element * static_cast<double>(moe.expert_parallel - 1) / static_cast<double>(moe.expert_parallel);
    }
  }
  const double flops_token = spmdx::models::flops_per_token(job.model, spec.seq_len);
  const double tokens = static_cast<double>(spec.global_batch_size) * static_cast<double>(spec.seq_len);
  const auto& dims = job.mesh.dims();
  // With pipeline stages: per stage, what its first rank sends and receives and its planned peak.
  nlohmann::json stages_json = nlohmann::json::array();
  std::string stages_text;
  if (job.pipeline.stages > 1) {
    const spmdx::sharding::DeviceMesh mesh = spmdx::job::run_mesh(job);
    for (std::int64_t st = 0; st < job.pipeline.stages; ++st) {
      spmdx::train::StageGraph staged;
      const spmdx::ir::Graph g = spmdx::job::rank_program(job, plan, st * job.mesh.size(), spec, nullptr, &staged);
      const spmdx::plan::RuntimePlan runtime = spmdx::plan::make_runtime_plan(g, mesh, spec.plan);
      const std::int64_t peak = spmdx::plan::plan_memory(g, runtime).peak_bytes;
      const std::int64_t first = job.pipeline.first_layer[static_cast<std::size_t>(st)];
      const bool last = st + 1 == job.pipeline.stages;
      stages_json.push_back({{"stage", st}, {"first_layer", first}, {"layers", spmdx::train::stage_layers(job.pipeline, st)}, {"sends", staged.sends}, {"recvs", staged.recvs}, {"bytes_sent", staged.bytes_sent},
                             {"planned_peak_bytes", peak}, {"nodes", g.num_nodes()}});
      const std::int64_t r0 = st * job.mesh.size(), r1 = (st + 1) * job.mesh.size() - 1;
      const std::string layers = spmdx::train::stage_layers(job.pipeline, st) + (last ? ", the final norm and output" : "");
      stages_text += "  stage " + std::to_string(st) + (r0 == r1 ? " (rank " + std::to_string(r0) : " (ranks " + std::to_string(r0) + "-" + std::to_string(r1)) + "): " +
                     (st == 0 ? "the embedding, " : "") + layers + ", " + std::to_string(staged.sends) + " sends (" +
                     spmdx::human_bytes(static_cast<double>(staged.bytes_sent)) + ") and " + std::to_string(staged.recvs) + " recvs a step, planned peak " +
                     spmdx::human_bytes(static_cast<double>(peak)) + "\n";
    }
  }
  const spmdx::job::ContextParallelSummary cp = spmdx::job::context_parallel_summary(spec, job, plan);
  if (o.json) {
    nlohmann::json by_dim = nlohmann::json::object();
    for (std::size_t d = 0; d < dims.size(); ++d) by_dim[dims[d].name] = plan.comm_bytes_by_dim.at(d);
    nlohmann::json mesh = nlohmann::json::array();
    for (const auto& d : dims) mesh.push_back({{"name", d.name}, {"size", d.size}});
    const auto& m = planned.memory;
    nlohmann::json j{{"format", "spmdx.compile"},
                     {"version", 1},
                     {"model", {{"label", spmdx::models::model_label(spec.model)}, {"vocab_size", spec.model.vocab_size}, {"parameters", count},
                                {"active_parameters", active}, {"embedding_parameters", embedding},
                                {"expert_parallel", {{"degree", moe.expert_parallel}, {"all_to_all_v_bytes_even_routing", ep_bytes}}}, {"graph_nodes", job.model.graph.num_nodes()}}},
                     {"mesh", mesh},
                     {"world_size", world},
                     {"global_batch_size", spec.global_batch_size},
                     {"seq_len", spec.seq_len},
                     {"microbatches", spec.step.microbatches},
                     {"sequence_parallel", job.sequence_parallel_dim >= 0},
                     {"loss_parallel", job.loss_parallel},
                     {"context_parallel", {{"degree", cp.degree}, {"tokens_per_rank", cp.tokens_per_rank}, {"pieces", cp.pieces},
                                           {"load_balance", cp.pieces > 1}, {"rotate_method", spec.context_parallel_allgather ? "allgather" : "auto"}, {"attentions", cp.attentions},
                                           {"query_rows", cp.query_rows}, {"all_to_all", cp.all_to_all}}},
                     {"pipeline", {{"stages", job.pipeline.stages}, {"schedule", job.pipeline.schedule}, {"microbatches", job.pipeline.microbatches},
                                   {"bubble_fraction", spmdx::train::bubble_fraction(job.pipeline)}, {"per_stage", stages_json}}},
                     {"flops_per_token", flops_token},
                     {"flops_per_step", flops_token * tokens},
                     {"rank0", {{"parameter_bytes", param}, {"gradient_bytes", param}, {"optimizer_state_bytes", 2 * param},
                                {"comm_bytes_per_step", plan.comm_bytes}, {"comm_bytes_per_step_by_dim", by_dim}, {"comm_seconds_estimate", plan.comm_seconds},
                                {"graph_flops_per_step", planned.flops}}},
                     {"planned_peak", {{"bytes", m.peak_bytes}, {"parameters", m.parameters}, {"gradients", m.gradients}, {"optimizer_state", m.optimizer_state},
                                       {"activations", m.activations}, {"communication", m.communication}, {"state_copy", m.state_copy}}},
                     {"memory_budget_bytes", spec.memory_budget},
                     {"memory_budget_choice", spec.memory_fit},
                     {"planner_seconds", seconds},
                     {"planner_peak_rss_bytes", peak_rss_bytes()},
                     {"fake", o.fake}};
    j["decided_by"] = job.decided_by;  // who placed each mesh dim
    j["parameters_kept_whole"] = nlohmann::json::array();  // job::short_parameters: their dim 0 shorter than a sharding dim's degree
    for (const auto& short_ones : spmdx::job::short_parameters(spec, job)) {
      nlohmann::json names = nlohmann::json::array();
      for (const auto& p : short_ones.parameters) names.push_back(p.name);
      j["parameters_kept_whole"].push_back({{"mesh_dim", short_ones.mesh_dim}, {"degree", short_ones.degree}, {"strategy", short_ones.strategy},
                                            {"parameters", names}, {"extra_bytes", short_ones.extra_bytes}, {"message", short_ones.line()}});
    }
    if (spec.auto_strategy) {
      const std::string report = file_text(fs::path(spec.output.dump_folder) / "auto_report.json");
      j["auto"] = report.empty() ? nlohmann::json(spec.auto_report) : nlohmann::json::parse(report);
    }
    if (o.estimate) {
      const auto e = spmdx::job::estimate_job(spec, registry, *calibration);
      const auto [mfu, peak_text] = predicted_mfu(spec, e, flops_token, tokens, world);
      j["estimate"] = {{"step_seconds", e.step_seconds}, {"compute_seconds", e.compute_seconds}, {"comm_seconds", e.comm_seconds},
                       {"mfu", mfu >= 0 ? nlohmann::json(mfu) : nlohmann::json()}, {"mfu_peak", peak_text},
                       {"target", spec.planning_target.empty() ? "this-machine" : spec.planning_target},
                       {"comm_seconds_by_dim", e.comm_seconds_by_dim}, {"peak_bytes", e.peak_bytes}, {"threads", e.threads}, {"core_sharing", e.core_sharing},
                       {"stages", e.stages}, {"bubble_seconds", e.bubble_seconds}, {"bubble_fraction", e.bubble_fraction}, {"stage_seconds", e.stage_seconds},
                       {"calibration", nlohmann::json::parse(spmdx::job::planning_machine(spec, *calibration).calibration.to_json())}};
      if (spec.balance.speed && spec.dims.dp_replicate * spec.dims.dp_shard > 1) {  // one data-parallel rank: no batch to split
        const auto b = spmdx::job::estimate_balance(spec, registry, *calibration);
        j["estimate"]["balance"] = {{"speeds", b.speeds}, {"fixed_seconds", b.line.fixed}, {"row_seconds", b.line.per_row}, {"even", b.even},
                                    {"balanced", b.balanced}, {"start", b.start}, {"max_rows", b.max_rows}, {"even_step_seconds", b.even_seconds},
                                    {"balanced_step_seconds", b.balanced_seconds}, {"start_step_seconds", b.start_seconds}, {"comm_seconds", b.comm_seconds}};
      }
    }
    std::cout << j.dump(1) << "\n";
    return 0;
  }
  char comm_ms[32];
  std::snprintf(comm_ms, sizeof comm_ms, "%.2f", plan.comm_seconds * 1e3);
  char params[128];
  std::snprintf(params, sizeof params, "%lld parameters (%.3g x 10^9", static_cast<long long>(count), static_cast<double>(count) / 1e9);
  std::string params_text = params;
  if (active != count) {  // an MoE: the parameters a token meets (its top_k of the routed experts)
    std::snprintf(params, sizeof params, "; %.3g x 10^9 active per token, top %lld of %lld experts", static_cast<double>(active) / 1e9,
                  static_cast<long long>(moe.top_k), static_cast<long long>(moe.experts));
    params_text += params;
  }
  params_text += ")";
  char flops[256];
  std::snprintf(flops, sizeof flops, "%.4g FLOPs per token (torchtitan's 6 x %.4g non-embedding %sparameters%s), %.4g per step of %.0f tokens", flops_token,
                static_cast<double>(active - embedding), active != count ? "active " : "",
                spmdx::models::is_builtin_transformer(spec.model.name) ? " + 12 x layers x heads x head_dim x seq_len" : "", flops_token * tokens, tokens);
  std::string by_dim;
  for (std::size_t d = 0; d < dims.size(); ++d) by_dim += (d ? ", " : "") + dims[d].name + " " + spmdx::human_bytes(plan.comm_bytes_by_dim.at(d));
  std::cout << "model " << spmdx::models::model_label(spec.model) << " (vocab " << spec.model.vocab_size << ", " << params_text << "), " << job.model.graph.num_nodes()
            << " nodes; mesh " << spmdx::job::run_mesh(job).str() << " (" << world << " ranks" << (job.sequence_parallel_dim >= 0 ? ", sequence parallel over tp" : "") << (job.loss_parallel ? ", loss parallel" : "") << "); global batch " << spec.global_batch_size << " x " << spec.seq_len
            << (spec.step.microbatches > 1 ? " in " + std::to_string(spec.step.microbatches) + " microbatches (" +
                                                 (job.pipeline.stages > 1 ? "pipeline" : "gradient accumulation") + ")"
                                           : std::string())
            << "\n"
            << flops << "\n"
            << "per rank (rank 0): parameters " << spmdx::human_bytes(param) << ", gradients " << spmdx::human_bytes(param) << ", AdamW state "
            << spmdx::human_bytes(2 * param) << ", communication " << spmdx::human_bytes(plan.comm_bytes) << " sent per step (" << by_dim
            << (spec.planning_target.empty() ? "; about " + std::string(comm_ms) + " ms at 10 GB/s, 10 us per message)\n"
                                             : "; over " + spec.planning_target + "'s links: --estimate)\n")
            << "planned peak memory (rank 0): " << planned.memory.str() << "\n"
            << (moe.expert_parallel > 1 ? "expert parallelism: ep " + std::to_string(moe.expert_parallel) + " over " + moe.expert_dim + ", " +
                                              std::to_string(moe.experts / moe.expert_parallel) + " of " + std::to_string(moe.experts) +
                                              " experts a rank; all_to_all_v sends " + spmdx::human_bytes(ep_bytes) +
                                              " per rank per step with even routing (not in the communication above; routing decides: up to " +
                                              std::to_string(moe.expert_parallel) + " x that reach one rank)\n"
                                        : std::string())
            << (job.sequence_parallel_off.empty() ? "" : "sequence parallel: off, " + job.sequence_parallel_off + "\n")
            << (cp.degree > 1 ? cp.line() + "\n" : std::string())
            << (job.pipeline.stages > 1 ? "pipeline: " + std::to_string(job.pipeline.stages) + " stages" +
                                              (job.pipeline.virtual_stages > 1 ? " of " + std::to_string(job.pipeline.virtual_stages) + " chunks" : std::string()) +
                                              ", schedule " + job.pipeline.schedule + ", " +
                                              std::to_string(job.pipeline.microbatches) + " microbatches, theoretical bubble " +
                                              [&] {
                                              char b[16];
                                              std::snprintf(b, sizeof b, "%.3f", spmdx::train::bubble_fraction(job.pipeline));
                                              return std::string(b);
                                            }() + " (parameters, gradients, AdamW state and communication above: the whole model on one stage's mesh; the planned peak: stage 0's)\n" + stages_text
                                        : std::string())
            << (spec.memory_fit.empty() ? "" : spec.memory_fit + "\n");
  for (const auto& line : job.decided_by) std::cout << line << "\n";
  for (const auto& short_ones : spmdx::job::short_parameters(spec, job)) std::cout << "warning: " << short_ones.line() << "\n";
  for (const auto& line : spmdx::job::tp_replicated_parameters(spec, job)) std::cout << "warning: " << line << "\n";
  if (const std::string note = spmdx::models::mla_note(spec.model); !note.empty()) std::cout << "note: " << note << "\n";
  for (const auto& [layout, why] : spec.strategies_passed_over) {
    std::cout << "fallback: strategies " << layout << " passed over (" << why << ")\n";
  }
  if (!spec.strategies_passed_over.empty()) std::cout << "strategies: " << spmdx::job::layout_text(spec.strategies) << "\n";
  if (spec.auto_strategy) {
    const std::string report = file_text(fs::path(spec.output.dump_folder) / "auto_report.txt");
    std::cout << (report.empty() ? spec.auto_report + "\n" : report) << "(the ranking: " << (fs::path(spec.output.dump_folder) / "auto_report.{txt,json}").string() << ")\n";
    if (spec.auto_reused) {
      std::cout << "(kept from an earlier search of the same job and calibration in " << (fs::path(spec.output.dump_folder) / "auto_plan.json").string()
                << ": the ranking and its times are that search's; remove the file to search again)\n";
    }
  }
  if (o.estimate) {
    const auto e = spmdx::job::estimate_job(spec, registry, *calibration);
    char text[512];
    char bubble[160] = "";
    if (e.stages > 1) {
      std::snprintf(bubble, sizeof bubble, " + pipeline bubble %.2f ms (%.2f of the step)", e.bubble_seconds * 1e3, e.bubble_fraction);
    }
    char who[128] = "rank 0";
    if (e.stages > 1) std::snprintf(who, sizeof who, "the slowest of %lld stages; the largest stage's peak", static_cast<long long>(e.stages));
    char on[96];
    if (spec.planning_target.empty()) {
      std::snprintf(on, sizeof on, "%lld thread%s a rank, cores shared %.2fx", static_cast<long long>(e.threads), e.threads == 1 ? "" : "s", e.core_sharing);
    } else {
      std::snprintf(on, sizeof on, "one %s a rank", spec.planning_target.c_str());
    }
    std::snprintf(text, sizeof text, "estimate (%s): %.2f ms a step = compute %.2f ms (%s) + communication %.2f ms%s; planned peak %s\n", who,
                  e.step_seconds * 1e3, e.compute_seconds * 1e3, on, e.comm_seconds * 1e3, bubble, spmdx::human_bytes(static_cast<double>(e.peak_bytes)).c_str());
    const auto [mfu, peak_text] = predicted_mfu(spec, e, flops_token, tokens, world);
    std::cout << text;
    std::fflush(stdout);
    if (mfu >= 0) std::printf("predicted mfu: %.1f%% (torchtitan's: FLOPs per token x tokens/s per rank / peak; against %s)\n", mfu, peak_text.c_str());
    else std::printf("predicted mfu: n/a (%s)\n", peak_text.c_str());
    std::fflush(stdout);
    std::cout << "calibration: " << spmdx::job::planning_machine(spec, *calibration).calibration.str() << "\n";  // planning.target's, or this machine's
    if (spec.balance.speed && spec.dims.dp_replicate * spec.dims.dp_shard == 1) {
      std::printf("balance (speed): one data-parallel rank, so there is no batch to split\n");
    } else if (spec.balance.speed) {
      const auto b = spmdx::job::estimate_balance(spec, registry, *calibration);
      std::string start = "the ranks' CPU shares (--cpu-affinity), else even";
      if (!spec.balance.speeds.empty() && b.start == b.balanced) {
        start = "the balanced split";
      } else if (!spec.balance.speeds.empty()) {
        char one[160];
        std::snprintf(one, sizeof one, "%s (rows in proportion to the speeds, before a step is measured: %.2f ms predicted)", spmdx::job::split_text(b.start).c_str(),
                      b.start_seconds * 1e3);
        start = one;
      }
      if (b.max_rows > 0) start += "; at most " + std::to_string(b.max_rows) + " rows a rank within parallelism.memory_budget";
      std::printf("balance (speed): data-parallel ranks at speeds %s (%s); a rank's compute at speed 1: %.2f ms + %.2f ms a row; even %s predicts %.2f ms a step, "
                  "balanced %s %.2f ms (%.2fx); spmdx run starts from %s, and re-plans from measured steps\n",
                  spmdx::job::speeds_text(b.speeds).c_str(), spec.balance.speeds.empty() ? "equal: parallelism.balance_speeds not given" : "parallelism.balance_speeds", b.line.fixed * 1e3,
                  b.line.per_row * 1e3, spmdx::job::split_text(b.even).c_str(), b.even_seconds * 1e3, spmdx::job::split_text(b.balanced).c_str(), b.balanced_seconds * 1e3,
                  b.balanced_seconds / b.even_seconds, start.c_str());
      std::fflush(stdout);
    }
  }
  std::cout << "planned in " << std::fixed << std::setprecision(3) << seconds << " s, peak RSS " << spmdx::human_bytes(static_cast<double>(peak_rss_bytes())) << std::defaultfloat << (o.fake ? " (--fake: no ranks started" : " (no ranks started")
            << (dumped_ranks ? "; wrote " + o.dump + " with " + std::to_string(dumped_ranks) + " rank graph(s))" : ")") << "\n";
  return 0;
}

class Compile final : public Command {
 public:
  CLI::App* add(CLI::App& parent, const std::string& name) override {
    auto* compile = parent.add_subcommand(name, "Plan a job from its config without starting ranks: placements, rank graphs, bytes");
    compile->allow_extras();  // --section.key value overrides
    compile->add_option("config", o_.config, "The job's TOML config")->required()->check(CLI::ExistingFile);
    compile->add_option("--world-size", o_.world_size, "Ranks to plan for (default: the product of the config's degrees)")
        ->check(CLI::Range(1, 100000000));
    compile->add_option("--dump", o_.dump, "Write logical.{txt,json}, plan.{txt,json}, rankR.{txt,json} rankR.plan.txt (RuntimePlan) and rankR.memory.txt (memory plan) here");
    compile->add_option("--strategy", o_.strategy, "manual | auto: plan every layout, print the ranking and why the first wins (parallelism.strategy)")
        ->check(CLI::IsMember({"manual", "auto"}));
    compile->add_flag("--estimate", o_.estimate, "Print rank 0's predicted step time (compute, communication) and peak, by the calibration in job.dump_folder (measured once)");
    compile->add_option("--target", o_.target,
                        "Price the plan (--estimate, strategy = \"auto\") for this hardware: this-machine, h100-sxm, h200, b200 (planning.target)");
    compile->add_flag("--fake", o_.fake, "Plan a mesh larger than this machine; dump only rank 0's graph");
    auto* print_config = compile->add_flag("--print-config", o_.print_config, "Print the effective config and exit");
    add_json_flag(*compile, o_.json, "the summary",
                  "schema spmdx.compile/1: parameters, FLOPs per token, per-rank bytes, bytes per mesh dim, planned peak")
        ->excludes(print_config);
    compile->footer(kOverridesHelp);
    return compile;
  }

  int run(const CLI::App& cmd, int, char**) override {
    o_.overrides = cmd.remaining();
    return run_compile(o_);
  }

 private:
  CompileOptions o_;
};

}  // namespace

std::unique_ptr<Command> make_compile() { return std::make_unique<Compile>(); }

}  // namespace spmdx::cli
