#include "spmdx/job/memory_budget.h"

#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <vector>

#include "spmdx/models/model.h"
#include "spmdx/sharding/cost_model.h"
#include "spmdx/sharding/rewriter.h"
#include "spmdx/text.h"

namespace spmdx::job {
using namespace spmdx::train;
namespace {

std::string bytes(std::int64_t b) { return human_bytes(static_cast<double>(b)); }

std::string ms(double seconds) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f ms", seconds * 1e3);
  return text;
}

// A change to try and the spec with it (and every change before it).
struct Candidate {
  std::string what;
  JobSpec spec;
};

// What `s` changes from `configured`, in config keys.
std::string changes(const JobSpec& configured, const JobSpec& s) {
  std::string out;
  auto add = [&](const std::string& change) { out += (out.empty() ? "" : ", ") + change; };
  if (s.reshard_after_forward != configured.reshard_after_forward) add("parallelism.fsdp_reshard_after_forward = \"always\"");
  if (s.activation_checkpoint.mode != configured.activation_checkpoint.mode) {
    add("activation_checkpoint.mode = \"" + s.activation_checkpoint.mode + "\"" + (s.activation_checkpoint.mode == "selective" ? " (op)" : ""));
  }
  if (s.dims.dp_shard != configured.dims.dp_shard) {
    add("data_parallel_shard_degree " + std::to_string(s.dims.dp_shard) + " (replicate " + std::to_string(s.dims.dp_replicate) + ")");
  }
  return out;
}

// True when the model has layers that activation checkpointing would recompute (parameters
// named with a numbered prefix, models::layer_of): an MLP has none.
bool has_layers(const PlacedJob& job) {
  for (const auto& p : job.model.params) {
    if (!models::layer_of(p).empty()) return true;
  }
  return false;
}

// `layers`: the model has layers to checkpoint (else checkpointing changes nothing: not tried).
std::vector<Candidate> candidates(const JobSpec& configured, bool layers) {
  std::vector<Candidate> out;
  JobSpec s = configured;
  if (!s.reshard_after_forward && s.dims.dp_shard > 1) {
    s.reshard_after_forward = true;
    out.push_back({changes(configured, s), s});
  }
  if (layers && s.activation_checkpoint.mode == "none") {
    s.activation_checkpoint = {"selective", "op"};
    out.push_back({changes(configured, s), s});
  }
  if (layers && s.activation_checkpoint.mode != "full") {
    s.activation_checkpoint = {"full", "op"};
    out.push_back({changes(configured, s), s});
  }
  while (s.dims.dp_replicate > 1) {  // a prime factor at a time, from replicate to shard
    std::int64_t p = 2;
    while (s.dims.dp_replicate % p != 0) ++p;
    s.dims.dp_replicate /= p;
    s.dims.dp_shard *= p;
    s.reshard_after_forward = true;
    out.push_back({changes(configured, s), s});
  }
  return out;
}

}  // namespace

std::int64_t state_copy_bytes(const ir::Graph& rank_graph, const std::vector<std::string>& params) {
  std::int64_t bytes = 0;
  for (const auto& name : step_state_names(rank_graph, params)) {
    if (const ir::Value* v = rank_graph.find_input(name)) bytes += v->meta().nbytes();  // a pipeline stage holds its own
  }
  return bytes;
}

PlannedStep plan_step(const PlacedJob& job, const JobSpec& spec, std::int64_t rank) {
  if (rank < 0) {  // the stage with the highest peak
    PlannedStep worst;
    for (std::int64_t s = 0; s < job.pipeline.stages; ++s) {
      PlannedStep step = plan_step(job, spec, s * job.mesh.size());
      if (s == 0 || step.memory.peak_bytes > worst.memory.peak_bytes) worst = std::move(step);
    }
    return worst;
  }
  const auto plan = propagate_job(job);
  const ir::Graph graph = rank_program(job, plan, rank, spec);
  PlannedStep step;
  step.memory = plan::plan_memory(graph, plan::make_runtime_plan(graph, run_mesh(job), spec.plan));
  if (spec.comm.failover() && spec.world_size > 1) step.memory.add_state_copy(state_copy_bytes(graph, job.model.params));
  step.comm_seconds = plan.comm_seconds;
  for (const auto& n : graph.nodes()) step.flops += sharding::node_flops(*n);
  return step;
}

std::int64_t balance_max_rows(const JobSpec& spec, PluginRegistry& registry, const std::map<std::int64_t, std::map<int, std::string>>& choices) {
  if (spec.memory_budget <= 0) return 0;
  const std::int64_t dp = spec.dims.dp_replicate * spec.dims.dp_shard;
  const std::int64_t even = (spec.global_batch_size + dp - 1) / dp, most = spec.global_batch_size - (dp - 1);
  auto fits = [&](std::int64_t rows) {
    const JobSpec s = rows_spec(spec, rows, choices);
    return plan_step(place_job(s, registry), s, 0).memory.peak_bytes <= spec.memory_budget;
  };
  if (most <= even || fits(most)) return 0;
  std::int64_t lo = even, hi = most;  // lo fits (or is the floor), hi does not
  while (hi - lo > 1) {
    const std::int64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo;
}

std::string fit_memory_budget(JobSpec& spec, PluginRegistry& registry) {
  if (spec.memory_budget <= 0) return "";
  const PlacedJob placed = place_job(spec, registry);
  const PlannedStep configured = plan_step(placed, spec, -1);
  const std::string budget = spec.memory_budget_source.empty() ? "parallelism.memory_budget = " + bytes(spec.memory_budget)
                                                               : "memory budget " + bytes(spec.memory_budget) + " (" + spec.memory_budget_source + ")";
  const std::string head = budget + ": planned peak per rank " + bytes(configured.memory.peak_bytes);
  if (configured.memory.peak_bytes <= spec.memory_budget) return head + " fits as configured";
  std::string tried = "as configured " + bytes(configured.memory.peak_bytes);
  PlannedStep last = configured;
  for (const Candidate& c : candidates(spec, has_layers(placed))) {
    const PlannedStep step = plan_step(place_job(c.spec, registry), c.spec, -1);
    if (step.memory.peak_bytes <= spec.memory_budget) {
      char flops[64];
      const double more = std::round(100.0 * (step.flops / configured.flops - 1));
      std::snprintf(flops, sizeof flops, "%+.0f%% matmul FLOPs", more == 0 ? 0.0 : more);
      spec = c.spec;
      return head + " as configured; chose " + c.what + ": planned peak " + step.memory.str() + "; estimated cost: communication " +
             ms(configured.comm_seconds) + " -> " + ms(step.comm_seconds) + " per step (alpha-beta), compute " + flops;
    }
    tried += "; " + c.what + " " + bytes(step.memory.peak_bytes);
    last = step;
  }
  if (spec.dims.dp_replicate == 1) tried += "; no data_parallel_replicate_degree to turn into sharding";
  std::string largest;
  for (const auto& h : last.memory.largest) largest += (largest.empty() ? "" : ", ") + h.what + (h.type.empty() ? "" : " " + h.type) + " " + bytes(h.bytes);
  throw std::invalid_argument("planned peak per rank " + configured.memory.str() + " is over the budget " + bytes(spec.memory_budget) +
                              ", and nothing spmdx tries fits (" + tried + "). Largest tensors held at the last one's peak: " + largest +
                              ". Raise the budget, add ranks or lower the batch or sequence length");
}

}  // namespace spmdx::job
