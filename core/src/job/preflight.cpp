#include "spmdx/job/preflight.h"

#include <algorithm>
#include <functional>
#include <set>

#include <unistd.h>

#include "spmdx/comm/score_map.h"
#include "spmdx/core/log.h"
#include "spmdx/files.h"
#include "spmdx/text.h"
#include "spmdx/data/text_dataset.h"
#include "spmdx/hooks/hook_set.h"
#include "spmdx/models/weights.h"
#include "spmdx/job/auto_sharding.h"
#include "spmdx/job/compile.h"
#include "spmdx/job/devices.h"
#include "spmdx/job/memory_budget.h"
#include "spmdx/train/checkpoint_folder.h"
#include "problems.h"

namespace spmdx::job {
using namespace spmdx::train;

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
  for (const auto& [dim, spec] : strategies) {
    const std::string name = spec.substr(0, spec.find(':'));  // "name:key=value;..."
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
  // Host memory unless every rank is on CUDA: a mesh that may mix CPU and CUDA ranks
  // ("auto", training.devices) moves host memory between them (job/devices.h).
  const std::string device = comm_device(configured_devices(cfg.get_string("training.device"), cfg.get_list("training.devices")));
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
void check_hooks(const config::Config& cfg, PluginRegistry& registry, std::int64_t world_size, const std::optional<JobSpec>& spec,
                 const std::optional<CompiledJob>& compiled, bool run, std::vector<std::string>& out) {
  const PlacedJob* job = compiled ? &compiled->job : nullptr;
  try {
    if (compiled && run) {  // the validators' verdicts (partition_validator), as rank 0 would give them after start (compile runs them itself)
      if (const std::string refused = validator_hooks(*spec, registry)(compiled->job, compiled->plan); !refused.empty()) {
        out.push_back(cfg.where({"hooks.enable"}) + ": " + refused);
      }
    } else {
      hooks::make_hooks(spec ? spec->hooks : hook_spec(cfg), registry, hook_context(world_size, job));  // the config's, when no JobSpec could be made
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
      for (const auto& [dim, bound] : layout) {
        const std::string plugin = bound.substr(0, bound.find(':'));  // options may follow
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
                               [&] { choose_strategies(**spec, registry, validator_hooks(**spec, registry)); });
  }
  const std::size_t before_strategies = out.size();
  if (*spec && strategies_found) check_strategy_names(cfg, registry, (*spec)->strategies, out);
  strategies_found = strategies_found && out.size() == before_strategies;
  if (run && world_size > 1 && !cfg.has_problem("comm.")) check_comm_backends(cfg, registry, out);
  std::optional<CompiledJob> compiled;
  if (*spec && plugins_ok && strategies_found) {  // what `spmdx compile` finds: placements and local shapes
    auto place = [&] {
      compiled.emplace(**spec, registry);  // in place: the plan points at its graph
      sharding::rank_graph(compiled->plan, 0);
    };
    const bool placed = attempt({"model.name", "model.flavor", "model.tokenizer", "model.path", kDegreeKeys[0], kDegreeKeys[1], kDegreeKeys[2], "parallelism.expert_parallel_degree",
                                 "parallelism.tp_plan", "parallelism.strategies"}, place);
    // Over the budget: the job as fit_memory_budget changed it, or a problem naming the largest tensors.
    if (placed && (*spec)->memory_budget > 0 && (*spec)->fallback_strategies.empty() && !(*spec)->auto_strategy) {  // (choose_strategies fitted it already)
      compiled.reset();
      if (attempt({"parallelism.memory_budget"}, [&] { (*spec)->memory_fit = fit_memory_budget(**spec, registry); })) place();
    }
    // The initial weights' names, shapes and dtypes, from the files' headers; a job that will
    // resume from its own checkpoint never reads them (as torchtitan's initial_load_path).
    if (const CheckpointSpec& ckpt = (*spec)->checkpoint; run && compiled && !ckpt.initial_load_path.empty() && !has_checkpoint(ckpt)) {
      try {
        models::plan_weight_load(ckpt.initial_load_path, compiled->job.model);
      } catch (const std::exception& e) {  // a line per tensor, each said where the path was set
        for (const auto& line : split_lines(e.what())) out.push_back(cfg.where({"checkpoint.initial_load_path"}) + ": " + line);
      }
    }
  }
  if (!cfg.get_list("hooks.enable").empty() && !cfg.has_problem("hooks.")) check_hooks(cfg, registry, world_size, *spec, compiled, run, out);
  return out;
}

std::string comm_backend_problem(PluginRegistry& registry, const std::string& spec_text, const std::string& device, std::unique_ptr<CommBackend>* made,
                                 std::string* choice, const PluginSpec* parsed) {
  const std::vector<MemoryType> memory = comm::job_memory(device);
  const std::string memory_text = device == "cuda" ? "CUDA" : "host";
  if (spec_text == "auto" || spec_text.rfind("auto:", 0) == 0) {
    try {
      std::string chosen;
      auto backend = parsed != nullptr ? comm::make_job_backend(registry, *parsed, spec_text, memory, true, &chosen)
                                       : comm::make_job_backend(registry, spec_text, memory, true, &chosen);
      if (made != nullptr) *made = std::move(backend);
      if (choice != nullptr) *choice = chosen;
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
    auto backend = parsed != nullptr ? registry.make_comm_backend(parsed->name, parsed->options) : registry.make_comm_backend_from_spec(spec_text);
    if (const std::string problem = comm::capability_problem(backend->capabilities()); !problem.empty()) {
      return ": the " + name + " plugin's capabilities are malformed: " + problem + "; fix the plugin";
    }
    bool moves = false;
    for (const auto& c : backend->capabilities()) moves = moves || c.memory == memory.front();
    if (!moves) return ": the " + name + " plugin does not move " + memory_text + " memory, which training.device = \"" + device + "\" needs";
    if (made != nullptr) *made = std::move(backend);
    if (choice != nullptr) *choice = spec_text;
  } catch (const std::exception& e) {
    return ": " + std::string(e.what());
  }
  return "";
}

}  // namespace spmdx::job
