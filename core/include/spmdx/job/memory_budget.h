// Planned memory and `[parallelism] memory_budget`: before any rank starts, spmdx knows the peak
// of a rank's step (plan/memory_plan.h) and, when it is over the budget, changes the job the way
// an FSDP user would, in order, until it fits.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "spmdx/core/registry.h"
#include "spmdx/plan/memory_plan.h"
#include "spmdx/job/compile.h"

namespace spmdx::job {

/// What one rank's step is planned to cost.
struct PlannedStep {
  plan::MemoryPlan memory;  ///< the rank's predicted peak (bytes) and what is held at it
  double comm_seconds = 0;  ///< the propagation's alpha-beta estimate of one rank's communication, seconds
  double flops = 0;         ///< the rank graph's FLOPs (sharding::node_flops: 2MNK per matmul)
};

/// Bytes of the copy of a rank's train state (parameters and AdamW state, train_state_names of
/// `params`, at their shapes in `rank_graph`) that each step starts from under run-time failover
/// (comm.fallback): what MemoryPlan::add_state_copy adds.
std::int64_t state_copy_bytes(const ir::Graph& rank_graph, const std::vector<std::string>& params);

/// Propagates `job`, makes `rank`'s graph (with pipeline stages, its stage's: rank_program) and
/// its RuntimePlan with spec.plan's options, and simulates it (plan_memory). `rank` -1: the
/// stage with the highest planned peak (each stage's first rank; rank 0 without stages).
PlannedStep plan_step(const PlacedJob& job, const JobSpec& spec, std::int64_t rank = 0);

/// parallelism.balance = "speed" under parallelism.memory_budget: the most rows a data-parallel
/// rank may take, the largest count whose plan (rows_spec with `choices`, rank 0's step) is
/// planned within the budget, by bisection between the even rows and all but one a rank for
/// each other rank; 0 without a budget or when every count fits. At least the even rows (the
/// even plan is fitted to the budget before, or said to be over it).
std::int64_t balance_max_rows(const JobSpec& spec, PluginRegistry& registry, const std::map<std::int64_t, std::map<int, std::string>>& choices);

/// parallelism.memory_budget (spec.memory_budget bytes; 0: none). When rank 0's planned peak
/// (with pipeline stages, the highest stage's) is over it, tries in order, each on top of the one before: FSDP resharding after the forward
/// (when data_parallel_shard_degree > 1 and it is off), selective activation checkpointing
/// ("op"), full activation checkpointing, then a higher data_parallel_shard_degree taken from
/// data_parallel_replicate_degree (a prime factor at a time: HSDP towards FSDP, DDP towards
/// FSDP) - and keeps the first that fits, changing `spec`. Returns the report for the start
/// line ("" without a budget): the peak as configured, what was chosen, its peak and its
/// estimated cost (communication seconds and FLOPs before and after). Throws
/// std::invalid_argument when nothing fits, naming each peak tried and the largest tensors held
/// at the last one's peak.
std::string fit_memory_budget(JobSpec& spec, PluginRegistry& registry);

}  // namespace spmdx::job
