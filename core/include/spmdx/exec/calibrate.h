// The compute half of the calibrated cost model (plan/estimate.h): the f32 matmul rate of the
// executor's kernels and ATen's elementwise rates on one thread of this machine, measured once
// and kept in the dump folder.
#pragma once

#include <filesystem>
#include <string>

#include "spmdx/plan/estimate.h"

namespace spmdx::exec {

/// `base` with its compute rates measured on one intra-op thread: a linear's three 384 x 384 x
/// 384 f32 products as the kernels run them (x W^T and g W on the library cpu_matmul() names,
/// g^T x on ATen's; FLOPs 2MNK per second, their mean) and an out-of-place add of 4 Mi f32 (12 bytes an element per
/// second), each repeated for about seconds / 2 after a warm-up. The thread count is restored.
/// `cpu_share`, when given, gets the share of the wall time the measuring thread ran on a core
/// (its CPU time over the wall time, at most 1): well under 1 when other work had the cores.
plan::Calibration measure_compute(plan::Calibration base, double seconds = 0.6, double* cpu_share = nullptr);

/// <dump_folder>/calibration.json with measured compute rates: read when it has them for the
/// library in use (cpu_matmul()), else measured now and written (keeping its links). A
/// measurement whose thread ran under 80% of the wall time (a busy machine: its rates low) says
/// so in its source and in a warning naming the file to delete. Throws std::invalid_argument
/// naming the file when it is malformed, and what writing it throws.
plan::Calibration ensure_calibration(const std::filesystem::path& dump_folder);

/// The GEMM rate of one core of this machine per dtype, in FLOP/s (2MNK per second): the peak
/// that MFU divides by (model FLOPs utilization, Chowdhery et al., PaLM 2022, appendix B;
/// torchtitan's `mfu` divides by a GPU's datasheet peak, utils.get_peak_flops). A CPU has no
/// datasheet figure that holds for a given library, clock and core, so it is measured: square
/// 1024^3 products on one thread, the best of the libraries the kernels use (float32: oneDNN's
/// inner product and ATen's BLAS; bfloat16 and float16: the path exec::half_gemm chose, ATen's
/// half kernel on oneDNN where the CPU has their dot products, else float32 GEMMs of the
/// upcast operands).
struct GemmPeak {
  double float32 = 0, bfloat16 = 0, float16 = 0;  ///< FLOP/s of one thread
  std::string source;                             ///< "measured <when> on <CPU> (...)"; "busy: ..." when the thread ran under 80% of the time
  /// The rate for a dtype name ("float32", "bfloat16", "float16"); throws std::invalid_argument for another.
  double of(const std::string& dtype) const;
};
/// Measures it (about 3 x `seconds`).
GemmPeak measure_gemm_peak(double seconds = 0.25);
/// This machine's, measured once and kept in <cache>/gemm_peak.json under the CPU's model, its
/// ISA extensions and the libraries in use (cache: $SPMDX_CACHE_DIR, else
/// $XDG_CACHE_HOME/spmdx, else $HOME/.cache/spmdx; measured each time when none can be
/// written). A measurement on a busy machine is kept with "busy" in its source and measured
/// again next time (the higher of the two kept).
GemmPeak gemm_peak();

}  // namespace spmdx::exec
