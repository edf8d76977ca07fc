// `[parallelism] strategy = "auto"`: spmdx chooses the mesh and every op's placements from the
// calibrated cost model (plan/estimate.h), as Alpa does (Zheng et al., OSDI 2022): for each
// factorisation of the ranks into pp x dp_replicate x dp_shard x tp (cp as configured; pp as
// configured when pipeline_parallel_degree > 1, else every degree up to the model's layers, the
// layers split evenly), the default strategies place the parameters and batch, then each mesh dim's op strategies are
// chosen by an integer linear program over the rule table with resharding costs on edges
// (sharding::propagate_optimal, solved by a planner plugin: planner.h), and the plan the
// model predicts fastest within parallelism.memory_budget wins. `spmdx compile --strategy auto`
// prints the ranking and why; `spmdx run` starts the winner.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "spmdx/core/registry.h"
#include "spmdx/plan/estimate.h"
#include "spmdx/plan/target.h"
#include "spmdx/sharding/propagate.h"
#include "spmdx/job/spec.h"

namespace spmdx::job {

/// One layout the auto strategy planned.
struct AutoPlan {
  sharding::ParallelDims dims;   ///< the degrees of one pipeline stage's mesh
  std::int64_t stages = 1;       ///< pipeline stages (mesh dim pp, outermost)
  std::int64_t microbatches = 1; ///< the step's microbatches (the pipeline's, with stages)
  std::string schedule;          ///< parallelism.pipeline_parallel_schedule, with stages
  std::string layout;            ///< "pp 2 x dp_shard 2 x tp 2"
  std::string error;             ///< why it cannot run ("" when it can): a strategy's refusal, an uneven split
  plan::StepEstimate greedy;     ///< propagation's own plan, predicted
  plan::StepEstimate chosen;     ///< the plan kept: the planner's where predicted 2% faster, else greedy's
  bool planner_kept = false;     ///< the planner's plan is the one kept
  std::vector<sharding::IntraOpDim> intra;  ///< what the planner did per mesh dim
  bool fits = true;              ///< chosen.peak_bytes within parallelism.memory_budget (or no budget)
  std::map<std::string, std::int64_t> collectives;  ///< rank 0's collectives by op, in the plan kept
  std::map<std::int64_t, std::map<int, std::string>> choices;  ///< the planner's (JobSpec::auto_choices), when kept
  double plan_seconds = 0;       ///< planning this layout took
  /// activation_checkpoint.mode the search turned on to meet the budget ("" : as configured).
  std::string activation_checkpoint;
  std::int64_t layers = 0;       ///< the model's layers (pipeline stages cut between them; 0: none found)
  /// Pipelined with more than 4 microbatches: priced at 2 and 3 microbatches of the same rows and
  /// extrapolated (time, bytes and calls per microbatch; the peak per microbatch in flight), and
  /// propagation's plan kept (the planner is not run).
  bool extrapolated = false;
};

/// Every layout, ranked: those that fit by predicted step time, then those over the budget,
/// then those that cannot run.
struct AutoReport {
  std::int64_t world_size = 1;
  std::int64_t ranks_per_host = 1, cores = 1;
  std::int64_t memory_budget = 0;
  std::string planner;           ///< parallelism.planner
  plan::Calibration calibration;
  std::vector<AutoPlan> plans;
  double seconds = 0;            ///< the whole search
  bool tried_checkpointing = false;  ///< choose_auto tried activation checkpointing, and nothing fit
  /// Pipelined layouts not priced: beyond the first 4 (by the layout whose replicas their stages
  /// replace), while some layout priced fits the budget.
  std::size_t pipeline_layouts_skipped = 0;
  /// The ranking's top `top` (step ms, compute and comm ms, bytes sent per mesh dim, planned
  /// peak, the planner's work) and why the first wins over the next: the collectives it avoids.
  std::string text(std::size_t top = 5) const;
  /// {"format": "spmdx.auto/1", "chosen", "calibration", "plans": [{layout, dims, error, fits,
  /// step_seconds, compute_seconds, comm_seconds, comm_bytes_by_dim, peak_bytes, planner_kept,
  /// planner: [{mesh_dim, greedy_seconds, chosen_seconds, bound_seconds, optimal, changed,
  /// solve_seconds, solver}], collectives, greedy_step_seconds}]}.
  std::string json() const;
  /// "auto: chose dp_shard 4 of 6 layouts: predicted 41.20 ms a step (...); 1.21x faster than the next, ...".
  std::string line() const;
  /// line() and, against the next layout, the collectives the winner avoids, the bytes it sends
  /// and its compute.
  std::string why() const;
};

/// The ranks of a host the cost model assumes: LOCAL_WORLD_SIZE when set (torchrun's), else the
/// world size up to 64 ranks, else 8 (a planned mesh larger than one machine: hosts of 8).
std::int64_t planning_ranks_per_host(std::int64_t world_size);

/// The machine a plan is priced on: planning.target's device (its datasheet rates, 8 a host, one
/// rank a device) when spec names one, else this one (`measured`, planning_ranks_per_host, the
/// usable CPUs).
struct PlanningMachine {
  plan::Calibration calibration;
  std::int64_t ranks_per_host = 1, cores = 1;
  const plan::TargetProfile* target = nullptr;  ///< nullptr: this machine
};
PlanningMachine planning_machine(const JobSpec& spec, const plan::Calibration& measured);

/// Plans every layout of spec.world_size / cp ranks (spec's other settings as they are; with
/// spec.pipeline.stages > 1 only those of that many stages, else every stage count from 1 up to
/// the model's layers, Interleaved1F1B's half; a layout's microbatches are the global batch over
/// its data-parallel ranks in pipeline_microbatch_size rows)
/// with the calibration `c`: each by propagation, then the best 4 of them again with the
/// planner's choices (kept where predicted at least 2% faster), in order while spec.planner_time_limit
/// seconds last. Throws PluginError when parallelism.planner names no planner.
AutoReport plan_auto(const JobSpec& spec, PluginRegistry& registry, const plan::Calibration& c);

/// With spec.auto_strategy: plan_auto with <job.dump_folder>/calibration.json (defaults when
/// absent), and the first plan that fits made spec's (its degrees, its choices); when none fits
/// parallelism.memory_budget, the search again with selective, then full activation
/// checkpointing (as fit_memory_budget tries them); the report's
/// line goes to spec.auto_report. The search is kept in <job.dump_folder>/auto_plan.json and
/// reused while the job and the calibration are the same, so that every rank starts the plan
/// the launcher chose (a solver stopped by its time limit need not find the same plan twice).
/// With parallelism.balance = "speed": no pipelined layout is planned (a split of rows over
/// stages is not supported), and the speeds of balance_speeds, one per rank, become one per
/// data-parallel rank of the chosen layout (its slowest rank's).
/// Throws std::invalid_argument naming each layout's peak when none fits the budget, or each
/// layout's error when none can run.
AutoReport choose_auto(JobSpec& spec, PluginRegistry& registry);

/// What the auto line adds under parallelism.balance = "speed", for `spec` as choose_auto left
/// it: the balanced split of its layout and its predicted step against the even one
/// (estimate_balance, on <job.dump_folder>/calibration.json), and the split the run starts from
/// when it differs; or that a layout of one data-parallel rank has no batch to split, or that
/// without balance_speeds the split follows measured speeds. Computed where the line is
/// printed (rank 0), since every rank chooses.
std::string auto_balance_line(const JobSpec& spec, PluginRegistry& registry);

/// One rank's predicted step of `spec` as configured (rank 0; with pipeline stages every stage's
/// rank at position 0, combined by plan::pipeline_step): `spmdx compile --estimate`, on
/// planning_machine(spec, c).
plan::StepEstimate estimate_job(const JobSpec& spec, PluginRegistry& registry, const plan::Calibration& c);

/// parallelism.balance = "speed" planned: a data-parallel rank's predicted compute at speed 1 as a
/// line (estimate_job of rows_spec at the even rows and at half of them), each rank's that over
/// its parallelism.balance_speeds (1 each when not given), the even split and the split
/// balanced_rows makes of them, and each one's predicted step (the slowest rank's compute plus
/// the even plan's communication: the collectives move the parameters' and gradients' bytes,
/// whatever the rows). `start` is the split spmdx run starts from (Balancer::start: rows in
/// proportion to the speeds, before a step is measured), which the line's fixed part can make
/// differ from `balanced`. With one data-parallel rank every split is the whole batch.
struct BalanceEstimate {
  std::vector<double> speeds;
  RankCost line;  ///< seconds at speed 1: fixed + rows x per_row
  std::vector<std::int64_t> even, balanced, start;
  double comm_seconds = 0, even_seconds = 0, balanced_seconds = 0, start_seconds = 0;
  std::int64_t max_rows = 0;  ///< under parallelism.memory_budget, the most rows a rank may take (balance_max_rows; 0: no bound)
};
BalanceEstimate estimate_balance(const JobSpec& spec, PluginRegistry& registry, const plan::Calibration& c);

}  // namespace spmdx::job
