// Collectives built on point-to-point messages, for backends whose transport moves bytes
// between two ranks (UCX's tag matching; in-process mailboxes). The algorithms, each as the
// literature gives it:
//   all_reduce      ring: reduce-scatter then all-gather (Patarasuk & Yuan 2009), or
//                   recursive doubling for small messages on power-of-two groups (Thakur et al. 2005)
//   all_gather      ring, uneven blocks (MPI_Allgatherv)
//   reduce_scatter  ring, uneven blocks
//   all_to_all      pairwise exchange
//   broadcast       binomial tree
// Operations run in submission order on one communication thread per backend (so compute
// overlaps them); Work handles report completion, and a peer that fails or stays silent past
// the timeout fails the operation with a CommError naming the collective and the peer rank.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "spmdx/comm.h"
#include "spmdx/comm/comm_queue.h"

namespace spmdx::comm {

/// What a transport provides. Called from the communication thread only.
class Transport {
 public:
  virtual ~Transport() = default;
  /// Posts a send of `bytes` to global rank `peer` under `tag`; returns a request id.
  virtual std::uint64_t isend(int peer, const void* data, std::size_t bytes, std::uint64_t tag) = 0;
  /// Posts a receive of exactly `bytes` from `peer` under `tag`.
  virtual std::uint64_t irecv(int peer, void* data, std::size_t bytes, std::uint64_t tag) = 0;
  /// Makes progress; true once the request completed (it is then forgotten). Throws CommError
  /// naming the peer when the request failed.
  virtual bool test(std::uint64_t request) = 0;
};

/// dst[i] = dst[i] op src[i] for `count` elements of `dtype` (avg sums; divide afterwards).
void reduce_into(void* dst, const void* src, std::size_t count, CommDType dtype, ReduceOp op);
/// dst[i] /= divisor.
void divide(void* data, std::size_t count, CommDType dtype, double divisor);

class P2PBackend : public CommBackend {
 public:
  P2PBackend();
  ~P2PBackend() override;

  int new_group(const std::vector<int>& ranks) override;
  std::unique_ptr<Work> all_reduce(int group, CommBuffer buf, ReduceOp op) override;
  std::unique_ptr<Work> all_gather(int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> counts) override;
  std::unique_ptr<Work> reduce_scatter(int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> counts,
                                       ReduceOp op) override;
  std::unique_ptr<Work> all_to_all(int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> send_counts,
                                   std::vector<std::size_t> recv_counts) override;
  std::unique_ptr<Work> broadcast(int group, CommBuffer buf, int root_member) override;
  std::unique_ptr<Work> send(CommBuffer buf, int peer_rank, int tag) override;
  std::unique_ptr<Work> recv(CommBuffer buf, int peer_rank, int tag) override;
  std::unique_ptr<Work> barrier(int group) override;
  void abort() noexcept override;

 protected:
  /// Called by the subclass once its transport is up (from init()); the group of all ranks is
  /// group 0. With a store, every rank keeps a heartbeat counter there, so that a timeout can
  /// name the ranks that died rather than a neighbour that waits on them.
  void start(Transport* transport, const CommInit& init);
  /// Drains the queue and stops the thread (from finalize()); the transport may go after.
  void stop();
  int rank() const noexcept { return rank_; }
  int world_size() const noexcept { return world_size_; }

 private:
  struct Group {
    std::vector<int> ranks;
    int me = 0;
    std::uint64_t seq = 0;  // collectives issued on this group
  };
  static constexpr int kPointToPoint = -1;
  struct Op;
  class OpWork;
  std::unique_ptr<Work> submit(const char* name, int group, std::function<void(Op&)> body);
  void run();
  // Exchanges with two peers at once (ring steps); waits for both.
  // `step` tells messages of one operation apart; both sides of an exchange must use the same
  // (-1: the operation's next step, for algorithms where every rank takes the same steps).
  void sendrecv(Op& op, int to, const void* sbuf, std::size_t sbytes, int from, void* rbuf, std::size_t rbytes, int step = -1);
  // A failure every rank should blame on `peer` (the first one seen wins), kept in the store.
  void report_fault(int peer);
  int reported_fault();
  // The ranks whose heartbeat stopped (checked over ~2 s), or empty.
  std::vector<int> dead_ranks();
  void wait_all(Op& op, const std::vector<std::pair<std::uint64_t, int>>& requests);
  // Scratch memory of the comm thread, reused across operations: slot 0 or 1, at least `bytes`.
  char* scratch(std::size_t slot, std::size_t bytes);
  struct Scratch {
    std::unique_ptr<char[]> data;
    std::size_t size = 0;
  };
  Scratch scratch_[2];

  Transport* transport_ = nullptr;
  int rank_ = 0;
  int world_size_ = 1;
  double timeout_ = 300;
  std::vector<Group> groups_;
  std::mutex mutex_;  // groups_ and their sequence numbers: a group's operations enter the queue in sequence order
  CommQueue<std::shared_ptr<Op>> queue_{1024};  // to the comm thread, which never locks
  bool stopping_ = false;
  std::atomic<bool> aborted_{false};
  std::thread thread_;
  Store* store_ = nullptr;
  std::string heartbeat_prefix_;
  std::thread heartbeat_;
  std::mutex heartbeat_mutex_;
  std::condition_variable heartbeat_cv_;
};

}  // namespace spmdx::comm
