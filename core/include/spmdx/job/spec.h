// A training job as the config describes it, with every derived number resolved: the model,
// the mesh degrees, batch sizes, optimizer and schedule. The one place that turns
// config::Config into the pipeline's inputs, checking what the parts cannot check alone.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "spmdx/comm.h"
#include "spmdx/config/config.h"
#include "spmdx/core/registry.h"
#include "spmdx/data/text_dataset.h"
#include "spmdx/data/tokenizer.h"
#include "spmdx/hooks/hook_set.h"
#include "spmdx/job/balance.h"
#include "spmdx/models/model.h"
#include "spmdx/plan/runtime_plan.h"
#include "spmdx/sharding/parallelize.h"
#include "spmdx/train/activation_checkpoint.h"
#include "spmdx/train/mixed_precision.h"
#include "spmdx/train/pipeline.h"
#include "spmdx/train/train_step.h"

namespace spmdx::job {

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
  /// Every backend spec of the job (the chain's and swap_to), parsed once by job_spec into its
  /// plugin name and options, keyed by the text as written; a rank makes each backend from
  /// here. A spec that does not parse is absent (preflight refuses it, naming the key).
  std::map<std::string, PluginSpec> parsed{};
  /// The parsed form of `text`, or nullptr.
  const PluginSpec* find_parsed(const std::string& text) const {
    auto it = parsed.find(text);
    return it == parsed.end() ? nullptr : &it->second;
  }
  std::int64_t max_failures = 1;     ///< comm.max_failures: failures of one backend before the next replaces it
  std::int64_t failure_window = 100; ///< comm.failure_window: the steps over which they count
  /// Run-time failover: a step whose collectives fail runs again (on a rejoined or the next
  /// backend); on when the chain has a fallback.
  bool failover() const { return chain.size() > 1; }
};

/// [fault_tolerance] (torchtitan's section; torchft's replica groups): the replica groups are
/// the slices of the mesh along dp_replicate, which spmdx puts outermost (sharding::make_mesh),
/// so group g holds ranks [g x ranks_per_group, (g + 1) x ranks_per_group). Off: groups = 0.
struct FaultToleranceSpec {
  bool enable = false;
  std::int64_t groups = 0;           ///< fault_tolerance.group_size: replica groups (= dp_replicate)
  std::int64_t ranks_per_group = 1;  ///< world_size / groups
  std::int64_t min_replicas = 1;     ///< fault_tolerance.min_replica_size
  double timeout_seconds = 10;       ///< fault_tolerance.process_group_timeout_ms / 1000
};

/// Where a rank's tensors live and run ([training] device keys).
struct DeviceSpec {
  std::string kind = "cpu";  ///< training.device: "cpu", "cuda" (GPU LOCAL_RANK per rank) or "auto" (cuda where a local rank has a GPU)
  bool allow_tf32 = false;   ///< training.allow_tf32: TF32 matmuls on CUDA (off: losses compare with the CPU's)
  bool cuda_graphs = false;  ///< training.cuda_graphs: capture the step once, replay it each step
  std::string cpu_matmul = "auto";  ///< training.cpu_matmul: "auto", "onednn" or "aten" (exec::CpuMatmul)
  /// training.devices: one of "cpu", "cuda", "auto" per rank, in place of kind; empty when not given.
  std::vector<std::string> per_rank;
  /// Rank `rank`'s configured device: per_rank's entry, else kind (job/devices.h).
  const std::string& of(int rank) const { return per_rank.empty() ? kind : per_rank.at(static_cast<std::size_t>(rank)); }
  /// Every rank is configured "cpu" / "cuda" (what a check for one device may assume).
  bool all(const std::string& device) const {
    if (per_rank.empty()) return kind == device;
    for (const auto& d : per_rank) if (d != device) return false;
    return true;
  }
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
  train::LrSchedule schedule;  ///< [lr_scheduler], with training.steps
  std::uint64_t seed = 42;
  train::TrainStepConfig step;
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
  train::PipelineSpec pipeline;
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
  train::ActivationCheckpoint activation_checkpoint;  ///< [activation_checkpoint]
  train::MixedPrecision mixed_precision;              ///< training.mixed_precision_param, mixed_precision_reduce
  /// parallelism.strategy == "auto" (job/auto_sharding.h): choose_strategies picks the degrees
  /// and each op's placements.
  bool auto_strategy = false;
  std::string planner = "auto";          ///< parallelism.planner ("greedy": none)
  double planner_time_limit = 10;        ///< parallelism.planner_time_limit_seconds
  /// What the auto strategy chose per node (by id in the model's graph) and mesh dim: the
  /// strategy signature (sharding::signature) that place_job hands propagation; empty: greedy.
  std::map<std::int64_t, std::map<int, std::string>> auto_choices;
  std::string auto_report;               ///< the auto strategy's choice, for the start line
  bool auto_reused = false;              ///< that choice was read from <job.dump_folder>/auto_plan.json, not searched now
  std::int64_t memory_budget = 0;  ///< parallelism.memory_budget, bytes of a rank's planned peak (0: none; a planning.target's device memory when it names one)
  /// planning.target: the hardware plans are priced for (plan/target.h: "h100-sxm", "h200",
  /// "b200"), or "" for this machine (its calibration.json).
  std::string planning_target;
  std::string memory_budget_source;  ///< where memory_budget came from when not parallelism.memory_budget ("planning.target h100-sxm's device memory, 80 GB")
  std::string memory_fit;          ///< what fit_memory_budget (memory_budget.h) reported, for the start line
  CommSpec comm;              ///< [comm] but the plan's options
  FaultToleranceSpec fault_tolerance;  ///< [fault_tolerance]
  BalanceSpec balance;        ///< parallelism.balance, balance_interval, balance_threshold (job/balance.h)
  CheckpointSpec checkpoint;  ///< [checkpoint]
  DataSpec data;              ///< [data] and model.tokenizer
  OutputSpec output;          ///< job.dump_folder, [metrics], [debug], [profiling]
  ValidationSpec validation;  ///< [validation]
  hooks::HookSpec hooks;      ///< hooks.enable and [hooks.<name>] (hook_spec)
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

/// model.tokenizer's tokenizer: what a rank makes before its JobSpec, whose vocabulary it sets.
std::unique_ptr<data::Tokenizer> job_tokenizer(const config::Config& cfg);

/// Whether hooks.enable names any hook: a rank asks before its JobSpec, to block the signals its
/// hooks dump on before any thread starts (signals.h).
bool hooks_enabled(const config::Config& cfg);

/// CommSpec::chain from comm.backend, comm.fallback and comm.strict.
std::vector<std::string> comm_chain(const config::Config& cfg);

/// Why context parallelism splits the sequence in order ("" when it is load-balanced, 2 cp
/// pieces): load balancing permutes the positions, which it needs as inputs (the built-in
/// models' RoPE tables); an imported program makes its own (arange).
std::string context_parallel_in_order(const JobSpec& s);

/// The held-out data set's options: validation.paths, its global batch and training.seq_len,
/// data.seed and data.document_separator (the same documents and sampling as training's).
data::TextDatasetOptions validation_data(const JobSpec& spec);

/// registry.discover() over the config's plugins.paths, then SPMDX_PLUGIN_PATH and the
/// built-in folder (plugin_search_path).
void discover_plugins(PluginRegistry& registry, const config::Config& cfg);

}  // namespace spmdx::job
