// Store keys where the ranks of a job leave, for the launcher, whom to blame for a failed
// collective (written by the collective engine's health check and by run_job).
#pragma once

namespace spmdx::comm {

/// The store key where ranks name the first rank that failed a collective (the first report
/// wins; "<key>_reported" counts the reports), read by the launcher to say whom to blame.
inline constexpr const char* kFaultKey = "spmdx/fault";
/// The store key where ranks that found members calling different collectives, with no
/// majority to tell which one is wrong, leave the first such message for the launcher.
inline constexpr const char* kMismatchKey = "spmdx/mismatch";

}  // namespace spmdx::comm
