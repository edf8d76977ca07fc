// One rank's steps: the batch, the step through the executor, the fault a test planted, the
// hooks, a hot-swap or a failover of the comm backend, the metrics and the checkpoints.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "spmdx/comm.h"
#include "spmdx/core/registry.h"
#include "spmdx/data/text_dataset.h"
#include "spmdx/exec/checkpoint.h"
#include "spmdx/exec/device.h"
#include "spmdx/exec/distributed.h"
#include "spmdx/exec/profiler.h"
#include "spmdx/hooks/hook_set.h"
#include "spmdx/job/balance.h"
#include "spmdx/job/comm_chain.h"
#include "spmdx/job/compile.h"
#include "spmdx/job/fault_injection.h"
#include "spmdx/job/fault_tolerance.h"
#include "spmdx/job/metrics.h"
#include "spmdx/job/validation.h"
#include "spmdx/launch/launcher.h"
#include "spmdx/train/mixed_precision.h"

namespace spmdx::job {

// A step whose collectives failed on some rank (the ranks' vote said so, or this rank's own
// call threw): it runs again, after CommChain::replace, from the state before it.
struct StepFailed : std::runtime_error {
  StepFailed(const std::string& why, bool voted_on) : std::runtime_error(why), voted(voted_on) {}
  bool voted;  ///< the ranks voted already: what() is the verdict every rank has
};

// Fault tolerance dropped the step on every live rank (the vote said so): the state is as before
// it, the live ranks rejoined, and the step runs again.
struct StepDropped {};

// One rank's step loop: the batch, the step through the executor, the fault a test planted,
// the hooks, a hot-swap of the comm backend, the metrics and checkpoints.
struct StepLoop {
  const launch::RankEnv& env;
  const JobSpec& spec;
  const PlacedJob& job;
  const sharding::DistributedPlan& plan;
  exec::DistributedExecutor* executor;  // replaced when parallelism.balance re-plans this rank's rows
  exec::Device& device;
  exec::TensorMap& state;
  const std::map<std::string, ir::TensorMeta>& state_metas;
  const std::map<std::string, sharding::Placements>& state_placements;  // every stage's
  data::TextDataset& dataset;
  hooks::HookSet& hooks;
  PluginRegistry& registry;
  std::unique_ptr<CommBackend>& backend;
  CommChain* chain;  // null for one rank
  Store* store;
  MetricsWriter* metrics;  // rank 0's
  const Fault& fault;
  double timeout;
  std::filesystem::path ckpt_dir;
  std::string tokenizer_id;
  bool lead = env.rank == 0;
  bool checkpointing = spec.checkpoint.enable;
  std::int64_t log_freq = spec.output.log_freq;
  bool dump_batches = spec.output.dump_batches;
  std::filesystem::path batches_dir = spec.output.dump_folder / "debug" / "batches";
  std::vector<std::int64_t> coord = job.mesh.coordinate(env.rank % job.mesh.size());
  const sharding::Placements& tokens_pl = plan.placement.at(job.model.graph.find_input("tokens"));
  const sharding::Placements& labels_pl = plan.placement.at(job.model.graph.find_input("labels"));
  // The state this rank updates (with pipeline stages, its stage's).
  std::vector<std::string> names = [this] {
    std::vector<std::string> out;
    for (auto& n : train::step_state_names(job.model.graph, job.model.params)) {
      if (state.count(n) > 0) out.push_back(std::move(n));
    }
    return out;
  }();
  // training.cuda_graphs: the step captured once (at the second step run: the first warms up
  // cuBLAS and the caching allocator eagerly, as torch.cuda.graph asks), its fixed input
  // buffers (the state tensors themselves, the batch, lr and step) and outputs.
  std::unique_ptr<exec::CapturedStep> graph{};
  exec::TensorMap graph_feed{}, graph_out{};
  exec::RunStats graph_stats{};
  bool warmed_up = false;
  // float16: the loss scale (torch.amp.GradScaler's), and the AdamW updates applied so far
  // (a step whose gradients overflow is skipped: its "step" is given to the next one).
  bool loss_scaling = spec.step.loss_scaling;
  train::GradScaler scaler{spec.mixed_precision.init_scale, spec.mixed_precision.growth_interval};
  std::int64_t optimizer_steps = 0;
  bool over_budget_said = false;  // the warning of a measured peak over parallelism.memory_budget, once
  // Run-time failover (comm.fallback): each step starts from a copy of the state, the data
  // position, the optimizer's count and the loss scale, and ends with a vote of every rank that
  // its collectives completed; a step that failed anywhere runs again from the copy.
  bool failover = chain != nullptr && spec.comm.failover();
  // spec.comm with the memory the ranks' devices need (job/devices.h): what a hot-swap joins.
  const CommSpec* comm_spec = &spec.comm;
  exec::TensorMap before{};
  data::TextDatasetState data_before{};
  std::int64_t optimizer_steps_before = 0;
  train::GradScaler scaler_before{};
  std::int64_t recoveries = 0;  // every rank's count of steps run again: part of each vote's key
  std::size_t events_told = 0;  // of chain->events(), said in a metrics row
  std::vector<FallbackEvent> strategy_events{};  // the layouts passed over at start, for the first row
  std::int64_t planned_peak = 0;  // bytes: the memory plan's peak of the step, with the failover's state copy
  Validation* validation = nullptr;  // [validation]
  exec::StepProfiler* profiler = nullptr;  // [profiling]
  const exec::PipelineStages* pipeline_stages = nullptr;  // which stage holds each state tensor
  // [fault_tolerance]: this rank's side (null: off); the lead's role (metrics.jsonl, the step
  // lines) moves to the lowest live rank, on_lead_change(true, first step) opening its metrics
  // and (false, _) closing them; a checkpoint due while a group is away is written whole by
  // the live groups.
  FaultTolerance* ft = nullptr;
  std::vector<ProcessFault> process_faults{};  // SPMDX_FAULT's kill, stop, slow, hold at start and commit (each fires once a job)
  double slowdown_in_force = 1;  // SPMDX_FAULT's slow factor in force on this rank (compute_slowdown())
  std::function<void(bool, std::int64_t)> on_lead_change{};
  // parallelism.balance = "speed": the split of the global batch in force (this rank feeds rows
  // [offset, offset + rows) of it), and what makes this rank's executor for its rows when the
  // split changes (every rank calls it at the same step: it makes the backend's groups anew).
  Balancer* balancer = nullptr;
  std::function<void()> replan{};
  std::int64_t ft_next_config = 0;  // the configuration the last vote opened
  // The lead's line when the live groups changed: "from step N, k of R replica groups train".
  void say_configuration();
  std::int64_t drops = 0;           // times the step now running was dropped (metrics.jsonl's `dropped`)
  std::int64_t replicas_said = -1;  // the live groups last said on a line

  // Fault tolerance: moves to configuration `id` (after step `after_step`): leaves the backend,
  // joins the live ranks' one, gives the joining groups the state, and votes that it all went
  // through; a move that failed goes on to the next configuration. A restarted rank starts here
  // (after_step: where the live groups are).
  void reconfigure(std::int64_t id, std::int64_t after_step);
  // A restarted rank, joined to the configuration that took it in: receives the state and where
  // training stands, and returns the step it trains first.
  std::int64_t join_restarted();

  // Where a resumed job's checkpoint left the optimizer's count and, for float16, the loss
  // scale (a count past this run's growth interval grows it at the next clean step).
  void resume(const exec::CheckpointMeta& meta);

  // This rank's part of each microbatch of `global` ([global batch, seq] ids) as the graph's
  // inputs `name`, `name`.1, ...: a data-parallel rank's rows [d B/dp, (d+1) B/dp) split in
  // order, microbatch k taking rows [k b, (k+1) b) of them (b = B / (dp x microbatches)), so
  // that the microbatches together are the rows the rank reads without accumulation.
  void feed_microbatches(exec::TensorMap& feed, const char* name, const at::Tensor& global, const sharding::Placements& pl, const c10::Device& on) const;

  // The step through the executor, or through the captured CUDA graph.
  exec::TensorMap run_step(exec::TensorMap& feed, std::int64_t step);

  // Runs step `step` (1-based) and returns its loss. Throws std::runtime_error for a loss that
  // is not finite and what the executor, the backend or the checkpoint writer throw.
  double step(std::int64_t step);

  std::string vote_key(std::int64_t step) const { return "spmdx/step/s" + std::to_string(step) + "/r" + std::to_string(recoveries); }

  // Step `step` failed (StepFailed): every rank learns why through the step's vote, the backend
  // is replaced (CommChain::replace: rejoined, or the next of the chain) and the state, the
  // data position, the optimizer's count and the loss scale are put back as they were before it.
  void recover(std::int64_t step, const StepFailed& f);

  // Runs steps first_step .. spec.steps; returns the first one's loss and the last one's.
  std::pair<double, double> run(std::int64_t first_step, bool serves_store);
};

}  // namespace spmdx::job
