// Collectives built on point-to-point messages, for backends whose transport moves bytes
// between two ranks (UCX's tag matching; in-process mailboxes). The algorithms, each as the
// literature gives it:
//   all_reduce      ring: reduce-scatter then all-gather (Patarasuk & Yuan 2009), its steps
//                   pipelined in chunks; recursive doubling for small messages on power-of-two
//                   groups (Thakur et al. 2005); direct (all-pairs) reduce-scatter then
//                   all-gather for mid sizes on small groups (as MPICH's and Open MPI's shared-
//                   memory collectives read every peer's block at once)
//   all_gather      ring or direct, uneven blocks (MPI_Allgatherv)
//   reduce_scatter  ring (pipelined) or direct, uneven blocks
//   all_to_all      pairwise exchange
//   broadcast       binomial tree
// Groups whose members share a host run all_reduce, reduce_scatter and all_gather through a
// shared-memory segment instead (shm_channel.h): each member copies its data in once, reduces
// its own block straight from every peer's copy, and copies the result out (as Open MPI's
// coll/sm and DeepSpeed's CPU shm all_reduce), in rounds that stay in the last-level cache.
// Operations run in submission order on one communication thread per backend (so compute
// overlaps them); Work handles report completion, and a peer that fails or stays silent past
// the timeout fails the operation with a CommError naming the collective and the peer rank.
// After such a failure the backend is aborted: every later operation fails at once, naming the
// first failure.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "spmdx/comm.h"
#include "spmdx/comm/comm_queue.h"

namespace spmdx::comm {

class ShmChannel;

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

/// The store key where ranks name the first rank that failed a collective (the first report
/// wins; "<key>_reported" counts the reports), read by the launcher to say whom to blame.
inline constexpr const char* kFaultKey = "spmdx/fault";
/// The store key where ranks that found members calling different collectives, with no
/// majority to tell which one is wrong, leave the first such message for the launcher.
inline constexpr const char* kMismatchKey = "spmdx/mismatch";

/// Unlinks the shared-memory segments (/dev/shm/spmdx-<pid>-...) that rank process `pid` made
/// for a group and left behind because it died before every member had mapped them; the
/// launcher calls it for every rank it reaped. Returns how many it removed.
int remove_shared_memory_of(long pid);

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
    // Shared memory, when every member is on this host: set up at the group's first
    // collective that can use it (0: not yet tried, 1: up, -1: not available).
    int shm_state = 0;
    std::shared_ptr<ShmChannel> shm;
    std::uint64_t shm_round = 0;  // rounds run through `shm`, the same count on every member
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
  // How a pipelined reduction cuts blocks into chunks, and the tag steps it reserved: every
  // member reserves as many as the group's largest block has chunks (so that senders and
  // receivers of blocks of different sizes agree), at most `max_chunks`; a chunk is at most
  // that block (the scratch is sized from it).
  struct Chunks {
    std::size_t chunk = 1;    // elements
    std::uint16_t base = 0;   // tag step of chunk 0
    std::size_t pieces(std::size_t count) const { return count == 0 ? 1 : (count + chunk - 1) / chunk; }
    std::size_t piece(std::size_t count, std::size_t c) const { return std::min(chunk, count - std::min(count, c * chunk)); }
  };
  Chunks reserve_chunks(Op& op, std::size_t max_count, std::size_t element_size, std::size_t max_chunks);
  // Posts the sends of `count` elements at `block` to `to`, one per chunk, tagged from ck.base.
  void send_chunks(Op& op, const Chunks& ck, int to, const char* block, std::size_t count, std::size_t element_size,
                   std::vector<std::pair<std::uint64_t, int>>& sends);
  // "all_reduce (group 1, #12)": an operation, for errors.
  static std::string op_name(const Op& op);
  // One reduce-scatter ring step: sends `scount` elements of sbuf to `to` while receiving
  // `rcount` from `from` and reducing them into dst, pipelined in chunks of chunk_bytes_.
  // `max_count` is the group's largest block (every member reserves the same tag steps).
  void reduce_step(Op& op, int to, const void* sbuf, std::size_t scount, int from, void* dst, std::size_t rcount,
                   std::size_t max_count, CommDType dtype, ReduceOp rop);
  // Direct (all-pairs) reduce-scatter of `in`'s blocks (`counts`) into dst, which holds this
  // member's own block; and direct all_gather of `out`'s blocks, this member's in place.
  void direct_reduce_scatter(Op& op, const char* in, const std::vector<std::size_t>& counts, char* dst, CommDType dtype, ReduceOp rop);
  void direct_all_gather(Op& op, char* out, const std::vector<std::size_t>& counts, CommDType dtype);
  // A failure every rank should blame on `peer` (the first one seen wins), kept in the store.
  void report_fault(int peer);
  // Members called different collectives and none can be blamed alone: says so (kMismatchKey).
  void report_mismatch(const std::string& what);
  int reported_fault();
  // The ranks whose heartbeat stopped (checked over ~2 s), or empty.
  std::vector<int> dead_ranks();
  void wait_all(Op& op, const std::vector<std::pair<std::uint64_t, int>>& requests);
  // A wait that is not progressing: throws CommError when the backend was aborted, when after
  // 5 s stuck a peer is blamed by another rank or its heartbeat stopped, or at the timeout
  // (naming `silent`, the peer waited for).
  struct Stall;
  void check_stall(Op& op, Stall& stall, int silent);
  // The group's shared-memory channel, set up on first use (collectively: every member calls
  // it at the same collective), or null when some member is on another host or cannot map it.
  ShmChannel* shm_channel(Op& op);
  // Reduce-scatter, all-gather or both (all_reduce) through the group's shared memory, in
  // rounds of up to shm_chunk_bytes per block (see shm_channel.h).
  enum class ShmKind { all_reduce, reduce_scatter, all_gather };
  void shm_collective(Op& op, ShmChannel& ch, ShmKind kind, const char* in, char* out, const std::vector<std::size_t>& counts,
                      CommDType dtype, ReduceOp rop);
  void shm_wait(Op& op, ShmChannel& ch, int counter, std::uint32_t target);
  // Scratch memory of the comm thread, reused across operations: slot 0 or 1, at least `bytes`.
  char* scratch(std::size_t slot, std::size_t bytes);
  struct Scratch {
    std::unique_ptr<char[]> data;
    std::size_t size = 0;
  };
  Scratch scratch_[2];
  bool use_direct(std::size_t members, std::size_t bytes) const;
  static constexpr std::size_t kDirectMaxMembers = 8;
  std::size_t direct_max_bytes_ = 4 * 1024 * 1024;
  static constexpr std::size_t kStepBudget = 32768;  // tag steps of one operation's ring steps (the tag's step field is 16 bits)
  std::size_t chunk_bytes_ = 1024 * 1024;
  bool shm_ = true;
  std::size_t shm_chunk_bytes_ = 256 * 1024;
  static constexpr std::size_t kShmMaxSegment = std::size_t{256} << 20;  // bytes of one group's segment
  // Bytes of each block per round on a group of `members`: shm_chunk_bytes, less where the
  // segment would pass kShmMaxSegment.
  std::size_t shm_round_bytes(std::size_t members) const;
  std::string host_id_;  // hostname and boot id: ranks with the same one can share memory
  std::int64_t generation_ = 0;

 protected:
  /// Takes an option every P2P backend understands, returning false for any other key:
  /// Values are sizes as spmdx::parse_bytes reads them (262144, 256K, 4MiB, 1MB).
  /// - chunk_bytes: the pipeline chunk of ring all_reduce / reduce_scatter steps in bytes (at
  ///   least 64; default 1 MiB: 4 chunks in flight stay in the last-level cache; 256 KiB to
  ///   4 MiB measured alike on 2 and 4 ranks here);
  /// - direct_max_bytes: all_reduce, reduce_scatter and all_gather of at most this many bytes
  ///   on groups of at most 8 members go direct, every member to every other at once, instead
  ///   of around the ring (default 4 MiB; 0: always the ring). On 3 and 4 ranks here direct
  ///   had 1.3-2x the ring's busbw from 128 KiB to 4 MiB and the same above.
  /// - shm: on (default) or off. On: all_reduce, reduce_scatter and all_gather of a group whose
  ///   members share a host (same host name and boot id, with a store) go through shared
  ///   memory; a group that cannot map it (full /dev/shm) warns and uses the transport.
  ///   Measured here (64 MiB all_reduce busbw): 2 ranks 7.5 vs 3.2-3.6 GB/s, 4 ranks 3.2 vs
  ///   1.8-1.9 GB/s through UCX.
  /// - shm_chunk_bytes: bytes of each member's block per shared-memory round (64 to 64M,
  ///   default 256 KiB). A group's segment, which every member maps, is 3 x members^2 x this
  ///   (12 MiB for 4 members at the default), at most 256 MiB: larger groups get smaller rounds.
  ///   Every rank must use the same shm and shm_chunk_bytes; a group whose members differ warns
  ///   and uses the transport.
  /// Call before init. Throws std::invalid_argument naming the plugin, the option and the
  /// value when the value is bad.
  bool take_option(const std::string& plugin, const std::string& key, const std::string& value);
  /// "chunk_bytes=1048576, direct_max_bytes=4194304, shm=on, shm_chunk_bytes=262144": the
  /// values in use, for describe().
  std::string option_str() const;

 private:

  Transport* transport_ = nullptr;
  int rank_ = 0;
  int world_size_ = 1;
  double timeout_ = 300;
  std::deque<Group> groups_;  // a deque: operations keep pointers to their group while new_group adds more
  std::mutex mutex_;  // groups_ and their sequence numbers: a group's operations enter the queue in sequence order
  CommQueue<std::shared_ptr<Op>> queue_{1024};  // to the comm thread, which never locks
  bool stopping_ = false;
  std::atomic<bool> aborted_{false};
  std::string first_failure_;    // the CommError that aborted the backend (comm thread only)
  int first_failure_peer_ = -1;
  std::thread thread_;
  Store* store_ = nullptr;
  std::string heartbeat_prefix_;
  std::thread heartbeat_;
  std::mutex heartbeat_mutex_;
  std::condition_variable heartbeat_cv_;
};

}  // namespace spmdx::comm
