// Helpers of the tests that run `spmdx run` for real: a small text corpus and the losses of a
// run's metrics.jsonl.
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

/// The value of `key` in every row of a metrics.jsonl, in step order.
inline std::vector<double> column(const std::filesystem::path& metrics, const std::string& key) {
  std::vector<double> out;
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line).at(key).get<double>());
  return out;
}

/// The "loss" of every row of a metrics.jsonl, in step order.
inline std::vector<double> losses(const std::filesystem::path& metrics) {
  std::vector<double> out;
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line).at("loss").get<double>());
  return out;
}

}  // namespace spmdx::test
