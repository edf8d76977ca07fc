// `spmdx fr-trace`: merges the flight_recorder hook's per-rank dumps and says which rank is
// missing from which collective, as PyTorch's Flight Recorder analyser (fr_trace) does for
// NCCL: collectives are matched across the ranks of each group by sequence number.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace spmdx::hooks {

struct FrFinding {
  std::string group;       ///< "dp_shard [0, 1, 2, 3]"
  std::uint64_t seq = 0;   ///< the first collective of the group where the ranks disagree
  std::vector<int> ranks;  ///< the ranks to blame (missing, different, or not completed)
  std::string message;     ///< one paragraph, naming the ranks, the collective and the step
};

struct FrAnalysis {
  std::vector<int> dumped;     ///< ranks with a dump
  std::vector<int> no_dump;    ///< ranks of the job without one
  std::vector<FrFinding> findings;  ///< per group, at most one, mismatches before stalls
  std::string text;            ///< the report, as `spmdx fr-trace` prints it
};

/// Reads <folder>/rank*.json (format "spmdx-flight-recorder-1"). Throws std::runtime_error
/// naming the folder when it holds no dump, or the file that is not valid.
FrAnalysis analyze_flight_recorder(const std::filesystem::path& folder);

}  // namespace spmdx::hooks
