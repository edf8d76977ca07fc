// `spmdx fr-trace`: merges the flight_recorder hook's per-rank dumps and says which rank
// diverged from which collective, as PyTorch's Flight Recorder analyser (fr_trace) does for
// NCCL. Collectives are matched across the ranks of each group by what they carry: the step,
// the collective's place in the step's plan (CollectiveInfo::index) or, in dumps without it,
// the graph value or bucket it produces; the group's sequence number says which call of each
// rank to compare. At the first sequence number where the ranks of a group disagree, the
// rank(s) holding a collective that comes later in the plan skipped the one the others hold
// (without plan indices: the value the others hold that the odd rank never issues later).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace spmdx::hooks {

struct FrFinding {
  /// skipped: ranks issued a later collective where the others issued this one;
  /// different: ranks disagree and their order cannot be told (the minority is named);
  /// missing: ranks never issued a collective the others did (stuck, or stopped early);
  /// stalled: every rank issued it and it did not complete on `ranks`.
  enum class Kind { skipped, different, missing, stalled };
  Kind kind = Kind::stalled;
  std::string group;       ///< "dp_shard [0, 1, 2, 3]"
  std::uint64_t seq = 0;   ///< the first collective of the group where the ranks disagree
  std::vector<int> ranks;  ///< the ranks to blame (skipped, different, missing, or not completed)
  std::int64_t step = -1;  ///< the step of the collective in question (the one skipped)
  std::int64_t index = -1; ///< its place in the step's plan (-1: not in the dumps)
  std::string value;       ///< the value or bucket it produces ("%126", "bucket 0 (...)")
  std::string message;     ///< one paragraph, naming the ranks, the collective and the step
};

struct FrAnalysis {
  std::vector<int> dumped;     ///< ranks with a dump
  std::vector<int> no_dump;    ///< ranks of the job without one
  /// At most one per group: divergences (skipped, different, missing) before stalls, each the
  /// earliest in plan order first (the likely cause; later ones are often its consequences),
  /// then those whose place in the plan is not known.
  std::vector<FrFinding> findings;
  std::string text;            ///< the report, as `spmdx fr-trace` prints it
};

/// Reads <folder>/rank*.json (format "spmdx-flight-recorder-1"; a job's dump folder stands for
/// its hooks/flight_recorder), not the rank<R>.<N>.json the flight recorder keeps of earlier runs. Throws std::runtime_error naming the folder when it holds no
/// dump, or the file that is not valid (a field of the wrong type or out of range, named with
/// its entry; a file named for another rank; dumps of different runs).
FrAnalysis analyze_flight_recorder(const std::filesystem::path& folder);

}  // namespace spmdx::hooks
