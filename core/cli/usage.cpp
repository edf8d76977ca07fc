// The command line's help and usage errors (usage.h).
#include "usage.h"

#include <algorithm>
#include <iostream>
#include <vector>

#include "spmdx/config/config.h"

namespace spmdx::cli {

std::string command_path(const CLI::App* cmd) {
  std::string path;
  for (; cmd != nullptr; cmd = cmd->get_parent()) path = cmd->get_name() + (path.empty() ? "" : " " + path);
  return path;
}

std::string command_lines(const CLI::App& cmd) {
  const auto subs = cmd.get_subcommands([](const CLI::App*) { return true; });
  std::size_t width = 0;
  for (const auto* sub : subs) width = std::max(width, sub->get_name().size());
  std::string out;
  for (const auto* sub : subs) out += "  " + sub->get_name() + std::string(width + 2 - sub->get_name().size(), ' ') + sub->get_description() + "\n";
  return out;
}

std::string usage_error(const CLI::App* app, const CLI::Error& e) {
  const CLI::App* cmd = app;
  while (!cmd->get_subcommands().empty()) cmd = cmd->get_subcommands().front();  // the command being parsed
  return "error: " + std::string(e.what()) + "\n" + command_path(cmd) + " --help describes " + (cmd == app ? "the commands and options" : "its options") + "\n";
}

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

int missing_command(const CLI::App& cmd) {
  std::cerr << (cmd.get_parent() == nullptr ? cmd.help()
                                            : "Usage: " + command_path(&cmd) + " COMMAND [OPTIONS]\n" + cmd.get_description() + "\n\nCommands:\n" + command_lines(cmd) + "\n")
            << "error: " << command_path(&cmd) << " needs a command (" << command_path(&cmd) << " COMMAND --help describes one)\n";
  return 2;
}

const char* const kOverridesHelp =
    "Any config key can be given after the config as --section.key value (or --section.key=value; lists as a,b),\n"
    "replacing the file's: e.g. --training.steps 3 --optimizer.lr 1e-3 --parallelism.tensor_parallel_degree 1.\n"
    "Every key, with its default and meaning: spmdx run CONFIG --print-config (docs/configuration.md).";

CLI::Option* add_json_flag(CLI::App& cmd, bool& json, const std::string& what, const std::string& form) {
  return cmd.add_flag("--json", json, "Print " + what + " as JSON instead of text" + (form.empty() ? "" : " (" + form + ")"));
}

}  // namespace spmdx::cli
