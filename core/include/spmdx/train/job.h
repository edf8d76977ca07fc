// A training job as the config describes it, with every derived number resolved: the model,
// the mesh degrees, batch sizes, optimizer and schedule. The one place that turns
// config::Config into the pipeline's inputs, checking what the parts cannot check alone.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "spmdx/comm.h"
#include "spmdx/config/config.h"
#include "spmdx/data/text_dataset.h"
#include "spmdx/data/tokenizer.h"
#include "spmdx/hooks/hook_set.h"
#include "spmdx/models/model.h"
#include "spmdx/sharding/rewriter.h"
#include "spmdx/plan/runtime_plan.h"
#include "spmdx/sharding/parallelize.h"
#include "spmdx/train/activation_checkpoint.h"
#include "spmdx/train/mixed_precision.h"
#include "spmdx/train/pipeline.h"
#include "spmdx/train/train_step.h"

namespace spmdx::train {

/// [comm] as a rank's run loop uses it (the plan's options are JobSpec::plan).
struct CommSpec {
  std::string backend = "auto";   ///< comm.backend: "auto" or "name[:key=value;...]" (comm/score_map.h)
  std::string swap_to;            ///< comm.swap_to: the backend hot-swapped to ("": none)
  std::int64_t swap_at_step = 0;  ///< comm.swap_at_step: swap every this many steps (0: never)
  double timeout_seconds = 300;   ///< comm.timeout_seconds: a collective or the rendezvous not done by then fails
  std::vector<MemoryType> memory{MemoryType::host};  ///< what training.device moves (comm::job_memory)
  /// The backends a rank may join, in order: comm.backend (when set, or when comm.fallback is
  /// empty), then comm.fallback without repeats; with comm.strict, comm.backend alone.
  std::vector<std::string> chain{"auto"};
  std::int64_t max_failures = 1;     ///< comm.max_failures: failures of one backend before the next replaces it
  std::int64_t failure_window = 100; ///< comm.failure_window: the steps over which they count
  /// Run-time failover: a step whose collectives fail runs again (on a rejoined or the next
  /// backend); on when the chain has a fallback.
  bool failover() const { return chain.size() > 1; }
};

/// Where a rank's tensors live and run ([training] device keys).
struct DeviceSpec {
  std::string kind = "cpu";  ///< training.device: "cpu", or "cuda" (GPU LOCAL_RANK per rank)
  bool allow_tf32 = false;   ///< training.allow_tf32: TF32 matmuls on CUDA (off: losses compare with the CPU's)
  bool cuda_graphs = false;  ///< training.cuda_graphs: capture the step once, replay it each step
  std::string cpu_matmul = "auto";  ///< training.cpu_matmul: "auto", "onednn" or "aten" (exec::CpuMatmul)
};

/// [checkpoint]: where and when a rank saves, and what it resumes from.
struct CheckpointSpec {
  bool enable = false;           ///< checkpoint.enable
  std::filesystem::path folder;  ///< <job.dump_folder>/<checkpoint.folder>
  std::int64_t interval = 0;     ///< checkpoint.interval, in steps (and always at the last step)
  std::int64_t load_step = -1;   ///< checkpoint.load_step: resume from this step (-1: the latest, if any)
  /// checkpoint.initial_load_path: the weights a job with nothing to resume starts from (a
  /// .safetensors file or a folder of them; models/weights.h); empty: the seeded initialisation.
  std::filesystem::path initial_load_path;
  /// checkpoint.keep_latest_k: after a save, the complete checkpoints kept, the oldest deleted
  /// (torchtitan's _purge_stale_checkpoints); 0 keeps all.
  std::int64_t keep_latest_k = 0;
};

/// [data] and the tokenizer: what every rank reads.
struct DataSpec {
  std::vector<std::string> paths;  ///< data.paths: text or JSON Lines files
  std::uint64_t seed = 0;          ///< data.seed: the order of the samples
  std::string tokenizer;           ///< model.tokenizer: "byte" or a tokenizer.json (folder)
  std::string document_separator;  ///< data.document_separator: splits text files into documents ("" off)
};

/// What a run writes besides checkpoints: job.dump_folder, [metrics], [debug].
struct OutputSpec {
  std::filesystem::path dump_folder;  ///< job.dump_folder: metrics.jsonl, debug/, checkpoints
  std::int64_t log_freq = 1;          ///< metrics.log_freq: a printed line every this many steps
  bool dump_initial_weights = false;  ///< debug.dump_initial_weights: debug/initial.safetensors
  bool dump_batches = false;          ///< debug.dump_batches: debug/batches/step-N.{tokens,labels}.npy
  /// metrics.enable_tensorboard: rank 0's event files in tensorboard_folder (empty: off), the
  /// folder job.dump_folder / metrics.save_tb_folder / YYYYmmdd-HHMM as torchtitan's.
  std::filesystem::path tensorboard_folder;
  /// [profiling]: Kineto traces of every profile_freq-th step in
  /// job.dump_folder / save_traces_folder / iteration_N / rankR_trace.json (0: off).
  std::int64_t profile_freq = 0;
  std::filesystem::path traces_folder;
};

/// [validation] (torchtitan's): every `freq` steps, the mean loss of `steps` batches of
/// held-out text, by a forward-only graph of the same model on the same mesh.
struct ValidationSpec {
  bool enable = false;
  std::vector<std::string> paths;  ///< validation.paths: text or JSON Lines files
  std::int64_t freq = 500;
  std::int64_t steps = -1;          ///< batches per validation; -1: as many as the held-out tokens fill once (resolved at run time)
  std::int64_t global_batch_size = 8;  ///< validation.local_batch_size x the data-parallel degree
};

struct JobSpec {
  models::ModelArgs model;
  sharding::ParallelDims dims;
  std::int64_t world_size = 1;
  std::int64_t global_batch_size = 8;  ///< rows per step, all ranks
  std::int64_t seq_len = 256;
  std::int64_t steps = 10;
  double lr = 8e-4;
  LrSchedule schedule;  ///< [lr_scheduler], with training.steps
  std::uint64_t seed = 42;
  TrainStepConfig step;
  /// FSDP frees gathered parameters after the forward and gathers them again for the backward
  /// (parallelism.fsdp_reshard_after_forward: "default" and "always" do, "never" keeps them).
  bool reshard_after_forward = true;
  /// [parallelism.tp_plan]: parameter glob -> colwise | rowwise | replicate | shard(d), the
  /// tensor_parallel strategy's options (empty: its built-in plan).
  std::map<std::string, std::string> tp_plan;
  /// parallelism.enable_sequence_parallel: with tensor parallelism, the residual stream and the
  /// norms are sharded on the sequence over tp (Megatron-SP; sharding::propagate).
  bool sequence_parallel = false;
  /// parallelism.context_parallel_load_balance: with context parallelism, the sequence in
  /// 2 cp pieces, rank r of cp holding pieces r and 2 cp - 1 - r (train/context_parallel.h).
  bool context_parallel_load_balance = true;
  /// parallelism.context_parallel_rotate_method == "allgather" (else "auto"; sharding::propagate).
  bool context_parallel_allgather = true;
  /// !parallelism.disable_loss_parallel: with tensor parallelism, cross entropy runs on the
  /// vocabulary-sharded logits (vocab_parallel_cross_entropy) instead of gathering them.
  bool loss_parallel = false;
  /// parallelism.pipeline_parallel_degree, _schedule and the microbatches (first_layer is
  /// resolved by place_job, from pipeline_split_points or pipeline_layers_per_stage).
  PipelineSpec pipeline;
  std::vector<std::string> pipeline_split_points;  ///< parallelism.pipeline_parallel_split_points
  std::int64_t pipeline_layers_per_stage = -1;     ///< parallelism.pipeline_parallel_layers_per_stage (-1: unset)
  std::int64_t pipeline_microbatch_size = 1;      ///< parallelism.pipeline_parallel_microbatch_size: rows a data-parallel rank's microbatch has
  plan::PlanOptions plan;  ///< [comm] bucket caps, overlap, prefetch (plan_options)
  /// [parallelism.strategies]: mesh dim -> the strategy plugin that decides it, where the
  /// config names one (others: sharding::strategy_for's defaults).
  std::map<std::string, std::string> strategies;
  /// parallelism.fallback_strategies: the layouts tried after `strategies`, in order, each
  /// `strategies` with the entry's bindings over it (empty with parallelism.strict).
  std::vector<std::map<std::string, std::string>> fallback_strategies;
  /// The layouts choose_strategies passed over, in order: {the layout, why}.
  std::vector<std::pair<std::string, std::string>> strategies_passed_over;
  DeviceSpec device;          ///< training.device, allow_tf32, cuda_graphs
  ActivationCheckpoint activation_checkpoint;  ///< [activation_checkpoint]
  MixedPrecision mixed_precision;              ///< training.mixed_precision_param, mixed_precision_reduce
  /// parallelism.strategy == "auto" (train/auto_sharding.h): choose_strategies picks the degrees
  /// and each op's placements.
  bool auto_strategy = false;
  std::string planner = "auto";          ///< parallelism.planner ("greedy": none)
  double planner_time_limit = 10;        ///< parallelism.planner_time_limit_seconds
  /// What the auto strategy chose per node (by id in the model's graph) and mesh dim: the
  /// strategy signature (sharding::signature) that place_job hands propagation; empty: greedy.
  std::map<std::int64_t, std::map<int, std::string>> auto_choices;
  std::string auto_report;               ///< the auto strategy's choice, for the start line
  std::int64_t memory_budget = 0;  ///< parallelism.memory_budget, bytes of a rank's planned peak (0: none)
  std::string memory_fit;          ///< what fit_memory_budget (memory_budget.h) reported, for the start line
  CommSpec comm;              ///< [comm] but the plan's options
  CheckpointSpec checkpoint;  ///< [checkpoint]
  DataSpec data;              ///< [data] and model.tokenizer
  OutputSpec output;          ///< job.dump_folder, [metrics], [debug], [profiling]
  ValidationSpec validation;  ///< [validation]
};

/// The RuntimePlan's options from [comm]: bucket_cap_mb and first_bucket_cap_mb (MiB ->
/// bytes), overlap, prefetch.
plan::PlanOptions plan_options(const config::Config& cfg);

/// The hooks the config enables (hooks.enable; options from [hooks.<name>]; job.dump_folder).
/// An options table of a hook that hooks.enable does not list is ignored with a warning naming
/// where it was set (a command line may enable other hooks than the file), unless its name is
/// a near miss of an enabled hook: then a problem (its options would be lost).
hooks::HookSpec hook_spec(const config::Config& cfg);

/// The config keys of the mesh's degrees (dp_replicate, dp_shard, tp, cp), for messages about them.
inline const std::vector<std::string> kDegreeKeys{"parallelism.data_parallel_replicate_degree", "parallelism.data_parallel_shard_degree",
                                                  "parallelism.tensor_parallel_degree", "parallelism.context_parallel_degree"};

/// The ranks the config's degrees make when data_parallel_shard_degree is given (-1, "the
/// ranks left", counts as 1): what `spmdx compile` plans for and a lone `spmdx run` would need.
std::int64_t degree_product(const config::Config& cfg);

/// Resolves the config for `world_size` ranks and a tokenizer of `vocab_size` ids:
/// data_parallel_shard_degree -1 takes the ranks the other degrees leave; the global batch is
/// global_batch_size, or local_batch_size x the data-parallel degree. For model.name "pt2" the
/// program is imported: its exported tokens [batch, seq] are the global batch and seq_len (a
/// config that sets either otherwise is refused, naming both), its logits' classes the vocab
/// (a tokenizer with more ids is refused). Throws
/// config::ConfigError naming the key when the degrees do not multiply to world_size, the
/// global batch does not split evenly over the data-parallel ranks, or tensor_parallel_degree
/// does not divide the model's head count. When the degrees do not multiply to world_size the
/// message says what to change: the ranks to start (with `start_flag`, e.g. "--nproc" or
/// "--world-size", when the caller's command line starts or counts them by a flag) or a
/// degree, as the flag that fits ("--parallelism.data_parallel_shard_degree -1").
JobSpec job_spec(const config::Config& cfg, std::int64_t world_size, std::int64_t vocab_size, const std::string& start_flag = "");

/// Checks what this build can run before any rank starts: training.device "cpu", data.paths
/// non-empty and every file present, and a swap schedule names what to swap to. Throws config::ConfigError naming the
/// key and what to do.
void check_runnable(const config::Config& cfg);

/// Reads and tokenizes the job's data as every rank will (so that a file without text, a JSON
/// Lines record without "text", or data shorter than seq_len + 1 tokens fails before any rank
/// starts), and checks that job.dump_folder can be made. Throws config::ConfigError or
/// std::runtime_error naming the file.
void check_data(const config::Config& cfg, const data::Tokenizer& tokenizer, const JobSpec& spec);

/// CommSpec::chain from comm.backend, comm.fallback and comm.strict.
std::vector<std::string> comm_chain(const config::Config& cfg);

/// What a preflight is for: a run checks everything; a plan (`spmdx compile`) what planning
/// needs (no data files or comm backends; the hooks' options, but not their compile stages,
/// which compile runs itself).
enum class Preflight { run, plan };

/// Every check of a job that needs no rank, each problem collected (none stops the others that
/// do not depend on it): the tokenizer; job_spec; the plugins found; the strategies'
/// placements and rank 0's local shapes (what `spmdx compile` finds); and for a run also
/// check_runnable, the comm backends named by comm.backend and comm.swap_to when world_size > 1
/// (made, not initialised, so that each checks its options, and refused when none of their
/// capabilities moves the memory of training.device), and the hooks (every option of every
/// hook, then their compile stages, so that a validator's verdict comes before any rank
/// starts). Returns the messages, a line each, for Config::check; a hook option's names where
/// the config set it. `spec` and `tokenizer` are set when they could be made. Keys that already
/// have a problem in the config (Config::has_problem) are not checked again. `start_flag`: as
/// job_spec's.
std::vector<std::string> preflight(const config::Config& cfg, std::int64_t world_size, PluginRegistry& registry, std::unique_ptr<data::Tokenizer>* tokenizer,
                                   std::optional<JobSpec>* spec, Preflight what = Preflight::run, const std::string& start_flag = "");

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
  CheckpointReport checkpointed{};  ///< what activation checkpointing did to model.graph
  /// The mesh dim whose ranks shard the residual stream on the sequence (sequence parallelism:
  /// tp's index with parallelism.enable_sequence_parallel and tp > 1), or -1.
  int sequence_parallel_dim = -1;
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
  PipelineSpec pipeline{};
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

/// The model's train-step graph (with mixed precision and activation checkpointing as the spec
/// asks) and where its inputs go on the mesh, by the strategy plugins.
PlacedJob place_job(const JobSpec& spec, PluginRegistry& registry);

/// What a validator hook (hooks.enable, e.g. partition_validator) says of a placed job, as it
/// would on rank 0 before the first step: "" when none objects (or none is enabled).
using PlanValidator = std::function<std::string(const PlacedJob&, const sharding::DistributedPlan&)>;
PlanValidator validator_hooks(const config::Config& cfg, PluginRegistry& registry, std::int64_t world_size);

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
/// The held-out data set's options: validation.paths, its global batch and training.seq_len,
/// data.seed and data.document_separator (the same documents and sampling as training's).
data::TextDatasetOptions validation_data(const JobSpec& spec);

/// "dp_shard=fsdp, tp=tensor_parallel": a layout for messages ("the default strategies" when empty).
std::string layout_text(const std::map<std::string, std::string>& strategies);


/// The graph `rank` runs (sharding::rank_graph of `plan`), with keep_collective_outputs applied
/// when the spec checkpoints activations and asks for it; `kept` (if given): how many
/// collectives it merged.
ir::Graph rank_step_graph(const sharding::DistributedPlan& plan, std::int64_t rank, const JobSpec& spec, std::int64_t* kept = nullptr);
/// The graph global rank `rank` runs: rank_step_graph of its place on job.mesh, and with
/// pipeline stages its stage's part of it (stage_graph; `staged`, if given, what that made).
ir::Graph rank_program(const PlacedJob& job, const sharding::DistributedPlan& plan, std::int64_t rank, const JobSpec& spec, std::int64_t* kept = nullptr,
                       StageGraph* staged = nullptr);
/// The mesh the ranks run on: job.mesh, with pp outermost when the job has pipeline stages
/// (pipeline_mesh), which rank_program's collectives count their mesh dims in.
sharding::DeviceMesh run_mesh(const PlacedJob& job);

/// "" when `spec_text` (comm.backend's form: "auto" or "name[:key=value;...]") names a comm
/// backend that can serve ranks in processes on `device` ("cpu" or "cuda"); else what is
/// wrong, worded to follow `key = "spec"`: not found (with the names found and a hint at
/// plugins.paths), an in-process-only plugin, options it refuses, malformed capabilities, memory
/// it does not move, or, for "auto", that none is found or that "auto" takes no options.
std::string comm_backend_problem(PluginRegistry& registry, const std::string& spec_text, const std::string& device);

/// registry.discover() over the config's plugins.paths, then SPMDX_PLUGIN_PATH and the
/// built-in folder (plugin_search_path).
void discover_plugins(PluginRegistry& registry, const config::Config& cfg);

/// Bytes one rank holds for parameters (equal to its gradients'), and AdamW state (twice).
std::int64_t local_parameter_bytes(const PlacedJob& job, std::int64_t rank);

}  // namespace spmdx::train
