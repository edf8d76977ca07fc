// `spmdx plugins`: lists every plugin found on the search path (--plugin-path,
// SPMDX_PLUGIN_PATH, the built-in folder) after loading it, so that a plugin that would fail at
// run time fails here first; for a comm plugin, each backend's capability table and options.
// Exit 1 when any plugin failed (or a comm backend's capabilities are malformed), 0 otherwise.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <map>

#include "command.h"
#include "usage.h"
#include "spmdx/comm/score_map.h"
#include "spmdx/core/registry.h"
#include "spmdx/text.h"

namespace spmdx::cli {
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

class Plugins final : public Command {
 public:
  CLI::App* add(CLI::App& parent, const std::string& name) override {
    auto* plugins = parent.add_subcommand(name, "List the plugins found on the search path, loading each to check it");
    plugins->fallthrough();  // global options (--log-level) may also follow the subcommand
    plugins->add_option("--plugin-path", paths_,
                        "A plugin file or folder searched before SPMDX_PLUGIN_PATH and the built-in folder "
                        "(repeatable)");
    add_json_flag(*plugins, json_, "the plugins", "an array of {name, kind, version, abi, path, ...}");
    return plugins;
  }

  int run(const CLI::App&, int, char**) override {
    std::vector<std::filesystem::path> user_paths(paths_.begin(), paths_.end());
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
    if (json_) {
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

 private:
  std::vector<std::string> paths_;
  bool json_ = false;
};

}  // namespace

std::unique_ptr<Command> make_plugins() { return std::make_unique<Plugins>(); }

}  // namespace spmdx::cli
