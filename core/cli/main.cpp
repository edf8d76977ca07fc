// The spmdx command line. Subcommands arrive with their issues: `plugins` lists and checks
// the plugins the registry finds.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <optional>
#include <set>

#include "spmdx/core/log.h"
#include "spmdx/files.h"
#include "spmdx/text.h"
#include "spmdx/core/registry.h"
#include "spmdx/core/version.h"
#include "spmdx/config/config.h"
#include "spmdx/data/tokenizer.h"
#include "spmdx/ir/serialize.h"
#include "spmdx/sharding/distribute.h"
#include "spmdx/train/job.h"
#include "spmdx/plan/memory_plan.h"
#include "spmdx/train/memory_budget.h"
#include "spmdx/train/auto_sharding.h"
#include "spmdx/plan/estimate.h"
#include "spmdx/launch/launcher.h"
#include "spmdx/bench/compare.h"
#include "spmdx/comm/bench.h"
#include "spmdx/comm/select.h"
#include "spmdx/comm/store.h"
#include "spmdx/hooks/fr_trace.h"
#include "spmdx/hooks/hook_set.h"
#include "spmdx/plan/runtime_plan.h"
#include "spmdx/plan/diff.h"
#ifdef SPMDX_HAVE_EXEC
#include "spmdx/exec/calibrate.h"
#include "spmdx/exec/checkpoint.h"
#include "spmdx/exec/device.h"
#include "spmdx/exec/job_runner.h"
#include "spmdx/exec/kernels.h"
#include "spmdx/models/pt2.h"
#endif

#include <sys/prctl.h>
#include <sys/resource.h>
#include <csignal>
#include <unistd.h>
#include "spmdx/models/model.h"
#include "spmdx/train/train_step.h"

namespace {

std::string abi_text(const spmdx::PluginInfo& p) {
  return std::to_string(p.abi_major) + "." + std::to_string(p.abi_minor);
}

// A comm backend as `spmdx plugins` shows it: its capability table (comm.h's CommCapability;
// what comm.backend = "auto" scores), what is wrong with it, or why it cannot be made here
// (e.g. nccl without a CUDA device); and the option keys it takes, when it runs over a transport.
struct CommListing {
  nlohmann::json capabilities = nlohmann::json::array();
  std::string cannot_make;  // the factory's error
  std::string malformed;    // comm::capability_problem
  std::vector<std::string> options;
};

CommListing list_comm_backend(spmdx::PluginRegistry& registry, const std::string& backend) {
  CommListing out;
  out.options = registry.comm_backend_options(backend);
  try {
    const auto caps = registry.make_comm_backend(backend)->capabilities();
    out.malformed = spmdx::comm::capability_problem(caps);
    for (const auto& c : caps) {
      out.capabilities.push_back({{"op", c.op},
                                  {"memory", c.memory == spmdx::MemoryType::cuda ? "cuda" : "host"},
                                  {"min_bytes", c.min_bytes},
                                  {"max_bytes", c.max_bytes},
                                  {"score", c.score}});
    }
  } catch (const std::exception& e) {
    out.cannot_make = e.what();
  }
  return out;
}

// "all_reduce host up to 4096 B score 50", one capability in the text listing.
std::string capability_text(const nlohmann::json& c) {
  const auto min = c.at("min_bytes").get<std::uint64_t>(), max = c.at("max_bytes").get<std::uint64_t>();
  const bool unbounded = max == static_cast<std::uint64_t>(-1);
  const std::string sizes = min == 0 && unbounded ? "any size"
                            : unbounded          ? "from " + std::to_string(min) + " B"
                            : min == 0           ? "up to " + std::to_string(max) + " B"
                                                 : std::to_string(min) + " to " + std::to_string(max) + " B";
  return c.at("op").get<std::string>() + " " + c.at("memory").get<std::string>() + " " + sizes + " score " + std::to_string(c.at("score").get<int>());
}

nlohmann::json plugin_json(const spmdx::PluginInfo& p, const std::map<std::string, CommListing>& comm) {
  nlohmann::json entry{{"name", p.name},
                       {"kind", spmdx::to_string(p.kind)},
                       {"version", p.version},
                       {"abi", abi_text(p)},
                       {"toolchain", p.toolchain},
                       {"in_process_only", (p.flags & spmdx::kPluginInProcessOnly) != 0},
                       {"path", p.path.string()},
                       {"description", p.description},
                       {"registered", p.registered},
                       {"factories", p.factories}};
  if (p.kind != spmdx::PluginKind::comm) return entry;
  nlohmann::json tables = nlohmann::json::object(), options = nlohmann::json::object();
  for (const auto& backend : p.factories) {
    const CommListing& c = comm.at(backend);
    tables[backend] = c.cannot_make.empty() ? c.capabilities : nlohmann::json{{"error", c.cannot_make}};
    if (!c.options.empty()) options[backend] = c.options;
  }
  entry["capabilities"] = tables;
  entry["options"] = options;
  return entry;
}

void print_plugin_table(const spmdx::PluginRegistry& registry, const std::map<std::string, CommListing>& comm) {
  std::size_t width = 4;
  for (const auto& p : registry.plugins()) width = std::max(width, p.name.size());
  width += 2;
  std::cout << std::left << std::setw(static_cast<int>(width)) << "NAME" << std::setw(10) << "KIND" << std::setw(10) << "VERSION" << std::setw(6) << "ABI"
            << "PATH\n";
  for (const auto& p : registry.plugins()) {
    std::cout << std::setw(static_cast<int>(width)) << p.name << std::setw(10) << spmdx::to_string(p.kind) << std::setw(10) << p.version << std::setw(6)
              << abi_text(p) << p.path.string() << "\n"
              << "    " << p.description << "\n";
    if (p.kind != spmdx::PluginKind::comm || !p.registered) continue;
    for (const auto& backend : p.factories) {
      const CommListing& c = comm.at(backend);
      if (!c.cannot_make.empty()) {
        std::cout << "    capabilities of " << backend << ": cannot make it here: " << c.cannot_make << "\n";
        continue;
      }
      std::vector<std::string> rows;
      for (const auto& cap : c.capabilities) rows.push_back(capability_text(cap));
      std::cout << "    capabilities of " << backend << ": " << spmdx::join(rows, "; ") << "\n";
      if (!c.options.empty()) std::cout << "    options of " << backend << ": " << spmdx::join(c.options) << "\n";
    }
  }
}

// Lists every plugin found on the search path after loading it, so that a plugin that would
// fail at run time fails here first. Exit 1 when any plugin failed (or a comm backend's
// capabilities are malformed), 0 otherwise.
int run_plugins(const std::vector<std::string>& paths, bool json) {
  std::vector<std::filesystem::path> user_paths(paths.begin(), paths.end());
  spmdx::PluginRegistry registry;
  registry.discover(spmdx::plugin_search_path(user_paths));
  registry.load_all();

  std::map<std::string, CommListing> comm;
  std::vector<std::string> problems;
  for (const auto& p : registry.plugins()) {
    if (p.kind != spmdx::PluginKind::comm || !p.registered) continue;
    for (const auto& backend : p.factories) {
      comm[backend] = list_comm_backend(registry, backend);
      if (!comm[backend].malformed.empty()) {
        problems.push_back("comm backend '" + backend + "' of plugin '" + p.name + "' (" + p.path.string() + ") has malformed capabilities: " +
                           comm[backend].malformed + "; fix the plugin");
      }
    }
  }
  if (json) {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& p : registry.plugins()) out.push_back(plugin_json(p, comm));
    // Paths need not be UTF-8; replace what is not rather than fail the whole listing.
    std::cout << out.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  } else if (registry.plugins().empty()) {
    std::cout << "no plugins found (searched: --plugin-path, SPMDX_PLUGIN_PATH, "
              << spmdx::builtin_plugin_dir().string() << ")\n";
  } else {
    print_plugin_table(registry, comm);
  }
  for (const auto& e : registry.errors()) std::cerr << "error: " << e.what() << "\n";
  for (const auto& problem : problems) std::cerr << "error: " << problem << "\n";
  return registry.errors().empty() && problems.empty() ? 0 : 1;
}

struct GraphOptions {
  std::string config;  ///< a job's TOML: its model, vocabulary, global batch and seq_len
  std::string model = "llama";
  std::string flavor = "tiny";
  std::int64_t vocab = 0;  ///< 0: the tokenizer's (the config's, or the default one's)
  std::int64_t batch = 8;
  std::int64_t seq = 64;
  bool json = false;
  bool forward_only = false;
  std::set<std::string> given;  ///< the flags given (--model, ...): they replace the config's values
};

// The ids of the tokenizer a config that names none uses (the byte tokenizer's 264).
std::int64_t default_vocab() { return spmdx::data::make_tokenizer(spmdx::config::Config().get_string("model.tokenizer"))->vocab_size(); }

// Prints a model's train-step graph (forward, loss, backward, clipping, AdamW), verified: the
// model a run of the config would train (as job_spec makes it: the tokenizer's vocabulary or
// model.vocab_size, model.n_layers), for its global batch and seq_len; each flag given replaces
// the config's value. Without a config, the flags' defaults and the default tokenizer's ids.
int run_graph(const GraphOptions& o) {
  spmdx::models::ModelArgs args;
  std::int64_t batch = o.batch, seq = o.seq;
  if (!o.config.empty()) {
    const spmdx::config::Config cfg = spmdx::config::Config::load(o.config);
    const auto tokenizer = spmdx::data::make_tokenizer(cfg.get_string("model.tokenizer"));
    const spmdx::train::JobSpec spec = spmdx::train::job_spec(cfg, spmdx::train::degree_product(cfg), tokenizer->vocab_size());
    args = spec.model;
    if (!o.given.count("--batch")) batch = spec.global_batch_size;
    if (!o.given.count("--seq")) seq = spec.seq_len;
    if (o.given.count("--model") || o.given.count("--flavor")) {
      args = spmdx::models::model_args(o.given.count("--model") ? o.model : args.name, o.given.count("--flavor") ? o.flavor : args.flavor, args.vocab_size);
    }
  } else {
    args = spmdx::models::model_args(o.model, o.flavor, default_vocab());
  }
  if (o.given.count("--vocab")) args.vocab_size = o.vocab;
  spmdx::models::Model m = spmdx::models::build_model(args, batch, seq);
  if (!o.forward_only) spmdx::train::append_train_step(m.graph, m.params, {});
  m.graph.verify();
  std::cout << (o.json ? spmdx::ir::to_json(m.graph) + "\n" : m.graph.str());
  return 0;
}

struct ImportOptions {
  std::string path;
  std::vector<std::string> inputs;
  std::string loss = "auto";
  bool graph = false;
  bool json = false;
};

#ifdef SPMDX_HAVE_EXEC

// Inspects a .pt2 file: what it holds, what spmdx cannot map (with source lines), and whether
// it imports. Exit 0 when it imports, 1 when it cannot be trained.
int run_import(const ImportOptions& o) {
  using spmdx::models::Pt2Summary;
  const Pt2Summary s = spmdx::models::summarize_pt2(o.path);
  std::string error;
  std::size_t nodes = 0;
  std::optional<spmdx::models::Model> model;
  if (s.unsupported.empty()) {
    spmdx::models::ModelArgs args = spmdx::models::model_args("pt2", "", 0);
    args.path = o.path;
    args.inputs = o.inputs;
    args.loss = o.loss;
    try {
      model.emplace(spmdx::models::import_pt2(args));
      nodes = model->graph.num_nodes();
    } catch (const spmdx::models::ImportError& e) {
      error = e.what();
    }
  }
  if (o.graph && model) {
    std::cout << model->graph.str();
    return 0;
  }
  std::vector<std::pair<std::string, int>> ops(s.ops.begin(), s.ops.end());
  std::stable_sort(ops.begin(), ops.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  if (o.json) {
    auto tensors = [](const std::vector<Pt2Summary::Tensor>& list) {
      nlohmann::json out = nlohmann::json::array();
      for (const auto& t : list) out.push_back({{"name", t.name}, {"shape", t.shape}, {"dtype", t.dtype}, {"bytes", t.bytes}});
      return out;
    };
    nlohmann::json j{{"path", s.path}, {"torch_version", s.torch_version}, {"schema_version", s.schema_version}, {"verifier", s.verifier},
                     {"parameter_count", s.parameter_count()}, {"parameter_bytes", s.parameter_bytes()}, {"parameters", tensors(s.parameters)},
                     {"buffers", tensors(s.buffers)}, {"inputs", tensors(s.inputs)}, {"outputs", tensors(s.outputs)}, {"ops", s.ops},
                     {"tied", nlohmann::json::array()}, {"unsupported", nlohmann::json::array()}, {"imports", error.empty() && s.unsupported.empty()},
                     {"error", error}, {"ir_nodes", nodes}};
    for (const auto& [alias, param] : s.tied) j["tied"].push_back({{"name", alias}, {"parameter", param}});
    for (const auto& u : s.unsupported) j["unsupported"].push_back({{"op", u.op}, {"node", u.node}, {"source", u.source}, {"why", u.why}});
    std::cout << j.dump(2) << "\n";
    return error.empty() && s.unsupported.empty() ? 0 : 1;
  }
  auto shape = [](const Pt2Summary::Tensor& t) { return t.dtype + spmdx::ir::shape_str(t.shape); };
  std::cout << s.path << ": torch.export program from torch " << s.torch_version << " (schema " << s.schema_version << ", " << s.verifier << " IR)\n";
  std::cout << "parameters: " << s.parameters.size() << (s.parameters.size() == 1 ? " tensor, " : " tensors, ") << s.parameter_count() << " elements, " << spmdx::human_bytes(static_cast<double>(s.parameter_bytes()))
            << (s.tied.empty() ? "" : " (tied: ");
  for (std::size_t i = 0; i < s.tied.size(); ++i) std::cout << (i ? ", " : "") << s.tied[i].first << " = " << s.tied[i].second;
  std::cout << (s.tied.empty() ? "" : ")") << "\n";
  for (const auto& p : s.parameters) std::cout << "  " << p.name << " " << shape(p) << "\n";  // the names a [parallelism.tp_plan] matches
  if (!s.buffers.empty()) {
    std::cout << "buffers and constants (frozen):";
    for (const auto& b : s.buffers) std::cout << " " << b.name << " " << shape(b);
    std::cout << "\n";
  }
  std::cout << "inputs:";
  for (const auto& t : s.inputs) std::cout << " " << t.name << " " << shape(t);
  std::cout << "\noutputs:";
  for (const auto& t : s.outputs) std::cout << " " << t.name << " " << shape(t);
  std::cout << "\nops (" << ops.size() << " kinds):";
  for (const auto& [op, n] : ops) std::cout << " " << op << " x" << n;
  std::cout << "\n";
  if (!s.unsupported.empty()) {
    std::cout << "unsupported (" << s.unsupported.size() << (s.unsupported.size() == 1 ? " node" : " nodes") << "; spmdx cannot train this program):\n";
    for (const auto& u : s.unsupported) std::cout << "  " << u.op << " at node '" << u.node << "'" << (u.source.empty() ? "" : ": " + u.source) << " (" << u.why << ")\n";
    return 1;
  }
  if (!error.empty()) {
    std::cout << "does not import: " << error << "\n";
    return 1;
  }
  std::cout << "imports: " << nodes << " IR nodes (forward and loss); train it with [model] name = \"pt2\", path = \"" << o.path << "\"\n";
  return 0;
}
#endif

// This program's own path, for starting ranks as copies of it.
std::string self_exe() {
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  return n > 0 ? std::string(self, static_cast<std::size_t>(n)) : "/proc/self/exe";
}

struct CompileOptions {
  std::string config;
  std::int64_t world_size = 0;
  std::string dump;
  std::string strategy;   ///< --strategy: parallelism.strategy ("auto": print the ranking)
  bool estimate = false;  ///< --estimate: the calibrated step time
  bool fake = false;
  bool print_config = false;
  bool json = false;
  std::vector<std::string> overrides;
};

// Plans a job without starting ranks: placements, each rank's graph, bytes per rank.
// What `spmdx compile --dump` writes, as (file name, text): the logical graph, the sharding
// plan and, for ranks 0 .. ranks-1, the rank graph and its RuntimePlan; with `everything`,
// the text forms and memory plans too (`spmdx diff` reads only the JSON ones).
std::vector<std::pair<std::string, std::string>> dump_documents(const spmdx::train::PlacedJob& job, const spmdx::sharding::DistributedPlan& plan,
                                                                const spmdx::train::JobSpec& spec, std::int64_t ranks, bool everything) {
  std::vector<std::pair<std::string, std::string>> docs;
  if (everything) docs.emplace_back("logical.txt", job.model.graph.str());
  docs.emplace_back("logical.json", spmdx::ir::to_json(job.model.graph));
  if (everything) docs.emplace_back("plan.txt", plan.str());
  if (job.pipeline.stages > 1 || job.context_parallel_dim >= 0) {
    nlohmann::json p = nlohmann::json::parse(plan.to_json());
    if (job.pipeline.stages > 1) {  // the stages, and the mesh the rank graphs' collectives count their dims in
      p["pipeline"] = {{"stages", job.pipeline.stages}, {"schedule", job.pipeline.schedule}, {"microbatches", job.pipeline.microbatches},
                       {"first_layer", job.pipeline.first_layer}};
      p["run_mesh"] = nlohmann::json::array();
      const spmdx::sharding::DeviceMesh mesh = spmdx::train::run_mesh(job);
      for (const auto& d : mesh.dims()) p["run_mesh"].push_back({{"name", d.name}, {"size", d.size}});
    }
    if (job.context_parallel_dim >= 0) {  // what spmdx diff names when two jobs' context parallelism differs
      p["context_parallel"] = {{"degree", job.mesh.size(job.context_parallel_dim)}, {"load_balance", job.context_parallel_chunks > 1},
                               {"rotate_method", job.context_parallel_allgather ? "allgather" : "auto"}};
    }
    docs.emplace_back("plan.json", p.dump(1));
  } else {
    docs.emplace_back("plan.json", plan.to_json());
  }
  for (std::int64_t r = 0; r < ranks; ++r) {
    const std::string rank = "rank" + std::to_string(r);
    const spmdx::ir::Graph g = spmdx::train::rank_program(job, plan, r, spec);
    const spmdx::sharding::DeviceMesh mesh = spmdx::train::run_mesh(job);
    const spmdx::plan::RuntimePlan runtime = spmdx::plan::make_runtime_plan(g, mesh, spec.plan);
    if (everything) {
      docs.emplace_back(rank + ".txt", g.str());
      docs.emplace_back(rank + ".plan.txt", runtime.str(g, mesh));
      docs.emplace_back(rank + ".memory.txt", spmdx::plan::plan_memory(g, runtime).report(g, runtime));
      if (job.pipeline.stages > 1) docs.emplace_back(rank + ".schedule.txt", spmdx::train::schedule_table(job.pipeline, r / job.mesh.size()));
    }
    docs.emplace_back(rank + ".json", spmdx::ir::to_json(g));
    docs.emplace_back(rank + ".plan.json", runtime.to_json(g, mesh));
  }
  return docs;
}

// A config compiled in memory into the documents `spmdx diff` compares, every rank's (a
// config with problems is refused as spmdx compile refuses it).
spmdx::plan::JobDump compile_for_diff(const std::string& config) {
  spmdx::config::Config cfg = spmdx::config::Config::load(config, {}, /*throw_on_problems=*/false);
  const std::int64_t world = spmdx::train::degree_product(cfg);
  spmdx::PluginRegistry registry;
  std::unique_ptr<spmdx::data::Tokenizer> tokenizer;
  std::optional<spmdx::train::JobSpec> checked_spec;
  cfg.check(spmdx::train::preflight(cfg, world, registry, &tokenizer, &checked_spec, spmdx::train::Preflight::plan));
  const spmdx::train::JobSpec& spec = checked_spec.value();
  spmdx::train::PlacedJob job = spmdx::train::place_job(spec, registry);
  const auto plan = spmdx::train::propagate_job(job);
  spmdx::plan::JobDump d;
  d.label = config;
  for (auto& [name, text] : dump_documents(job, plan, spec, world, /*everything=*/false)) {
    if (name == "logical.json") d.logical = std::move(text);
    else if (name == "plan.json") d.plan = std::move(text);
    else if (name.size() > 10 && name.compare(name.size() - 10, 10, ".plan.json") == 0) d.rank_plans.push_back(std::move(text));
    else d.ranks.push_back(std::move(text));
  }
  return d;
}

struct DiffOptions {
  std::string a, b;
  bool json = false;
  std::size_t max = 10;
};

CLI::App* add_diff(CLI::App& app, DiffOptions& o) {
  auto* diff = app.add_subcommand("diff", "Compare two compiled jobs (compile --dump folders or configs): graphs, placements, collectives, buckets");
  diff->add_option("a", o.a, "A spmdx compile --dump folder, or a config .toml (compiled in memory)")->required();
  diff->add_option("b", o.b, "The same for the other job")->required();
  diff->add_flag("--json", o.json, "Print every difference and the summary as JSON (schema spmdx.diff/1)");
  diff->add_option("--max", o.max, "Differences printed per level (text)")->capture_default_str()->check(CLI::Range(1, 1000000));
  return diff;
}

// Exit 0: equivalent; 1: they differ; 2: bad input (a missing or malformed dump, a bad config).
int run_diff(const DiffOptions& o) {
  auto load = [](const std::string& path) {
    std::error_code ec;
    if (std::filesystem::is_regular_file(path, ec)) return compile_for_diff(path);
    return spmdx::plan::read_dump(path);
  };
  try {
    const auto d = spmdx::plan::diff_jobs(load(o.a), load(o.b));
    std::cout << (o.json ? spmdx::plan::to_json(d) : spmdx::plan::to_text(d, o.max));
    return d.equivalent() ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 2;
  }
}

// This process's peak resident set (getrusage's ru_maxrss, KiB on Linux), bytes.
std::int64_t peak_rss_bytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<std::int64_t>(usage.ru_maxrss) * 1024;
}

// The calibration in job.dump_folder that strategy = "auto" and --estimate price plans with:
// measured here (once) where this build has LibTorch, else the file's or the defaults.
spmdx::plan::Calibration job_calibration(const spmdx::config::Config& cfg) {
  const std::filesystem::path dump = cfg.get_string("job.dump_folder");
#ifdef SPMDX_HAVE_EXEC
  try {  // the linears' library, as the ranks will set it, is the one measured
    spmdx::exec::set_cpu_matmul(spmdx::exec::cpu_matmul_named(cfg.get_string("training.cpu_matmul")));
  } catch (const std::runtime_error& e) {
    throw std::invalid_argument(cfg.where({"training.cpu_matmul"}) + ": " + e.what());
  }
#endif
  try {
#ifdef SPMDX_HAVE_EXEC
    return spmdx::exec::ensure_calibration(dump);
#else
    return spmdx::plan::load_calibration(spmdx::plan::calibration_path(dump));
#endif
  } catch (const std::runtime_error& e) {  // filesystem_error, or write_file_atomic's
    throw std::invalid_argument(cfg.where({"job.dump_folder"}) + ": job.dump_folder = \"" + dump.string() +
                                "\": the cost model's calibration.json cannot be kept there (" + e.what() + "): name a folder this user may write");
  }
}

// The text of a file, or "" when it cannot be read.
std::string file_text(const std::filesystem::path& file) {
  try {
    return spmdx::read_file_bytes(file);
  } catch (const std::runtime_error&) {
    return "";
  }
}

int run_compile(const CompileOptions& o) {
  namespace fs = std::filesystem;
  std::vector<std::string> overrides = o.overrides;
  if (!o.strategy.empty()) overrides.insert(overrides.end(), {"--parallelism.strategy", o.strategy});
  spmdx::config::Config cfg = spmdx::config::Config::load(o.config, overrides, /*throw_on_problems=*/false);
  std::optional<spmdx::plan::Calibration> calibration;
  if (!cfg.has_problem("parallelism.strategy") && !cfg.has_problem("job.dump_folder") && (o.estimate || cfg.get_string("parallelism.strategy") == "auto")) {
    calibration = job_calibration(cfg);
  }
  if (o.print_config) {
    cfg.check();
    std::cout << cfg.to_toml();
    return 0;
  }
  const auto start = std::chrono::steady_clock::now();
  if (o.world_size < 0 || o.world_size > 100000000) throw std::invalid_argument("--world-size must be between 1 and 1e8");
  const std::int64_t world = o.world_size > 0 ? o.world_size : spmdx::train::degree_product(cfg);
  // Every problem at once: the config's, the tokenizer's, the degrees', the placements'. With
  // none, the preflight's tokenizer, job spec and plugins are the ones to plan with.
  spmdx::PluginRegistry registry;
  std::unique_ptr<spmdx::data::Tokenizer> tokenizer;
  std::optional<spmdx::train::JobSpec> checked_spec;
  cfg.check(spmdx::train::preflight(cfg, world, registry, &tokenizer, &checked_spec, spmdx::train::Preflight::plan, "--world-size"));
  if (!cfg.ignored().empty()) std::cerr << cfg.ignored_text() << "\n";
  const spmdx::train::JobSpec& spec = checked_spec.value();
  spmdx::train::PlacedJob job = spmdx::train::place_job(spec, registry);
  const auto plan = spmdx::train::propagate_job(job);
  const std::int64_t dumped_ranks = o.dump.empty() ? 0 : (o.fake ? 1 : world);
  if (!o.dump.empty()) {
    std::error_code ec;
    if (fs::exists(o.dump, ec) && !fs::is_directory(o.dump, ec)) {
      throw std::invalid_argument("--dump " + o.dump + " is a file: give a folder (it is made if missing)");
    }
    fs::create_directories(o.dump);
    for (const auto& [name, text] : dump_documents(job, plan, spec, dumped_ranks, /*everything=*/true)) {
      std::ofstream out(fs::path(o.dump) / name);
      out << text;
      out.flush();
      if (!out) throw std::runtime_error("cannot write " + (fs::path(o.dump) / name).string() + ": " + std::strerror(errno));
    }
  } else {
    spmdx::sharding::rank_graph(plan, 0);  // checks that the local shapes work out
  }
  if (!cfg.get_list("hooks.enable").empty()) {  // compile-stage hooks: pictures, partition checks
    spmdx::HookContext base;
    base.world_size = static_cast<int>(world);
    base.mesh = job.mesh.dims();
    base.coordinate = job.mesh.coordinate(0);
    base.compile_only = true;
    spmdx::hooks::HookSet hooks = spmdx::hooks::make_hooks(spmdx::train::hook_spec(cfg), registry, base);
    std::vector<std::int64_t> ranks;
    for (std::int64_t r = 0; r < (o.fake ? 1 : job.mesh.size()); ++r) ranks.push_back(r);
    hooks.compile(plan, ranks, spec.plan);
    (o.json ? std::cerr : std::cout) << "hooks (" << spmdx::join(cfg.get_list("hooks.enable")) << ") ran on the compile stages; their files are under "
              << (fs::path(cfg.get_string("job.dump_folder")) / "hooks").string() << "\n";
  }
  const spmdx::train::PlannedStep planned = spmdx::train::plan_step(job, spec);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double param = static_cast<double>(spmdx::train::local_parameter_bytes(job, 0));
  const std::int64_t count = spmdx::models::parameter_count(job.model);
  const std::int64_t embedding = spmdx::models::embedding_parameter_count(job.model);
  const double flops_token = spmdx::models::flops_per_token(job.model, spec.seq_len);
  const double tokens = static_cast<double>(spec.global_batch_size) * static_cast<double>(spec.seq_len);
  const auto& dims = job.mesh.dims();
  // With pipeline stages: per stage, what its first rank sends and receives and its planned peak.
  nlohmann::json stages_json = nlohmann::json::array();
  std::string stages_text;
  if (job.pipeline.stages > 1) {
    const spmdx::sharding::DeviceMesh mesh = spmdx::train::run_mesh(job);
    for (std::int64_t st = 0; st < job.pipeline.stages; ++st) {
      spmdx::train::StageGraph staged;
      const spmdx::ir::Graph g = spmdx::train::rank_program(job, plan, st * job.mesh.size(), spec, nullptr, &staged);
      const spmdx::plan::RuntimePlan runtime = spmdx::plan::make_runtime_plan(g, mesh, spec.plan);
      const std::int64_t peak = spmdx::plan::plan_memory(g, runtime).peak_bytes;
      const std::int64_t first = job.pipeline.first_layer[static_cast<std::size_t>(st)];
      const bool last = st + 1 == job.pipeline.stages;
      stages_json.push_back({{"stage", st}, {"first_layer", first}, {"layers", spmdx::train::stage_layers(job.pipeline, st)}, {"sends", staged.sends}, {"recvs", staged.recvs}, {"bytes_sent", staged.bytes_sent},
                             {"planned_peak_bytes", peak}, {"nodes", g.num_nodes()}});
      const std::int64_t r0 = st * job.mesh.size(), r1 = (st + 1) * job.mesh.size() - 1;
      const std::string layers = spmdx::train::stage_layers(job.pipeline, st) + (last ? ", the final norm and output" : "");
      stages_text += "  stage " + std::to_string(st) + (r0 == r1 ? " (rank " + std::to_string(r0) : " (ranks " + std::to_string(r0) + "-" + std::to_string(r1)) + "): " +
                     (st == 0 ? "the embedding, " : "") + layers + ", " + std::to_string(staged.sends) + " sends (" +
                     spmdx::human_bytes(static_cast<double>(staged.bytes_sent)) + ") and " + std::to_string(staged.recvs) + " recvs a step, planned peak " +
                     spmdx::human_bytes(static_cast<double>(peak)) + "\n";
    }
  }
  const spmdx::train::ContextParallelSummary cp = spmdx::train::context_parallel_summary(spec, job, plan);
  if (o.json) {
    nlohmann::json by_dim = nlohmann::json::object();
    for (std::size_t d = 0; d < dims.size(); ++d) by_dim[dims[d].name] = plan.comm_bytes_by_dim.at(d);
    nlohmann::json mesh = nlohmann::json::array();
    for (const auto& d : dims) mesh.push_back({{"name", d.name}, {"size", d.size}});
    const auto& m = planned.memory;
    nlohmann::json j{{"format", "spmdx.compile"},
                     {"version", 1},
                     {"model", {{"label", spmdx::models::model_label(spec.model)}, {"vocab_size", spec.model.vocab_size}, {"parameters", count},
                                {"embedding_parameters", embedding}, {"graph_nodes", job.model.graph.num_nodes()}}},
                     {"mesh", mesh},
                     {"world_size", world},
                     {"global_batch_size", spec.global_batch_size},
                     {"seq_len", spec.seq_len},
                     {"microbatches", spec.step.microbatches},
                     {"sequence_parallel", job.sequence_parallel_dim >= 0},
                     {"loss_parallel", job.loss_parallel},
                     {"context_parallel", {{"degree", cp.degree}, {"tokens_per_rank", cp.tokens_per_rank}, {"pieces", cp.pieces},
                                           {"load_balance", cp.pieces > 1}, {"rotate_method", spec.context_parallel_allgather ? "allgather" : "auto"}, {"attentions", cp.attentions},
                                           {"query_rows", cp.query_rows}, {"all_to_all", cp.all_to_all}}},
                     {"pipeline", {{"stages", job.pipeline.stages}, {"schedule", job.pipeline.schedule}, {"microbatches", job.pipeline.microbatches},
                                   {"bubble_fraction", spmdx::train::bubble_fraction(job.pipeline)}, {"per_stage", stages_json}}},
                     {"flops_per_token", flops_token},
                     {"flops_per_step", flops_token * tokens},
                     {"rank0", {{"parameter_bytes", param}, {"gradient_bytes", param}, {"optimizer_state_bytes", 2 * param},
                                {"comm_bytes_per_step", plan.comm_bytes}, {"comm_bytes_per_step_by_dim", by_dim}, {"comm_seconds_estimate", plan.comm_seconds},
                                {"graph_flops_per_step", planned.flops}}},
                     {"planned_peak", {{"bytes", m.peak_bytes}, {"parameters", m.parameters}, {"gradients", m.gradients}, {"optimizer_state", m.optimizer_state},
                                       {"activations", m.activations}, {"communication", m.communication}, {"state_copy", m.state_copy}}},
                     {"memory_budget_bytes", spec.memory_budget},
                     {"memory_budget_choice", spec.memory_fit},
                     {"planner_seconds", seconds},
                     {"planner_peak_rss_bytes", peak_rss_bytes()},
                     {"fake", o.fake}};
    j["parameters_kept_whole"] = nlohmann::json::array();  // train::short_parameters: their dim 0 shorter than a sharding dim's degree
    for (const auto& short_ones : spmdx::train::short_parameters(spec, job)) {
      nlohmann::json names = nlohmann::json::array();
      for (const auto& p : short_ones.parameters) names.push_back(p.name);
      j["parameters_kept_whole"].push_back({{"mesh_dim", short_ones.mesh_dim}, {"degree", short_ones.degree}, {"strategy", short_ones.strategy},
                                            {"parameters", names}, {"extra_bytes", short_ones.extra_bytes}, {"message", short_ones.line()}});
    }
    if (spec.auto_strategy) {
      const std::string report = file_text(fs::path(spec.output.dump_folder) / "auto_report.json");
      j["auto"] = report.empty() ? nlohmann::json(spec.auto_report) : nlohmann::json::parse(report);
    }
    if (o.estimate) {
      const auto e = spmdx::train::estimate_job(spec, registry, *calibration);
      j["estimate"] = {{"step_seconds", e.step_seconds}, {"compute_seconds", e.compute_seconds}, {"comm_seconds", e.comm_seconds},
                       {"comm_seconds_by_dim", e.comm_seconds_by_dim}, {"peak_bytes", e.peak_bytes}, {"threads", e.threads}, {"core_sharing", e.core_sharing},
                       {"stages", e.stages}, {"bubble_seconds", e.bubble_seconds}, {"bubble_fraction", e.bubble_fraction}, {"stage_seconds", e.stage_seconds},
                       {"calibration", nlohmann::json::parse(calibration->to_json())}};
    }
    std::cout << j.dump(1) << "\n";
    return 0;
  }
  char comm_ms[32];
  std::snprintf(comm_ms, sizeof comm_ms, "%.2f", plan.comm_seconds * 1e3);
  char params[64];
  std::snprintf(params, sizeof params, "%lld parameters (%.3g x 10^9)", static_cast<long long>(count), static_cast<double>(count) / 1e9);
  char flops[256];
  std::snprintf(flops, sizeof flops, "%.4g FLOPs per token (torchtitan's 6 x %.4g non-embedding parameters%s), %.4g per step of %.0f tokens", flops_token,
                static_cast<double>(count - embedding), spec.model.name == "llama" ? " + 12 x layers x heads x head_dim x seq_len" : "", flops_token * tokens, tokens);
  std::string by_dim;
  for (std::size_t d = 0; d < dims.size(); ++d) by_dim += (d ? ", " : "") + dims[d].name + " " + spmdx::human_bytes(plan.comm_bytes_by_dim.at(d));
  std::cout << "model " << spmdx::models::model_label(spec.model) << " (vocab " << spec.model.vocab_size << ", " << params << "), " << job.model.graph.num_nodes()
            << " nodes; mesh " << spmdx::train::run_mesh(job).str() << " (" << world << " ranks" << (job.sequence_parallel_dim >= 0 ? ", sequence parallel over tp" : "") << (job.loss_parallel ? ", loss parallel" : "") << "); global batch " << spec.global_batch_size << " x " << spec.seq_len
            << (spec.step.microbatches > 1 ? " in " + std::to_string(spec.step.microbatches) + " microbatches (" +
                                                 (job.pipeline.stages > 1 ? "pipeline" : "gradient accumulation") + ")"
                                           : std::string())
            << "\n"
            << flops << "\n"
            << "per rank (rank 0): parameters " << spmdx::human_bytes(param) << ", gradients " << spmdx::human_bytes(param) << ", AdamW state "
            << spmdx::human_bytes(2 * param) << ", communication " << spmdx::human_bytes(plan.comm_bytes) << " sent per step (" << by_dim << "; about "
            << comm_ms << " ms at 10 GB/s, 10 us per message)\n"
            << "planned peak memory (rank 0): " << planned.memory.str() << "\n"
            << (job.sequence_parallel_off.empty() ? "" : "sequence parallel: off, " + job.sequence_parallel_off + "\n")
            << (cp.degree > 1 ? cp.line() + "\n" : std::string())
            << (job.pipeline.stages > 1 ? "pipeline: " + std::to_string(job.pipeline.stages) + " stages" +
                                              (job.pipeline.virtual_stages > 1 ? " of " + std::to_string(job.pipeline.virtual_stages) + " chunks" : std::string()) +
                                              ", schedule " + job.pipeline.schedule + ", " +
                                              std::to_string(job.pipeline.microbatches) + " microbatches, theoretical bubble " +
                                              [&] {
                                              char b[16];
                                              std::snprintf(b, sizeof b, "%.3f", spmdx::train::bubble_fraction(job.pipeline));
                                              return std::string(b);
                                            }() + " (parameters, gradients, AdamW state and communication above: the whole model on one stage's mesh; the planned peak: stage 0's)\n" + stages_text
                                        : std::string())
            << (spec.memory_fit.empty() ? "" : spec.memory_fit + "\n");
  for (const auto& short_ones : spmdx::train::short_parameters(spec, job)) std::cout << "warning: " << short_ones.line() << "\n";
  for (const auto& [layout, why] : spec.strategies_passed_over) {
    std::cout << "fallback: strategies " << layout << " passed over (" << why << ")\n";
  }
  if (!spec.strategies_passed_over.empty()) std::cout << "strategies: " << spmdx::train::layout_text(spec.strategies) << "\n";
  if (spec.auto_strategy) {
    const std::string report = file_text(fs::path(spec.output.dump_folder) / "auto_report.txt");
    std::cout << (report.empty() ? spec.auto_report + "\n" : report) << "(the ranking: " << (fs::path(spec.output.dump_folder) / "auto_report.{txt,json}").string() << ")\n";
  }
  if (o.estimate) {
    const auto e = spmdx::train::estimate_job(spec, registry, *calibration);
    char text[512];
    char bubble[160] = "";
    if (e.stages > 1) {
      std::snprintf(bubble, sizeof bubble, " + pipeline bubble %.2f ms (%.2f of the step)", e.bubble_seconds * 1e3, e.bubble_fraction);
    }
    char who[128] = "rank 0";
    if (e.stages > 1) std::snprintf(who, sizeof who, "the slowest of %lld stages; the largest stage's peak", static_cast<long long>(e.stages));
    std::snprintf(text, sizeof text, "estimate (%s): %.2f ms a step = compute %.2f ms (%lld thread%s a rank, cores shared %.2fx) + communication %.2f ms%s; planned peak %s\n",
                  who, e.step_seconds * 1e3, e.compute_seconds * 1e3, static_cast<long long>(e.threads), e.threads == 1 ? "" : "s", e.core_sharing, e.comm_seconds * 1e3,
                  bubble, spmdx::human_bytes(static_cast<double>(e.peak_bytes)).c_str());
    std::cout << text << "calibration: " << calibration->str() << "\n";
  }
  std::cout << "planned in " << std::fixed << std::setprecision(3) << seconds << " s, peak RSS " << spmdx::human_bytes(static_cast<double>(peak_rss_bytes())) << std::defaultfloat << (o.fake ? " (--fake: no ranks started" : " (no ranks started")
            << (dumped_ranks ? "; wrote " + o.dump + " with " + std::to_string(dumped_ranks) + " rank graph(s))" : ")") << "\n";
  return 0;
}

struct RunOptions {
  std::string config;
  int nproc = 0;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr;
  int master_port = 0;
  bool print_config = false;
  std::vector<std::string> overrides;
};

// The preflight's problems, and for training.device = "cuda" whether this host has a GPU for
// each of its `ranks_per_host` ranks: checked before any rank starts, since each would fail
// with the same message.
std::vector<std::string> run_problems(const spmdx::config::Config& cfg, std::int64_t world_size, int ranks_per_host, spmdx::PluginRegistry& registry,
                                      std::unique_ptr<spmdx::data::Tokenizer>* tokenizer, std::optional<spmdx::train::JobSpec>* spec,
                                      const std::string& start_flag = "") {
  std::vector<std::string> problems = spmdx::train::preflight(cfg, world_size, registry, tokenizer, spec, spmdx::train::Preflight::run, start_flag);
#ifdef SPMDX_HAVE_EXEC
  if (!cfg.has_problem("training.device") && cfg.get_string("training.device") == "cuda") {
    if (const std::string why = spmdx::exec::cuda_problem(ranks_per_host); !why.empty()) {
      problems.push_back(cfg.where({"training.device"}) + ": training.device = \"cuda\": " + why);
    }
  }
#else
  (void)ranks_per_host;
#endif
  return problems;
}

// `spmdx run`: validates the config, then either starts --nproc ranks here (each one this same
// command, told its rank by the environment) or runs as the rank its environment names.
int run_run(const RunOptions& o) {
  const bool launched = std::getenv("SPMDX_STORE_HOSTED") != nullptr;
  // A rank the launcher started: the launcher has checked everything already.
  spmdx::config::Config cfg = spmdx::config::Config::load(o.config, o.overrides, /*throw_on_problems=*/launched);
  if (o.print_config) {
    cfg.check();
    std::cout << cfg.to_toml();
    return 0;
  }
  if (o.nproc > 0 && !launched) {
    // strategy = "auto" prices plans with this machine's rates: measured once, before the ranks share its cores.
    if (!cfg.has_problem("parallelism.strategy") && !cfg.has_problem("job.dump_folder") && cfg.get_string("parallelism.strategy") == "auto") job_calibration(cfg);
    // Check everything that can be checked before starting any rank, and say all of it at once.
    spmdx::PluginRegistry registry;
    std::unique_ptr<spmdx::data::Tokenizer> tokenizer;
    std::optional<spmdx::train::JobSpec> spec;
    cfg.check(run_problems(cfg, o.nproc * o.nnodes, o.nproc, registry, &tokenizer, &spec, o.nnodes == 1 ? "--nproc" : ""));
    spmdx::train::check_data(cfg, *tokenizer, *spec);  // reads the data: only once the rest is right
    if (!cfg.ignored().empty()) std::cerr << cfg.ignored_text() << "\n";
    std::vector<std::string> argv{self_exe(), "run", o.config};
    for (const auto& a : o.overrides) argv.push_back(a);
    spmdx::launch::LaunchOptions lo{o.nproc, o.nnodes, o.node_rank, o.master_addr, o.master_port, "spmdx run", ""};
    const auto& enabled = cfg.get_list("hooks.enable");
    if (std::find(enabled.begin(), enabled.end(), "flight_recorder") != enabled.end()) {
      lo.flight_recorder_dir = (std::filesystem::path(cfg.get_string("job.dump_folder")) / "hooks" / "flight_recorder").string();
    }
    return spmdx::launch::launch(lo, argv);
  }
  const spmdx::launch::RankEnv env = spmdx::launch::rank_env();
  if (env.source == "single" && !cfg.has_problem("parallelism.")) {  // a job of several ranks started as one: say how to start it
    const std::int64_t want = spmdx::train::degree_product(cfg);
    if (want > 1) {  // with the config's other problems, if any: each is to fix before starting them
      cfg.check({cfg.where(spmdx::train::kDegreeKeys) + ": its parallelism degrees make " + std::to_string(want) + " ranks: start them with --nproc " +
                 std::to_string(want) + " (or under torchrun, srun, mpirun)"});
    }
  }
  if (!launched) {  // one rank, or started by hand, torchrun, srun or mpirun: this rank checks its own job
    spmdx::PluginRegistry registry;
    std::unique_ptr<spmdx::data::Tokenizer> tokenizer;
    std::optional<spmdx::train::JobSpec> spec;
    cfg.check(run_problems(cfg, env.world_size, env.local_world_size, registry, &tokenizer, &spec));
    if (env.rank == 0 && !cfg.ignored().empty()) std::cerr << cfg.ignored_text() << "\n";
  }
  if (launched) {
    prctl(PR_SET_PDEATHSIG, SIGTERM);  // never outlive the launcher
    if (getppid() == 1) return 1;
  }
  // One "[rank R]" a line: the launcher puts it on each line of the ranks it started; a rank
  // started otherwise (torchrun, srun, mpirun) puts it on its log lines itself.
  if (env.world_size > 1 && !launched) spmdx::log::set_rank(env.rank);
#ifdef SPMDX_HAVE_EXEC
  return spmdx::exec::run_job(cfg, env);
#else
  std::cerr << "error: this spmdx was built without LibTorch (SPMDX_WITH_TORCH=OFF) and cannot run jobs\n";
  return 1;
#endif
}

struct BenchCommOptions {
  std::string backend = "ucx";
  int nproc = 2;
  std::string op = "all_reduce";
  std::string min_bytes = "8";
  std::string max_bytes = "64M";
  int iters = 20;
  int warmup = 5;
  double timeout_seconds = 300;
  std::vector<std::string> plugin_paths;
  std::string calibrate;            ///< --calibrate: the calibration.json to write alpha and beta to
  std::string link = "intra_host";  ///< --link
};

// `spmdx bench comm`: starts --nproc ranks (or runs as the rank the environment names) and
// sweeps sizes of one collective on the chosen backend.
int run_bench_comm(const BenchCommOptions& o, const std::vector<std::string>& raw_args) {
  spmdx::comm::BenchOptions bo;
  bo.op = o.op;
  bo.min_bytes = spmdx::parse_bytes(o.min_bytes);
  bo.max_bytes = spmdx::parse_bytes(o.max_bytes);
  bo.iters = o.iters;
  bo.warmup = o.warmup;
  bo.timeout_seconds = o.timeout_seconds;
  if (bo.min_bytes < 4 || bo.max_bytes < 4) {
    throw std::invalid_argument("--min-bytes and --max-bytes must be at least 4 (one float32), got " + o.min_bytes + " and " + o.max_bytes);
  }
  if (bo.min_bytes > bo.max_bytes) throw std::invalid_argument("--min-bytes is larger than --max-bytes");
  if (!o.calibrate.empty() && o.nproc < 2 && std::getenv("SPMDX_STORE_HOSTED") == nullptr) {
    throw std::invalid_argument("--calibrate fits the link between ranks: give --nproc 2 or more");
  }
  if (!o.calibrate.empty()) spmdx::plan::load_calibration(o.calibrate);  // a bad file is named before the sweep, not after
  if (!o.calibrate.empty() && o.op != "all_reduce" && o.op != "all_gather" && o.op != "reduce_scatter") {
    throw std::invalid_argument("--calibrate fits the ring model of all_reduce, all_gather or reduce_scatter, not --op " + o.op);
  }
  const std::vector<std::filesystem::path> paths(o.plugin_paths.begin(), o.plugin_paths.end());
  if (std::getenv("SPMDX_STORE_HOSTED") == nullptr) {
    {  // the backend and its options, once, before any rank starts
      spmdx::PluginRegistry registry;
      registry.discover(spmdx::plugin_search_path(paths));
      if (const std::string why = spmdx::train::comm_backend_problem(registry, o.backend, "cpu"); !why.empty()) {
        throw std::invalid_argument("--backend \"" + o.backend + "\"" + why);
      }
    }
    std::vector<std::string> argv{self_exe()};
    for (const auto& a : raw_args) argv.push_back(a);
    return spmdx::launch::launch({o.nproc, 1, 0, "", 0, "spmdx bench comm", ""}, argv);
  }
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  const auto env = spmdx::launch::rank_env();
  spmdx::comm::TcpStore store(env.master_addr, env.master_port, env.token, 60, env.rank);
  spmdx::PluginRegistry registry;
  registry.discover(spmdx::plugin_search_path(paths));
  auto backend = spmdx::comm::make_job_backend(registry, o.backend, {spmdx::MemoryType::host}, true);
  backend->init({env.rank, env.world_size, 0, &store, bo.timeout_seconds});
  std::vector<std::pair<double, double>> times;
  if (!o.calibrate.empty()) bo.times = &times;
  const std::int64_t wrong = spmdx::comm::run_comm_bench(*backend, env.rank, env.world_size, bo);
  if (!o.calibrate.empty() && env.rank == 0 && wrong == 0) {
    // The ring's counts per rank (redistribute.h): all_reduce 2(k-1) messages and 2(k-1)/k of
    // the bytes, all_gather and reduce_scatter half that.
    const double k = static_cast<double>(env.world_size), phases = bo.op == "all_reduce" ? 2 : 1;
    std::vector<double> messages, bytes, seconds;
    for (const auto& [size, t] : times) messages.push_back(phases * (k - 1)), bytes.push_back(phases * (k - 1) / k * size), seconds.push_back(t);
    const auto link = spmdx::plan::fit_alpha_beta(messages, bytes, seconds);
    spmdx::plan::Calibration c = spmdx::plan::load_calibration(o.calibrate);
    char source[256];
    std::snprintf(source, sizeof source, "spmdx bench comm --op %s, %d ranks, %s, %zu sizes", bo.op.c_str(), env.world_size, backend->describe().c_str(), times.size());
    (o.link == "inter_host" ? c.inter_host : c.intra_host) = link;
    (o.link == "inter_host" ? c.inter_source : c.intra_source) = source;
    spmdx::plan::save_calibration(o.calibrate, c);
    std::printf("# calibration: %s alpha %.2f us, beta %.3f GB/s (fitted to t = messages x alpha + bytes / beta) written to %s\n", o.link.c_str(),
                link.alpha * 1e6, link.beta / 1e9, o.calibrate.c_str());
  }
  backend->barrier(0)->wait(bo.timeout_seconds);
  backend->finalize();
  return wrong == 0 ? 0 : 1;
}

// Each subcommand's options, bound to the struct (or variables) they fill; each add_* returns
// the subcommand.

CLI::App* add_plugins(CLI::App& app, std::vector<std::string>& plugin_paths, bool& json) {
  auto* plugins = app.add_subcommand("plugins", "List the plugins found on the search path, loading each to check it");
  plugins->fallthrough();  // global options (--log-level) may also follow the subcommand
  plugins->add_option("--plugin-path", plugin_paths,
                      "A plugin file or folder searched before SPMDX_PLUGIN_PATH and the built-in folder "
                      "(repeatable)");
  plugins->add_flag("--json", json, "Print a JSON array of {name, kind, version, abi, path, ...}");
  return plugins;
}

CLI::App* add_graph(CLI::App& app, GraphOptions& graph_options) {
  auto* graph = app.add_subcommand("graph", "Print a model's train-step graph (forward, backward, clipping, AdamW) as IR");
  graph->fallthrough();
  graph->add_option("config", graph_options.config, "A job's TOML config: the model a run of it trains, for its global batch and seq_len (flags replace its values)")
      ->check(CLI::ExistingFile);
  graph->add_option("--model", graph_options.model, "mlp | llama (default: the config's, else llama)");
  graph->add_option("--flavor", graph_options.flavor, "tiny | debugmodel | ... (default: the config's, else tiny)");
  graph->add_option("--vocab", graph_options.vocab,
                    "vocabulary size (default: what a run uses: model.vocab_size or the config's tokenizer's ids; without a config the default tokenizer's, " +
                        std::to_string(default_vocab()) + ")")
      ->check(CLI::PositiveNumber);
  graph->add_option("--batch", graph_options.batch, "batch size, rows (default: the config's global batch, else 8)")->check(CLI::PositiveNumber);
  graph->add_option("--seq", graph_options.seq, "sequence length, tokens (default: the config's training.seq_len, else 64)")->check(CLI::PositiveNumber);
  graph->add_flag("--json", graph_options.json, "Print the versioned JSON form instead of text");
  graph->add_flag("--forward-only", graph_options.forward_only, "Only the forward graph and loss");
  return graph;
}

CLI::App* add_compile(CLI::App& app, CompileOptions& compile_options) {
  auto* compile = app.add_subcommand("compile", "Plan a job from its config without starting ranks: placements, rank graphs, bytes");
  compile->allow_extras();  // --section.key value overrides
  compile->add_option("config", compile_options.config, "The job's TOML config")->required()->check(CLI::ExistingFile);
  compile->add_option("--world-size", compile_options.world_size, "Ranks to plan for (default: the product of the config's degrees)")
      ->check(CLI::Range(1, 100000000));
  compile->add_option("--dump", compile_options.dump, "Write logical.{txt,json}, plan.{txt,json}, rankR.{txt,json} rankR.plan.txt (RuntimePlan) and rankR.memory.txt (memory plan) here");
  compile->add_option("--strategy", compile_options.strategy, "manual | auto: plan every layout, print the ranking and why the first wins (parallelism.strategy)")
      ->check(CLI::IsMember({"manual", "auto"}));
  compile->add_flag("--estimate", compile_options.estimate, "Print rank 0's predicted step time (compute, communication) and peak, by the calibration in job.dump_folder (measured once)");
  compile->add_flag("--fake", compile_options.fake, "Plan a mesh larger than this machine; dump only rank 0's graph");
  auto* print_config = compile->add_flag("--print-config", compile_options.print_config, "Print the effective config and exit");
  compile->add_flag("--json", compile_options.json, "Print the summary as JSON (schema spmdx.compile/1): parameters, FLOPs per token, per-rank bytes, bytes per mesh dim, planned peak")
      ->excludes(print_config);
  return compile;
}

CLI::App* add_run(CLI::App& app, RunOptions& run_options) {
  auto* run = app.add_subcommand("run", "Train: the job its config describes, on --nproc ranks here or as torchrun/srun/mpirun started it");
  run->allow_extras();  // --section.key value overrides
  run->add_option("config", run_options.config, "The job's TOML config")->required()->check(CLI::ExistingFile);
  run->add_option("--nproc,--nproc-per-node", run_options.nproc, "Start this many ranks on this machine (as torchrun --standalone)")
      ->check(CLI::Range(1, 4096));
  run->add_option("--nnodes", run_options.nnodes, "Nodes in the job (torchrun's flag; needs SPMDX_JOB_TOKEN)")->check(CLI::Range(1, 100000));
  run->add_option("--node-rank", run_options.node_rank, "This node's index, 0 .. nnodes-1 (node 0 serves the store)")->check(CLI::NonNegativeNumber);
  run->add_option("--master-addr", run_options.master_addr, "Node 0's address, reachable from every node");
  run->add_option("--master-port", run_options.master_port, "The store's port on node 0")->check(CLI::Range(1, 65535));
  run->add_flag("--print-config", run_options.print_config, "Print the effective config and exit");
  return run;
}

CLI::App* add_bench_comm(CLI::App& bench, BenchCommOptions& bench_options) {
  auto* bench_comm = bench.add_subcommand("comm", "Time one collective over a backend, size by size, as nccl-tests do (algbw, busbw, checked)");
  bench_comm->add_option("--backend", bench_options.backend, "comm plugin, \"name\" or \"name:key=value;...\" (ucx:chunk_bytes=1048576)")->capture_default_str();
  bench_comm->add_option("--nproc", bench_options.nproc, "ranks to start here")->capture_default_str()->check(CLI::Range(1, 256));
  bench_comm->add_option("--op", bench_options.op, "collective")->capture_default_str()
      ->check(CLI::IsMember({"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"}));
  bench_comm->add_option("--min-bytes", bench_options.min_bytes, "smallest size (8, 4K, 64M, ...)")->capture_default_str();
  bench_comm->add_option("--max-bytes", bench_options.max_bytes, "largest size")->capture_default_str();
  bench_comm->add_option("--iters", bench_options.iters, "timed operations per size")->capture_default_str()->check(CLI::PositiveNumber);
  bench_comm->add_option("--warmup", bench_options.warmup, "untimed operations per size")->capture_default_str()->check(CLI::NonNegativeNumber);
  bench_comm->add_option("--timeout-seconds", bench_options.timeout_seconds, "a collective that takes longer fails, naming the peer")
      ->capture_default_str()->check(CLI::Range(0.1, 1e6));
  bench_comm->add_option("--plugin-path", bench_options.plugin_paths, "plugin files or folders searched first");
  bench_comm->add_option("--calibrate", bench_options.calibrate,
                         "Fit alpha and beta of the ring model to the out-of-place times and write them to this calibration.json (strategy = \"auto\" and compile --estimate read <job.dump_folder>/calibration.json)");
  bench_comm->add_option("--link", bench_options.link, "the link the ranks share: intra_host (one host) or inter_host (one rank a host)")
      ->capture_default_str()->check(CLI::IsMember({"intra_host", "inter_host"}));
  return bench_comm;
}

struct BenchCompareOptions {
  std::string a, b, max_slowdown;
  bool max_slowdown_given = false;
  int warmup = 2;
  bool json = false;
};

CLI::App* add_bench_compare(CLI::App& bench, BenchCompareOptions& o) {
  auto* cmp = bench.add_subcommand("compare", "Is run B slower than run A beyond the noise? Two metrics.jsonl (or run folders) or two bench comm outputs");
  cmp->add_option("run_a", o.a, "The baseline: a run's job.dump_folder, its metrics.jsonl, or a saved bench comm output")->required();
  cmp->add_option("run_b", o.b, "The run to judge, of the same kind")->required();
  cmp->add_option("--max-slowdown", o.max_slowdown, "Exit 1 when B's step time is slower than this beyond the noise (5%, 0.05)")
      ->each([&o](const std::string&) { o.max_slowdown_given = true; });
  cmp->add_option("--warmup", o.warmup, "Steps dropped from the front of each metrics.jsonl")->capture_default_str()->check(CLI::Range(0, 1000000));
  cmp->add_flag("--json", o.json, "Print the comparison as JSON (schema spmdx.bench.compare/1)");
  return cmp;
}

// `spmdx bench fit RUN --calibrate FILE`: a run's measured exposed communication fitted into
// the calibration's per-collective cost (plan/estimate.h: fit_collective_seconds).
struct BenchFitOptions {
  std::string run;
  std::string calibrate;
  std::int64_t warmup = 2;
};

CLI::App* add_bench_fit(CLI::App& bench, BenchFitOptions& o) {
  auto* fit = bench.add_subcommand("fit", "Fit the cost model's per-collective cost (strategy = \"auto\", compile --estimate) to a run's measured steps");
  fit->add_option("run", o.run, "A run's job.dump_folder or its metrics.jsonl (several ranks, a few steps)")->required();
  fit->add_option("--calibrate", o.calibrate, "The calibration.json to update (the job's: <job.dump_folder>/calibration.json)")->required();
  fit->add_option("--warmup", o.warmup, "Steps dropped from the front")->capture_default_str()->check(CLI::Range(0, 1000000));
  return fit;
}

int run_bench_fit(const BenchFitOptions& o) {
  std::filesystem::path metrics = o.run;
  if (std::filesystem::is_directory(metrics)) metrics /= "metrics.jsonl";
  const auto c = spmdx::plan::fit_collective_seconds(spmdx::plan::load_calibration(o.calibrate), metrics, o.warmup);
  spmdx::plan::save_calibration(o.calibrate, c);
  std::printf("%.0f us a collective (%s) written to %s\n", c.collective_seconds * 1e6, c.collective_source.c_str(), o.calibrate.c_str());
  return 0;
}

// Exit 0: no regression (or none asked about); 1: B slower than allowed; 2: bad input.
int run_bench_compare(const BenchCompareOptions& o) {
  try {
    spmdx::bench::CompareOptions options;
    options.warmup = o.warmup;
    if (o.max_slowdown_given) options.max_slowdown = spmdx::bench::parse_fraction(o.max_slowdown);
    const auto c = spmdx::bench::compare_runs(o.a, o.b, options);
    std::cout << (o.json ? spmdx::bench::to_json(c) : spmdx::bench::to_text(c));
    return c.regressed ? 1 : 0;
  } catch (const spmdx::bench::CompareInputError& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 2;
  }
}

CLI::App* add_import(CLI::App& app, ImportOptions& import_options) {
  auto* import_cmd = app.add_subcommand("import", "Inspect a torch.export program (.pt2): parameters, bytes, ops, what spmdx cannot map; --graph prints its IR");
  import_cmd->add_option("model", import_options.path, "The .pt2 file torch.export.save wrote (torch >= 2.9)")->required();
  import_cmd->add_option("--inputs", import_options.inputs, "The program's inputs that take tokens and labels, in order (as [model] inputs)");
  import_cmd->add_option("--loss", import_options.loss, "auto | cross_entropy | output (as [model] loss)")->check(CLI::IsMember({"auto", "cross_entropy", "output"}));
  import_cmd->add_flag("--graph", import_options.graph, "Print the imported forward graph (IR) instead of the summary");
  import_cmd->add_flag("--json", import_options.json, "Print the summary as JSON");
  return import_cmd;
}

// `spmdx export` and `spmdx import` need LibTorch; a build without it says so.
int run_export(const std::string& step_folder, const std::string& out, const std::string& names) {
#ifdef SPMDX_HAVE_EXEC
  const std::size_t n = spmdx::exec::export_safetensors(step_folder, out, names == "hf");
  std::cout << "wrote " << n << " tensors to " << out << (names == "hf" ? " (Hugging Face names, rotary rows half-split)" : "") << "\n";
  return 0;
#else
  (void)step_folder, (void)out, (void)names;
  std::cerr << "error: this spmdx was built without LibTorch\n";
  return 1;
#endif
}

int run_import_command(const ImportOptions& o) {
#ifdef SPMDX_HAVE_EXEC
  return run_import(o);
#else
  (void)o;
  std::cerr << "error: this spmdx was built without LibTorch\n";
  return 1;
#endif
}

// "spmdx bench": a command as the user types it, from the program down to `cmd`.
std::string command_path(const CLI::App* cmd) {
  std::string path;
  for (; cmd != nullptr; cmd = cmd->get_parent()) path = cmd->get_name() + (path.empty() ? "" : " " + path);
  return path;
}

// The commands of `cmd`, one a line: "  run       Train: ...".
std::string command_lines(const CLI::App& cmd) {
  const auto subs = cmd.get_subcommands([](const CLI::App*) { return true; });
  std::size_t width = 0;
  for (const auto* sub : subs) width = std::max(width, sub->get_name().size());
  std::string out;
  for (const auto* sub : subs) out += "  " + sub->get_name() + std::string(width + 2 - sub->get_name().size(), ' ') + sub->get_description() + "\n";
  return out;
}

// CLI11's parse errors in spmdx's form: "error: <what>" and where the options are described.
std::string usage_error(const CLI::App* app, const CLI::Error& e) {
  const CLI::App* cmd = app;
  while (!cmd->get_subcommands().empty()) cmd = cmd->get_subcommands().front();  // the command being parsed
  return "error: " + std::string(e.what()) + "\n" + command_path(cmd) + " --help describes " + (cmd == app ? "the commands and options" : "its options") + "\n";
}

// A word where a command of `app` (or of a verb group such as bench) is expected that names
// none, as "error: unknown command 'runn'; did you mean 'run'?" and the commands: CLI11 would
// only say "The following arguments were not expected". Returns the exit code (2) when it
// found one. Only the top level's --log-level takes a value; the words after a command that
// has no commands of its own are its arguments.
std::optional<int> unknown_command(const CLI::App& app, int argc, char** argv) {
  const CLI::App* level = &app;
  for (int i = 1; i < argc; ++i) {
    const std::string word = argv[i];
    if (word == "--") return std::nullopt;
    if (word.rfind('-', 0) == 0) {
      if (level == &app && word == "--log-level") ++i;
      continue;
    }
    const auto subs = level->get_subcommands([](const CLI::App*) { return true; });
    std::vector<std::string> names;
    const CLI::App* found = nullptr;
    for (const auto* sub : subs) {
      names.push_back(sub->get_name());
      if (sub->check_name(word)) found = sub;
    }
    if (found == nullptr) {
      std::cerr << "error: unknown command '" << word << "'" << spmdx::config::did_you_mean(word, names) << "\n"
                << "Commands of " << command_path(level) << ":\n"
                << command_lines(*level);
      return 2;
    }
    if (found->get_subcommands([](const CLI::App*) { return true; }).empty()) return std::nullopt;
    level = found;
  }
  return std::nullopt;
}

// A verb (spmdx, spmdx bench) given without one of its commands: its usage, exit 2, as git,
// torchrun (argparse) and CLI11 (require_subcommand) refuse a missing command.
int missing_command(const CLI::App& cmd) {
  std::cerr << (cmd.get_parent() == nullptr ? cmd.help()
                                            : "Usage: " + command_path(&cmd) + " COMMAND [OPTIONS]\n" + cmd.get_description() + "\n\nCommands:\n" + command_lines(cmd) + "\n")
            << "error: " << command_path(&cmd) << " needs a command (" << command_path(&cmd) << " COMMAND --help describes one)\n";
  return 2;
}

// The footer of run's and compile's --help: how to set any config key there.
const char* const kOverridesHelp =
    "Any config key can be given after the config as --section.key value (or --section.key=value; lists as a,b),\n"
    "replacing the file's: e.g. --training.steps 3 --optimizer.lr 1e-3 --parallelism.tensor_parallel_degree 1.\n"
    "Every key, with its default and meaning: spmdx run CONFIG --print-config (docs/configuration.md).";

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"spmdx: SPMD distributed training from one config file, with sharding strategies, "
               "communication backends and debug hooks as plugins.", "spmdx"};
  app.require_subcommand(0, 1);
  app.failure_message(usage_error);
  bool show_version = false;
  std::string log_level;
  app.add_flag("--version", show_version, "Print the version and the plugin ABI, then exit");
  app.add_option("--log-level", log_level, "trace|debug|info|warn|error|off (default: $SPMDX_LOG_LEVEL or info)")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "warning", "error", "off"}));

  std::vector<std::string> plugin_paths;
  bool json = false;
  auto* plugins = add_plugins(app, plugin_paths, json);
  GraphOptions graph_options;
  auto* graph = add_graph(app, graph_options);
  CompileOptions compile_options;
  auto* compile = add_compile(app, compile_options);
  RunOptions run_options;
  auto* run = add_run(app, run_options);
  auto* bench = app.add_subcommand("bench", "Benchmarks: time a collective, compare two runs, fit the cost model to a run");
  BenchCommOptions bench_options;
  auto* bench_comm = add_bench_comm(*bench, bench_options);
  BenchCompareOptions compare_options;
  auto* bench_compare = add_bench_compare(*bench, compare_options);
  BenchFitOptions fit_options;
  auto* bench_fit = add_bench_fit(*bench, fit_options);

  auto* fr_trace = app.add_subcommand("fr-trace", "Merge the flight_recorder hook's dumps; name the rank missing from a collective");
  std::string fr_folder;
  fr_trace->add_option("folder", fr_folder, "<job.dump_folder>/hooks/flight_recorder")->required();

  ImportOptions import_options;
  auto* import_cmd = add_import(app, import_options);
  DiffOptions diff_options;
  auto* diff = add_diff(app, diff_options);

  auto* export_cmd = app.add_subcommand("export", "Write a checkpoint's parameters, consolidated, as a safetensors file");
  std::string export_step, export_out, export_names = "spmdx";
  export_cmd->add_option("checkpoint", export_step, "A checkpoint's step-N folder")->required()->check(CLI::ExistingDirectory);
  export_cmd->add_option("out", export_out, "The .safetensors file to write")->required();
  export_cmd->add_option("--names", export_names,
                         "spmdx (torchtitan's names) | hf (Hugging Face's Llama names, query and key rows permuted for its rotary layout; llama only)")
      ->check(CLI::IsMember({"spmdx", "hf"}));

  run->footer(kOverridesHelp);
  compile->footer(kOverridesHelp);
  if (const auto rc = unknown_command(app, argc, argv)) return *rc;
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);  // prints help, or the usage error
    return rc == 0 ? 0 : 2;      // usage errors exit 2, as most command lines do
  }
  if (!log_level.empty()) spmdx::log::set_level(*spmdx::log::parse_level(log_level));

  if (show_version && !app.get_subcommands().empty()) {
    std::cerr << "error: --version takes no subcommand\n";
    return 2;
  }
  if (show_version) {
    std::cout << "spmdx " << SPMDX_VERSION << " (plugin ABI " << SPMDX_ABI_MAJOR << "." << SPMDX_ABI_MINOR << ")\n";
    return 0;
  }
  try {
    if (plugins->parsed()) return run_plugins(plugin_paths, json);
    if (graph->parsed()) {
      for (const char* flag : {"--model", "--flavor", "--vocab", "--batch", "--seq"}) {
        if (graph->count(flag) > 0) graph_options.given.insert(flag);
      }
      return run_graph(graph_options);
    }
    if (export_cmd->parsed()) return run_export(export_step, export_out, export_names);
    if (import_cmd->parsed()) return run_import_command(import_options);
    if (fr_trace->parsed()) {
      std::cout << spmdx::hooks::analyze_flight_recorder(fr_folder).text;
      return 0;
    }
    if (diff->parsed()) return run_diff(diff_options);
    if (bench_compare->parsed()) return run_bench_compare(compare_options);
    if (bench_fit->parsed()) return run_bench_fit(fit_options);
    if (bench_comm->parsed()) return run_bench_comm(bench_options, std::vector<std::string>(argv + 1, argv + argc));
    if (bench->parsed()) return missing_command(*bench);
    if (run->parsed()) {
      run_options.overrides = run->remaining();
      return run_run(run_options);
    }
    if (compile->parsed()) {
      compile_options.overrides = compile->remaining();
      return run_compile(compile_options);
    }
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  return missing_command(app);
}
