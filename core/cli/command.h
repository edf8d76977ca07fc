// What each `spmdx` subcommand implements, and the factories main.cpp's command table lists.
// A command is one file in core/cli/ (plugins.cpp, run.cpp, bench_comm.cpp, ...) holding its
// options; adding one is that file, its factory below and one row of main.cpp's table.
#pragma once

#include <CLI/CLI.hpp>

#include <memory>
#include <string>

namespace spmdx::cli {

// One subcommand: `spmdx NAME` or, under a verb group, `spmdx bench NAME`.
class Command {
 public:
  virtual ~Command() = default;

  // Adds the subcommand `name` to `parent` (the program, or a verb group such as bench): its
  // one-line description, arguments and options, bound to this object's fields, which parsing
  // fills. Returns the subcommand. Called once, before parsing.
  virtual CLI::App* add(CLI::App& parent, const std::string& name) = 0;

  // Runs the command once the command line parsed into it: `cmd` is what add() returned (for
  // count(), remaining()), argc/argv the whole command line (bench comm starts its ranks with
  // it). Returns the exit code: 0 done, 1 failed, 2 usage or bad input (where a command tells
  // bad input apart: diff, bench compare). An exception escaping run() is printed by main() as
  // "error: <what>" with exit 1.
  virtual int run(const CLI::App& cmd, int argc, char** argv) = 0;
};

// The commands, in the order `spmdx --help` lists them (main.cpp's table).
std::unique_ptr<Command> make_plugins();
std::unique_ptr<Command> make_graph();
std::unique_ptr<Command> make_compile();
std::unique_ptr<Command> make_run();
std::unique_ptr<Command> make_bench_comm();
std::unique_ptr<Command> make_bench_compare();
std::unique_ptr<Command> make_bench_fit();
std::unique_ptr<Command> make_fr_trace();
std::unique_ptr<Command> make_import();
std::unique_ptr<Command> make_diff();
std::unique_ptr<Command> make_export();

}  // namespace spmdx::cli
