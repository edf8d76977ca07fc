// Faults a test plants in a run (SPMDX_FAULT), to check that the debug hooks find them.
#pragma once

#include <cstdint>
#include <string>

#include "spmdx/job/compile.h"
#include "spmdx/launch/launcher.h"

namespace spmdx::job {

// Fault injection for testing the debug hooks, from SPMDX_FAULT (never set in normal runs):
//   skip_collective:rank=R,step=S,index=I  rank R does not issue the collective at plan index I of
//                                          step S (CollectiveInfo::index; a bucket member: its bucket)
//   perturb:rank=R,step=S,tensor=NAME[,delta=D]  rank R adds D (1e-3) to NAME after step S
struct Fault {
  std::string kind;
  int rank = -1;
  std::int64_t step = -1, index = 0;
  std::string tensor;
  double delta = 1e-3;
};

/// SPMDX_FAULT's text parsed (an empty Fault when `text` is null or empty). Throws
/// std::invalid_argument naming the variable and the form expected.
Fault parse_fault(const char* text);

// A fault that can never happen is a mistake in the test that planted it.
void check_fault(const Fault& fault, const launch::RankEnv& env, const JobSpec& spec, const PlacedJob& job);

}  // namespace spmdx::job
