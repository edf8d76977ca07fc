#include "spmdx/train/job.h"

#include <filesystem>

#include "spmdx/data/text_dataset.h"
#include "spmdx/sharding/spec.h"

namespace spmdx::train {

JobSpec job_spec(const config::Config& cfg, std::int64_t world_size, std::int64_t vocab_size) {
  // `keys`: those the message is about, so that it says where their values came from.
  auto fail = [&](const std::vector<std::string>& keys, const std::string& why) { throw config::ConfigError(cfg.where(keys) + ": " + why); };
  JobSpec s;
  s.world_size = world_size;
  s.model = models::model_args(cfg.get_string("model.name"), cfg.get_string("model.flavor"), vocab_size);
  s.dims.dp_replicate = cfg.get_int("parallelism.data_parallel_replicate_degree");
  s.dims.tp = cfg.get_int("parallelism.tensor_parallel_degree");
  s.dims.dp_shard = cfg.get_int("parallelism.data_parallel_shard_degree");
  if (s.dims.dp_shard == -1) {
    const std::int64_t rest = s.dims.dp_replicate * s.dims.tp;
    if (world_size % rest != 0) {
      fail(kDegreeKeys, "parallelism.data_parallel_replicate_degree x tensor_parallel_degree = " + std::to_string(rest) +
           " does not divide world_size " + std::to_string(world_size));
    }
    s.dims.dp_shard = world_size / rest;
  } else if (s.dims.dp_shard < 1) {
    fail({"parallelism.data_parallel_shard_degree"}, "parallelism.data_parallel_shard_degree must be >= 1 or -1");
  }
  const std::int64_t product = s.dims.dp_replicate * s.dims.dp_shard * s.dims.tp;
  if (product != world_size) {
    fail(kDegreeKeys, "parallelism degrees multiply to " + std::to_string(product) + " (" + std::to_string(s.dims.dp_replicate) + " x " +
         std::to_string(s.dims.dp_shard) + " x " + std::to_string(s.dims.tp) + "), but world_size is " + std::to_string(world_size));
  }
  if (s.model.name == "llama" && s.model.n_heads % s.dims.tp != 0) {
    fail({"parallelism.tensor_parallel_degree", "model.name", "model.flavor"}, "parallelism.tensor_parallel_degree " + std::to_string(s.dims.tp) + " does not divide the " + std::to_string(s.model.n_heads) +
         " attention heads of " + s.model.name + " " + s.model.flavor);
  }
  const std::int64_t dp = s.dims.dp_replicate * s.dims.dp_shard;
  const std::int64_t global = cfg.get_int("training.global_batch_size");
  s.global_batch_size = global > 0 ? global : cfg.get_int("training.local_batch_size") * dp;
  if (s.global_batch_size % dp != 0) {
    fail({"training.global_batch_size", "training.local_batch_size", kDegreeKeys[0], kDegreeKeys[1]}, "training.global_batch_size " + std::to_string(s.global_batch_size) + " does not split over the " + std::to_string(dp) +
         " data-parallel ranks: make it a multiple of " + std::to_string(dp));
  }
  s.seq_len = cfg.get_int("training.seq_len");
  s.steps = cfg.get_int("training.steps");
  s.warmup_steps = cfg.get_int("lr_scheduler.warmup_steps");
  s.lr = cfg.get_float("optimizer.lr");
  s.min_lr_factor = cfg.get_float("lr_scheduler.min_lr_factor");
  s.seed = static_cast<std::uint64_t>(cfg.get_int("job.seed"));
  s.reshard_after_forward = cfg.get_string("parallelism.fsdp_reshard_after_forward") != "never";
  s.step.max_norm = cfg.get_float("training.max_norm");
  s.step.adamw = {cfg.get_float("optimizer.beta1"), cfg.get_float("optimizer.beta2"), cfg.get_float("optimizer.eps"),
                  cfg.get_float("optimizer.weight_decay")};
  return s;
}

void check_runnable(const config::Config& cfg) {
  auto fail = [&](const std::vector<std::string>& keys, const std::string& why) { throw config::ConfigError(cfg.where(keys) + ": " + why); };
  if (cfg.get_string("training.device") != "cpu") {
    fail({"training.device"}, "training.device = \"" + cfg.get_string("training.device") + "\": this build runs on the CPU only; use \"cpu\"");
  }
  if (cfg.get_list("data.paths").empty()) fail({"data.paths"}, "data.paths is empty: name text or JSON Lines files to train on");
  for (const auto& p : cfg.get_list("data.paths")) {
    std::error_code ec;
    if (!std::filesystem::is_regular_file(p, ec)) {
      fail({"data.paths"}, "data.paths: '" + p + "' is not a readable file" +
           (p.rfind("/usr/share/games/fortunes", 0) == 0 ? " (scripts/setup installs Debian's fortunes package)" : ""));
    }
  }
  if (cfg.get_int("comm.swap_at_step") > 0 && cfg.get_string("comm.swap_to").empty()) {
    fail({"comm.swap_at_step", "comm.swap_to"}, "comm.swap_at_step is set but comm.swap_to is empty: name the backend to swap to (e.g. \"ucx:tls=tcp,self\")");
  }
}

void check_data(const config::Config& cfg, const data::Tokenizer& tokenizer, const JobSpec& spec) {
  data::TextDataset dataset({cfg.get_list("data.paths"), spec.global_batch_size, spec.seq_len,
                             static_cast<std::uint64_t>(cfg.get_int("data.seed"))},
                            tokenizer);
  std::error_code ec;
  std::filesystem::create_directories(cfg.get_string("job.dump_folder"), ec);
  if (ec || !std::filesystem::is_directory(cfg.get_string("job.dump_folder"))) {
    throw config::ConfigError(cfg.where({"job.dump_folder"}) + ": job.dump_folder '" +
                              cfg.get_string("job.dump_folder") + "' cannot be made: " + ec.message());
  }
}

void discover_plugins(PluginRegistry& registry, const config::Config& cfg) {
  const auto& listed = cfg.get_list("plugins.paths");
  registry.discover(plugin_search_path(std::vector<std::filesystem::path>(listed.begin(), listed.end())));
}

PlacedJob place_job(const JobSpec& spec, PluginRegistry& registry) {
  PlacedJob job{models::build_model(spec.model, spec.global_batch_size, spec.seq_len), sharding::make_mesh(spec.dims, spec.world_size), {}, {}, {}, spec.reshard_after_forward};
  append_train_step(job.model.graph, job.model.params, spec.step);
  StrategyInput in;
  for (const auto& init : job.model.init) {
    if (init.trainable) in.parameters.push_back({init.name, init.shape});
  }
  for (const char* name : {"tokens", "labels"}) in.inputs.push_back({name, job.model.graph.find_input(name)->meta().shape});
  job.inputs = sharding::parallelize(registry, job.mesh, in);
  std::map<std::string, sharding::Placements> params;
  for (const auto& p : job.model.params) params[p] = job.inputs.at(p);
  job.use = sharding::use_placements(job.mesh, params);
  for (const auto& p : job.model.params) job.inputs["exp_avg." + p] = job.inputs["exp_avg_sq." + p] = job.inputs.at(p);
  for (const auto& s : train_state_names(job.model.params)) job.outputs["next." + s] = job.inputs.at(s);
  return job;
}

std::int64_t local_parameter_bytes(const PlacedJob& job, std::int64_t rank) {
  std::int64_t bytes = 0;
  const auto coord = job.mesh.coordinate(rank);
  for (const auto& p : job.model.params) {
    const ir::Value* v = job.model.graph.find_input(p);
    ir::TensorMeta local = v->meta();
    local.shape = sharding::ShardingSpec{job.inputs.at(p), v->meta()}.local_shape(job.mesh, coord);
    bytes += local.nbytes();
  }
  return bytes;
}

}  // namespace spmdx::train
