// Helpers of the tests that run `spmdx run` for real: the command, a small text corpus and the
// rows of a run's metrics.jsonl.
#pragma once

#include <nlohmann/json.hpp>

#include <fstream>
#include <string>
#include <vector>

#include "test_util.h"

namespace spmdx::test {

/// Writes <dir>/corpus.txt, 200 lines of English (enough tokens for the tests' batches), and
/// returns its path.
inline std::string corpus_file(const TempDir& dir) {
  std::string text;
  for (int i = 0; i < 200; ++i) text += "The ranks of a job agree on every number they compute, line " + std::to_string(i) + ".\n";
  write_file(dir / "corpus.txt", text);
  return (dir / "corpus.txt").string();
}

#ifdef SPMDX_EXE
/// Runs the spmdx command line of the build with `args` (shell words).
inline CommandResult spmdx(const std::string& args) { return run_command("'" SPMDX_EXE "' " + args); }
#endif

/// Every row of a metrics.jsonl, in step order.
inline std::vector<nlohmann::json> rows(const std::filesystem::path& metrics) {
  std::vector<nlohmann::json> out;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

/// The value of `key` in every row of a metrics.jsonl, in step order.
inline std::vector<double> column(const std::filesystem::path& metrics, const std::string& key) {
  std::vector<double> out;
  for (const auto& row : rows(metrics)) out.push_back(row.at(key).get<double>());
  return out;
}

/// The value of `key` in the rows of a metrics.jsonl that have it (val_loss: the steps that
/// validated), in step order.
inline std::vector<double> column_where_present(const std::filesystem::path& metrics, const std::string& key) {
  std::vector<double> out;
  for (const auto& row : rows(metrics)) {
    if (row.contains(key)) out.push_back(row.at(key).get<double>());
  }
  return out;
}

/// The "loss" of every row of a metrics.jsonl, in step order.
inline std::vector<double> losses(const std::filesystem::path& metrics) { return column(metrics, "loss"); }

}  // namespace spmdx::test
