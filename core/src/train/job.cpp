#include "spmdx/train/job.h"
#include "spmdx/train/context_parallel.h"
#include "spmdx/train/loss_parallel.h"

#include <algorithm>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <functional>
#include <limits>
#include <numeric>
#include <set>

#include <unistd.h>

#include "spmdx/comm/score_map.h"
#include "spmdx/core/log.h"
#include "spmdx/files.h"
#include "spmdx/text.h"
#include "spmdx/data/text_dataset.h"
#include "spmdx/sharding/spec.h"
#include "spmdx/sharding/parallelize.h"
#include "spmdx/hooks/hook_set.h"
#include "spmdx/models/weights.h"
#include "spmdx/plan/runtime_plan.h"
#include "spmdx/train/auto_sharding.h"
#include "spmdx/train/checkpoint_folder.h"
#include "spmdx/train/memory_budget.h"

namespace spmdx::train {

namespace {

// Problems found one after another and thrown together: one ConfigError, a line each.
struct Problems {
  const config::Config& cfg;
  std::vector<std::string> lines;
  // `keys`: those the message is about, so that it says where their values came from.
  void add(const std::vector<std::string>& keys, const std::string& why) { lines.push_back(cfg.where(keys) + ": " + why); }
  void throw_if_any() const {
    if (lines.empty()) return;
    std::string all;
    for (const auto& l : lines) all += (all.empty() ? "" : "\n") + l;
    throw config::ConfigError(all);
  }
};

}  // namespace

plan::PlanOptions plan_options(const config::Config& cfg) {
  plan::PlanOptions o;
  o.bucket_bytes = cfg.get_float("comm.bucket_cap_mb") * 1024 * 1024;
  o.first_bucket_bytes = cfg.get_float("comm.first_bucket_cap_mb") * 1024 * 1024;
  o.overlap = cfg.get_bool("comm.overlap");
  o.prefetch = cfg.get_bool("comm.prefetch");
  o.donate_state = true;  // the run loop hands each step its state and takes the updated one back
  return o;
}

hooks::HookSpec hook_spec(const config::Config& cfg) {
  hooks::HookSpec spec;
  spec.enabled = cfg.get_list("hooks.enable");
  spec.dump_folder = cfg.get_string("job.dump_folder");
  for (const auto& [table, opts] : cfg.plugin_option_tables()) {
    if (table.rfind("hooks.", 0) != 0) continue;  // another plugin's table ([parallelism.tp_plan])
    const std::string name = table.substr(table.find('.') + 1);
    if (std::find(spec.enabled.begin(), spec.enabled.end(), name) == spec.enabled.end()) {
      // A near miss of an enabled hook is a typo whose options would be lost: refused.
      if (const std::string near = nearest_word(name, spec.enabled, 2); !near.empty()) {
        spec.problems.push_back("[" + table + "] sets options of hook '" + name + "', which hooks.enable does not list; did you mean [hooks." + near + "]?");
      } else {
        // Where its first option is set (the file's line, or the command line), else the table.
        SPMDX_WARN(cfg.where({opts.empty() ? table : table + "." + opts.begin()->first}) << ": [" << table << "] sets options of hook '" << name
                                                                                        << "', which hooks.enable does not list: ignored");
      }
      continue;
    }
    spec.options[name] = opts;
  }
  return spec;
}

std::int64_t degree_product(const config::Config& cfg) {
  const std::int64_t shard = cfg.get_int("parallelism.data_parallel_shard_degree");
  // Four degrees of up to 1e6 each pass int64: the product saturates at 1e12 ranks, which
  // read_degrees refuses (more than 1e8) naming the keys.
  const double product = static_cast<double>(cfg.get_int("parallelism.data_parallel_replicate_degree")) *
                         static_cast<double>(cfg.get_int("parallelism.tensor_parallel_degree")) * static_cast<double>(shard > 0 ? shard : 1) *
                         static_cast<double>(cfg.get_int("parallelism.pipeline_parallel_degree")) *
                         static_cast<double>(cfg.get_int("parallelism.context_parallel_degree"));
  return static_cast<std::int64_t>(std::min(product, 1e12));
}

namespace {

// model.path, model.inputs and model.loss, which only model.name = "pt2" takes: its program
// fixes the vocabulary, and the tokens' [batch, seq] (returned; empty for other models).
std::vector<std::int64_t> read_pt2(const config::Config& cfg, std::int64_t vocab_size, models::ModelArgs& model, Problems& problems) {
  std::vector<std::int64_t> exported;
  if (model.name != "pt2") {
    for (const char* key : {"model.path", "model.inputs", "model.loss"}) {
      if (cfg.is_set(key)) problems.add({key, "model.name"}, std::string(key) + " is set but model.name is \"" + model.name + "\": it is for model.name = \"pt2\" (a torch.export file); set that, or remove " + key);
    }
  }
  if (model.name == "pt2") {
    model.path = cfg.get_string("model.path");
    model.inputs = cfg.get_list("model.inputs");
    model.loss = cfg.get_string("model.loss");
    if (model.path.empty()) {
      problems.add({"model.name", "model.path"}, "model.name = \"pt2\" needs model.path: the .pt2 file torch.export.save wrote (see examples/export)");
    } else {
      try {
        const models::Model m = models::import_model(model);
        exported = m.graph.find_input("tokens")->meta().shape;
        model.vocab_size = m.args.vocab_size;
        if (vocab_size > model.vocab_size) {
          problems.add({"model.tokenizer", "model.path"}, "the tokenizer '" + cfg.get_string("model.tokenizer") + "' has " + std::to_string(vocab_size) + " ids but " + model.path +
                       "'s logits have " + std::to_string(model.vocab_size) + " classes: export the model with a vocabulary of at least " + std::to_string(vocab_size));
        }
      } catch (const std::exception& e) {
        problems.add({"model.path"}, e.what());
      }
    }
  }
  return exported;
}

// Why context parallelism splits the sequence in order ("" when it is load-balanced, 2 cp
// pieces): load balancing permutes the positions, which it needs as inputs (the built-in
// models' RoPE tables); an imported program makes its own (arange).
std::string context_parallel_in_order(const JobSpec& s) {
  if (!s.context_parallel_load_balance) return "parallelism.context_parallel_load_balance = false";
  if (s.model.name == "pt2") return "an imported program makes its own positions";
  return "";
}

// [parallelism.tp_plan] and [parallelism.strategies], whose keys must be mesh dims.
void read_strategies(const config::Config& cfg, JobSpec& s, Problems& problems) {
  s.tp_plan = cfg.plugin_options("parallelism.tp_plan");
  s.strategies = cfg.plugin_options("parallelism.strategies");
  for (const auto& [dim, plugin] : s.strategies) {
    if (dim != "dp_replicate" && dim != "dp_shard" && dim != "tp") {
      // torchtitan's other dims are other features, not typos of tp: no "did you mean" for them.
      static const std::map<std::string, std::string> elsewhere{
          {"pp", "; pipeline stages are cut by parallelism.pipeline_parallel_degree, not placed by a strategy plugin"},
          {"cp", "; context parallelism is parallelism.context_parallel_degree, placed by spmdx itself, not by a strategy plugin"},
          {"ep", "; spmdx has no expert parallelism yet"},
          {"sp", "; sequence parallelism is parallelism.enable_sequence_parallel, over tp"},
          {"etp", "; spmdx has no expert tensor parallelism yet"}};
      const auto other = elsewhere.find(dim);
      const std::string near = other != elsewhere.end() ? "" : nearest_word(dim, {"dp_replicate", "dp_shard", "tp"}, 3);
      problems.add({"parallelism.strategies"}, "[parallelism.strategies] names mesh dim '" + dim + "'; strategies decide the mesh dims dp_replicate, dp_shard and tp" +
                   (other != elsewhere.end() ? other->second : std::string()) +
                   (near.empty() ? std::string() : "; did you mean '" + near + "'?"));
    }
    if (plugin.empty()) problems.add({"parallelism.strategies"}, "[parallelism.strategies] " + dim + " names no plugin: give a strategy plugin's name (e.g. \"" + sharding::strategy_for(dim == "tp" ? "tp" : "dp_shard") + "\")");
  }
  if (cfg.get_bool("parallelism.strict")) return;
  for (const auto& entry : cfg.get_list("parallelism.fallback_strategies")) {
    std::map<std::string, std::string> layout = s.strategies;
    std::set<std::string> bound;  // each dim once
    bool ok = entry.find_first_not_of(' ') != std::string::npos;
    for (std::size_t start = entry.find_first_not_of(' '); ok && start < entry.size(); start = entry.find_first_not_of(' ', start)) {
      const std::size_t end = std::min(entry.find(' ', start), entry.size());
      const std::string binding = entry.substr(start, end - start);
      const std::size_t eq = binding.find('=');
      const std::string dim = eq == std::string::npos ? "" : binding.substr(0, eq), plugin = eq == std::string::npos ? "" : binding.substr(eq + 1);
      ok = (dim == "dp_replicate" || dim == "dp_shard" || dim == "tp") && !plugin.empty() &&
           plugin.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789_") == std::string::npos && bound.insert(dim).second;  // plugin names are [a-z0-9_]+
      layout[dim] = plugin;
      start = end;
    }
    if (!ok) {
      problems.add({"parallelism.fallback_strategies"}, "parallelism.fallback_strategies entry \"" + entry +
                   "\" is not \"dim=plugin[ dim=plugin]\" over the mesh dims dp_replicate, dp_shard and tp, each once, with plugin names of a-z, 0-9 and _ "
                   "(e.g. \"dp_shard=fsdp\" or \"dp_shard=fsdp tp=tensor_parallel\")");
    } else {
      s.fallback_strategies.push_back(std::move(layout));
    }
  }
}

// What to change when the degrees multiply to `product` but a stage has `ranks` ranks (of
// `stages`): start the ranks the degrees make (with `start_flag`, "--nproc", when one starts
// them), or change one degree so that they fit, as flags: dp_shard -1 (the ranks the others
// leave) where that fits, then a degree above 1 set to the value that fits (never a new kind of
// parallelism: tp 2 where the job has none is another job, not a fix).
std::string degrees_fix(const sharding::ParallelDims& dims, std::int64_t product, std::int64_t ranks, std::int64_t stages, const std::string& start_flag) {
  const std::string need = std::to_string(product * stages);
  std::string text = "start " + need + " ranks" + (start_flag.empty() ? std::string() : " (" + start_flag + " " + need + ")");
  std::vector<std::string> fixes;
  if (ranks % (dims.dp_replicate * dims.cp * dims.tp) == 0) fixes.push_back("--parallelism.data_parallel_shard_degree -1 (the ranks the other degrees leave)");
  const std::vector<std::pair<std::string, std::int64_t>> degrees{{kDegreeKeys[2], dims.tp}, {kDegreeKeys[3], dims.cp}, {kDegreeKeys[0], dims.dp_replicate}, {kDegreeKeys[1], dims.dp_shard}};
  for (const auto& [key, degree] : degrees) {
    const std::int64_t others = product / degree;
    const bool shard_covered = key == kDegreeKeys[1] && !fixes.empty();  // -1 says it already
    if (degree > 1 && !shard_covered && ranks % others == 0 && ranks / others != degree) fixes.push_back("--" + key + " " + std::to_string(ranks / others));
  }
  const std::string a_stage = stages > 1 ? " (the ranks of a stage)" : "";
  if (fixes.empty()) return text + ", or set degrees that multiply to " + std::to_string(ranks) + a_stage;
  return text + ", or make the degrees fit " + std::to_string(ranks) + (ranks == 1 ? " rank" : " ranks") + a_stage + ": " + join(fixes, " or ");
}

// What to change when data_parallel_shard_degree is -1 but the other degrees, multiplied to
// `rest`, do not divide a stage's `ranks` (of `stages`): start a multiple of them (the next one
// above, with `start_flag`), or lower one degree above 1 to the largest that divides both it and
// the ranks the others leave, as flags (never a new kind of parallelism, as degrees_fix).
std::string shard_rest_fix(const sharding::ParallelDims& dims, std::int64_t rest, std::int64_t ranks, std::int64_t stages, const std::string& start_flag) {
  const std::string next = std::to_string((ranks / rest + 1) * rest * stages);
  std::string text = "start a multiple of " + std::to_string(rest * stages) + " ranks" + (start_flag.empty() ? std::string() : " (" + start_flag + " " + next + ")");
  std::vector<std::string> fixes;
  const std::vector<std::pair<std::string, std::int64_t>> degrees{{kDegreeKeys[2], dims.tp}, {kDegreeKeys[3], dims.cp}, {kDegreeKeys[0], dims.dp_replicate}};
  for (const auto& [key, degree] : degrees) {
    const std::int64_t others = rest / degree;
    if (degree <= 1 || ranks % others != 0) continue;
    if (const std::int64_t fits = std::gcd(degree, ranks / others); fits != degree) fixes.push_back("--" + key + " " + std::to_string(fits));
  }
  const std::string a_stage = stages > 1 ? " (the ranks of a stage)" : "";
  if (fixes.empty()) return text + ", or set degrees whose product divides " + std::to_string(ranks) + a_stage;
  return text + ", or make the degrees fit " + std::to_string(ranks) + (ranks == 1 ? " rank" : " ranks") + a_stage + ": " + join(fixes, " or ");
}

// The mesh: parallelism's degrees, dp_shard = -1 taking what the others leave of world_size.
// With pipeline stages, the degrees divide the ranks of one stage (world_size / stages).
void read_degrees(const config::Config& cfg, std::int64_t world_size, const std::string& start_flag, sharding::ParallelDims& dims, Problems& problems) {
  const std::int64_t stages = cfg.get_int("parallelism.pipeline_parallel_degree");
  std::string world_text = "world_size " + std::to_string(world_size);
  if (stages > 1) {
    if (world_size % stages != 0) {
      problems.add({"parallelism.pipeline_parallel_degree"}, "parallelism.pipeline_parallel_degree " + std::to_string(stages) + " does not divide world_size " +
                   std::to_string(world_size) + ": each stage needs the same number of ranks");
    }
    world_text += " / pipeline_parallel_degree " + std::to_string(stages) + " = " + std::to_string(world_size / stages);
    world_size = std::max<std::int64_t>(1, world_size / stages);
  }
  dims.cp = cfg.get_int("parallelism.context_parallel_degree");
  if (cfg.get_string("parallelism.strategy") == "auto") {  // the other degrees are chosen (train/auto_sharding.h): all data parallel until then
    if (world_size % dims.cp != 0) {
      problems.add({"parallelism.context_parallel_degree"}, "parallelism.context_parallel_degree " + std::to_string(dims.cp) + " does not divide " + world_text);
    }
    dims.dp_replicate = 1, dims.tp = 1, dims.dp_shard = std::max<std::int64_t>(1, world_size / dims.cp);
    return;
  }
  dims.dp_replicate = cfg.get_int("parallelism.data_parallel_replicate_degree");
  dims.tp = cfg.get_int("parallelism.tensor_parallel_degree");
  dims.dp_shard = cfg.get_int("parallelism.data_parallel_shard_degree");
  if (dims.dp_shard == -1) {
    const std::int64_t rest = dims.dp_replicate * dims.cp * dims.tp;
    if (world_size % rest != 0) {
      problems.add(kDegreeKeys, "parallelism.data_parallel_replicate_degree x " + std::string(dims.cp > 1 ? "context_parallel_degree x " : "") +
                   "tensor_parallel_degree = " + std::to_string(rest) + " does not divide " + world_text + ": " +
                   shard_rest_fix(dims, rest, world_size, std::max<std::int64_t>(1, stages), start_flag));
    }
    dims.dp_shard = std::max<std::int64_t>(1, world_size / rest);
  } else if (dims.dp_shard < 1) {
    problems.add({"parallelism.data_parallel_shard_degree"}, "parallelism.data_parallel_shard_degree must be >= 1 or -1");
    dims.dp_shard = 1;
  }
  const std::string cp_text = dims.cp > 1 ? " x " + std::to_string(dims.cp) : std::string();  // the degrees as multiplied, cp before tp
  if (const double ranks = static_cast<double>(dims.dp_replicate) * static_cast<double>(dims.dp_shard) * static_cast<double>(dims.cp) *
                           static_cast<double>(dims.tp) * static_cast<double>(stages);
      ranks > 1e8) {
    std::vector<std::string> keys = kDegreeKeys;
    if (stages > 1) keys.push_back("parallelism.pipeline_parallel_degree");
    problems.add(keys, "parallelism degrees multiply to " + (stages > 1 ? std::to_string(stages) + " x " : std::string()) + std::to_string(dims.dp_replicate) +
                           " x " + std::to_string(dims.dp_shard) + cp_text + " x " + std::to_string(dims.tp) +
                           " ranks, more than the 100,000,000 spmdx plans (as --world-size): use smaller degrees");
    return;
  }
  const std::int64_t product = dims.dp_replicate * dims.dp_shard * dims.cp * dims.tp;
  if (product != world_size && problems.lines.empty()) {
    // Named when context parallelism adds a fourth factor (dp_replicate x dp_shard x tp otherwise, as before).
    const std::string factors = dims.cp > 1 ? "dp_replicate " + std::to_string(dims.dp_replicate) + " x dp_shard " + std::to_string(dims.dp_shard) + " x cp " +
                                                  std::to_string(dims.cp) + " x tp " + std::to_string(dims.tp)
                                            : std::to_string(dims.dp_replicate) + " x " + std::to_string(dims.dp_shard) + " x " + std::to_string(dims.tp);
    problems.add(kDegreeKeys, "parallelism degrees multiply to " + std::to_string(product) + " (" + factors + "), but " +
                                  (stages > 1 ? world_text : "world_size is " + std::to_string(world_size)) + ": " +
                                  degrees_fix(dims, product, world_size, std::max<std::int64_t>(1, stages), start_flag));
  }
}

// The global batch and the sequence length: from training.*, or fixed by an exported program
// (`exported`: its tokens' [batch, seq]); the batch must split over the data-parallel ranks.
void read_batch(const config::Config& cfg, const std::vector<std::int64_t>& exported, bool degrees_ok, JobSpec& s, Problems& problems) {
  const std::int64_t dp = s.dims.dp_replicate * s.dims.dp_shard;
  const std::int64_t global = cfg.get_int("training.global_batch_size");
  s.global_batch_size = global > 0 ? global : cfg.get_int("training.local_batch_size") * dp;
  // An exported program runs microbatches of its batch: local_batch_size x dp = the export's
  // rows, and a global batch a multiple of them.
  const bool pt2_microbatches = !exported.empty() && global > exported[0] && cfg.is_set("training.local_batch_size") &&
                                cfg.get_int("training.local_batch_size") * dp == exported[0];
  if (pt2_microbatches && global % exported[0] != 0) {
    problems.add({"training.global_batch_size", "model.path"}, "training.global_batch_size " + std::to_string(global) + " is not a multiple of the " +
                 std::to_string(exported[0]) + " rows " + s.model.path + " was exported for (gradient accumulation runs microbatches of them): make it a multiple of " +
                 std::to_string(exported[0]));
  } else if (pt2_microbatches) {
    s.step.microbatches = global / exported[0];
  } else if (!exported.empty()) {  // a program's batch and sequence are fixed when it is exported
    const bool local_set = global <= 0 && cfg.is_set("training.local_batch_size");
    if ((global > 0 || local_set) && s.global_batch_size != exported[0]) {
      problems.add({global > 0 ? "training.global_batch_size" : "training.local_batch_size", "model.path"},
                   (global > 0 ? "training.global_batch_size " + std::to_string(global) : "training.local_batch_size " + std::to_string(cfg.get_int("training.local_batch_size")) + " x " + std::to_string(dp) + " data-parallel ranks = " + std::to_string(s.global_batch_size)) +
                   ", but " + s.model.path + " was exported for a batch of " + std::to_string(exported[0]) +
                   " rows: remove the key or export with that batch (or, for gradient accumulation, set training.local_batch_size to " +
                   (exported[0] % dp == 0 ? std::to_string(exported[0] / dp) : std::string("its rows / the data-parallel degree")) + " and global_batch_size to a multiple of " +
                   std::to_string(exported[0]) + ")");
    }
  }
  if (!exported.empty()) {
    if (cfg.is_set("training.seq_len") && cfg.get_int("training.seq_len") != exported[1]) {
      problems.add({"training.seq_len", "model.path"}, "training.seq_len " + std::to_string(cfg.get_int("training.seq_len")) + ", but " + s.model.path + " was exported for sequences of " +
                   std::to_string(exported[1]) + " tokens: remove the key or export with that length");
    }
    s.global_batch_size = exported[0] * s.step.microbatches;
  }
  if (degrees_ok && !exported.empty() && exported[0] % dp != 0) {
    problems.add({kDegreeKeys[0], kDegreeKeys[1], "model.path"}, s.model.path + " was exported for a batch of " + std::to_string(exported[0]) + " rows, which does not split over the " +
                 std::to_string(dp) + " data-parallel ranks: use a data-parallel degree that divides " + std::to_string(exported[0]) + ", or export with a batch it divides");
  } else if (degrees_ok && s.global_batch_size % dp != 0) {
    problems.add({"training.global_batch_size", "training.local_batch_size", kDegreeKeys[0], kDegreeKeys[1]}, "training.global_batch_size " + std::to_string(s.global_batch_size) + " does not split over the " + std::to_string(dp) +
                 " data-parallel ranks: make it a multiple of " + std::to_string(dp));
  }
  s.seq_len = exported.empty() ? cfg.get_int("training.seq_len") : exported[1];
  // Gradient accumulation, as torchtitan: a global batch larger than local_batch_size x the
  // data-parallel degree runs in microbatches of local_batch_size rows per rank. Unset
  // local_batch_size with a global batch: one microbatch (torchtitan's default of 8 rows would
  // split it; the losses are the same either way, only the memory differs); so is a global
  // batch smaller than one microbatch (torchtitan refuses it; a command line's smaller global
  // batch over a config's local_batch_size means fewer rows).
  const bool local_set = cfg.is_set("training.local_batch_size");
  if (global > 0 && local_set && degrees_ok && problems.lines.empty() && global > cfg.get_int("training.local_batch_size") * dp && exported.empty()) {
    const std::int64_t local = cfg.get_int("training.local_batch_size");
    const std::int64_t rows = local * dp;
    if (global % rows != 0) {
      problems.add({"training.global_batch_size", "training.local_batch_size", kDegreeKeys[0], kDegreeKeys[1]},
                   "training.global_batch_size " + std::to_string(global) + " is not a multiple of training.local_batch_size " + std::to_string(local) + " x " +
                   std::to_string(dp) + " data-parallel ranks = " + std::to_string(rows) + " (gradient accumulation runs global / (local x data-parallel degree) "
                   "microbatches per step): make global_batch_size a multiple of " + std::to_string(rows) + ", or change local_batch_size");
    } else {
      s.step.microbatches = global / rows;
    }
  }
}

// [parallelism] pipeline_parallel_*: the stages and the schedule; the microbatches are the
// global batch over the data-parallel ranks in pipeline_parallel_microbatch_size rows (torchtitan's
// local_batch_size / pipeline_parallel_microbatch_size per data-parallel rank).
void read_pipeline(const config::Config& cfg, const std::vector<std::int64_t>& exported, bool degrees_ok, JobSpec& s, Problems& problems) {
  PipelineSpec& p = s.pipeline;
  p.stages = cfg.get_int("parallelism.pipeline_parallel_degree");
  p.schedule = cfg.get_string("parallelism.pipeline_parallel_schedule");
  s.pipeline_split_points = cfg.get_list("parallelism.pipeline_parallel_split_points");
  s.pipeline_layers_per_stage = cfg.get_int("parallelism.pipeline_parallel_layers_per_stage");
  s.pipeline_microbatch_size = cfg.get_int("parallelism.pipeline_parallel_microbatch_size");
  if (p.stages == 1 && s.auto_strategy && (!s.pipeline_split_points.empty() || s.pipeline_layers_per_stage > 0)) {
    const char* key = s.pipeline_split_points.empty() ? "parallelism.pipeline_parallel_layers_per_stage" : "parallelism.pipeline_parallel_split_points";
    problems.add({key, "parallelism.strategy", "parallelism.pipeline_parallel_degree"},
                 std::string(key) + " is set, but parallelism.strategy = \"auto\" chooses the pipeline stages and splits the layers evenly over them: "
                 "set parallelism.pipeline_parallel_degree to keep that many stages split so, or remove " + key);
  }
  if (p.stages == 1) {
    p.microbatches = s.step.microbatches;
    return;
  }
  if (s.pipeline_layers_per_stage == 0 || s.pipeline_layers_per_stage < -1) {
    problems.add({"parallelism.pipeline_parallel_layers_per_stage"}, "parallelism.pipeline_parallel_layers_per_stage must be positive, or -1 (unset)");
  }
  if (!s.pipeline_split_points.empty() && s.pipeline_layers_per_stage > 0) {
    problems.add({"parallelism.pipeline_parallel_split_points", "parallelism.pipeline_parallel_layers_per_stage"},
                 "parallelism.pipeline_parallel_split_points and pipeline_parallel_layers_per_stage both say where the stages begin: keep one");
  }
  const std::int64_t dp = s.dims.dp_replicate * s.dims.dp_shard;
  const std::int64_t rows = cfg.get_int("parallelism.pipeline_parallel_microbatch_size");
  if (!exported.empty()) {  // an exported program fixes the microbatch: its batch; gradient accumulation's microbatches are the pipeline's
    p.microbatches = s.step.microbatches;
    return;
  }
  if (s.auto_strategy) {  // the data-parallel degree is chosen later: each layout's microbatches are checked as it is planned (auto_sharding.h)
    p.microbatches = s.step.microbatches;
    return;
  }
  if (degrees_ok && s.global_batch_size % (dp * rows) != 0) {
    problems.add({"parallelism.pipeline_parallel_microbatch_size", "training.global_batch_size", kDegreeKeys[0], kDegreeKeys[1]},
                 "training.global_batch_size " + std::to_string(s.global_batch_size) + " does not split into microbatches of " + std::to_string(rows) +
                 " rows on each of the " + std::to_string(dp) + " data-parallel ranks (parallelism.pipeline_parallel_microbatch_size): make it a multiple of " +
                 std::to_string(dp * rows));
    return;
  }
  s.step.microbatches = p.microbatches = std::max<std::int64_t>(1, s.global_batch_size / (dp * rows));
  if (p.schedule == "Interleaved1F1B" && p.microbatches % p.stages != 0) {
    problems.add({"parallelism.pipeline_parallel_schedule", "parallelism.pipeline_parallel_microbatch_size", "training.global_batch_size"},
                 "parallelism.pipeline_parallel_schedule = \"Interleaved1F1B\" runs microbatches in groups of pipeline_parallel_degree " + std::to_string(p.stages) +
                 ", and training.global_batch_size " + std::to_string(s.global_batch_size) + " makes " + std::to_string(p.microbatches) +
                 ": make the microbatches (global_batch_size / (data-parallel degree x pipeline_parallel_microbatch_size)) a multiple of " + std::to_string(p.stages));
  }
}

// The typed sections a rank's run loop reads: [comm], [checkpoint], [data], outputs.

void read_sections(const config::Config& cfg, JobSpec& s) {
  s.comm = {cfg.get_string("comm.backend"), cfg.get_string("comm.swap_to"), cfg.get_int("comm.swap_at_step"), cfg.get_float("comm.timeout_seconds"),
            comm::job_memory(cfg.get_string("training.device"))};
  s.comm.chain = comm_chain(cfg);
  s.comm.backend = s.comm.chain.front();
  s.comm.max_failures = cfg.get_int("comm.max_failures");
  s.comm.failure_window = cfg.get_int("comm.failure_window");
  s.device = {cfg.get_string("training.device"), cfg.get_bool("training.allow_tf32"), cfg.get_bool("training.cuda_graphs"),
              cfg.get_string("training.cpu_matmul")};
  s.activation_checkpoint = {cfg.get_string("activation_checkpoint.mode"), cfg.get_string("activation_checkpoint.selective_ac_option"),
                             cfg.get_bool("activation_checkpoint.keep_collective_outputs")};
  s.mixed_precision = {cfg.get_string("training.mixed_precision_param"), cfg.get_string("training.mixed_precision_reduce"),
                       cfg.get_float("training.grad_scaler_init_scale"), cfg.get_int("training.grad_scaler_growth_interval")};
  const std::filesystem::path dump = cfg.get_string("job.dump_folder");
  s.checkpoint = {cfg.get_bool("checkpoint.enable"), dump / cfg.get_string("checkpoint.folder"), cfg.get_int("checkpoint.interval"),
                  cfg.get_int("checkpoint.load_step"), cfg.get_string("checkpoint.initial_load_path"), cfg.get_int("checkpoint.keep_latest_k")};
  s.data = {cfg.get_list("data.paths"), static_cast<std::uint64_t>(cfg.get_int("data.seed")), cfg.get_string("model.tokenizer"),
            cfg.get_string("data.document_separator")};
  s.output = {dump, cfg.get_int("metrics.log_freq"), cfg.get_bool("debug.dump_initial_weights"), cfg.get_bool("debug.dump_batches"), {}, 0, {}};
  if (cfg.get_bool("metrics.enable_tensorboard")) {
    char stamp[32];
    const std::time_t now = std::time(nullptr);
    std::strftime(stamp, sizeof stamp, "%Y%m%d-%H%M", std::localtime(&now));  // torchtitan's run folder
    s.output.tensorboard_folder = dump / cfg.get_string("metrics.save_tb_folder") / stamp;
  }
  if (cfg.get_bool("profiling.enable_profiling")) {
    s.output.profile_freq = cfg.get_int("profiling.profile_freq");
    s.output.traces_folder = dump / cfg.get_string("profiling.save_traces_folder");
  }
  s.validation = {cfg.get_bool("validation.enable"), cfg.get_list("validation.paths"), cfg.get_int("validation.freq"), cfg.get_int("validation.steps"),
                  cfg.get_int("validation.local_batch_size") * s.dims.dp_replicate * s.dims.dp_shard};
}

void check_validation(const config::Config& cfg, const JobSpec& s, Problems& problems) {
  if (!s.validation.enable) return;
  if (s.validation.paths.empty()) {
    problems.add({"validation.enable", "validation.paths"}, "validation.enable = true needs held-out text: set validation.paths to text or JSON Lines files");
  }
  if (cfg.get_int("validation.steps") == 0) problems.add({"validation.steps"}, "validation.steps must be >= 1, or -1 (as many batches as the held-out tokens fill once)");
  if (const std::int64_t v = cfg.get_int("validation.seq_len"); v != -1 && v != s.seq_len) {
    problems.add({"validation.seq_len", "training.seq_len"}, "validation.seq_len " + std::to_string(v) + " differs from training.seq_len " + std::to_string(s.seq_len) +
                 ": the model's RoPE tables are made for training.seq_len; remove validation.seq_len (or set it to " + std::to_string(s.seq_len) + ")");
  }
  if (s.model.name == "pt2" && s.validation.global_batch_size != s.global_batch_size / s.step.microbatches) {
    problems.add({"validation.local_batch_size", "model.path"}, "validation.local_batch_size x the data-parallel degree = " + std::to_string(s.validation.global_batch_size) +
                 " rows, but " + s.model.path + " was exported for a batch of " + std::to_string(s.global_batch_size / s.step.microbatches) +
                 " rows: set validation.local_batch_size to " + std::to_string(s.global_batch_size / s.step.microbatches / (s.dims.dp_replicate * s.dims.dp_shard)));
  }
}

// The context of hooks made to check a plan, not to run: rank 0's place in the job's mesh.
HookContext hook_context(std::int64_t world_size, const PlacedJob* job) {
  HookContext base;
  base.compile_only = true;
  base.world_size = static_cast<int>(world_size);
  if (job) {
    base.mesh = job->mesh.dims();
    base.coordinate = job->mesh.coordinate(0);
  }
  return base;
}

}  // namespace

PlanValidator validator_hooks(const config::Config& cfg, PluginRegistry& registry, std::int64_t world_size) {
  return [&cfg, &registry, world_size](const PlacedJob& job, const sharding::DistributedPlan& plan) -> std::string {
    if (cfg.get_list("hooks.enable").empty()) return "";
    hooks::HookSet hooks = hooks::make_hooks(hook_spec(cfg), registry, hook_context(world_size, &job));
    std::vector<std::int64_t> ranks;
    for (std::int64_t r = 0; r < std::min<std::int64_t>(job.mesh.size(), 64); ++r) ranks.push_back(r);  // one stage's mesh with pipeline stages
    // Only the verdict counts here: the hooks' lines ("partition_validator: passed") are said
    // once, by rank 0 (or spmdx compile) running the compile stages of the job chosen.
    const log::ThreadLevel quiet(log::Level::error);
    try {
      hooks.compile(plan, ranks, plan_options(cfg));
    } catch (const ValidationError& e) {
      return e.what();
    }
    return "";
  };
}

std::string layout_text(const std::map<std::string, std::string>& strategies) {
  if (strategies.empty()) return "the default strategies";
  std::string text;
  for (const auto& [dim, plugin] : strategies) text += (text.empty() ? "" : ", ") + dim + "=" + plugin;
  return text;
}

void choose_strategies(JobSpec& spec, PluginRegistry& registry, const PlanValidator& validate) {
  if (spec.auto_strategy) {
    choose_auto(spec, registry);
    return;
  }
  if (spec.fallback_strategies.empty()) {
    spec.memory_fit = fit_memory_budget(spec, registry);
    return;
  }
  std::vector<std::map<std::string, std::string>> layouts{spec.strategies};
  layouts.insert(layouts.end(), spec.fallback_strategies.begin(), spec.fallback_strategies.end());
  std::vector<std::pair<std::string, std::string>> passed;
  for (const auto& layout : layouts) {
    JobSpec s = spec;
    s.strategies = layout;
    std::string why;
    try {  // what a rank does before its first step: the budget's fit, the placements, rank 0's graph, the validators
      s.memory_fit = fit_memory_budget(s, registry);
      const PlacedJob job = place_job(s, registry);
      const auto plan = propagate_job(job);
      sharding::rank_graph(plan, 0);
      why = validate ? validate(job, plan) : "";
    } catch (const std::exception& e) {
      why = e.what();
    }
    if (why.empty()) {
      spec = std::move(s);
      spec.strategies_passed_over = std::move(passed);
      return;
    }
    passed.emplace_back(layout_text(layout), why);
  }
  std::string text = "no layout of [parallelism.strategies] and parallelism.fallback_strategies can place the job: ";
  for (std::size_t i = 0; i < passed.size(); ++i) text += (i ? "; " : "") + passed[i].first + ": " + passed[i].second;
  throw std::invalid_argument(text);
}

std::vector<std::string> comm_chain(const config::Config& cfg) {
  const auto& fallback = cfg.get_list("comm.fallback");
  std::vector<std::string> chain;
  // comm.backend = "" (on the command line, where a config file's value cannot be removed) is unset.
  if ((cfg.is_set("comm.backend") && !cfg.get_string("comm.backend").empty()) || fallback.empty()) chain.push_back(cfg.get_string("comm.backend"));
  for (const auto& b : fallback) {
    if (std::find(chain.begin(), chain.end(), b) == chain.end()) chain.push_back(b);
  }
  if (cfg.get_bool("comm.strict")) chain.resize(1);
  return chain;
}

JobSpec job_spec(const config::Config& cfg, std::int64_t world_size, std::int64_t vocab_size, const std::string& start_flag) {
  Problems problems{cfg, {}};
  auto fail = [&](const std::vector<std::string>& keys, const std::string& why) { problems.add(keys, why); };
  JobSpec s;
  s.world_size = world_size;
  if (const std::int64_t v = cfg.get_int("model.vocab_size"); v != -1) {
    if (v < vocab_size) {
      problems.add({"model.vocab_size", "model.tokenizer"}, "model.vocab_size " + std::to_string(v) + " is fewer than the " + std::to_string(vocab_size) + " ids of the tokenizer '" +
                   cfg.get_string("model.tokenizer") + "': its ids would index past the embedding; use at least " + std::to_string(vocab_size) + ", or -1");
    } else if (v == 0) {
      problems.add({"model.vocab_size"}, "model.vocab_size must be positive, or -1 (the tokenizer's)");
    } else {
      vocab_size = v;
    }
  }
  s.model = models::model_args(cfg.get_string("model.name"), cfg.get_string("model.flavor"), vocab_size);
  if (const std::int64_t layers = cfg.get_int("model.n_layers"); layers != -1) {
    if (layers == 0) problems.add({"model.n_layers"}, "model.n_layers must be positive, or -1 (the flavor's)");
    else if (s.model.name != "llama") problems.add({"model.n_layers", "model.name"}, "model.n_layers applies to llama only, not " + s.model.name);
    else s.model.n_layers = layers;
  }
  const std::vector<std::int64_t> exported = read_pt2(cfg, vocab_size, s.model, problems);  // pt2: the tokens' [batch, seq] as exported
  read_strategies(cfg, s, problems);
  read_degrees(cfg, world_size, start_flag, s.dims, problems);
  const bool degrees_ok = problems.lines.empty();  // the batch check below needs the data-parallel degree
  if (s.model.name == "llama" && s.model.n_heads % s.dims.tp != 0) {
    fail({"parallelism.tensor_parallel_degree", "model.name", "model.flavor"}, "parallelism.tensor_parallel_degree " + std::to_string(s.dims.tp) + " does not divide the " + std::to_string(s.model.n_heads) +
         " attention heads of " + s.model.name + " " + s.model.flavor);
  } else if (s.model.name == "llama" && s.model.n_kv_heads > 0 && s.model.n_kv_heads % s.dims.tp != 0) {
    // Tensor parallelism shards the key/value heads as the query heads (wk and wv colwise);
    // torchtitan replicates them instead when it cannot; spmdx refuses.
    fail({"parallelism.tensor_parallel_degree", "model.flavor"}, "parallelism.tensor_parallel_degree " + std::to_string(s.dims.tp) + " does not divide the " +
         std::to_string(s.model.n_kv_heads) + " key/value heads of " + s.model.name + " " + s.model.flavor +
         " (grouped-query attention: tensor parallelism shards them as the query heads): use a degree that divides " + std::to_string(s.model.n_kv_heads));
  }
  read_batch(cfg, exported, degrees_ok, s, problems);
  s.steps = cfg.get_int("training.steps");
  s.lr = cfg.get_float("optimizer.lr");
  const std::int64_t total_steps = cfg.get_int("lr_scheduler.total_steps");
  s.schedule = {cfg.get_int("lr_scheduler.warmup_steps"), total_steps > 0 ? total_steps : s.steps, cfg.get_float("lr_scheduler.decay_ratio"),
                cfg.get_string("lr_scheduler.decay_type"), cfg.get_float("lr_scheduler.min_lr_factor")};
  if (s.schedule.decay_ratio != -1 && s.schedule.decay_ratio < 0) {
    fail({"lr_scheduler.decay_ratio"}, "lr_scheduler.decay_ratio must be between 0 and 1, or -1 (unset: decay over every step after warm-up)");
  }
  if (total_steps == 0) {
    fail({"lr_scheduler.total_steps"}, "lr_scheduler.total_steps 0 is not a schedule: give the steps it spans, or -1 for training.steps");
  } else if (total_steps > 0 && total_steps < s.steps) {
    fail({"lr_scheduler.total_steps", "training.steps"}, "lr_scheduler.total_steps " + std::to_string(total_steps) + " is less than training.steps " +
         std::to_string(s.steps) + ": the schedule would end before the run does (its lr past step " + std::to_string(total_steps) +
         " is undefined); raise total_steps to at least " + std::to_string(s.steps) + ", or set -1 to span training.steps");
  } else {
    // torchtitan's build_lr_schedulers (v0.2.2) warns of these two and cuts the phase to fit.
    const train::LrPhases phases = train::lr_phases(s.schedule);
    const char* total_key = total_steps > 0 ? "lr_scheduler.total_steps" : "training.steps";
    if (s.schedule.warmup_steps > s.schedule.steps) {
      SPMDX_WARN(cfg.where({"lr_scheduler.warmup_steps"}) << ": lr_scheduler.warmup_steps " << s.schedule.warmup_steps << " is more than the " << s.schedule.steps
                                                         << " steps of the schedule (" << total_key << "): the warm-up is cut to " << phases.warmup
                                                         << " steps and the lr never reaches optimizer.lr's plateau");
    } else if (s.schedule.decay_ratio >= 0 && phases.decay < static_cast<std::int64_t>(std::nearbyint(static_cast<double>(s.schedule.steps) * s.schedule.decay_ratio))) {
      SPMDX_WARN(cfg.where({"lr_scheduler.decay_ratio", "lr_scheduler.warmup_steps"})
                 << ": warm-up (" << phases.warmup << ") and decay (lr_scheduler.decay_ratio " << s.schedule.decay_ratio << " of " << s.schedule.steps
                 << " steps) are more steps than the schedule has: the decay is cut to the " << phases.decay << " after warm-up, as torchtitan does");
    }
  }

  s.seed = static_cast<std::uint64_t>(cfg.get_int("job.seed"));
  s.reshard_after_forward = cfg.get_string("parallelism.fsdp_reshard_after_forward") != "never";
  s.sequence_parallel = cfg.get_bool("parallelism.enable_sequence_parallel");
  s.loss_parallel = !cfg.get_bool("parallelism.disable_loss_parallel");
  s.context_parallel_load_balance = cfg.get_bool("parallelism.context_parallel_load_balance");
  s.context_parallel_allgather = cfg.get_string("parallelism.context_parallel_rotate_method") == "allgather";
  if (const std::int64_t cp = s.dims.cp; cp > 1 && degrees_ok) {
    const std::int64_t pieces = context_parallel_in_order(s).empty() ? 2 * cp : cp;
    if (s.seq_len % pieces != 0) {
      fail({"parallelism.context_parallel_degree", "training.seq_len"},
           "parallelism.context_parallel_degree " + std::to_string(cp) + " splits the sequence into " + std::to_string(pieces) + " pieces" +
               (pieces == 2 * cp ? " (2 a rank: load balancing)" : "") + ", but training.seq_len " + std::to_string(s.seq_len) + " is not a multiple of " +
               std::to_string(pieces) + ": make seq_len a multiple of " + std::to_string(pieces) +
               (pieces == 2 * cp ? ", or set parallelism.context_parallel_load_balance = false (then of " + std::to_string(cp) + ")" : std::string()));
    }
  }
  if (const std::string budget = cfg.get_string("parallelism.memory_budget"); !budget.empty()) {
    try {
      const std::uint64_t bytes = parse_bytes(budget);
      if (bytes > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) throw std::invalid_argument("a budget must be less than 8 EiB");
      s.memory_budget = static_cast<std::int64_t>(bytes);
      if (s.memory_budget <= 0) throw std::invalid_argument("a budget must be more than 0 bytes");
    } catch (const std::exception& e) {
      fail({"parallelism.memory_budget"}, "parallelism.memory_budget = \"" + budget + "\": " + e.what() + "; use a size such as \"2GiB\" or \"512MiB\"");
    }
  }
  s.auto_strategy = cfg.get_string("parallelism.strategy") == "auto";
  s.planner = cfg.get_string("parallelism.planner");
  s.planner_time_limit = cfg.get_float("parallelism.planner_time_limit_seconds");
  s.step.max_norm = cfg.get_float("training.max_norm");
  s.plan = plan_options(cfg);
  s.step.adamw = {cfg.get_float("optimizer.beta1"), cfg.get_float("optimizer.beta2"), cfg.get_float("optimizer.eps"),
                  cfg.get_float("optimizer.weight_decay")};
  read_sections(cfg, s);
  check_validation(cfg, s, problems);
  s.step.loss_scaling = s.mixed_precision.param == "float16";
  if (s.activation_checkpoint.keep_collective_outputs && s.activation_checkpoint.mode == "none") {
    fail({"activation_checkpoint.keep_collective_outputs"}, "activation_checkpoint.keep_collective_outputs = true keeps what a recomputation "
         "would move again, and activation_checkpoint.mode = \"none\" recomputes nothing: set mode to \"full\" or \"selective\", or remove it");
  }
  if (const std::string& o = s.activation_checkpoint.selective_option; s.activation_checkpoint.mode == "selective" && o != "op" &&
      (o.empty() || o.size() > 9 || o.find_first_not_of("0123456789") != std::string::npos || std::stoll(o) <= 0)) {
    fail({"activation_checkpoint.selective_ac_option"}, "activation_checkpoint.selective_ac_option = \"" + o +
         "\": use \"op\" (keep matmul and attention outputs) or a positive integer N (every N-th layer in full), as torchtitan");
  }
  read_pipeline(cfg, exported, degrees_ok, s, problems);
  if (s.device.cuda_graphs && s.device.kind != "cuda") {
    fail({"training.cuda_graphs", "training.device"}, "training.cuda_graphs = true needs training.device = \"cuda\" (CUDA graphs are a GPU feature)");
  } else if (s.device.cuda_graphs && world_size > 1) {
    fail({"training.cuda_graphs"}, "training.cuda_graphs = true runs one rank only for now (" + std::to_string(world_size) +
         " ranks here): capturing a step's collectives needs the nccl stream inside the graph, which spmdx does not do yet; set it false");
  }
  problems.throw_if_any();
  return s;
}

namespace {

// [checkpoint] against what checkpoint.folder holds, before any rank starts (and again on each
// rank, before it trains): a folder checkpoints cannot be written to; a rerun that would start
// at step 1 beside an earlier run's checkpoints; a resume with nothing whole to resume from; a
// resume from checkpoint.load_step whose saves would replace newer complete checkpoints.
void check_checkpoint_folder(const config::Config& cfg, Problems& problems) {
  const std::filesystem::path dump = cfg.get_string("job.dump_folder");
  const std::filesystem::path folder = dump / cfg.get_string("checkpoint.folder");
  const bool enable = cfg.get_bool("checkpoint.enable");
  const std::int64_t load_step = cfg.get_int("checkpoint.load_step");
  if (enable) {
    if (const std::string why = unusable_checkpoint_folder(folder); !why.empty()) {
      problems.add({"checkpoint.folder", "job.dump_folder"}, "checkpoint.folder '" + cfg.get_string("checkpoint.folder") + "': " + folder.string() + " " + why +
                                                                 ": checkpoints are saved there; name a folder this user may write, or a new one");
      return;
    }
  }
  const CheckpointFolder found = scan_checkpoints(folder);
  if (!enable && load_step < 0) {
    if (found.empty()) return;
    const std::filesystem::path newest = found.complete.empty() ? found.broken.rbegin()->second.first : found.complete.rbegin()->second;
    problems.add({"checkpoint.enable", "job.dump_folder"},
                 "job.dump_folder '" + dump.string() + "' holds the checkpoints of an earlier run (the newest: " + newest.string() +
                     (found.complete.empty() ? ", not complete" : "") +
                     ") and checkpoint.enable is false, so this run would start again at step 1 beside them. To resume that run, add "
                     "--checkpoint.enable true; to start a new one, choose another --job.dump_folder (or move the old run away)");
    return;
  }
  if (const std::string why = resume_problem(folder, found, load_step); !why.empty()) {
    problems.add({"checkpoint.enable", "checkpoint.load_step"}, why);
  } else if (const std::string newer = enable && load_step >= 0 ? newer_checkpoints_problem(folder, found, load_step) : ""; !newer.empty()) {
    problems.add({"checkpoint.load_step"}, newer);
  }
}

}  // namespace

void check_runnable(const config::Config& cfg) {
  Problems problems{cfg, {}};
  if (!cfg.has_problem("checkpoint.") && !cfg.has_problem("job.dump_folder")) check_checkpoint_folder(cfg, problems);
  auto fail = [&](const std::vector<std::string>& keys, const std::string& why) { problems.add(keys, why); };
  if (cfg.get_list("data.paths").empty()) fail({"data.paths"}, "data.paths is empty: name text or JSON Lines files to train on");
  auto check_files = [&](const std::string& key) {
    for (const auto& p : cfg.get_list(key)) {
      if (const std::string why = unreadable_file(p); !why.empty()) {
        fail({key}, key + ": '" + p + "': " + why +
             (p.rfind("/usr/share/games/fortunes", 0) == 0 ? " (scripts/setup installs Debian's fortunes package)" : ""));
        break;  // one missing file says enough
      }
    }
  };
  check_files("data.paths");
  if (cfg.get_bool("validation.enable")) check_files("validation.paths");
  if (cfg.get_int("comm.swap_at_step") > 0 && cfg.get_string("comm.swap_to").empty()) {
    fail({"comm.swap_at_step", "comm.swap_to"}, "comm.swap_at_step is set but comm.swap_to is empty: name the backend to swap to (e.g. \"ucx:tls=tcp,self\")");
  }
  if (cfg.get_int("comm.swap_at_step") > 0 && comm_chain(cfg).size() > 1) {
    fail({"comm.fallback", "comm.swap_at_step"}, "comm.fallback and comm.swap_at_step both change the comm backend during the run: use one (a "
                                                 "hot-swap between a fixed pair, or a fallback when a backend fails), or set comm.strict = true");
  }
  for (const auto& b : cfg.get_list("comm.fallback")) {
    if (b.empty()) fail({"comm.fallback"}, "comm.fallback lists an empty name: give comm backends (\"ucx\", \"nccl\", \"auto\", \"name:key=value\")");
  }
  for (const char* key : {"comm.max_failures", "comm.failure_window"}) {
    if (cfg.is_set(key) && comm_chain(cfg).size() == 1) {
      fail({key, "comm.fallback"}, std::string(key) + " is set, but " + (cfg.get_bool("comm.strict") ? "comm.strict = true" : "comm.fallback is empty") +
           ": it counts a backend's failures before the next of comm.fallback replaces it, and without one the first failure stops the job; "
           "set comm.fallback, or remove " + key);
    }
  }
  if (cfg.get_int("comm.swap_at_step") == 0 && !cfg.get_string("comm.swap_to").empty()) {
    fail({"comm.swap_to", "comm.swap_at_step"}, "comm.swap_to is set but comm.swap_at_step is 0, so nothing would swap: set comm.swap_at_step (swap every this "
                                                "many steps), or remove comm.swap_to");
  }
  problems.throw_if_any();
}

void check_data(const config::Config& cfg, const data::Tokenizer& tokenizer, const JobSpec& spec) {
  data::TextDatasetOptions options{cfg.get_list("data.paths"), spec.global_batch_size, spec.seq_len,
                                   static_cast<std::uint64_t>(cfg.get_int("data.seed"))};
  options.document_separator = cfg.get_string("data.document_separator");
  data::TextDataset dataset(options, tokenizer);
  auto separator_unused = [&](const data::TextDataset& d, const std::string& key) {
    if (options.document_separator.empty() || d.separators() != 0) return;
    SPMDX_WARN(cfg.where({"data.document_separator"}) << ": data.document_separator " << config::toml_string(options.document_separator) << " occurs nowhere in the text files of " << key
                                                       << ": each file is one document. A command line takes the value as written (\"\\n\" is a backslash "
                                                          "and an n there): write a real newline, e.g. $'%\\n' in bash, or set the key in the TOML file");
  };
  separator_unused(dataset, "data.paths");
  if (spec.validation.enable) {
    std::optional<data::TextDataset> held_out;
    try {
      held_out.emplace(validation_data(spec), tokenizer);
    } catch (const std::exception& e) {
      throw config::ConfigError(cfg.where({"validation.paths"}) + ": the held-out text: " + e.what());
    }
    separator_unused(*held_out, "validation.paths");
    const std::int64_t batch_tokens = spec.validation.global_batch_size * spec.seq_len;
    const std::int64_t fills = static_cast<std::int64_t>(held_out->stream().size()) / batch_tokens;
    const std::string what = "validation.paths hold " + std::to_string(held_out->stream().size()) + " tokens, " + std::to_string(fills) +
                             " batch" + (fills == 1 ? "" : "es") + " of validation.local_batch_size x " + std::to_string(spec.dims.dp_replicate * spec.dims.dp_shard) +
                             " data-parallel ranks x seq_len " + std::to_string(spec.seq_len) + " = " + std::to_string(batch_tokens) + " tokens";
    if (fills == 0) {
      throw config::ConfigError(cfg.where({"validation.paths", "validation.local_batch_size"}) + ": " + what +
                                ": a validation needs one at least; add held-out text or lower validation.local_batch_size");
    }
    if (spec.validation.steps > fills) {
      throw config::ConfigError(cfg.where({"validation.steps"}) + ": validation.steps " + std::to_string(spec.validation.steps) + " asks for more batches than " +
                                what + ": the held-out text would be read twice; use at most " + std::to_string(fills) + ", or -1 for all of them");
    }
    if (spec.validation.freq > spec.steps) {
      SPMDX_WARN(cfg.where({"validation.freq"}) << ": validation.freq " << spec.validation.freq << " is more than training.steps " << spec.steps
                                                << ": validation never runs");
    }
  }
  if (spec.output.profile_freq > spec.steps) {
    SPMDX_WARN(cfg.where({"profiling.profile_freq"}) << ": profiling.profile_freq " << spec.output.profile_freq << " is more than training.steps " << spec.steps
                                                     << ": no step is profiled");
  }
  auto make_folder = [&](const std::filesystem::path& folder, const std::string& key) {
    std::error_code ec;
    std::filesystem::create_directories(folder, ec);
    if (ec || !std::filesystem::is_directory(folder) || ::access(folder.c_str(), W_OK) != 0) {
      throw config::ConfigError(cfg.where({key}) + ": " + key + " '" + cfg.get_string(key) + "': the folder " + folder.string() + " cannot be made or written" +
                                (ec ? " (" + ec.message() + ")" : std::string()) + ": name a folder this user may write");
    }
  };
  make_folder(cfg.get_string("job.dump_folder"), "job.dump_folder");
  if (!spec.output.tensorboard_folder.empty()) make_folder(spec.output.tensorboard_folder.parent_path(), "metrics.save_tb_folder");
  if (spec.output.profile_freq > 0) make_folder(spec.output.traces_folder, "profiling.save_traces_folder");
}

namespace {


// The plugin file of `name` (libspmdx_<name>.so) found here that did not load, or null.
const PluginError* load_error_of(const PluginRegistry& registry, const std::string& name) {
  for (const auto& e : registry.errors()) {
    if (e.path().filename() == "libspmdx_" + name + ".so") return &e;
  }
  return nullptr;
}

// What the strategy plugins registered here offer, by factory name.
std::vector<std::string> strategy_factories(const PluginRegistry& registry) {
  std::vector<std::string> known;
  for (const auto& p : registry.plugins()) {
    if (p.kind == PluginKind::strategy && p.registered) known.insert(known.end(), p.factories.begin(), p.factories.end());
  }
  return known;
}

// The comm plugins found here, by name.
std::vector<std::string> comm_plugin_names(const PluginRegistry& registry) {
  std::vector<std::string> names;
  for (const auto& q : registry.plugins()) {
    if (q.kind == PluginKind::comm) names.push_back(q.name);
  }
  return names;
}

// [parallelism.strategies]: every plugin named is a strategy plugin found here, also for a dim
// of degree 1, which never asks it for placements (a typo there would wait for the day the
// degree grows).
void check_strategy_names(const config::Config& cfg, const PluginRegistry& registry, const std::map<std::string, std::string>& strategies,
                          std::vector<std::string>& out) {
  const std::vector<std::string> known = strategy_factories(registry);
  for (const auto& [dim, name] : strategies) {
    if (std::find(known.begin(), known.end(), name) != known.end()) continue;
    const std::string key = "parallelism.strategies." + dim;
    const PluginInfo* other = registry.find(name);
    std::string why = other != nullptr && other->kind != PluginKind::strategy
                          ? "'" + name + "' is a " + to_string(other->kind) + " plugin, not a strategy plugin"
                          : "no strategy plugin named '" + name + "'";
    const std::string near = nearest_word(name, known, 3);
    out.push_back(cfg.where({key}) + ": " + key + " = \"" + name + "\": " + why + "; found: " + join(known) +
                  (near.empty() ? std::string("") : " (did you mean " + near + "?)"));
  }
}

// comm.backend and comm.swap_to: "auto" finds a backend, or a comm plugin found here, made (not
// joined) so that each checks its options, that serves ranks in processes and moves the memory
// training.device holds. With comm.fallback, the chain (comm_chain) is refused only when no
// backend of it can serve the job, each named with its reason; the ranks pass over the others.
void check_comm_backends(const config::Config& cfg, PluginRegistry& registry, std::vector<std::string>& out) {
  const std::string device = cfg.get_string("training.device");
  if (const auto chain = comm_chain(cfg); chain.size() > 1) {
    // A name no plugin here has (loaded or not) is a typo, not a fallback: it could never serve.
    std::vector<std::string> comm_names{"auto"};
    for (auto& n : comm_plugin_names(registry)) comm_names.push_back(std::move(n));
    const auto& listed = cfg.get_list("comm.fallback");
    const bool options_given = std::any_of(listed.begin(), listed.end(), [](const std::string& b) { return b.find(':') != std::string::npos; });
    for (const auto& b : chain) {
      const std::string name = b.substr(0, b.find(':'));
      if (std::find(comm_names.begin(), comm_names.end(), name) != comm_names.end() || load_error_of(registry, name) != nullptr) continue;
      const std::string near = nearest_word(name, comm_names, 3);
      out.push_back(cfg.where({"comm.backend", "comm.fallback"}) + ": \"" + b + "\" is not a comm plugin found here; found: " + join(comm_names) +
                    (near.empty() ? std::string() : " (did you mean " + near + "?)") +
                    (b.find(':') == std::string::npos && options_given
                         ? "; on the command line, commas separate comm.fallback's entries: a backend whose options hold a comma goes in the config file"
                         : ""));
    }
    std::vector<std::string> why_not;
    bool usable = false;  // one before it serves: a later one that cannot is said now, not when it is needed
    for (const auto& b : chain) {
      const std::string why = comm_backend_problem(registry, b, device);
      if (why.empty()) usable = true;
      else if (!usable) why_not.push_back("\"" + b + "\"" + why);
      else SPMDX_WARN(cfg.where({"comm.fallback"}) << ": comm.fallback \"" << b << "\" cannot serve this job here" << why << ": a fallback to it would pass it over");
    }
    if (!usable) {
      out.push_back(cfg.where({"comm.backend", "comm.fallback"}) + ": no comm backend of comm.backend and comm.fallback can serve this job: " + join(why_not, "; "));
    }
  } else if (const std::string why = comm_backend_problem(registry, chain.front(), device); !why.empty()) {
    const char* key = cfg.is_set("comm.backend") || cfg.get_list("comm.fallback").empty() ? "comm.backend" : "comm.fallback";
    out.push_back(cfg.where({key}) + ": " + key + (std::string(key) == "comm.fallback" ? " (comm.strict: its first alone)" : "") + " = \"" + chain.front() + "\"" + why);
  }
  if (const std::string swap_to = cfg.get_string("comm.swap_to"); !swap_to.empty()) {
    if (const std::string why = comm_backend_problem(registry, swap_to, device); !why.empty()) {
      out.push_back(cfg.where({"comm.swap_to"}) + ": comm.swap_to = \"" + swap_to + "\"" + why);
    }
  }
}

// The hooks hooks.enable names, made as for a compile; with a plan (and for a run), the
// validators run on it.
void check_hooks(const config::Config& cfg, PluginRegistry& registry, std::int64_t world_size, const std::optional<PlacedJob>& job,
                 const std::optional<sharding::DistributedPlan>& plan, bool run, std::vector<std::string>& out) {
  try {
    if (plan && run) {  // the validators' verdicts (partition_validator), as rank 0 would give them after start (compile runs them itself)
      if (const std::string refused = validator_hooks(cfg, registry, world_size)(*job, *plan); !refused.empty()) {
        out.push_back(cfg.where({"hooks.enable"}) + ": " + refused);
      }
    } else {
      hooks::make_hooks(hook_spec(cfg), registry, hook_context(world_size, job ? &*job : nullptr));
    }
  } catch (const std::invalid_argument& e) {
    // A line per problem; one about an option names where the config set it.
    for (const auto& line : split_lines(e.what())) {
      std::string key = "hooks.enable";
      if (const auto open = line.find("[hooks."); open != std::string::npos) {
        const auto close = line.find(']', open);
        const auto end = line.find_first_of(" :=", close + 2);
        if (close != std::string::npos && close + 2 < line.size()) key = line.substr(open + 1, close - open - 1) + "." + line.substr(close + 2, end - close - 2);
      }
      out.push_back(cfg.where({key}) + ": " + line);
    }
  }
}

// Whether the job will resume from a checkpoint of its own (a step-N folder under
// checkpoint.folder, which exec::find_checkpoint checks in full on the ranks).
bool has_checkpoint(const CheckpointSpec& ckpt) { return (ckpt.enable || ckpt.load_step >= 0) && !scan_checkpoints(ckpt.folder).complete.empty(); }

}  // namespace

std::vector<std::string> preflight(const config::Config& cfg, std::int64_t world_size, PluginRegistry& registry, std::unique_ptr<data::Tokenizer>* tokenizer,
                                   std::optional<JobSpec>* spec, Preflight what, const std::string& start_flag) {
  const bool run = what == Preflight::run;
  std::vector<std::string> out;
  auto lines = [&](const std::string& text) {
    for (auto& line : split_lines(text)) out.push_back(std::move(line));
  };
  auto attempt = [&](const std::vector<std::string>& keys, const std::function<void()>& f) {
    try {
      f();
      return true;
    } catch (const config::ConfigError& e) {
      lines(e.what());
    } catch (const std::exception& e) {
      // A message that begins with the key it is about (the pipeline's) is placed where that key is set.
      const std::string what = e.what();
      const std::string first = what.substr(0, what.find_first_of(" :"));
      lines(cfg.where(first.rfind("parallelism.pipeline_parallel_", 0) == 0 ? std::vector<std::string>{first} : keys) + ": " + what);
    }
    return false;
  };
  if (!cfg.has_problem("model.tokenizer")) {
    try {
      *tokenizer = data::make_tokenizer(cfg.get_string("model.tokenizer"));
    } catch (const std::exception& e) {
      out.push_back(cfg.where({"model.tokenizer"}) + ": " + cfg.given_as("model.tokenizer") + ": " + e.what());
    }
  }
  if (*tokenizer && !cfg.has_problem("model.") && !cfg.has_problem("parallelism.") && !cfg.has_problem("training.")) {
    attempt({}, [&] { *spec = job_spec(cfg, world_size, (*tokenizer)->vocab_size(), start_flag); });
  }
  if (run && !cfg.has_problem("training.device") && !cfg.has_problem("data.") && !cfg.has_problem("comm.")) attempt({}, [&] { check_runnable(cfg); });
  discover_plugins(registry, cfg);
  // Every plugin found registers now, as `spmdx plugins` checks them: one that would fail when a
  // name is looked up (or that "auto" would silently skip) fails the check instead.
  registry.load_all();
  // Blame the config only where it names plugin paths (the error may come from SPMDX_PLUGIN_PATH
  // or the built-in folder, which the message names). A job with fallbacks goes on past a
  // plugin that fails to load: the fallbacks pass over it, saying why.
  const std::string plugins_where = cfg.is_set("plugins.paths") ? cfg.where({"plugins.paths"}) + ": " : std::string();
  const bool falls_back = comm_chain(cfg).size() > 1 || (*spec && !(*spec)->fallback_strategies.empty());
  for (const auto& e : registry.errors()) {
    if (falls_back) {
      SPMDX_WARN(plugins_where << "plugins: " << e.what() << " (the job goes on: it has fallbacks)");
    } else {
      out.push_back(plugins_where + "plugins: " + e.what());
    }
  }
  const bool plugins_ok = falls_back || registry.errors().empty();
  // parallelism.fallback_strategies: a plugin no file here has is a typo, not a fallback; then
  // the layout the ranks will choose, or why none serves.
  bool strategies_found = true;
  if (*spec && !(*spec)->fallback_strategies.empty()) {
    const std::vector<std::string> known = strategy_factories(registry);
    for (const auto& layout : (*spec)->fallback_strategies) {
      for (const auto& [dim, plugin] : layout) {
        if (std::find(known.begin(), known.end(), plugin) != known.end() || load_error_of(registry, plugin) != nullptr) continue;
        const std::string near = nearest_word(plugin, known, 3);
        out.push_back(cfg.where({"parallelism.fallback_strategies"}) + ": parallelism.fallback_strategies names '" + plugin + "' for " + dim +
                      ", which is no strategy plugin found here; found: " + join(known) + (near.empty() ? std::string() : " (did you mean " + near + "?)"));
        strategies_found = false;
      }
    }
  }
  if (*spec && (*spec)->auto_strategy && plugins_ok) {
    strategies_found = attempt({"parallelism.strategy", "parallelism.planner"}, [&] { choose_auto(**spec, registry); });
  } else if (*spec && !(*spec)->fallback_strategies.empty() && plugins_ok && strategies_found) {
    strategies_found = attempt({"parallelism.strategies", "parallelism.fallback_strategies"},
                               [&] { choose_strategies(**spec, registry, validator_hooks(cfg, registry, world_size)); });
  }
  const std::size_t before_strategies = out.size();
  if (*spec && strategies_found) check_strategy_names(cfg, registry, (*spec)->strategies, out);
  strategies_found = strategies_found && out.size() == before_strategies;
  if (run && world_size > 1 && !cfg.has_problem("comm.")) check_comm_backends(cfg, registry, out);
  std::optional<PlacedJob> job;
  std::optional<sharding::DistributedPlan> plan;
  if (*spec && plugins_ok && strategies_found) {  // what `spmdx compile` finds: placements and local shapes
    auto place = [&] {
      job.emplace(place_job(**spec, registry));
      plan.emplace(propagate_job(*job));
      sharding::rank_graph(*plan, 0);
    };
    const bool placed = attempt({"model.name", "model.flavor", "model.tokenizer", "model.path", kDegreeKeys[0], kDegreeKeys[1], kDegreeKeys[2],
                                 "parallelism.tp_plan", "parallelism.strategies"}, place);
    // Over the budget: the job as fit_memory_budget changed it, or a problem naming the largest tensors.
    if (placed && (*spec)->memory_budget > 0 && (*spec)->fallback_strategies.empty() && !(*spec)->auto_strategy) {  // (choose_strategies fitted it already)
      job.reset();
      plan.reset();
      if (attempt({"parallelism.memory_budget"}, [&] { (*spec)->memory_fit = fit_memory_budget(**spec, registry); })) place();
    }
    // The initial weights' names, shapes and dtypes, from the files' headers; a job that will
    // resume from its own checkpoint never reads them (as torchtitan's initial_load_path).
    if (const CheckpointSpec& ckpt = (*spec)->checkpoint; run && job && !ckpt.initial_load_path.empty() && !has_checkpoint(ckpt)) {
      try {
        models::plan_weight_load(ckpt.initial_load_path, job->model);
      } catch (const std::exception& e) {  // a line per tensor, each said where the path was set
        for (const auto& line : split_lines(e.what())) out.push_back(cfg.where({"checkpoint.initial_load_path"}) + ": " + line);
      }
    }
  }
  if (!cfg.get_list("hooks.enable").empty() && !cfg.has_problem("hooks.")) check_hooks(cfg, registry, world_size, job, plan, run, out);
  return out;
}

std::string comm_backend_problem(PluginRegistry& registry, const std::string& spec_text, const std::string& device) {
  const std::vector<MemoryType> memory = comm::job_memory(device);
  const std::string memory_text = device == "cuda" ? "CUDA" : "host";
  if (spec_text == "auto" || spec_text.rfind("auto:", 0) == 0) {
    try {
      comm::make_job_backend(registry, spec_text, memory, true);
    } catch (const std::exception& e) {
      return ": " + std::string(e.what());
    }
    return "";
  }
  const std::string name = spec_text.substr(0, spec_text.find(':'));
  const auto* p = registry.find(name);
  if (const PluginError* e = p == nullptr ? load_error_of(registry, name) : nullptr) return ": " + std::string(e->what());  // its own reason
  if (p == nullptr || p->kind != PluginKind::comm) {
    const std::string known = join(comm_plugin_names(registry));
    return " is not a comm plugin found here; found: " + (known.empty() ? std::string("none") : known) +
           " (or \"auto\"). A plugin built elsewhere: add its folder to plugins.paths or SPMDX_PLUGIN_PATH";
  }
  try {  // made, not initialised: the plugin checks its options (and what it needs) here
    if ((registry.comm_backend_plugin(name).flags & kPluginInProcessOnly) != 0) {
      return ": the " + name + " plugin runs ranks as threads of one process (its descriptor is flagged in-process only), and spmdx "
             "starts a process per rank; use ucx, or \"auto\"";
    }
    const auto backend = registry.make_comm_backend_from_spec(spec_text);
    if (const std::string problem = comm::capability_problem(backend->capabilities()); !problem.empty()) {
      return ": the " + name + " plugin's capabilities are malformed: " + problem + "; fix the plugin";
    }
    bool moves = false;
    for (const auto& c : backend->capabilities()) moves = moves || c.memory == memory.front();
    if (!moves) return ": the " + name + " plugin does not move " + memory_text + " memory, which training.device = \"" + device + "\" needs";
  } catch (const std::exception& e) {
    return ": " + std::string(e.what());
  }
  return "";
}

void discover_plugins(PluginRegistry& registry, const config::Config& cfg) {
  const auto& listed = cfg.get_list("plugins.paths");
  registry.discover(plugin_search_path(std::vector<std::filesystem::path>(listed.begin(), listed.end())));
}

ir::Graph rank_step_graph(const sharding::DistributedPlan& plan, std::int64_t rank, const JobSpec& spec, std::int64_t* kept) {
  ir::Graph g = sharding::rank_graph(plan, rank);
  std::int64_t merged = 0;
  if (spec.activation_checkpoint.mode != "none" && spec.activation_checkpoint.keep_collective_outputs) merged = keep_collective_outputs(g);
  if (kept != nullptr) *kept = merged;
  return g;
}

ir::Graph rank_program(const PlacedJob& job, const sharding::DistributedPlan& plan, std::int64_t rank, const JobSpec& spec, std::int64_t* kept,
                       StageGraph* staged) {
  const std::int64_t per_stage = job.mesh.size();
  ir::Graph g = rank_step_graph(plan, rank % per_stage, spec, kept);
  if (job.pipeline.stages <= 1) return g;
  StageGraph stage = stage_graph(g, job.pipeline, job.model.params, rank, per_stage);
  ir::Graph out = std::move(stage.graph);
  if (staged != nullptr) *staged = std::move(stage);
  return out;
}

sharding::DeviceMesh run_mesh(const PlacedJob& job) { return job.pipeline.stages > 1 ? pipeline_mesh(job.mesh, job.pipeline.stages) : job.mesh; }

namespace {

// The model's forward for a batch of `rows` rows, with the casts of the spec's mixed precision.
models::Model forward_model(const JobSpec& spec, std::int64_t rows) {
  models::Model m = models::build_model(spec.model, rows, spec.seq_len);
  if (spec.mixed_precision.param != "float32") {
    m.graph = cast_for_mixed_precision(m.graph, spec.mixed_precision.param == "float16" ? ir::DType::f16 : ir::DType::bf16);
  }
  return m;
}

}  // namespace

namespace {

// Each pipeline stage's first layer: from pipeline_parallel_split_points, or
// pipeline_parallel_layers_per_stage, or an even split (earlier stages take one more layer).
// Throws std::invalid_argument naming the key when the stages do not fit the model's layers.
std::vector<std::int64_t> first_layers(const JobSpec& spec, const std::vector<std::string>& params) {
  const std::int64_t stages = spec.pipeline.stages;
  const bool interleaved = spec.pipeline.schedule == "Interleaved1F1B";
  std::int64_t layers = 0;
  for (const auto& p : params) layers = std::max(layers, layer_of(p) + 1);
  // The chunks the layers make (stages; with Interleaved1F1B, several per stage: 2 unless the
  // split points or layers_per_stage say otherwise).
  std::int64_t chunks = interleaved ? 2 * stages : stages;
  if (!spec.pipeline_split_points.empty()) chunks = static_cast<std::int64_t>(spec.pipeline_split_points.size()) + 1;
  if (spec.pipeline_layers_per_stage > 0) chunks = (layers + spec.pipeline_layers_per_stage - 1) / spec.pipeline_layers_per_stage;  // torchtitan's count
  auto fits = [&](std::int64_t n) { return interleaved ? n % stages == 0 && n >= 2 * stages : n == stages; };  // a chunk count these stages run
  if (layers < chunks) {
    const std::int64_t most = interleaved ? layers / 2 : layers;
    throw std::invalid_argument("parallelism.pipeline_parallel_degree " + std::to_string(stages) + " is more " +
                                (interleaved ? "chunks (" + std::to_string(chunks) + ", Interleaved1F1B)" : std::string("stages")) + " than the model's " +
                                std::to_string(layers) + " layers: " +
                                (most >= 2 ? "use at most " + std::to_string(most) + " stages" : std::string("the model is too shallow to pipeline; use pipeline_parallel_degree 1")));
  }
  if (!fits(chunks)) {
    const std::string key = spec.pipeline_split_points.empty() ? "parallelism.pipeline_parallel_layers_per_stage " + std::to_string(spec.pipeline_layers_per_stage)
                                                               : "parallelism.pipeline_parallel_split_points";
    const std::string want = interleaved ? "a multiple of pipeline_parallel_degree " + std::to_string(stages) + ", at least twice it (Interleaved1F1B)"
                                         : "pipeline_parallel_degree " + std::to_string(stages);
    std::string hint;  // the most even layers_per_stage that fits, if any: ceil(layers / chunks) for P chunks (2P, 3P, ... interleaved)
    for (std::int64_t c = interleaved ? 2 * stages : stages; c <= layers && spec.pipeline_split_points.empty() && hint.empty(); c += stages) {
      const std::int64_t lps = (layers + c - 1) / c;
      if (fits((layers + lps - 1) / lps)) hint = ": use " + std::to_string(lps) + ", or unset it for an even split";
      if (!interleaved) break;
    }
    if (spec.pipeline_split_points.empty() && hint.empty()) hint = ": no count of layers a chunk fits; unset it for an even split";
    throw std::invalid_argument(key + " makes " + std::to_string(layers) + " layers into " + std::to_string(chunks) + (interleaved ? " chunks" : " stages") + ", not " + want +
                                (interleaved ? "" : (chunks > stages ? " (more are virtual stages: pipeline_parallel_schedule = \"Interleaved1F1B\")" : std::string())) + hint);
  }
  std::vector<std::int64_t> first{0};
  if (!spec.pipeline_split_points.empty()) {
    for (const auto& name : spec.pipeline_split_points) {
      const std::int64_t layer = layer_of(name);
      if (layer <= 0 || layer >= layers || models::layer_of(name) != name) {
        throw std::invalid_argument("parallelism.pipeline_parallel_split_points: \"" + name + "\" names no layer a stage can begin at: use \"layers.N\" with N from 1 to " +
                                    std::to_string(layers - 1) + " (on the command line, a list is comma-separated: layers.2,layers.4)");
      }
      if (layer <= first.back()) {
        throw std::invalid_argument("parallelism.pipeline_parallel_split_points must name each layer once, in increasing order (\"" + name +
                                    "\" comes after layers." + std::to_string(first.back()) + ")");
      }
      first.push_back(layer);
    }
    return first;
  }
  if (spec.pipeline_layers_per_stage > 0) {
    for (std::int64_t c = 1; c < chunks; ++c) first.push_back(c * spec.pipeline_layers_per_stage);
    return first;
  }
  for (std::int64_t c = 1; c < chunks; ++c) first.push_back(first.back() + layers / chunks + (c - 1 < layers % chunks ? 1 : 0));
  return first;
}

}  // namespace

PlacedJob place_job(const JobSpec& spec, PluginRegistry& registry) {
  PlacedJob job{forward_model(spec, spec.global_batch_size / spec.step.microbatches), sharding::make_mesh(spec.dims, spec.world_size / spec.pipeline.stages),
                {}, {}, {}, spec.reshard_after_forward};
  job.pipeline = spec.pipeline;
  if (spec.pipeline.stages > 1) {
    job.pipeline.first_layer = first_layers(spec, job.model.params);
    job.pipeline.virtual_stages = static_cast<std::int64_t>(job.pipeline.first_layer.size()) / spec.pipeline.stages;
  }
  if (spec.loss_parallel && spec.dims.tp > 1) {
    job.model.graph = vocab_parallel_cross_entropy(job.model.graph);
    job.loss_parallel = true;
  }
  if (spec.dims.cp > 1) {
    job.context_parallel_dim = job.mesh.dim_index("cp");
    job.context_parallel_allgather = spec.context_parallel_allgather;
    job.context_parallel_order = context_parallel_in_order(spec);
    if (job.context_parallel_order.empty()) job.context_parallel_chunks = 2 * spec.dims.cp;
    job.model.graph = context_parallel(job.model.graph, spec.seq_len, job.context_parallel_chunks);
  }
  const std::size_t forward_nodes = job.model.graph.num_nodes();
  append_train_step(job.model.graph, job.model.params, spec.step);
  if (job.context_parallel_dim >= 0) job.model.graph = context_parallel_weight_grads(job.model.graph);
  if (spec.activation_checkpoint.mode != "none") {
    job.model.graph = spec.step.microbatches == 1
                          ? checkpoint_activations(job.model.graph, forward_nodes, job.model.params, spec.activation_checkpoint, &job.checkpointed)
                          : checkpoint_activations(job.model.graph, forward_nodes_of(job.model.graph), job.model.params, spec.activation_checkpoint, &job.checkpointed);
  }
  StrategyInput in;
  for (const auto& init : job.model.init) {
    if (init.trainable) in.parameters.push_back({init.name, init.shape});
  }
  for (const char* name : {"tokens", "labels"}) in.inputs.push_back({name, job.model.graph.find_input(name)->meta().shape});
  std::map<std::string, Options> options;
  if (!spec.tp_plan.empty()) {
    options["tensor_parallel"] = spec.tp_plan;
    if (spec.dims.tp == 1) {  // checked all the same: a plan's mistakes show before tensor parallelism is switched on
      StrategyInput one = in;
      one.mesh = {{"tp", 1}};
      registry.make_strategy("tensor_parallel", spec.tp_plan)->place(one);
    }
  }
  job.inputs = sharding::parallelize(registry, job.mesh, in, spec.strategies, options);
  std::map<std::string, sharding::Placements> params;
  for (const auto& p : job.model.params) params[p] = job.inputs.at(p);
  job.use = sharding::use_placements(job.mesh, params);
  for (const auto& p : job.model.params) job.inputs["exp_avg." + p] = job.inputs["exp_avg_sq." + p] = job.inputs.at(p);
  for (std::int64_t k = 1; k < spec.step.microbatches; ++k) {  // every microbatch's rows go where microbatch 0's do
    for (const char* name : {"tokens", "labels"}) job.inputs[microbatch_input(name, k)] = job.inputs.at(name);
  }
  for (const auto& s : train_state_names(job.model.params)) job.outputs["next." + s] = job.inputs.at(s);
  if (spec.sequence_parallel && spec.dims.tp == 1) {
    job.sequence_parallel_off = "parallelism.enable_sequence_parallel acts only with parallelism.tensor_parallel_degree > 1";
  } else if (spec.sequence_parallel && sharding::sequence_parallel_values(job.model.graph, spec.dims.tp).empty()) {
    job.sequence_parallel_off = "the model has no rms_norm or layer_norm op over a sequence of at least tensor_parallel_degree (" + std::to_string(spec.dims.tp) +
                                ") positions to shard (a norm written as its arithmetic, as Hugging Face exports do, is not one)";
  } else if (spec.sequence_parallel) {
    job.sequence_parallel_dim = job.mesh.dim_index("tp");
  }
  if (!spec.auto_choices.empty()) {
    for (const auto& node : job.model.graph.nodes()) {
      if (const auto it = spec.auto_choices.find(node->id()); it != spec.auto_choices.end()) job.forced[node.get()] = it->second;
    }
  }
  return job;
}

sharding::DistributedPlan propagate_job(const PlacedJob& job) {
  return sharding::propagate(job.model.graph, job.mesh, job.inputs, job.outputs, job.use, job.reshard_after_forward, job.sequence_parallel_dim,
                             job.context_parallel_dim, job.context_parallel_allgather, job.forced.empty() ? nullptr : &job.forced);
}

sharding::DistributedPlan propagate_job(const PlacedJob& job, const spmdx::Planner& planner, const sharding::IntraOpCostModel& cost,
                                        std::vector<sharding::IntraOpDim>* report) {
  return sharding::propagate_optimal(job.model.graph, job.mesh, job.inputs, job.outputs, job.use, job.reshard_after_forward, job.sequence_parallel_dim,
                                     job.context_parallel_dim, job.context_parallel_allgather, planner, cost, report);
}

data::TextDatasetOptions validation_data(const JobSpec& spec) {
  data::TextDatasetOptions options{spec.validation.paths, spec.validation.global_batch_size, spec.seq_len, spec.data.seed};
  options.document_separator = spec.data.document_separator;
  return options;
}

ContextParallelSummary context_parallel_summary(const JobSpec& spec, const PlacedJob& job, const sharding::DistributedPlan& plan) {
  ContextParallelSummary s;
  s.tokens_per_rank = spec.seq_len;
  if (job.context_parallel_dim < 0) return s;
  const auto dim = static_cast<std::size_t>(job.context_parallel_dim);
  s.degree = job.mesh.size(job.context_parallel_dim);
  s.tokens_per_rank = spec.seq_len / s.degree;
  s.pieces = job.context_parallel_chunks;
  s.in_order_why = job.context_parallel_order;
  const ir::Value* loss = job.model.graph.find_output("loss");
  const std::set<const ir::Node*> forward = loss != nullptr ? ir::producers_of(loss) : std::set<const ir::Node*>{};
  for (const auto& node : job.model.graph.nodes()) {
    if (node->op() != "sdpa" || forward.count(node.get()) == 0) continue;
    ++s.attentions;
    const auto& in = plan.inputs.at(node.get());
    if (in[0][dim] == Placement::shard(2) && in[1][dim].is_replicate()) ++s.query_rows;
    else if (in[0][dim].is_shard()) ++s.all_to_all;
  }
  if (const std::int64_t m = spec.step.microbatches; m > 1 && s.attentions % m == 0 && s.query_rows % m == 0 && s.all_to_all % m == 0) {
    s.attentions /= m, s.query_rows /= m, s.all_to_all /= m;  // a microbatch's (the same plan each)
  }
  return s;
}

std::vector<ShortParameters> short_parameters(const JobSpec& spec, const PlacedJob& job) {
  std::vector<ShortParameters> out;
  const auto& dims = job.mesh.dims();
  for (std::size_t d = 0; d < dims.size(); ++d) {
    const std::int64_t k = dims[d].size;
    if (k <= 1) continue;
    ShortParameters s;
    s.mesh_dim = dims[d].name;
    s.degree = k;
    bool shards = dims[d].name == "dp_shard", long_left_whole = false;
    for (const auto& name : job.model.params) {
      auto placed = job.inputs.find(name);
      const ir::Value* v = job.model.graph.find_input(name);
      if (placed == job.inputs.end() || v == nullptr || d >= placed->second.size()) continue;
      const ir::TensorMeta& m = v->meta();
      if (!placed->second[d].is_replicate()) {
        shards = shards || placed->second[d].is_shard();
        continue;
      }
      if (!m.shape.empty() && m.shape[0] >= k) {
        long_left_whole = true;  // whole by the strategy's design (tp's norms, ddp): not for its length
        continue;
      }
      s.parameters.push_back({name, m.shape, m.nbytes()});
      s.extra_bytes += 4 * (m.nbytes() - m.nbytes() / k);
    }
    if (!shards || long_left_whole || s.parameters.empty()) continue;
    s.all = s.parameters.size() == job.model.params.size();
    auto bound = spec.strategies.find(dims[d].name);
    try {
      s.strategy = bound != spec.strategies.end() ? bound->second : sharding::strategy_for(dims[d].name);
    } catch (const std::invalid_argument&) {
      s.strategy = "";  // a dim no strategy decides (cp): named alone
    }
    out.push_back(std::move(s));
  }
  return out;
}

std::string ShortParameters::line() const {
  std::int64_t bytes = 0, shortest = degree;
  for (const auto& p : parameters) bytes += p.bytes, shortest = std::min<std::int64_t>(shortest, p.shape.empty() ? 1 : p.shape[0]);
  std::vector<std::string> shown;
  for (std::size_t i = 0; i < parameters.size() && i < 4; ++i) shown.push_back(parameters[i].name + " " + ir::shape_str(parameters[i].shape));
  if (parameters.size() > shown.size()) shown.push_back("and " + std::to_string(parameters.size() - shown.size()) + " more");
  const std::string n = std::to_string(parameters.size()) + (parameters.size() == 1 ? " parameter" : " parameters");
  const std::string which = all ? "every parameter (" + n + ", the whole model, " + human_bytes(static_cast<double>(bytes)) + ")"
                                : n + " (" + human_bytes(static_cast<double>(bytes)) + ")";
  return (strategy.empty() ? "" : strategy + " on ") + mesh_dim + " (" + std::to_string(degree) + " ranks) keeps " + which +
         " whole on every rank, not sharded: " + (parameters.size() == 1 ? "its" : "their") + " dim 0 is shorter than " + std::to_string(degree) + " (" +
         join(shown) + "); that costs each rank " + human_bytes(static_cast<double>(extra_bytes)) + " more than an even share of them (parameters, gradients and AdamW state: 4 x " +
         human_bytes(static_cast<double>(bytes)) + ", less 1/" + std::to_string(degree) + " of it; FSDP2 would pad them and leave some ranks an empty shard)" +
         (shortest > 1 ? "; a degree of at most " + std::to_string(shortest) + " shards them all" : "");
}

std::string ContextParallelSummary::line() const {
  if (degree <= 1) return "";
  std::string out = "context parallel: cp " + std::to_string(degree) + ", " + std::to_string(tokens_per_rank) + " of " + std::to_string(tokens_per_rank * degree) +
                    " tokens a rank, ";
  out += pieces > 1 ? "load-balanced (" + std::to_string(pieces) + " pieces: rank r of cp holds pieces r and " + std::to_string(pieces - 1) + " - r)"
                    : "in order (" + in_order_why + ")";
  if (attentions == 0) return out + "; the model has no sdpa op (attention written as matmuls and softmax is split like any other op)";
  out += "; attention: " + std::to_string(query_rows) + " of " + std::to_string(attentions) + " split their query rows and all-gather k and v";
  if (all_to_all > 0) out += ", " + std::to_string(all_to_all) + " split batch or heads by all_to_all";
  if (const std::int64_t whole = attentions - query_rows - all_to_all; whole > 0) out += ", " + std::to_string(whole) + " run whole on every rank";
  return out;
}

PlacedValidation place_validation(const JobSpec& spec, const PlacedJob& job) {
  PlacedValidation v{forward_model(spec, spec.validation.global_batch_size), {}};
  if (job.context_parallel_dim >= 0) v.model.graph = context_parallel(v.model.graph, spec.seq_len, job.context_parallel_chunks);
  for (const ir::Value* in : v.model.graph.inputs()) {  // buffers (RoPE tables) have no placement given: replicated, as the train step's
    if (const auto it = job.inputs.find(in->name()); it != job.inputs.end()) v.inputs[in->name()] = it->second;
  }
  return v;
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
