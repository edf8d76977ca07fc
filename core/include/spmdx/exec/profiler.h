// PyTorch's profiler around chosen steps (torchtitan's [profiling]): Kineto traces of a rank's
// ATen kernels, with the executor's compute and communication spans added, one Perfetto view.
#pragma once

#include <cstdint>
#include <filesystem>
#include <vector>

#include "spmdx/hook.h"

namespace spmdx::exec {

/// Profiles every `freq`-th step of one rank with torch::autograd::profiler (Kineto; CPU
/// activities, and CUDA's on a GPU), as torchtitan's profiler with profile_freq does, and writes
/// `folder`/iteration_<step>/rank<rank>_trace.json: Chrome trace JSON (chrome://tracing,
/// ui.perfetto.dev). The trace gets the step's executor spans (exec::DistributedExecutor's
/// spans(): every op and collective, with bytes) as two more tracks, "spmdx compute" and
/// "spmdx comm", on the trace's own clock, so kernels and collectives line up.
class StepProfiler {
 public:
  StepProfiler(std::filesystem::path folder, std::int64_t freq, int rank, bool cuda);
  /// True for the steps profiled: every freq-th (1-based step % freq == 0).
  bool chosen(std::int64_t step) const { return freq_ > 0 && step % freq_ == 0; }
  /// Starts profiling this thread. Throws std::runtime_error when the profiler is already on.
  void start();
  /// Stops it and writes step's trace with `spans` (seconds since the epoch) added; returns the
  /// file. Throws std::runtime_error naming the file when it cannot be written.
  std::filesystem::path stop(std::int64_t step, const std::vector<Span>& spans);
  /// Stops it without writing (a step that failed).
  void cancel();

 private:
  std::filesystem::path folder_;
  std::int64_t freq_;
  int rank_;
  bool cuda_;
};

}  // namespace spmdx::exec
