// A job placed and compiled: the train step's graph, where its inputs go on the mesh (the
// strategy plugins), the propagated plan and the graph each rank runs.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "spmdx/core/registry.h"
#include "spmdx/hooks/hook_set.h"
#include "spmdx/job/spec.h"
#include "spmdx/models/model.h"
#include "spmdx/sharding/rewriter.h"
#include "spmdx/sharding/parallelize.h"
#include "spmdx/train/activation_checkpoint.h"
#include "spmdx/train/pipeline.h"

namespace spmdx::job {

/// The train step of a job, placed: the model's graph with backward, clipping and AdamW, and
/// the placements of every input (strategies for parameters and the batch, parameters' for
/// their optimizer state) and of every state output (as its input).
struct PlacedJob {
  models::Model model;
  sharding::DeviceMesh mesh;
  std::map<std::string, sharding::Placements> inputs;
  std::map<std::string, sharding::Placements> outputs;
  std::map<std::string, sharding::Placements> use;  ///< parameters' placements at use (FSDP unshard)
  bool reshard_after_forward = true;
  /// Who placed each mesh dim, one line per dim (sharding::parallelize's decided_by): printed
  /// by `spmdx compile` and in the run's first lines.
  std::vector<std::string> decided_by{};
  train::CheckpointReport checkpointed{};  ///< what activation checkpointing did to model.graph
  /// The mesh dim whose ranks shard the residual stream on the sequence (sequence parallelism:
  /// tp's index with parallelism.enable_sequence_parallel and tp > 1), or -1.
  int sequence_parallel_dim = -1;
  /// Fault tolerance's mesh dim (dp_replicate's index with fault_tolerance.enable), or -1: on it
  /// propagation sums and splits locally, nothing else (sharding::propagate).
  int fault_domain_dim = -1;
  /// Why sequence parallelism is off although the config asks for it ("" otherwise): tp is 1,
  /// or the graph has no norm (rms_norm, layer_norm) with a sequence of at least tp positions.
  std::string sequence_parallel_off{};
  /// The cp mesh dim's index (context parallelism, context_parallel_degree > 1), or -1.
  int context_parallel_dim = -1;
  /// With context parallelism: the pieces of the load-balanced sequence (2 cp), or 1 when the
  /// sequence is split in order ("context_parallel_order" says why).
  std::int64_t context_parallel_chunks = 1;
  std::string context_parallel_order{};
  bool context_parallel_allgather = true;  ///< JobSpec's
  /// Whether the loss is vocab_parallel_cross_entropy's (loss parallelism with tp > 1).
  bool loss_parallel = false;
  /// The auto strategy's choices (JobSpec::auto_choices on this graph's nodes); empty: greedy.
  sharding::ForcedChoices forced{};
  /// The pipeline's stages (first_layer resolved); stages 1: none. `mesh` is then one stage's:
  /// rank R plans as rank R % mesh.size() and runs stage R / mesh.size() (rank_program).
  train::PipelineSpec pipeline{};
};

/// sharding::propagate over the job's graph with its inputs, outputs, `use` placements, FSDP
/// resharding, sequence and context parallelism: the plan every rank builds before its first step.
sharding::DistributedPlan propagate_job(const PlacedJob& job);
/// The same with each mesh dim's strategies chosen by `planner` (sharding::propagate_optimal).
sharding::DistributedPlan propagate_job(const PlacedJob& job, const spmdx::Planner& planner, const sharding::IntraOpCostModel& cost,
                                        std::vector<sharding::IntraOpDim>* report = nullptr);

/// What context parallelism does in a propagated job (cp > 1), for spmdx run's banner and
/// spmdx compile: the tokens a rank holds, the order of the sequence, and how the plan runs
/// each attention (sdpa) on mesh dim cp.
struct ContextParallelSummary {
  std::int64_t degree = 1;           ///< cp
  std::int64_t tokens_per_rank = 0;  ///< seq_len / cp (seq_len without context parallelism)
  std::int64_t pieces = 1;           ///< 2 cp when load-balanced, else 1 (in order)
  std::string in_order_why{};        ///< why the sequence is split in order, when it is
  std::int64_t attentions = 0;       ///< sdpa nodes of the forward (of one microbatch's)
  std::int64_t query_rows = 0;       ///< of them, those splitting their query rows with k and v all-gathered
  std::int64_t all_to_all = 0;       ///< those splitting batch or heads (k, v and q moved by all_to_all)
  /// "context parallel: cp 2, 64 of 128 tokens a rank, load-balanced (4 pieces: rank r holds r
  /// and 3 - r); attention: 6 of 6 split their query rows and all-gather k and v".
  std::string line() const;
};
/// Throws nothing; `degree` 1 (and line() "") when the job has no context parallelism.
ContextParallelSummary context_parallel_summary(const JobSpec& spec, const PlacedJob& job, const sharding::DistributedPlan& plan);
/// Parameters kept whole on a mesh dim that shards parameters, because their dim 0 is shorter
/// than the dim's degree: fsdp keeps a parameter with fewer rows than ranks whole on every rank
/// (where FSDP2 pads it and leaves some ranks an empty shard), so fsdp 1000 on a model of
/// 256-wide weights shards nothing and every rank holds the whole model. One per such mesh dim:
/// a dim whose parameters left Replicate are all shorter than its degree, and that shards some
/// parameter or is dp_shard (FSDP's dim in torchtitan's mesh).
struct ShortParameters {
  std::string mesh_dim;   ///< "dp_shard"
  std::int64_t degree = 1;
  std::string strategy;   ///< the plugin bound to the dim ("fsdp": [parallelism.strategies]' or the default)
  struct Parameter {
    std::string name;
    std::vector<std::int64_t> shape;  ///< global
    std::int64_t bytes = 0;           ///< whole
  };
  std::vector<Parameter> parameters;  ///< in the model's order
  bool all = false;                   ///< every parameter of the model is among them
  /// What holding them whole costs a rank over an even share (1/degree) of them, in bytes:
  /// the parameters, their gradients and AdamW's two moments, 4 x (bytes - bytes / degree).
  std::int64_t extra_bytes = 0;
  /// "fsdp on dp_shard (1000 ranks) keeps every parameter (..., the whole model, 20.0 MiB) whole
  /// on every rank, not sharded: their dim 0 is shorter than 1000 (tok_embeddings.weight [264,
  /// 256], ... and 50 more); that costs each rank 79.9 MiB more than an even share of them (...)".
  std::string line() const;
};
/// Throws nothing; empty when every parameter a dim could shard is sharded.
std::vector<ShortParameters> short_parameters(const JobSpec& spec, const PlacedJob& job);

/// With tensor parallelism (mesh dim "tp" of more than one rank), a line for each parameter of
/// more than 1% of the model's parameters that the plan keeps whole (Replicate on tp) although
/// it is at least 2-D: "tensor_parallel on tp (2 ranks) keeps model.lm_head.weight [264, 64]
/// (12.3% of the model's parameters) whole on every tp rank: ...". What it costs is memory,
/// never numbers (a replicated weight computes the same values). Empty without tp.
std::vector<std::string> tp_replicated_parameters(const JobSpec& spec, const PlacedJob& job);

/// The model's train-step graph (with mixed precision and activation checkpointing as the spec
/// asks) and where its inputs go on the mesh, by the strategy plugins.
PlacedJob place_job(const JobSpec& spec, PluginRegistry& registry);

/// A job compiled: its train step placed and the plan every rank builds before its first step.
/// Made in place and never moved: the plan points at job.model.graph.
struct CompiledJob {
  CompiledJob(const JobSpec& spec, PluginRegistry& registry);  ///< as compile_job
  CompiledJob(const CompiledJob&) = delete;
  CompiledJob& operator=(const CompiledJob&) = delete;
  PlacedJob job;
  sharding::DistributedPlan plan;  ///< propagate_job(job)
};

/// place_job, then propagate_job: the one way `spmdx run`, `compile` and `diff`, the strategy
/// fallbacks and the auto planner compile a JobSpec (which preflight checked and made).
/// Throws what place_job and propagation throw (std::invalid_argument naming the plugin or op).
CompiledJob compile_job(const JobSpec& spec, PluginRegistry& registry);

/// The strategy `plan` took for each node on each mesh dim of size > 1 (sharding::taken_signature),
/// by node id in its logical graph: JobSpec::auto_choices, which make place_job's propagation take
/// them again (the auto strategy's chosen plan; parallelism.balance's plan for other rows, whose
/// costs alone could choose otherwise).
std::map<std::int64_t, std::map<int, std::string>> plan_choices(const sharding::DistributedPlan& plan);

/// parallelism.balance = "speed": every op's strategy as propagation takes it for at least 64 Ki
/// tokens a data-parallel rank (the job compiled for that batch; plan_choices). There moving
/// activations costs more than moving gradients, so every op keeps its rows (data parallelism
/// proper); at a few rows the costs can choose to all_gather activations between the
/// data-parallel ranks, which unequal rows cannot do. Every split's plan takes these.
std::map<std::int64_t, std::map<int, std::string>> balance_choices(const JobSpec& spec, PluginRegistry& registry);
/// `spec` as one data-parallel rank of `rows` rows plans it: the global batch dp x rows (every
/// data-parallel rank as many), `choices` (balance_choices') pinned.
JobSpec rows_spec(const JobSpec& spec, std::int64_t rows, const std::map<std::int64_t, std::map<int, std::string>>& choices);

/// What a validator hook (spec.hooks, e.g. partition_validator) says of a placed job, as it
/// would on rank 0 before the first step: "" when none objects (or none is enabled).
using PlanValidator = std::function<std::string(const PlacedJob&, const sharding::DistributedPlan&)>;
PlanValidator validator_hooks(const JobSpec& spec, PluginRegistry& registry);

/// With parallelism.fallback_strategies: the first layout ([parallelism.strategies], then each
/// fallback over it) whose plugins are found and place the job, that meets
/// parallelism.memory_budget (fit_memory_budget, whose report goes to memory_fit) and that
/// `validate` accepts, made `spec`'s; each one passed over is recorded with its reason
/// (strategies_passed_over). Every rank chooses alike from the same config and plugins.
/// Without fallbacks: only the memory budget's fit. Throws std::invalid_argument naming each
/// layout and why, when none serves.
void choose_strategies(JobSpec& spec, PluginRegistry& registry, const PlanValidator& validate);

/// The forward-only graph of validation ([validation]): the model's forward and loss (with the
/// train step's mixed precision) for validation.global_batch_size rows, and where its inputs
/// go: parameters and buffers as the train step's `job` places them (read at their use
/// placements, FSDP's unshard), the batch as the strategies place the train step's.
struct PlacedValidation {
  models::Model model;
  std::map<std::string, sharding::Placements> inputs;
};
PlacedValidation place_validation(const JobSpec& spec, const PlacedJob& job);

/// "dp_shard=fsdp, tp=tensor_parallel": a layout for messages ("the default strategies" when empty).
std::string layout_text(const std::map<std::string, std::string>& strategies);

/// The graph `rank` runs (sharding::rank_graph of `plan`), with keep_collective_outputs applied
/// when the spec checkpoints activations and asks for it; `kept` (if given): how many
/// collectives it merged.
ir::Graph rank_step_graph(const sharding::DistributedPlan& plan, std::int64_t rank, const JobSpec& spec, std::int64_t* kept = nullptr);
/// The graph global rank `rank` runs: rank_step_graph of its place on job.mesh, and with
/// pipeline stages its stage's part of it (stage_graph; `staged`, if given, what that made).
ir::Graph rank_program(const PlacedJob& job, const sharding::DistributedPlan& plan, std::int64_t rank, const JobSpec& spec, std::int64_t* kept = nullptr,
                       train::StageGraph* staged = nullptr);
/// The mesh the ranks run on: job.mesh, with pp outermost when the job has pipeline stages
/// (pipeline_mesh), which rank_program's collectives count their mesh dims in.
sharding::DeviceMesh run_mesh(const PlacedJob& job);

/// Bytes one rank holds for parameters (equal to its gradients'), and AdamW state (twice).
std::int64_t local_parameter_bytes(const PlacedJob& job, std::int64_t rank);

/// The context of hooks made to check a plan, not to run: rank 0's place in the job's mesh
/// (none without a placed job).
HookContext hook_context(std::int64_t world_size, const PlacedJob* job);

}  // namespace spmdx::job
