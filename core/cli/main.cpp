// spmdx's command line: main() and the table of its commands. Each command is a file of this
// folder implementing command.h's Command (plugins.cpp, graph.cpp, compile.cpp, run.cpp,
// bench_comm.cpp, bench_compare.cpp, bench_fit.cpp, fr_trace.cpp, import.cpp, diff.cpp,
// export.cpp); usage.h holds the help and usage errors they share. main() adds the commands in
// the table's order (`spmdx --help` lists them so), handles --version and --log-level, parses
// and runs the one command given. Exit codes: 0 done, 1 failed, 2 usage or bad input.
#include <CLI/CLI.hpp>

#include <iostream>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "command.h"
#include "usage.h"
#include "spmdx/core/log.h"
#include "spmdx/core/version.h"
#include "spmdx/plugin.h"  // SPMDX_ABI_MAJOR, SPMDX_ABI_MINOR

namespace {

using spmdx::cli::Command;

// A row of the table: `spmdx NAME` (verb "") or `spmdx VERB NAME`.
struct CommandRow {
  const char* name;
  const char* verb;
  std::unique_ptr<Command> (*make)();
};

// Every command, in the order `spmdx --help` (or `spmdx VERB`) lists them.
const CommandRow kCommands[] = {
    {"plugins", "", spmdx::cli::make_plugins},
    {"graph", "", spmdx::cli::make_graph},
    {"compile", "", spmdx::cli::make_compile},
    {"run", "", spmdx::cli::make_run},
    {"comm", "bench", spmdx::cli::make_bench_comm},
    {"compare", "bench", spmdx::cli::make_bench_compare},
    {"fit", "bench", spmdx::cli::make_bench_fit},
    {"fr-trace", "", spmdx::cli::make_fr_trace},
    {"import", "", spmdx::cli::make_import},
    {"diff", "", spmdx::cli::make_diff},
    {"export", "", spmdx::cli::make_export},
};

// The verbs that group commands, and their one-line descriptions: each is added where the
// table first names it.
const std::map<std::string, std::string> kVerbs = {
    {"bench", "Benchmark: time a collective, compare two runs, fit the cost model to a run"},
};

struct Added {
  std::unique_ptr<Command> command;
  CLI::App* app;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"spmdx: SPMD distributed training from one config file, with sharding strategies, "
               "communication backends and debug hooks as plugins.", "spmdx"};
  app.require_subcommand(0, 1);
  app.failure_message(spmdx::cli::usage_error);
  bool show_version = false;
  std::string log_level;
  app.add_flag("--version", show_version, "Print the version and the plugin ABI, then exit");
  app.add_option("--log-level", log_level, "trace | debug | info | warn | error | off (default: $SPMDX_LOG_LEVEL or info)")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "warning", "error", "off"}));

  std::vector<Added> commands;
  std::map<std::string, CLI::App*> verbs;
  for (const CommandRow& row : kCommands) {
    CLI::App* parent = &app;
    if (*row.verb != '\0') {
      CLI::App*& verb = verbs[row.verb];
      if (verb == nullptr) verb = app.add_subcommand(row.verb, kVerbs.at(row.verb));
      parent = verb;
    }
    auto command = row.make();
    CLI::App* sub = command->add(*parent, row.name);
    commands.push_back({std::move(command), sub});
  }

  if (const auto rc = spmdx::cli::unknown_command(app, argc, argv)) return *rc;
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
    for (const Added& c : commands) {
      if (c.app->parsed()) return c.command->run(*c.app, argc, argv);
    }
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  for (const auto& [name, verb] : verbs) {
    if (verb->parsed()) return spmdx::cli::missing_command(*verb);
  }
  return spmdx::cli::missing_command(app);
}
