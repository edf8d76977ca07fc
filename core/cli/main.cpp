// The spmdx command line. Subcommands arrive with their issues: `plugins` lists and checks
// the plugins the registry finds.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <iomanip>
#include <iostream>

#include "spmdx/core/log.h"
#include "spmdx/core/registry.h"
#include "spmdx/core/version.h"
#include "spmdx/ir/serialize.h"
#include "spmdx/models/model.h"
#include "spmdx/train/train_step.h"

namespace {

std::string abi_text(const spmdx::PluginInfo& p) {
  return std::to_string(p.abi_major) + "." + std::to_string(p.abi_minor);
}

// Lists every plugin found on the search path after loading it, so that a plugin that would
// fail at run time fails here first. Exit 1 when any plugin failed, 0 otherwise.
int run_plugins(const std::vector<std::string>& paths, bool json) {
  std::vector<std::filesystem::path> user_paths(paths.begin(), paths.end());
  spmdx::PluginRegistry registry;
  registry.discover(spmdx::plugin_search_path(user_paths));
  registry.load_all();

  if (json) {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& p : registry.plugins()) {
      out.push_back({{"name", p.name},
                     {"kind", spmdx::to_string(p.kind)},
                     {"version", p.version},
                     {"abi", abi_text(p)},
                     {"path", p.path.string()},
                     {"description", p.description},
                     {"registered", p.registered},
                     {"factories", p.factories}});
    }
    // Paths need not be UTF-8; replace what is not rather than fail the whole listing.
    std::cout << out.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  } else if (registry.plugins().empty()) {
    std::cout << "no plugins found (searched: --plugin-path, SPMDX_PLUGIN_PATH, "
              << spmdx::builtin_plugin_dir().string() << ")\n";
  } else {
    std::cout << std::left << std::setw(20) << "NAME" << std::setw(10) << "KIND" << std::setw(10) << "VERSION"
              << std::setw(6) << "ABI" << "PATH\n";
    for (const auto& p : registry.plugins()) {
      std::cout << std::setw(20) << p.name << std::setw(10) << spmdx::to_string(p.kind) << std::setw(10)
                << p.version << std::setw(6) << abi_text(p) << p.path.string() << "\n"
                << "    " << p.description << "\n";
    }
  }
  for (const auto& e : registry.errors()) std::cerr << "error: " << e.what() << "\n";
  return registry.errors().empty() ? 0 : 1;
}

struct GraphOptions {
  std::string model = "llama";
  std::string flavor = "tiny";
  std::int64_t vocab = 256;
  std::int64_t batch = 8;
  std::int64_t seq = 64;
  bool json = false;
  bool forward_only = false;
};

// Prints a model's train-step graph (forward, loss, backward, clipping, AdamW), verified.
int run_graph(const GraphOptions& o) {
  spmdx::models::Model m = spmdx::models::build_model(spmdx::models::model_args(o.model, o.flavor, o.vocab), o.batch, o.seq);
  if (!o.forward_only) spmdx::train::append_train_step(m.graph, m.params, {});
  m.graph.verify();
  std::cout << (o.json ? spmdx::ir::to_json(m.graph) + "\n" : m.graph.str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"spmdx: SPMD distributed training from one config file, with sharding strategies, "
               "communication backends and debug hooks as plugins."};
  app.require_subcommand(0, 1);
  bool show_version = false;
  std::string log_level;
  app.add_flag("--version", show_version, "Print the version and the plugin ABI, then exit");
  app.add_option("--log-level", log_level, "trace|debug|info|warn|error|off (default: $SPMDX_LOG_LEVEL or info)")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "warning", "error", "off"}));

  auto* plugins = app.add_subcommand("plugins", "List the plugins found on the search path, loading each to check it");
  plugins->fallthrough();  // global options (--log-level) may also follow the subcommand
  std::vector<std::string> plugin_paths;
  bool json = false;
  plugins->add_option("--plugin-path", plugin_paths,
                      "A plugin file or folder searched before SPMDX_PLUGIN_PATH and the built-in folder "
                      "(repeatable)");
  plugins->add_flag("--json", json, "Print a JSON array of {name, kind, version, abi, path, ...}");

  auto* graph = app.add_subcommand("graph", "Print a model's train-step graph (forward, backward, clipping, AdamW) as IR");
  graph->fallthrough();
  GraphOptions graph_options;
  graph->add_option("--model", graph_options.model, "mlp | llama")->capture_default_str();
  graph->add_option("--flavor", graph_options.flavor, "tiny | debugmodel")->capture_default_str();
  graph->add_option("--vocab", graph_options.vocab, "vocabulary size")->capture_default_str()->check(CLI::PositiveNumber);
  graph->add_option("--batch", graph_options.batch, "batch size (rows)")->capture_default_str()->check(CLI::PositiveNumber);
  graph->add_option("--seq", graph_options.seq, "sequence length (tokens)")->capture_default_str()->check(CLI::PositiveNumber);
  graph->add_flag("--json", graph_options.json, "Print the versioned JSON form instead of text");
  graph->add_flag("--forward-only", graph_options.forward_only, "Only the forward graph and loss");

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
    if (graph->parsed()) return run_graph(graph_options);
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  std::cout << app.help();
  return 0;
}
