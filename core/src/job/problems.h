// Problems found one after another and thrown together: one ConfigError, a line each (the
// config's readers in spec.cpp and the checks in preflight.cpp).
#pragma once

#include <string>
#include <vector>

#include "spmdx/config/config.h"

namespace spmdx::job {

struct Problems {
  const config::Config& cfg;
  std::vector<std::string> lines;
  // `keys`: those the message is about, so that it says where their values came from.
  void add(const std::vector<std::string>& keys, const std::string& why) { lines.push_back(cfg.where(keys) + ": " + why); }
  void throw_if_any() const {
    if (lines.empty()) return;
    std::string all;
    for (const auto& l : lines) all += (all.empty() ? "" : "\n") + l;
    throw config::ConfigError(all);
  }
};

}  // namespace spmdx::job
