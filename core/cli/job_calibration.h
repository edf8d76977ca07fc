// The cost model's calibration a job is priced with (parallelism.strategy = "auto", compile
// --estimate): `spmdx compile` and `spmdx run --nproc` read it, measuring it first if needed.
#pragma once

#include "spmdx/config/config.h"
#include "spmdx/plan/estimate.h"

namespace spmdx::cli {

// The calibration.json in the config's job.dump_folder: measured here (once) where this build
// has LibTorch, with training.cpu_matmul's library as the ranks will set it; else the file's or
// the defaults. Throws std::invalid_argument naming the key (training.cpu_matmul, or
// job.dump_folder when the file cannot be kept there).
spmdx::plan::Calibration job_calibration(const spmdx::config::Config& cfg);

}  // namespace spmdx::cli
