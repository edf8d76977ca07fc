// Replica groups under fault tolerance ([fault_tolerance], torchft's model): which groups are
// alive, as spmdx run's launcher records it in the job's store for the ranks to read. The
// launcher is the one writer of the membership (it sees every rank exit and starts the
// restarted ones); the ranks agree, through a vote a step, on when a change takes effect
// (job/fault_tolerance.h).
//
// Keys (under "spmdx/ft/"):
//   epoch                 integer (add 0 to read): the latest membership; 0 at launch
//   members/<epoch>       the live groups then, "group:attempt" comma-separated ("0:0,2:1"),
//                         attempt counting the group's restarts (0: started with the job)
//   started               the first ranks that joined the job's first backend (when it reaches
//                         world_size, a rank that dies costs its group, not the job)
//   ready/<g>:<attempt>   ranks of a restarted group ready to be given the state
//   adopted/<g>:<attempt> the configuration (job/fault_tolerance.h) a restarted group joins
//   suspects, suspect     ranks that did not answer a vote within the timeout: their count, and
//                         the last list ("3,5"), for the launcher to stop them
//   finished              set once the last step is committed: a group still restarting exits
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "spmdx/comm.h"

namespace spmdx::launch::ft {

inline constexpr const char* kEpochKey = "spmdx/ft/epoch";
inline constexpr const char* kStartedKey = "spmdx/ft/started";
inline constexpr const char* kSuspectCountKey = "spmdx/ft/suspects";
inline constexpr const char* kSuspectKey = "spmdx/ft/suspect";
inline constexpr const char* kFinishedKey = "spmdx/ft/finished";
/// Set (a count) with kStopWhyKey when a rank's vote decides the job stops (too few groups, or
/// none left that holds the state): the launcher then stops it, as a job without fault tolerance.
inline constexpr const char* kStopKey = "spmdx/ft/stop";
inline constexpr const char* kStopWhyKey = "spmdx/ft/stop_why";
/// Counts the groups lost with no restart left: they will not be back (a hold stops waiting).
inline constexpr const char* kLostForGoodKey = "spmdx/ft/lost_for_good";
/// The environment variable the launcher sets on a restarted group's ranks: its attempt (>= 1).
inline constexpr const char* kRestartEnv = "SPMDX_FT_RESTART";

/// A replica group as one incarnation: its index and how many times it was restarted.
struct GroupAttempt {
  int group = 0;
  int attempt = 0;
  friend bool operator==(const GroupAttempt&, const GroupAttempt&) = default;
  friend auto operator<=>(const GroupAttempt&, const GroupAttempt&) = default;
  std::string str() const { return std::to_string(group) + ":" + std::to_string(attempt); }
};

inline std::string members_key(std::int64_t epoch) { return "spmdx/ft/members/" + std::to_string(epoch); }
inline std::string ready_key(const GroupAttempt& g) { return "spmdx/ft/ready/" + g.str(); }
inline std::string adopted_key(const GroupAttempt& g) { return "spmdx/ft/adopted/" + g.str(); }

/// "0:0,2:1"; parse_members reads it back (ascending by group). Throws std::invalid_argument
/// for text not of that form.
std::string members_text(const std::vector<GroupAttempt>& groups);
std::vector<GroupAttempt> parse_members(const std::string& text);

/// The groups alive at the latest epoch.
struct Membership {
  std::int64_t epoch = 0;
  std::vector<GroupAttempt> groups;  ///< ascending by group
};

/// The latest membership in `store`, waiting at most timeout_seconds for its record. Throws
/// CommError when the store does not answer.
Membership read_membership(Store& store, double timeout_seconds);

/// The launcher's side: writes `groups` as epoch `epoch` (the previous one + 1, or 0 before any
/// rank starts) and, from 1 on, moves the epoch counter to it.
void publish_membership(Store& store, std::int64_t epoch, const std::vector<GroupAttempt>& groups);

/// "replica group 1 (ranks 2-3)", for messages.
std::string group_text(int group, int ranks_per_group);

}  // namespace spmdx::launch::ft
