// The command line's help and usage errors, shared by main() and the commands: where a
// command's options are described, the commands of a verb, run's and compile's --help footer,
// and the one way a --json flag is described.
#pragma once

#include <CLI/CLI.hpp>

#include <optional>
#include <string>

namespace spmdx::cli {

// "spmdx bench": a command as the user types it, from the program down to `cmd`.
std::string command_path(const CLI::App* cmd);

// The commands of `cmd`, one a line, in the order they were added: "  run       Train: ...".
std::string command_lines(const CLI::App& cmd);

// CLI11's parse errors in spmdx's form (app.failure_message): "error: <what>" and the line
// "spmdx run --help describes its options".
std::string usage_error(const CLI::App* app, const CLI::Error& e);

// A word where a command of `app` (or of a verb group such as bench) is expected that names
// none, as "error: unknown command 'runn'; did you mean 'run'?" and the commands: CLI11 would
// only say "The following arguments were not expected". Returns the exit code (2) when it
// found one, after printing to stderr. Only the top level's --log-level takes a value; the
// words after a command that has no commands of its own are its arguments.
std::optional<int> unknown_command(const CLI::App& app, int argc, char** argv);

// A verb (spmdx, spmdx bench) given without one of its commands: its usage on stderr, and the
// exit code 2, as git, torchrun (argparse) and CLI11 (require_subcommand) refuse a missing command.
int missing_command(const CLI::App& cmd);

// The footer of run's and compile's --help: how to set any config key there.
extern const char* const kOverridesHelp;

// A command's --json flag, described as every command describes it: "Print <what> as JSON
// instead of text" and, in parentheses when not empty, `form`: the output's schema ("schema
// spmdx.diff/1") or shape ("an array of {name, ...}").
CLI::Option* add_json_flag(CLI::App& cmd, bool& json, const std::string& what, const std::string& form = "");

}  // namespace spmdx::cli
