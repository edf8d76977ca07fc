// Fault tolerance ([fault_tolerance]): training goes on when a rank dies, as torchft's replica
// groups (meta-pytorch/torchft, torchtitan's [fault_tolerance]) but inside spmdx's own plan,
// collectives and launcher.
//
// The fault domain is the replica group: a slice of the mesh along dp_replicate (a full copy
// of the model, laid out over dp_shard, cp and tp inside it). spmdx run's launcher records which
// groups are alive (launch/replica_groups.h); the ranks train in *configurations*: the live
// groups' ranks, joined under one comm backend of their own (the plugin's, over the live ranks
// renumbered: LiveBackend), each configuration with an id handed out by the store.
//
// A step, on every live rank: the step runs; then a commit vote through the store (torchft's
// should_commit): the step's update stands only when every rank of the configuration finished
// it, else every rank drops it, puts back the state from before it and runs it again. A vote
// closes early when the launcher reports a group of the configuration lost (each rank watches
// the membership and aborts its backend's collectives at once, so nobody waits for a dead
// peer); ranks that neither vote nor die within the timeout are named to the launcher, which
// stops them. The rank that completes or closes the vote decides for all: when the membership
// changed (a group lost, or a restarted one ready) it opens the next configuration, with the
// restarted groups as its joiners and where training stands (step, AdamW's count, data
// position, loss scale) for them.
//
// Between configurations every rank rejoins the backend over the new live set; each rank of a
// joining group receives every state tensor (parameters, AdamW moments, MoE biases) from the rank
// of the same coordinates in the lowest live group that was there before (a broadcast over
// those ranks), so its state is bitwise the live group's; no checkpoint is read. A vote closes
// the move: a transfer that failed (a rank died in it) opens the next configuration without
// that group.
//
// The replicate dim's gradient all_reduce runs over the live groups only. spmdx's graph sums
// gradients already divided by the global batch (Partial(sum) over dp), so with k of R groups
// live the sum is scaled by R / k: the mean over the rows trained, as torchft's all_reduce
// divides by the participants. The rows of a lost group's data are skipped while it is away
// (torchft's behaviour: each group reads its own part of the batch); the data position stays
// the job's, so a group that returns reads the rows the others read next.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "spmdx/comm.h"
#include "spmdx/core/registry.h"
#include "spmdx/exec/executor.h"
#include "spmdx/job/fault_injection.h"
#include "spmdx/job/spec.h"
#include "spmdx/launch/launcher.h"
#include "spmdx/launch/replica_groups.h"

namespace spmdx::job {

/// Where training stands: what a configuration that starts here gives a joining group.
struct FtProgress {
  std::int64_t next_step = 1;        ///< the step the configuration runs first
  std::int64_t optimizer_steps = 0;  ///< AdamW updates so far
  std::uint64_t samples = 0;         ///< the data position (data::TextDatasetState)
  double loss_scale = 0;             ///< float16's GradScaler scale (0: none)
  std::int64_t growth_tracker = 0;
};

/// The ranks that train together, and what the joining groups among them are given.
struct FtConfig {
  std::int64_t id = 0;     ///< 0: the job's start, every group
  std::int64_t epoch = 0;  ///< the launcher's membership it follows
  std::vector<launch::ft::GroupAttempt> groups;   ///< live, ascending
  std::vector<launch::ft::GroupAttempt> joiners;  ///< of them, those given the state first
  FtProgress progress;
  std::string to_json() const;
  static FtConfig from_json(const std::string& text);
  bool has(int group) const;
};

/// A step's commit vote, the same on every live rank.
struct FtDecision {
  bool commit = false;      ///< the step's update stands
  bool stop = false;        ///< fewer live groups than min_replica_size: the job stops
  std::int64_t config = 0;  ///< the configuration of what follows (another id: rejoin)
  std::string why;          ///< not committed: why (the rank's reason, or the groups lost)
};

/// The comm backend of one configuration: the plugin's backend joined over the live ranks
/// (renumbered 0 .. n-1 in rank order) under the global rank numbers the executor uses.
/// Groups with ranks of a lost group are the replica slices (one rank per group, same
/// coordinates): they shrink to the live members, and a sum over one (all_reduce,
/// reduce_scatter) is scaled by members / live members. A gather, all_to_all or broadcast
/// rooted at a lost rank over such a group fails with std::invalid_argument. Calls a rank makes
/// are counted per step for SPMDX_FAULT's at=collective.
class LiveBackend final : public CommBackend, public VariableAllToAll {
 public:
  /// `act`: what a fault due at a collective does (FaultTolerance::act).
  LiveBackend(std::unique_ptr<CommBackend> inner, std::vector<int> live, int rank, std::string what, const std::vector<ProcessFault>* faults,
              std::function<void(const ProcessFault&)> act);
  void init(const CommInit&) override;  ///< joined already: throws std::logic_error
  void finalize() override { inner_->finalize(); }
  void abort() noexcept override { inner_->abort(); }
  std::string describe() const override { return inner_->describe() + ", " + what_; }
  std::vector<CommCapability> capabilities() const override { return inner_->capabilities(); }
  int new_group(const std::vector<int>& ranks) override;
  std::unique_ptr<Work> all_reduce(int group, CommBuffer buf, ReduceOp op) override;
  std::unique_ptr<Work> all_gather(int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> counts) override;
  std::unique_ptr<Work> reduce_scatter(int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> counts, ReduceOp op) override;
  std::unique_ptr<Work> all_to_all(int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> send_counts,
                                   std::vector<std::size_t> recv_counts) override;
  std::unique_ptr<Work> broadcast(int group, CommBuffer buf, int root_member) override;
  std::unique_ptr<Work> send(CommBuffer buf, int peer_rank, int tag) override;
  std::unique_ptr<Work> recv(CommBuffer buf, int peer_rank, int tag) override;
  std::unique_ptr<Work> barrier(int group) override;
  std::unique_ptr<Work> all_to_all_v(int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> send_counts, std::size_t* recv_counts) override;
  /// The step the calls from now on belong to (for at=collective faults).
  void set_step(std::int64_t step) { step_ = step, calls_ = 0; }

 private:
  struct GroupInfo {
    std::vector<int> ranks;  ///< the caller's, global
    std::vector<int> live;   ///< of them, the live ones' positions in `ranks`
    double scale = 1;        ///< ranks / live
  };
  const GroupInfo& info(int group, const char* op) const;
  void tick();
  int member(int peer_rank, const char* op) const;
  std::unique_ptr<CommBackend> inner_;
  std::vector<int> live_;  // global ranks, ascending; inner rank i is live_[i]
  int rank_;
  std::string what_;
  const std::vector<ProcessFault>* faults_;
  std::function<void(const ProcessFault&)> act_;
  std::map<int, GroupInfo> groups_;
  std::int64_t step_ = 0, calls_ = 0;
};

/// One rank's side of fault tolerance: the configuration it is in, the votes, the rejoins and
/// the state transfers, and the thread that watches the launcher's membership.
class FaultTolerance {
 public:
  /// `store` is the job's (the launcher serves it); `faults`: SPMDX_FAULT's process faults, each
  /// acted out once a job (a restarted rank has them too).
  FaultTolerance(const JobSpec& spec, const launch::RankEnv& env, Store& store, PluginRegistry& registry, std::vector<ProcessFault> faults);
  ~FaultTolerance();
  FaultTolerance(const FaultTolerance&) = delete;
  FaultTolerance& operator=(const FaultTolerance&) = delete;

  int group() const noexcept { return group_; }
  int attempt() const noexcept { return attempt_; }        ///< 0: started with the job
  bool restarted() const noexcept { return attempt_ > 0; }
  const FtConfig& config() const noexcept { return config_; }
  int ranks_per_group() const noexcept { return ranks_per_group_; }
  int groups() const noexcept { return groups_; }
  bool all_live() const noexcept { return static_cast<int>(config_.groups.size()) == groups_; }
  /// The lowest live rank: it writes the metrics and prints the step lines.
  int lead() const;
  /// The live ranks of the configuration, ascending.
  std::vector<int> live_ranks() const;
  const std::vector<ProcessFault>& faults() const noexcept { return faults_; }

  /// A first rank: configuration 0 (every group, from `progress`). A restarted rank: says it is
  /// ready and waits for the configuration that adopts its group; nullopt when the job finished
  /// first.
  std::optional<FtConfig> start(const FtProgress& progress);
  /// Makes configuration `id` this rank's (read from the store). Throws std::runtime_error when
  /// it does not hold this rank's group (the launcher dropped it).
  void adopt(std::int64_t id);
  /// The comm backend of the configuration (joined now, collectively over its live ranks).
  std::unique_ptr<LiveBackend> join();
  /// Gives the joining groups the state: each of their ranks receives `names` of `state` from
  /// the rank of the same coordinates in the lowest group that is not joining. Throws
  /// CommError when a rank of the transfer died or did not answer.
  void transfer(CommBackend& backend, exec::TensorMap& state, const std::vector<std::string>& names, std::int64_t after_step);

  /// The vote closing step `step` (why_not: "" when this rank finished it, else why not);
  /// `committed` and `aborted`: where training stands in either case, for the configuration a
  /// change opens. `last`: the job's last step (committed: a restarting group is told the job
  /// is finished).
  FtDecision vote_step(std::int64_t step, bool last, const std::string& why_not, const FtProgress& committed, const FtProgress& aborted);
  /// The vote closing a move to the current configuration (the rejoin and the transfer).
  FtDecision vote_join(const std::string& why_not);

  /// SPMDX_FAULT's hold: waits until the launcher's membership has every group again (at most
  /// `max_seconds`; then throws std::runtime_error).
  void hold_until_all_live(double max_seconds);
  /// Tells the launcher and the waiting restarted ranks that the job stops (launch/replica_groups.h's kStopKey).
  void stop_job(const std::string& why);
  /// Acts out a process fault, once a job (the store counts them): hold here, the others by fire().
  void act(const ProcessFault& fault);

  /// The backend the watcher aborts when a group of the configuration is lost (null: none).
  void watch(CommBackend* backend);

  /// FNV-1a 64 of the bytes of `names` of `state` in order, as 16 hex digits.
  static std::string digest(const exec::TensorMap& state, const std::vector<std::string>& names);
  /// After the run: every live rank publishes its state's digest; the lead compares the ranks of
  /// the same coordinates across the live groups. Returns the lead's line ("" elsewhere);
  /// throws std::runtime_error naming the ranks whose states differ.
  std::string check_replicas_equal(const std::string& my_digest, std::int64_t step);
  /// After the run, on the lead: a line for each SPMDX_FAULT process fault that never fired
  /// (its step, collective index or transfer never came: e.g. an index past the step's backend
  /// calls), so a test's plant that did nothing is said, not taken for survived ("" if none).
  std::string unfired_faults();

 private:
  FtDecision vote(const std::string& key, bool join, bool last, const std::string& why_not, const FtProgress& committed, const FtProgress& aborted);
  FtDecision decide(const std::string& key, bool join, std::int64_t voted, bool last, const FtProgress& committed, const FtProgress& aborted);
  bool lost_from(const launch::ft::Membership& m) const;
  void watcher();

  const JobSpec& spec_;
  const launch::RankEnv& env_;
  Store& store_;
  PluginRegistry& registry_;
  std::vector<ProcessFault> faults_;
  bool publish_committed_ = false;  // a hold at=restart waits on the newest committed step
  int groups_ = 1, ranks_per_group_ = 1, group_ = 0, attempt_ = 0;
  double timeout_ = 10;
  FtConfig config_;
  // The watcher: its own store connection, the backend to abort, the groups it guards.
  std::unique_ptr<Store> watch_store_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool stopping_ = false;
  CommBackend* watched_ = nullptr;
  std::vector<launch::ft::GroupAttempt> guarded_;
  std::thread thread_;
};

}  // namespace spmdx::job
