#include "spmdx/job/spec.h"
#include "spmdx/plan/target.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <limits>
#include <numeric>
#include <set>

#include "spmdx/comm/score_map.h"
#include "spmdx/core/log.h"
#include "spmdx/files.h"
#include "spmdx/job/devices.h"
#include "spmdx/text.h"
#include "spmdx/sharding/spec.h"
#include "spmdx/sharding/parallelize.h"
#include "problems.h"

namespace spmdx::job {
using namespace spmdx::train;

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

// Why context parallelism splits the sequence in order ("" when it is load-balanced, 2 cp
// pieces): load balancing permutes the positions, which it needs as inputs (the built-in
// models' RoPE tables); an imported program makes its own (arange).
std::string context_parallel_in_order(const JobSpec& s) {
  if (!s.context_parallel_load_balance) return "parallelism.context_parallel_load_balance = false";
  if (s.model.name == "pt2") return "an imported program makes its own positions";
  return "";
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
    if (plugin.empty() || plugin[0] == ':') {
      problems.add({"parallelism.strategies"}, "[parallelism.strategies] " + dim + " names no plugin: give a strategy plugin's name (e.g. \"" +
                   sharding::strategy_for(dim == "tp" ? "tp" : "dp_shard") + "\"), with options as \"name:key=value;key=value\"");
      continue;
    }
    try {
      parse_plugin_spec(plugin, "[parallelism.strategies] " + dim);
    } catch (const std::invalid_argument& e) {
      problems.add({"parallelism.strategies"}, std::string(e.what()) + ": write options as \"name:key=value;key=value\"");
    }
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
      const std::string name = plugin.substr(0, plugin.find(':'));  // options may follow: "fsdp_except_embeddings:keep=embedding"
      ok = (dim == "dp_replicate" || dim == "dp_shard" || dim == "tp") && !name.empty() &&
           name.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789_") == std::string::npos && bound.insert(dim).second;  // plugin names are [a-z0-9_]+
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
  if (cfg.get_string("parallelism.strategy") == "auto") {  // the other degrees are chosen (job/auto_sharding.h): all data parallel until then
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
  s.device = {cfg.get_string("training.device"), cfg.get_bool("training.allow_tf32"), cfg.get_bool("training.cuda_graphs"),
              cfg.get_string("training.cpu_matmul"), cfg.get_list("training.devices")};
  // A mesh that may mix CPU and CUDA ranks moves host memory; a run learns the ranks' devices
  // at start and chooses again (job/devices.h).
  s.comm = {cfg.get_string("comm.backend"), cfg.get_string("comm.swap_to"), cfg.get_int("comm.swap_at_step"), cfg.get_float("comm.timeout_seconds"),
            job_comm_memory(configured_devices(s.device.kind, s.device.per_rank))};
  s.comm.chain = comm_chain(cfg);
  s.comm.backend = s.comm.chain.front();
  s.comm.max_failures = cfg.get_int("comm.max_failures");
  s.comm.failure_window = cfg.get_int("comm.failure_window");
  std::vector<std::string> specs = s.comm.chain;
  if (!s.comm.swap_to.empty()) specs.push_back(s.comm.swap_to);
  for (const auto& text : specs) {  // parsed once here; what does not parse preflight refuses
    try {
      s.comm.parsed.emplace(text, parse_plugin_spec(text, "comm backend"));
    } catch (const std::invalid_argument&) {
    }
  }
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

}  // namespace

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
    else if (!models::is_builtin_transformer(s.model.name)) problems.add({"model.n_layers", "model.name"}, "model.n_layers applies to llama, qwen3 and deepseek_v3 only, not " + s.model.name);
    else s.model.n_layers = layers;
  }
  if (const std::string mask = cfg.get_string("model.attn_mask_type"); mask != "causal") {
    if (!models::is_builtin_transformer(s.model.name)) {
      problems.add({"model.attn_mask_type", "model.name"}, "model.attn_mask_type = \"" + mask + "\" applies to the built-in llama, qwen3 and deepseek_v3 only, not " + s.model.name +
                                                               (s.model.name == "pt2" ? " (an exported program's attention is as it was exported)" : ""));
    } else if (const auto eos = job_tokenizer(cfg)->eos_id(); !eos) {
      problems.add({"model.attn_mask_type", "model.tokenizer"}, "model.attn_mask_type = \"block_causal\" needs documents that end with an EOS token, and the tokenizer '" +
                                                                    cfg.get_string("model.tokenizer") + "' has none: use \"causal\" or a tokenizer with an eos_token");
    } else {
      s.model.attn_mask_type = mask;
      s.model.eos_id = *eos;
    }
  }
  const std::vector<std::int64_t> exported = read_pt2(cfg, vocab_size, s.model, problems);  // pt2: the tokens' [batch, seq] as exported
  read_strategies(cfg, s, problems);
  read_degrees(cfg, world_size, start_flag, s.dims, problems);
  const bool degrees_ok = problems.lines.empty();  // the batch check below needs the data-parallel degree
  if (models::is_builtin_transformer(s.model.name) && s.model.n_heads % s.dims.tp != 0) {
    fail({"parallelism.tensor_parallel_degree", "model.name", "model.flavor"}, "parallelism.tensor_parallel_degree " + std::to_string(s.dims.tp) + " does not divide the " + std::to_string(s.model.n_heads) +
         " attention heads of " + s.model.name + " " + s.model.flavor);
  } else if (models::is_builtin_transformer(s.model.name) && s.model.n_kv_heads > 0 && s.model.n_kv_heads % s.dims.tp != 0) {
    // Tensor parallelism shards the key/value heads as the query heads (wk and wv colwise);
    // torchtitan replicates them instead when it cannot; spmdx refuses.
    fail({"parallelism.tensor_parallel_degree", "model.flavor"}, "parallelism.tensor_parallel_degree " + std::to_string(s.dims.tp) + " does not divide the " +
         std::to_string(s.model.n_kv_heads) + " key/value heads of " + s.model.name + " " + s.model.flavor +
         " (grouped-query attention: tensor parallelism shards them as the query heads): use a degree that divides " + std::to_string(s.model.n_kv_heads));
  }
  if (const std::int64_t ep = cfg.get_int("parallelism.expert_parallel_degree"); ep > 1) {
    const std::vector<std::string> keys{"parallelism.expert_parallel_degree"};
    const bool imported = s.model.name == "pt2";  // its experts are counted when it is read (the importer checks the degree)
    if (s.model.moe.experts == 0 && !imported) {
      fail(keys, "parallelism.expert_parallel_degree " + std::to_string(ep) + " applies to Mixture-of-Experts models (qwen3 debugmodel_moe, 30B-A3B, 235B-A22B, "
                 "tiny_moe; deepseek_v3; a transformers MoE export), not " + models::model_label(s.model));
    } else if (s.dims.cp != 1) {
      fail({"parallelism.expert_parallel_degree", "parallelism.context_parallel_degree"},
           "parallelism.expert_parallel_degree " + std::to_string(ep) + " with context_parallel_degree " + std::to_string(s.dims.cp) +
               ": expert parallelism with context parallelism (torchtitan's ep carved from dp_shard x cp) is not built yet: set context_parallel_degree to 1, "
               "or expert_parallel_degree to 1");
    } else if (s.dims.dp_shard % ep != 0) {
      fail({"parallelism.expert_parallel_degree", "parallelism.data_parallel_shard_degree"},
           "parallelism.expert_parallel_degree " + std::to_string(ep) + ": spmdx's expert parallelism is carved from the dp_shard dim (ep must divide "
           "data_parallel_shard_degree, here " + std::to_string(s.dims.dp_shard) + "; the rest, efsdp, shards the experts FSDP-style): "
           "set data_parallel_shard_degree to a multiple of " + std::to_string(ep) + " (spmdx compile: --world-size for the ranks)");
    } else if (!imported && s.model.moe.experts % ep != 0) {
      std::string divisors;
      for (std::int64_t d = 1; d <= s.model.moe.experts; ++d) {
        if (s.model.moe.experts % d == 0) divisors += (divisors.empty() ? "" : ", ") + std::to_string(d);
      }
      fail(keys, "parallelism.expert_parallel_degree " + std::to_string(ep) + " does not divide the " + std::to_string(s.model.moe.experts) + " experts of " +
                     models::model_label(s.model) + ": use one that does (" + divisors + ") and divides data_parallel_shard_degree (" +
                     std::to_string(s.dims.dp_shard) + ")");
    } else {
      s.model.moe.expert_parallel = ep;
      s.model.moe.expert_blocks = s.dims.dp_replicate * s.dims.dp_shard;  // one block per data-parallel rank; each run of ep blocks exchanges
      if (ep < s.dims.dp_shard) s.dims.ep = ep;  // the mesh's dp_shard as [efsdp, dp_shard (ep)]
    }
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
  if (const std::string target = cfg.get_string("planning.target"); target != "this-machine") {
    s.planning_target = target;
    if (const plan::TargetProfile* t = plan::find_target(target); t != nullptr && s.memory_budget == 0) {
      s.memory_budget = static_cast<std::int64_t>(std::llround(plan::kTargetMemoryShare * t->memory_bytes));
      s.memory_budget_source = "90% of planning.target " + t->name + "'s " + std::to_string(static_cast<long long>(t->memory_bytes / 1e9)) +
                               " GB: the rest for the CUDA context, NCCL's buffers and the caching allocator's fragmentation";
    }
  }
  s.auto_strategy = cfg.get_string("parallelism.strategy") == "auto";
  s.planner = cfg.get_string("parallelism.planner");
  s.planner_time_limit = cfg.get_float("parallelism.planner_time_limit_seconds");
  s.step.max_norm = cfg.get_float("training.max_norm");
  s.step.load_balance_coeff = s.model.moe.load_balance_coeff;
  s.plan = plan_options(cfg);
  s.hooks = hook_spec(cfg);
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
  if (const auto& devices = s.device.per_rank; !devices.empty()) {
    for (const auto& d : devices) {
      if (d != "cpu" && d != "cuda" && d != "auto") {
        fail({"training.devices"}, "training.devices: '" + d + "' is not a device: give each rank \"cpu\", \"cuda\" or \"auto\"");
        break;
      }
    }
    if (cfg.is_set("training.device")) {
      SPMDX_WARN(cfg.where({"training.devices", "training.device"}) << ": training.devices gives each rank its device: training.device = \""
                 << cfg.get_string("training.device") << "\" is not used");
    }
    if (static_cast<std::int64_t>(devices.size()) != world_size) {
      fail({"training.devices"}, "training.devices lists " + std::to_string(devices.size()) + " device" + (devices.size() == 1 ? "" : "s") + " for " +
           std::to_string(world_size) + (world_size == 1 ? " rank" : " ranks") + " (--nproc x nodes): give one per rank, in rank order (or remove it and set training.device)");
    }
  }
  if (s.device.cuda_graphs && !s.device.all("cuda")) {
    fail({"training.cuda_graphs", s.device.per_rank.empty() ? "training.device" : "training.devices"},
         s.device.per_rank.empty() ? "training.cuda_graphs = true needs training.device = \"cuda\" (CUDA graphs are a GPU feature)"
                                   : "training.cuda_graphs = true needs every rank on \"cuda\" (CUDA graphs are a GPU feature), and training.devices puts some elsewhere");
  } else if (s.device.cuda_graphs && world_size > 1) {
    fail({"training.cuda_graphs"}, "training.cuda_graphs = true runs one rank only for now (" + std::to_string(world_size) +
         " ranks here): capturing a step's collectives needs the nccl stream inside the graph, which spmdx does not do yet; set it false");
  }
  if (cfg.get_bool("fault_tolerance.enable")) {
    auto& ft = s.fault_tolerance;
    ft.enable = true;
    ft.groups = cfg.get_int("fault_tolerance.group_size") > 0 ? cfg.get_int("fault_tolerance.group_size") : s.dims.dp_replicate;
    ft.min_replicas = cfg.get_int("fault_tolerance.min_replica_size");
    ft.timeout_seconds = static_cast<double>(cfg.get_int("fault_tolerance.process_group_timeout_ms")) / 1000.0;
    ft.ranks_per_group = std::max<std::int64_t>(1, world_size / std::max<std::int64_t>(1, ft.groups));
    const std::string off = "; set it off, or fault_tolerance.enable = false";
    if (s.auto_strategy) {  // auto chooses the degrees, and does not yet keep a replicate dim as a fault domain
      fail({"fault_tolerance.enable", "parallelism.strategy"}, "fault tolerance with parallelism.strategy = \"auto\" is not supported yet: the "
           "replica groups are the data_parallel_replicate slices, whose degree auto would choose; set the degrees yourself "
           "(spmdx compile --strategy auto --fault_tolerance.enable false shows the layout it would pick)");
    } else if (s.dims.dp_replicate < 2) {
      fail({"fault_tolerance.enable", kDegreeKeys[0]}, "fault_tolerance.enable = true needs replica groups to fall back on: set "
           "parallelism.data_parallel_replicate_degree to 2 or more (it is " + std::to_string(s.dims.dp_replicate) +
           "); each replica group is a full copy of the model over the other mesh dims (FSDP, TP inside a group), as torchft's");
    } else if (ft.groups != s.dims.dp_replicate) {
      fail({"fault_tolerance.group_size", kDegreeKeys[0]}, "fault_tolerance.group_size = " + std::to_string(ft.groups) +
           " replica groups, but parallelism.data_parallel_replicate_degree = " + std::to_string(s.dims.dp_replicate) +
           ": the replica groups are the data_parallel_replicate slices; set group_size to 0 (it then takes the degree) or to the degree");
    }
    if (ft.groups >= 2 && ft.min_replicas >= ft.groups) {
      fail({"fault_tolerance.min_replica_size"}, "fault_tolerance.min_replica_size = " + std::to_string(ft.min_replicas) + " with " +
           std::to_string(ft.groups) + " replica groups: the job could never lose one (a group below the floor is not waited for); set it to at most " +
           std::to_string(ft.groups - 1));
    }
    if (cfg.get_int("fault_tolerance.replica_id") >= 0) {
      fail({"fault_tolerance.replica_id"}, "fault_tolerance.replica_id = " + std::to_string(cfg.get_int("fault_tolerance.replica_id")) +
           ": spmdx run's launcher gives each rank its replica group (rank / ranks per group), where torchtitan starts one torchrun job per "
           "group with its own replica_id; remove the key");
    }
    if (s.pipeline.stages > 1) fail({"fault_tolerance.enable", "parallelism.pipeline_parallel_degree"}, "fault tolerance with pipeline stages is not supported yet" + off);
    if (s.dims.cp > 1) {  // its loss gathers rows across the data-parallel dims, the replicate dim among them
      fail({"fault_tolerance.enable", "parallelism.context_parallel_degree"}, "fault tolerance with context parallelism is not supported yet (its loss "
           "gathers across the replica groups, which must exchange nothing but their gradients' all_reduce)" + off);
    }
    if (s.comm.swap_at_step > 0) fail({"fault_tolerance.enable", "comm.swap_at_step"}, "fault tolerance rejoins the comm backend itself; comm.swap_at_step hot-swaps it" + off);
    if (s.comm.failover()) fail({"fault_tolerance.enable", "comm.fallback"}, "fault tolerance replaces comm.fallback's run-time failover (a failed step is dropped and run again over the live groups)" + off);
    if (!s.device.all("cpu")) fail({"fault_tolerance.enable", s.device.per_rank.empty() ? "training.device" : "training.devices"}, "fault tolerance runs on training.device = \"cpu\" for now (the state transfer to a restarted group is host memory)");
    if (s.validation.enable) fail({"fault_tolerance.enable", "validation.enable"}, "fault tolerance with validation is not supported yet" + off);
  }
  const auto& speeds = cfg.get_list("parallelism.balance_speeds");
  if (!speeds.empty() && cfg.get_string("parallelism.balance") != "speed") {
    fail({"parallelism.balance_speeds", "parallelism.balance"}, "parallelism.balance_speeds is given, but parallelism.balance is \"" + cfg.get_string("parallelism.balance") +
         "\": the speeds split the batch only with balance = \"speed\"; set it, or remove balance_speeds");
  }
  if (cfg.get_string("parallelism.balance") == "speed") {
    s.balance = {true, cfg.get_int("parallelism.balance_interval"), cfg.get_float("parallelism.balance_threshold"), {}};
    const std::int64_t dp = s.dims.dp_replicate * s.dims.dp_shard;
    // A speed is a number, or a target profile's name (plan/target.h): its peak FLOP/s in the
    // compute dtype over planning.target's (the machine the estimates are of), or over the
    // fastest named when every entry is a name and planning.target is not given.
    const std::string per = s.auto_strategy ? "each rank's" : "each data-parallel rank's";
    std::string profiles;
    for (const auto& t : plan::target_profiles()) profiles += (profiles.empty() ? "" : ", ") + t.name;
    std::vector<const plan::TargetProfile*> named;
    for (const auto& text : speeds) {
      char* end = nullptr;
      const double v = std::strtod(text.c_str(), &end);
      if (const plan::TargetProfile* t = plan::find_target(text); t != nullptr) {
        named.push_back(t);
        s.balance.speeds.push_back(t->peak_flops(s.mixed_precision.param, s.device.allow_tf32));
        continue;
      }
      if (text.empty() || end != text.c_str() + text.size() || text.find_first_not_of("0123456789.eE+-") != std::string::npos || !std::isfinite(v) || v <= 0) {
        fail({"parallelism.balance_speeds"}, "parallelism.balance_speeds: '" + text + "' is not a speed: give " + per + " relative speed as a decimal number > 0, "
             "e.g. [\"1\", \"0.5\"], or the name of a target profile (" + profiles + ")");
        s.balance.speeds.clear();
        named.clear();
        break;
      }
      named.push_back(nullptr);
      s.balance.speeds.push_back(v);
    }
    const bool names = std::any_of(named.begin(), named.end(), [](const auto* t) { return t != nullptr; });
    const bool numbers = std::any_of(named.begin(), named.end(), [](const auto* t) { return t == nullptr; });
    const plan::TargetProfile* reference = s.planning_target.empty() ? nullptr : plan::find_target(s.planning_target);
    if (names && numbers && reference == nullptr) {
      fail({"parallelism.balance_speeds", "planning.target"}, "parallelism.balance_speeds mixes numbers and target names: set planning.target to the "
           "machine of speed 1 (the names' speeds are their peak FLOP/s over its), or give only numbers or only names");
    } else if (names) {
      double unit = reference != nullptr ? reference->peak_flops(s.mixed_precision.param, s.device.allow_tf32) : 0;
      if (reference == nullptr) {
        for (std::size_t i = 0; i < named.size(); ++i) unit = std::max(unit, s.balance.speeds[i]);
      }
      for (std::size_t i = 0; i < named.size(); ++i) {
        if (named[i] != nullptr) s.balance.speeds[i] /= unit;
      }
    }
    if (!s.balance.speeds.empty() && s.auto_strategy && static_cast<std::int64_t>(s.balance.speeds.size()) != world_size) {
      // The data-parallel ranks are known only once auto has chosen the layout: a speed per rank.
      fail({"parallelism.balance_speeds", "parallelism.strategy"}, "parallelism.balance_speeds gives " + std::to_string(s.balance.speeds.size()) +
           " speeds for " + std::to_string(world_size) + " ranks: with parallelism.strategy = \"auto\", give one a rank, in rank order (auto chooses which "
           "ranks are data-parallel peers; each data-parallel rank then runs at its slowest rank's speed)");
    } else if (!s.balance.speeds.empty() && !s.auto_strategy && degrees_ok && static_cast<std::int64_t>(s.balance.speeds.size()) != dp) {
      fail({"parallelism.balance_speeds", kDegreeKeys[0], kDegreeKeys[1]}, "parallelism.balance_speeds gives " + std::to_string(s.balance.speeds.size()) +
           " speeds for " + std::to_string(dp) + " data-parallel ranks: give one a data-parallel rank, in their order (dp_replicate outer, dp_shard inner)");
    }
    if (degrees_ok && s.global_batch_size < dp) {
      fail({"training.global_batch_size", "parallelism.balance"}, "training.global_batch_size " + std::to_string(s.global_batch_size) + " cannot give each of the " +
           std::to_string(dp) + " data-parallel ranks a row");
    }
    // What a rank's own rows cannot change yet: each would need its split taken apart.
    const std::string even = "; set parallelism.balance = \"even\"";
    if (s.pipeline.stages > 1) {
      fail({"parallelism.balance", "parallelism.pipeline_parallel_degree"}, "parallelism.balance = \"speed\" with pipeline stages is not supported yet "
           "(a stage's microbatches would differ in rows from its data-parallel peers')" + even);
    } else if (s.step.microbatches > 1) {
      fail({"parallelism.balance", "training.global_batch_size", "training.local_batch_size"}, "parallelism.balance = \"speed\" with gradient "
           "accumulation (" + std::to_string(s.step.microbatches) + " microbatches a step) is not supported yet: set training.local_batch_size to " +
           std::to_string(s.global_batch_size / std::max<std::int64_t>(1, s.dims.dp_replicate * s.dims.dp_shard)) + " (global_batch_size / the data-parallel "
           "degree: one microbatch), or set parallelism.balance = \"even\"");
    }
    if (s.dims.cp > 1) {  // its loss gathers rows across the data-parallel dims, which unequal rows would make unequal collectives
      fail({"parallelism.balance", "parallelism.context_parallel_degree"}, "parallelism.balance = \"speed\" with context parallelism is not supported yet "
           "(its loss gathers rows across the data-parallel ranks, whose counts would differ)" + even);
    }
    if (s.fault_tolerance.enable) fail({"parallelism.balance", "fault_tolerance.enable"}, "parallelism.balance = \"speed\" with fault tolerance is not supported yet" + even);
    if (s.dims.ep > 1) {
      fail({"parallelism.balance", "parallelism.expert_parallel_degree"}, "parallelism.balance = \"speed\" with expert parallelism is not supported yet "
           "(its all_to_all moves each rank's tokens over dp_shard)" + even);
    }
    if (s.device.cuda_graphs && dp > 1) fail({"parallelism.balance", "training.cuda_graphs"}, "parallelism.balance = \"speed\" re-plans the step, which a CUDA graph fixes" + even);
    if (degrees_ok && dp == 1) {
      SPMDX_WARN(cfg.where({"parallelism.balance"}) << ": parallelism.balance = \"speed\" with one data-parallel rank has no batch to split: it does nothing");
    } else if (s.balance.interval >= s.steps) {
      SPMDX_WARN(cfg.where({"parallelism.balance_interval", "training.steps"}) << ": parallelism.balance_interval " << s.balance.interval << " is not less than training.steps "
                                                                              << s.steps << ": the split is never re-planned from measured steps in this run");
    }
  } else {
    for (const char* key : {"parallelism.balance_interval", "parallelism.balance_threshold"}) {
      if (cfg.is_set(key)) SPMDX_WARN(cfg.where({key}) << ": " << key << " acts only with parallelism.balance = \"speed\" (it is \"" << cfg.get_string("parallelism.balance") << "\"): ignored");
    }
  }
  problems.throw_if_any();
  return s;
}

std::unique_ptr<data::Tokenizer> job_tokenizer(const config::Config& cfg) { return data::make_tokenizer(cfg.get_string("model.tokenizer")); }

bool hooks_enabled(const config::Config& cfg) { return !cfg.get_list("hooks.enable").empty(); }

void discover_plugins(PluginRegistry& registry, const config::Config& cfg) {
  const auto& listed = cfg.get_list("plugins.paths");
  registry.discover(plugin_search_path(std::vector<std::filesystem::path>(listed.begin(), listed.end())));
}

data::TextDatasetOptions validation_data(const JobSpec& spec) {
  data::TextDatasetOptions options{spec.validation.paths, spec.validation.global_batch_size, spec.seq_len, spec.data.seed};
  options.document_separator = spec.data.document_separator;
  return options;
}

}  // namespace spmdx::job
