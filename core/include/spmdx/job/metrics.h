// Rank 0's record of a run: metrics.jsonl, the step lines and TensorBoard's event files.
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <utility>

#include <nlohmann/json.hpp>

#include "spmdx/exec/distributed.h"
#include "spmdx/job/spec.h"
#include "spmdx/metrics/tensorboard.h"

namespace spmdx::job {

// Rank 0's metrics: <dump>/metrics.jsonl (a resumed run keeps the rows before its first step
// and appends), the banner, a JSON row per step and a printed line every metrics.log_freq.
class MetricsWriter {
 public:
  MetricsWriter(const OutputSpec& output, std::int64_t first_step, bool checkpointing, std::int64_t planned_peak_bytes, std::int64_t microbatches);

  std::filesystem::path file() const { return dump_ / "metrics.jsonl"; }
  /// `key` = `value` in the next row written (a fallback, the backend after it).
  void add_to_next_row(const std::string& key, nlohmann::json value) { next_row_[key] = std::move(value); }

  /// The planned peak the rows report from now on (parallelism.balance's plan for this rank's new rows).
  void set_planned_peak(std::int64_t bytes) { planned_peak_ = bytes; }

  /// MFU's basis (torchtitan's metrics: tflops = FLOPs per token x tokens/s per rank / 1e12,
  /// mfu = 100 x that / peak): `flops_per_token` (models::flops_per_token, 6N + attention), the
  /// `ranks` the step's tokens are trained by (tokens/s per rank = tokens/s / ranks, torchtitan's
  /// tps over the non-data-parallel size), and `peak_flops_per_rank` (FLOP/s of the hardware one
  /// rank has, in the compute dtype; 0: unknown, and rows have no mfu).
  void set_mfu_basis(double flops_per_token, std::int64_t ranks, double peak_flops_per_rank) {
    flops_per_token_ = flops_per_token, ranks_ = std::max<std::int64_t>(1, ranks), peak_flops_per_rank_ = peak_flops_per_rank;
  }

  // scaling: float16's loss scale this step ran with, and whether its update was skipped.
  void row(std::int64_t step, std::int64_t last_step, double loss, double grad_norm, double lr, double tokens_per_s, const exec::RunStats& st,
           const std::optional<std::pair<double, bool>>& scaling);

 private:
  std::filesystem::path dump_;
  std::int64_t log_freq_;
  std::int64_t planned_peak_;  ///< plan_memory's peak of this rank's step (bytes)
  std::int64_t microbatches_;  ///< gradient accumulation's, shown on the step line when > 1
  double flops_per_token_ = 0;      ///< set_mfu_basis's
  std::int64_t ranks_ = 1;
  double peak_flops_per_rank_ = 0;
  std::optional<metrics::EventWriter> tensorboard_;  ///< metrics.enable_tensorboard's event file
  std::ofstream out_;
  nlohmann::json next_row_ = nlohmann::json::object();
};

}  // namespace spmdx::job
