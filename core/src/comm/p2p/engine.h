// The collective engine (spmdx/comm/p2p.h): a CommBackend that holds a Transport. One file per
// concern: engine.cpp (queue, communication thread, waits), ring.cpp, direct.cpp, tree.cpp,
// shm.cpp (with shm_channel.cpp), reduce.cpp, health.cpp, collectives.cpp (which algorithm
// each call takes). Private to core/src/comm/p2p/.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "health.h"
#include "op.h"
#include "shm.h"
#include "spmdx/comm.h"
#include "spmdx/comm/comm_queue.h"
#include "spmdx/comm/p2p.h"
#include "spmdx/transport.h"

namespace spmdx::comm {

class P2PEngine final : public CommBackend, public VariableAllToAll {
 public:
  P2PEngine(std::string name, std::unique_ptr<Transport> transport, P2POptions options);
  ~P2PEngine() override;

  void init(const CommInit& init) override;
  void finalize() override;
  void abort() noexcept override;
  std::string describe() const override;
  std::vector<CommCapability> capabilities() const override { return transport_->capabilities(); }

  int new_group(const std::vector<int>& ranks) override;
  std::unique_ptr<Work> all_reduce(int group, CommBuffer buf, ReduceOp op) override;
  std::unique_ptr<Work> all_gather(int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> counts) override;
  std::unique_ptr<Work> reduce_scatter(int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> counts,
                                       ReduceOp op) override;
  std::unique_ptr<Work> all_to_all(int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> send_counts,
                                   std::vector<std::size_t> recv_counts) override;
  std::unique_ptr<Work> all_to_all_v(int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> send_counts,
                                     std::size_t* recv_counts) override;
  std::unique_ptr<Work> broadcast(int group, CommBuffer buf, int root_member) override;
  std::unique_ptr<Work> send(CommBuffer buf, int peer_rank, int tag) override;
  std::unique_ptr<Work> recv(CommBuffer buf, int peer_rank, int tag) override;
  std::unique_ptr<Work> barrier(int group) override;

 private:
  class OpWork;
  static constexpr int kPointToPoint = -1;
  static constexpr std::size_t kDirectMaxMembers = 8;

  // engine.cpp: joining, the queue and the communication thread.
  void connect_transport(const CommInit& init);
  std::unique_ptr<Work> submit(const char* name, int group, std::function<void(Op&)> body,
                               std::function<std::pair<std::uint64_t, int>(Op&)> post = {});
  void run();
  void stop();
  // Marks `op` done (error "" when it succeeded) and wakes its waiters.
  static void finish(Op& op, const std::string& error, int peer, double started_at);
  // Completes the posted sends and receives whose requests are done; fails those whose peer
  // died or that passed the timeout (Health::check_stall). Returns whether any completed.
  bool progress_posted();
  // Waits for every request (progressing all), naming the peer of one that fails.
  void wait_all(Op& op, const std::vector<Request>& requests);
  // Exchanges with two peers at once (a ring step); waits for both. `step` tells messages of
  // one operation apart; both sides of an exchange must use the same (-1: the operation's next
  // step, for algorithms where every rank takes the same steps).
  // A transport call that threw talking to `peer`: the fault said in the store (Health), and
  // a CommError naming the operation, the peer and who failed first.
  [[noreturn]] void transport_failed(Op& op, int peer, const CommError& e);
  // The transport's isend and irecv, a CommError they throw said as transport_failed does.
  std::uint64_t post_send(Op& op, int to, const void* data, std::size_t bytes, std::uint64_t tag);
  std::uint64_t post_recv(Op& op, int from, void* data, std::size_t bytes, std::uint64_t tag);
  void sendrecv(Op& op, int to, const void* sbuf, std::size_t sbytes, int from, void* rbuf, std::size_t rbytes, int step = -1);
  // Scratch memory of the comm thread, reused across operations: slot 0 or 1, at least `bytes`.
  char* scratch(std::size_t slot, std::size_t bytes);
  bool use_direct(std::size_t members, std::size_t bytes) const;

  // ring.cpp: the pipelined ring and recursive doubling.
  Chunks reserve_chunks(Op& op, std::size_t max_count, std::size_t element_size, std::size_t max_chunks);
  // Posts the sends of `count` elements at `block` to `to`, one per chunk, tagged from ck.base.
  void send_chunks(Op& op, const Chunks& ck, int to, const char* block, std::size_t count, std::size_t element_size,
                   std::vector<Request>& sends);
  // One reduce-scatter ring step: sends `scount` elements of sbuf to `to` while receiving
  // `rcount` from `from` and reducing them into dst, pipelined in chunks of chunk_bytes.
  // `max_count` is the group's largest block (every member reserves the same tag steps).
  void reduce_step(Op& op, int to, const void* sbuf, std::size_t scount, int from, void* dst, std::size_t rcount,
                   std::size_t max_count, CommDType dtype, ReduceOp rop);
  // After k-1 steps block `me` of `work` holds the reduction of every member's (unscaled).
  void ring_reduce_scatter(Op& op, char* work, const std::vector<std::size_t>& counts, std::size_t max_count, CommDType dtype, ReduceOp rop);
  // After k-1 steps every block of `out` holds its owner's.
  void ring_all_gather(Op& op, char* out, const std::vector<std::size_t>& counts, CommDType dtype);
  void recursive_doubling_all_reduce(Op& op, CommBuffer buf, ReduceOp rop);

  // direct.cpp: every member to every other at once.
  void direct_reduce_scatter(Op& op, const char* in, const std::vector<std::size_t>& counts, char* dst, CommDType dtype, ReduceOp rop);
  void direct_all_gather(Op& op, char* out, const std::vector<std::size_t>& counts, CommDType dtype);
  void pairwise_all_to_all(Op& op, CommBuffer in, CommBuffer out, const std::vector<std::size_t>& send_counts,
                           const std::vector<std::size_t>& recv_counts);
  // all_to_all_v's first half: send_counts[j] goes to member j; returns what each member sent
  // this one (all-pairs, one message of 8 bytes each way per pair).
  std::vector<std::size_t> exchange_counts(Op& op, const std::vector<std::size_t>& send_counts);

  // tree.cpp
  void binomial_broadcast(Op& op, CommBuffer buf, int root_member);
  void dissemination_barrier(Op& op);

  // collectives.cpp: which algorithm each call takes.
  void run_all_reduce(Op& op, CommBuffer buf, ReduceOp rop);
  void run_reduce_scatter(Op& op, CommBuffer in, CommBuffer out, const std::vector<std::size_t>& counts, ReduceOp rop);
  void run_all_gather(Op& op, CommBuffer in, CommBuffer out, const std::vector<std::size_t>& counts);

  std::string name_;
  std::unique_ptr<Transport> transport_;
  P2POptions options_;
  int rank_ = 0;
  int world_size_ = 1;
  std::atomic<bool> aborted_{false};
  Health health_{aborted_};
  ShmCollectives shm_{health_};
  std::deque<Group> groups_;  // a deque: operations keep pointers to their group while new_group adds more
  std::mutex mutex_;          // groups_ and their sequence numbers: a group's operations enter the queue in sequence order
  CommQueue<std::shared_ptr<Op>> queue_{1024};  // to the comm thread, which never locks
  std::string first_failure_;  // the CommError that aborted the backend (comm thread only)
  int first_failure_peer_ = -1;
  std::thread thread_;
  // Sends and receives posted and not yet complete (comm thread only).
  struct Posted {
    std::shared_ptr<Op> op;
    std::uint64_t request = 0;
    int peer = -1;
    Health::Stall stall;
    double started_at = 0;
  };
  std::vector<Posted> posted_;
  struct Scratch {
    std::unique_ptr<char[]> data;
    std::size_t size = 0;
  };
  Scratch scratch_[2];
};

}  // namespace spmdx::comm
