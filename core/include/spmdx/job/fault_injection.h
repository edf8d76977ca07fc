// Faults a test plants in a run (SPMDX_FAULT): to check that the debug hooks find them, and that
// fault tolerance (job/fault_tolerance.h) survives a rank that dies, stops or slows down.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "spmdx/job/compile.h"
#include "spmdx/launch/launcher.h"

namespace spmdx::job {

// Fault injection for testing the debug hooks, from SPMDX_FAULT (never set in normal runs):
//   skip_collective:rank=R,step=S,index=I  rank R does not issue the collective at plan index I of
//                                          step S (CollectiveInfo::index; a bucket member: its bucket)
//   perturb:rank=R,step=S,tensor=NAME[,delta=D]  rank R adds D (1e-3) to NAME after step S
// and, for fault tolerance, faults of the rank's process (ProcessFault), several of them
// separated by ';':
//   kill:rank=R,step=S[,at=POINT][,index=I]   rank R dies (SIGKILL) at that point of step S
//   stop:rank=R,step=S[,at=POINT][,index=I]   rank R stops (SIGSTOP): it hangs, alive
//   slow:rank=R,step=S[,at=POINT][,index=I][,seconds=X]  rank R sleeps X seconds (1) there
//   hold:rank=R,step=S[,at=start|commit]      rank R waits there until every replica group is
//                                             live again (fault tolerance: a test's lost group
//                                             is back by step S, whatever its start takes)
// POINT: start (before the step's forward; the default), collective (as it issues its
// collective number I of the step, 0-based, counting every call it makes to the backend),
// commit (after the step's kernels, the optimizer's included, before the commit vote), or
// recovery (in a state transfer to a restarted group after step S, when I tensors moved).
// Under fault tolerance each fault acts once a job (a restarted rank inherits SPMDX_FAULT).
struct Fault {
  std::string kind;
  int rank = -1;
  std::int64_t step = -1, index = 0;
  std::string tensor;
  double delta = 1e-3;
};

/// SPMDX_FAULT's skip_collective or perturb fault (an empty Fault when `text` is null, empty,
/// or holds only process faults). Throws std::invalid_argument naming the variable and the
/// form expected, for any of the faults listed.
Fault parse_fault(const char* text);

/// A fault of a rank's process: kill, stop or slow (see above).
struct ProcessFault {
  std::string kind;          ///< "kill", "stop", "slow", "hold"
  int rank = -1;
  std::int64_t step = -1;
  std::string at = "start";  ///< "start", "collective", "commit", "recovery", "restart" (a restarted rank before it joins: slow, step 0; hold until step is committed)
  std::int64_t index = 0;    ///< collective: the call's ordinal in the step; recovery: tensors moved first
  double seconds = 1;        ///< slow's sleep
  /// slow with factor=F (> 1): from step S (default 1) on, the rank's compute takes F times as
  /// long (DistributedExecutor::set_compute_slowdown: F - 1 times its kernels' time slept at the
  /// end of each step), a slower device on a uniform machine. Not fired once like the others:
  /// due_fault never returns it.
  double factor = 0;
  int id = 0;                ///< its place in SPMDX_FAULT's list
};

/// SPMDX_FAULT's process faults, in order. Throws as parse_fault.
std::vector<ProcessFault> parse_process_faults(const char* text);

/// The compute slowdown of `rank` at `step`: the factor of its slow fault with factor=F whose
/// step S <= step, else 1.
double compute_slowdown(const std::vector<ProcessFault>& faults, int rank, std::int64_t step);

/// The fault of `faults` due on `rank` at point `at` of `step` (collective and recovery: at
/// index `index`), or nullptr. A slow fault with a factor is never due (compute_slowdown).
const ProcessFault* due_fault(const std::vector<ProcessFault>& faults, int rank, std::int64_t step, const std::string& at, std::int64_t index = 0);

/// Acts it out on this process: SIGKILL, SIGSTOP (returns once continued), or the sleep (hold:
/// FaultTolerance::hold_until_all_live).
/// Says first, on stderr, what it does.
void fire(const ProcessFault& fault);

// A fault that can never happen is a mistake in the test that planted it.
void check_fault(const Fault& fault, const launch::RankEnv& env, const JobSpec& spec, const PlacedJob& job);
void check_process_faults(const std::vector<ProcessFault>& faults, const launch::RankEnv& env, const JobSpec& spec);

}  // namespace spmdx::job
