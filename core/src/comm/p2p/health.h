// The engine's watch over its peers: a heartbeat counter per rank in the store, the first
// failure every rank should blame, and the stall check that turns a silent wait into a
// CommError naming a rank (as NCCL's watchdog and PyTorch's flight recorder blame ranks).
// Private to core/src/comm/p2p/; the store keys the launcher reads are in spmdx/comm/health.h.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "op.h"
#include "spmdx/comm.h"

namespace spmdx::comm {

class Health {
 public:
  using Clock = std::chrono::steady_clock;

  /// One wait's progress: a wait that makes none is checked by check_stall.
  struct Stall {
    explicit Stall(double timeout_seconds)
        : deadline(Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_seconds))) {}
    Clock::time_point deadline;
    Clock::time_point last_progress = Clock::now();
    Clock::time_point next_check = last_progress;
    std::vector<int> suspects;  // ranks without a heartbeat at the last check
  };

  /// `aborted`: the engine's flag, set by abort() or the first failed operation.
  explicit Health(const std::atomic<bool>& aborted) : aborted_(aborted) {}
  ~Health() { stop(); }
  Health(const Health&) = delete;
  Health& operator=(const Health&) = delete;

  /// With a store, starts a thread that bumps this rank's heartbeat every 300 ms, so a
  /// stalled wait can name the ranks that died rather than a neighbour that waits on them.
  void start(const CommInit& init);
  void stop();

  Stall stall() const { return Stall(timeout_); }
  /// A wait that is not progressing: throws CommError when the backend was aborted, when after
  /// 5 s stuck a peer is blamed by another rank or its heartbeat stopped in two checks in a
  /// row, or at the timeout (naming `silent`, the peer waited for).
  void check_stall(Op& op, Stall& stall, int silent);

  /// A failure every rank should blame on `peer` (the first report wins), kept in the store
  /// for the peers and (kFaultKey) for the launcher.
  void report_fault(int peer);
  /// Members called different collectives and none can be blamed alone: says so (kMismatchKey).
  void report_mismatch(const std::string& what);
  /// The rank a peer blamed in this generation, or -1.
  int reported_fault();
  /// The ranks whose heartbeat stopped (checked over 1.5 s), or empty; empty too when this
  /// rank's own did not advance (the store or the machine is too slow to tell).
  std::vector<int> dead_ranks();

 private:
  const std::atomic<bool>& aborted_;
  Store* store_ = nullptr;
  int rank_ = 0;
  int world_size_ = 1;
  double timeout_ = 300;
  std::string prefix_;  // "spmdx/heartbeat/g<generation>/"
  bool stopping_ = false;
  std::thread thread_;
  std::mutex mutex_;
  std::condition_variable cv_;
};

}  // namespace spmdx::comm
