// Debug hook plugins (graphviz, timeline, partition_validator, consistency, flight_recorder).
//
// The design's OnGlobalSyncComplete part; the compile-stage, validation and per-collective
// callbacks are added with the hooks (issue 8), each addition bumping SPMDX_ABI_MAJOR.
// Plain C++17: part of the plugin ABI.
#pragma once

#include <cstdint>
#include <string>

namespace spmdx {

struct StepInfo {
  std::int64_t step = 0;  ///< 1-based training step just completed
  int rank = 0;
  int world_size = 1;
  double loss = 0.0;       ///< the step's global loss (mean over tokens)
  double step_seconds = 0.0;
};

class Hook {
 public:
  virtual ~Hook() = default;
  /// Called on every rank after the step's global synchronisation (OnGlobalSyncComplete).
  /// An exception is reported with the hook's name and does not stop the run.
  virtual void on_step_end(const StepInfo& step) = 0;
};

}  // namespace spmdx
