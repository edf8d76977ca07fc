#include "torchtitan_keys.h"

namespace spmdx::config {
namespace {

using K = TitanKey::Kind;

const std::vector<TitanKey>& table() {
  static const std::vector<TitanKey> keys = {
      // Aliases: the same setting under torchtitan's name (newer or older).
      {"checkpoint.enable_checkpoint", K::alias, "checkpoint.enable", {}, ""},
      {"lr_scheduler.lr_min", K::alias, "lr_scheduler.min_lr_factor", {}, ""},
      {"model.hf_assets_path", K::alias, "model.tokenizer", {}, ""},
      {"model.tokenizer_path", K::alias, "model.tokenizer", {}, ""},
      {"training.warmup_steps", K::alias, "lr_scheduler.warmup_steps", {}, ""},
      {"training.batch_size", K::alias, "training.local_batch_size", {}, ""},
      {"training.seed", K::alias, "job.seed", {}, ""},
      {"training.data_parallel_replicate_degree", K::alias, "parallelism.data_parallel_replicate_degree", {}, ""},
      {"training.data_parallel_shard_degree", K::alias, "parallelism.data_parallel_shard_degree", {}, ""},
      {"training.tensor_parallel_degree", K::alias, "parallelism.tensor_parallel_degree", {}, ""},
      // Features spmdx does not have yet: accepted only switched off.
      {"model.converters", K::unsupported, "model converters (float8, MX)", {"[]"}, ""},
      {"optimizer.early_step_in_backward", K::unsupported, "the optimizer step inside the backward", {"false"}, ""},
      {"training.dataset", K::unsupported, "torchtitan's named data sets (c4, c4_test)", {},
       "spmdx reads text or JSON Lines files: set data.paths"},
      {"training.dataset_path", K::unsupported, "torchtitan's data set folders", {}, "spmdx reads text or JSON Lines files: set data.paths"},
      {"training.enable_cpu_offload", K::unsupported, "CPU offload of FSDP state", {"false"}, ""},
      {"parallelism.pipeline_parallel_schedule_csv", K::unsupported, "pipeline schedules from a CSV file", {"\"\""}, "use pipeline_parallel_schedule"},
      {"parallelism.expert_tensor_parallel_degree", K::unsupported, "expert tensor parallelism", {"1"}, ""},
      {"parallelism.enable_async_tensor_parallel", K::unsupported, "async tensor parallelism", {"false"}, ""},
      {"checkpoint.export_dtype", K::unsupported, "exporting in another dtype", {"\"float32\""}, ""},
      {"checkpoint.create_seed_checkpoint", K::unsupported, "seed checkpoints", {"false"}, ""},
      {"checkpoint.exclude_from_loading", K::unsupported, "loading part of a checkpoint", {"[]"}, ""},
      {"checkpoint.load_only", K::unsupported, "load-only checkpointing", {"false"}, ""},
      {"validation.enabled", K::alias, "validation.enable", {}, ""},
      {"experimental.custom_import", K::unsupported, "importing Python modules", {"\"\""}, ""},
      {"experimental.custom_args_module", K::unsupported, "extending the config with Python", {"\"\""}, ""},
      // Ignored: nothing spmdx computes depends on them.
      {"job.description", K::ignored, "", {}, "a label for the run"},
      {"job.print_args", K::ignored, "", {}, "spmdx run --print-config prints the effective config"},
      {"job.print_config", K::ignored, "", {}, "spmdx run --print-config prints the effective config"},
      {"job.use_for_integration_test", K::ignored, "", {}, "torchtitan's own test suite"},
      {"job.config_file", K::ignored, "", {}, "spmdx takes the config file as its argument"},
      {"metrics.disable_color_printing", K::ignored, "", {}, "spmdx prints no colors"},
      {"metrics.enable_wandb", K::ignored, "", {}, "no Weights & Biases logging"},
      {"metrics.save_for_all_ranks", K::ignored, "", {}, "rank 0 writes the metrics"},
      {"metrics.rank_0_only", K::ignored, "", {}, "rank 0 writes the metrics"},
      {"model.print_after_conversion", K::ignored, "", {}, "no model converters"},
      {"optimizer.implementation", K::ignored, "", {}, "spmdx runs its own AdamW kernels (torchtitan's choice of PyTorch's)"},
      {"training.compile", K::ignored, "", {}, "spmdx always runs the train step as one compiled static graph"},
      {"training.gc_freq", K::ignored, "", {}, "Python's garbage collector"},
      {"training.gc_debug", K::ignored, "", {}, "Python's garbage collector"},
      {"training.deterministic", K::ignored, "", {}, "spmdx's kernels are deterministic"},
      {"parallelism.enable_compiled_autograd", K::ignored, "", {}, "spmdx differentiates its own graph"},
      {"checkpoint.initial_load_model_only", K::ignored, "", {}, "spmdx loads the weights alone from checkpoint.initial_load_path"},
      {"checkpoint.initial_load_in_hf", K::ignored, "", {}, "spmdx tells Hugging Face's names in checkpoint.initial_load_path from its own"},
      {"checkpoint.last_save_model_only", K::ignored, "", {}, "spmdx's last checkpoint keeps the optimizer state; spmdx export writes the weights alone"},
      {"checkpoint.last_save_in_hf", K::ignored, "", {}, "spmdx export writes the weights as safetensors"},
      {"checkpoint.async_mode", K::ignored, "", {}, "spmdx saves synchronously"},
      {"checkpoint.enable_first_step_checkpoint", K::ignored, "", {}, "spmdx saves every checkpoint.interval steps and at the end"},
      {"checkpoint.model_weights_only", K::ignored, "", {}, "spmdx export writes the weights alone"},
      {"comm.init_timeout_seconds", K::ignored, "", {}, "spmdx has one comm.timeout_seconds for start-up and training"},
      {"comm.train_timeout_seconds", K::ignored, "", {}, "spmdx has one comm.timeout_seconds for start-up and training"},
      {"comm.trace_buf_size", K::ignored, "", {}, "spmdx's flight recorder is a hook: hooks.enable = [\"flight_recorder\"], hooks.flight_recorder.size"},
      {"comm.save_traces_folder", K::ignored, "", {}, "the flight recorder writes <job.dump_folder>/hooks/flight_recorder"},
      {"activation_checkpoint.*", K::ignored, "", {},
       "it tunes torchtitan's checkpoint wrapper; spmdx's recomputation is a graph pass set by activation_checkpoint.mode and "
       "selective_ac_option, and changes the memory, not the numbers"},
      {"compile.*", K::ignored, "", {}, "spmdx always runs the train step as one compiled static graph"},
      {"float8.*", K::ignored, "", {}, "options of torchtitan's float8 converter, used only when model.converters lists it"},
      {"mx.*", K::ignored, "", {}, "options of torchtitan's MX converter, used only when model.converters lists it"},
      {"quantize.*", K::ignored, "", {}, "options of torchtitan's quantization converters, used only when model.converters lists them"},
      {"memory_estimation.*", K::ignored, "", {}, "spmdx compile prints the memory of each rank"},
      // torchtitan's FaultTolerance.semi_sync_method (None by default: every step commits).
      {"fault_tolerance.semi_sync_method", K::unsupported, "TorchFT's semi-synchronous training (local_sgd, diloco)", {"\"\""},
       "spmdx's fault tolerance commits every step, torchft's default: leave semi_sync_method unset"},
      {"fault_tolerance.process_group", K::ignored, "", {}, "TorchFT's process group (gloo, nccl): spmdx's collectives run on comm.backend"},
      // torchtitan's Streaming DiLoCo options (its ft experiment's FaultTolerance), read only with semi_sync_method.
      {"fault_tolerance.sync_steps", K::ignored, "", {}, "used only with semi_sync_method, which spmdx does not have"},
      {"fault_tolerance.should_quantize", K::ignored, "", {}, "used only with semi_sync_method, which spmdx does not have"},
      {"fault_tolerance.fragment_sync_delay", K::ignored, "", {}, "used only with semi_sync_method, which spmdx does not have"},
      {"fault_tolerance.fragment_update_alpha", K::ignored, "", {}, "used only with semi_sync_method, which spmdx does not have"},
      {"fault_tolerance.num_fragments", K::ignored, "", {}, "used only with semi_sync_method, which spmdx does not have"},
      {"fault_tolerance.module_fqns_per_model_fragment", K::ignored, "", {}, "used only with semi_sync_method, which spmdx does not have"},
      {"experimental.*", K::ignored, "", {}, "torchtitan's experimental options"},
      {"validation.dataset", K::ignored, "", {}, "torchtitan's named data sets; spmdx reads the text or JSON Lines files of validation.paths"},
      {"validation.dataset_path", K::ignored, "", {}, "torchtitan's data set location; spmdx reads the text or JSON Lines files of validation.paths "
                                                      "(e.g. validation.paths = [\"val.jsonl\"])"},
      {"profiling.profiler_active", K::ignored, "", {}, "spmdx profiles the whole of each chosen step (profiling.profile_freq)"},
      {"profiling.profiler_warmup", K::ignored, "", {}, "spmdx profiles the whole of each chosen step (profiling.profile_freq)"},
      {"profiling.enable_memory_snapshot", K::unsupported, "CUDA memory snapshots", {"false"}, ""},
      {"profiling.save_memory_snapshot_folder", K::ignored, "", {}, "used only with enable_memory_snapshot"},
  };
  return keys;
}

}  // namespace

const TitanKey* find_titan_key(const std::string& key) {
  for (const auto& k : table()) {
    if (k.key == key) return &k;
  }
  const std::string section = key.substr(0, key.find('.'));
  for (const auto& k : table()) {
    if (k.key == section + ".*") return &k;
  }
  return nullptr;
}

bool is_titan_section(const std::string& section) {
  for (const auto& k : table()) {
    if (k.key == section + ".*") return true;
  }
  return false;
}

}  // namespace spmdx::config
