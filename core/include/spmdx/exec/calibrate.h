// The compute half of the calibrated cost model (plan/estimate.h): the f32 matmul rate of the
// executor's kernels and ATen's elementwise rates on one thread of this machine, measured once
// and kept in the dump folder.
#pragma once

#include <filesystem>

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

}  // namespace spmdx::exec
