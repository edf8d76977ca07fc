// The comm backends a job's ranks join, in the order the config gives them (comm.backend, then
// comm.fallback: CommSpec::chain), agreed by every rank through the job's store: a
// backend that cannot be made (a plugin that fails to load, its ABI or capability check, its
// options) or started (init fails on some rank) is passed over for the next, the reason said,
// on every rank alike. During the run a backend whose collectives fail comm.max_failures times
// within comm.failure_window steps is replaced by the next the same way (StepLoop's failover).
// The checks a multi-process job makes without LibTorch; run_job owns the CommChain.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "spmdx/comm.h"
#include "spmdx/core/registry.h"
#include "spmdx/launch/launcher.h"
#include "spmdx/job/spec.h"

namespace spmdx::job {

/// A vote of every rank through `store` under `key` (unique per vote): each says "" (yes) or why
/// not. Returns "" when every rank said yes, else the first reason given, as "rank R: why".
/// Throws CommError when not every rank has voted within timeout_seconds.
std::string vote(Store& store, const std::string& key, int rank, int world_size, const std::string& why_not, double timeout_seconds);

/// The comm backend `backend_spec` names (comm.backend's form; comm/score_map.h), joined to the job
/// under store generation `generation`. Every rank must have made the same one ("auto" chooses
/// from the plugins each rank finds): one that differs from rank 0 fails here, naming both. A
/// peer that cannot be reached (it failed first, say) is named in the store for the launcher.
/// Throws what making and initialising the backend throws.
std::unique_ptr<CommBackend> join_backend(PluginRegistry& registry, const std::string& backend_spec, const CommSpec& spec,
                                          const launch::RankEnv& env, Store& store, std::int64_t generation);
/// The same with a backend already made (by comm_backend_problem's check) and what it is.
std::unique_ptr<CommBackend> join_backend(std::unique_ptr<CommBackend> backend, const std::string& choice, const std::string& backend_spec,
                                          const CommSpec& spec, const launch::RankEnv& env, Store& store, std::int64_t generation);

/// A change of backend (or, in FallbackEvent's other use, of strategies) and why.
struct FallbackEvent {
  std::string what;        ///< "comm" or "strategies"
  std::string from, to;    ///< the backend (or layout) passed over and the one used instead ("" when none)
  std::string reason;      ///< "rank R: ..." for comm
  std::int64_t step = 0;   ///< the step that ran again on `to` (0: at start)
  std::string str() const; ///< "comm backend \"from\" passed over at start (reason); using \"to\""
};

class CommChain {
 public:
  /// Store generations of joins after the first: above those of hot-swaps (step / swap_at_step)
  /// and below those of "auto"'s members ((i + 1) * 2^40 + generation).
  static constexpr std::int64_t kFirstFallbackGeneration = std::int64_t{1} << 36;

  CommChain(PluginRegistry& registry, const CommSpec& spec, const launch::RankEnv& env, Store& store)
      : registry_(registry), spec_(spec), env_(env), store_(store) {}

  /// Joins the first backend of the chain every rank can make and start, from the start of the
  /// chain. Each one passed over is an event (events()). Throws std::runtime_error naming every
  /// backend tried and why, when none can serve the job.
  std::unique_ptr<CommBackend> join_at_start();

  /// After collectives of `step` failed with `reason` on some rank (the ranks agreed through a
  /// vote): counts the failure against the current backend and joins, under a new generation,
  /// the same backend again while it has failed fewer than comm.max_failures times within
  /// comm.failure_window steps, else the next of the chain. `failed` is aborted and destroyed
  /// first. Throws std::runtime_error, naming the backend and the reason, when the chain has
  /// no backend left.
  std::unique_ptr<CommBackend> replace(std::unique_ptr<CommBackend> failed, std::int64_t step, const std::string& reason);

  const std::string& current() const { return spec_.chain.at(current_); }
  /// Every change since start, in order.
  const std::vector<FallbackEvent>& events() const { return events_; }

 private:
  // Joins chain[from], then the next ones, until every rank has one; `step` and `first_reason`
  // for the event of leaving chain[from - 1] (the caller's).
  std::unique_ptr<CommBackend> join_from(std::size_t from, std::int64_t step);

  PluginRegistry& registry_;
  const CommSpec& spec_;
  const launch::RankEnv& env_;
  Store& store_;
  std::size_t current_ = 0;
  std::int64_t joins_ = 0;               // joins so far: the first is generation 0
  std::deque<std::int64_t> failures_;    // steps at which the current backend failed
  std::vector<FallbackEvent> events_;
};

}  // namespace spmdx::job
