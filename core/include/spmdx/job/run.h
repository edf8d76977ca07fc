// One rank's training loop, as `spmdx run` runs it: plan the job (place, propagate, this
// rank's graph), load the comm backend, initialise this rank's shards, then for each step
// take the global batch from the data set, keep this rank's shard, run, and (rank 0) print a
// line and append to <dump_folder>/metrics.jsonl.
#pragma once

#include "spmdx/config/config.h"
#include "spmdx/launch/launcher.h"

namespace spmdx::job {

/// Returns the process exit code (0: trained every step). Throws config::ConfigError,
/// CommError and std::runtime_error with what went wrong, naming the file, key or rank.
int run_job(const config::Config& cfg, const launch::RankEnv& env);

}  // namespace spmdx::job
