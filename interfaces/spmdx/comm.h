// Communication backend plugins (ucx, nccl, local): how the ranks of a job talk.
//
// Every collective is asynchronous and returns a Work handle, as torch.distributed's
// ProcessGroup does; buffers are described by pointer, element count, dtype and memory kind.
// Groups are made once per mesh-dim slice with new_group(). Plain C++20: part of the plugin ABI.
// A plugin implements either a whole CommBackend (nccl) or only a point-to-point Transport
// (transport.h: ucx, local), under which the host runs its own collective engine.
//
// The contract every CommBackend keeps (as MPI's and NCCL's):
// - Buffers: the memory a call names must stay valid, and unchanged for inputs, until its Work
//   completes (wait() returned true, or test() true); the backend may read and write it at
//   any time until then. The CommBuffer structs themselves are copied at the call.
// - Cross-rank order: every member of a group issues the same collectives on that group in the
//   same order with matching dtypes, ops and counts (a mismatch is a CommError naming the
//   ranks, or a hang ended by the timeout); collectives of different groups may interleave
//   differently on different ranks. new_group is collective over all ranks (see there).
// - Completion order: a caller waits on each Work whose result it reads; it never infers one
//   Work's completion from another's (a scored backend, comm/select.h, runs the calls of one
//   group on several backends, which complete independently).
// - Threads: init, finalize, new_group and the calls that issue work come from one thread at a
//   time (the executor's); Work::wait and Work::test may be called from any thread; abort()
//   from any thread at any time, including while another thread waits.
// - Lifetime: init once, then calls, then finalize once (the destructor finalizes if needed);
//   Work handles may outlive neither finalize nor the backend.
// - Errors: a peer that dies or stays silent past CommInit::timeout_seconds fails the Work
//   with CommError naming it; std::invalid_argument for a call that is wrong on this rank
//   alone (counts that do not match the buffers, an unknown group), thrown from the call or
//   from Work::wait.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "spmdx/placement.h"

namespace spmdx {

/// Element types a backend moves: f32, f64, f16, bf16, i32, i64, u8.
enum class CommDType : std::uint8_t { f32, f64, f16, bf16, i32, i64, u8 };
inline std::size_t comm_dtype_size(CommDType t) noexcept {
  switch (t) {
    case CommDType::f64:
    case CommDType::i64: return 8;
    case CommDType::f32:
    case CommDType::i32: return 4;
    case CommDType::f16:
    case CommDType::bf16: return 2;
    case CommDType::u8: return 1;
  }
  return 0;
}

/// "f32", "f64", "f16", "bf16", "i32", "i64", "u8".
inline const char* to_string(CommDType t) noexcept {
  switch (t) {
    case CommDType::f32: return "f32";
    case CommDType::f64: return "f64";
    case CommDType::f16: return "f16";
    case CommDType::bf16: return "bf16";
    case CommDType::i32: return "i32";
    case CommDType::i64: return "i64";
    case CommDType::u8: return "u8";
  }
  return "unknown";
}

enum class MemoryType : std::uint8_t { host, cuda };

/// `count` elements of `dtype` at `data`, contiguous.
struct CommBuffer {
  void* data = nullptr;
  std::size_t count = 0;
  CommDType dtype = CommDType::f32;
  MemoryType memory = MemoryType::host;
  std::size_t bytes() const noexcept { return count * comm_dtype_size(dtype); }
};

/// A failure of communication: a peer that died or did not answer in time. what() names the
/// collective and the peer rank.
class CommError : public std::runtime_error {
 public:
  CommError(const std::string& what, int peer) : std::runtime_error(what), peer_(peer) {}
  int peer() const noexcept { return peer_; }  ///< -1 when no single peer is to blame

 private:
  int peer_;
};

/// The job's rendezvous key-value store, as torch.distributed.Store. Thread-safe.
class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  /// The value, waiting for the key to be set; throws CommError after timeout_seconds naming
  /// the key.
  virtual std::string get(const std::string& key, double timeout_seconds) = 0;
  /// Adds delta to the integer at key (0 when absent) and returns the new value.
  virtual std::int64_t add(const std::string& key, std::int64_t delta) = 0;
};

struct CommInit {
  int rank = 0;        ///< this process, 0 <= rank < world_size
  int world_size = 1;  ///< ranks in the job
  /// Bootstrap generation: 0 at start, +1 at each hot-swap, so keys of one generation never
  /// meet those of another in the store.
  std::int64_t generation = 0;
  Store* store = nullptr;        ///< for address exchange; outlives the backend
  double timeout_seconds = 300;  ///< a collective not done by then fails with CommError
};

/// A pending operation. wait() may be called from any thread, once.
class Work {
 public:
  virtual ~Work() = default;
  /// Blocks until the operation completes (true) or timeout_seconds pass (false); throws
  /// CommError when it failed (a peer died, or the backend was aborted).
  virtual bool wait(double timeout_seconds) = 0;
  /// True once complete (or failed).
  virtual bool test() = 0;
  /// When the backend began and finished moving the data, in seconds since the Unix epoch
  /// (system_clock); false while not complete or when the backend does not record it.
  virtual bool times(double& started_at, double& finished_at) const {
    (void)started_at, (void)finished_at;
    return false;
  }
};

/// What a backend does well, for choosing between backends per call (as UCC's score maps):
/// the highest score for the op, memory type and size wins unless the config pins a backend
/// (spmdx/comm/select.h in the core). Sizes are the bytes of the call's buffer (all_gather:
/// its output; all_to_all and all_to_all_v: 0, since they differ across ranks). Scores in use: ucx 10 and local 1 on host memory; nccl 100 on CUDA memory, 1
/// on host memory (staged through the GPU).
struct CommCapability {
  std::string op;  ///< "all_reduce", ..., or "*"
  MemoryType memory = MemoryType::host;
  std::size_t min_bytes = 0;
  std::size_t max_bytes = static_cast<std::size_t>(-1);
  int score = 0;
};

class CommBackend {
 public:
  virtual ~CommBackend() = default;

  /// Joins the job (address exchange through the store); collective over every rank. Throws
  /// CommError naming the rank that could not be reached.
  virtual void init(const CommInit& init) = 0;
  /// Completes outstanding work and leaves the job; the object may then be destroyed. Not
  /// collective: a rank that finalizes early only stops answering.
  virtual void finalize() = 0;
  /// Fails all outstanding and future work at once (a peer died); never blocks; any thread.
  virtual void abort() noexcept = 0;
  /// A short description for logs: backend, transport, rank/world_size. Any time.
  virtual std::string describe() const = 0;
  /// What this backend serves and how well (CommCapability). Any time, also before init: the
  /// host reads it to choose backends (comm.backend = "auto") and for `spmdx plugins --json`.
  /// The same on every rank.
  virtual std::vector<CommCapability> capabilities() const = 0;

  /// A group of global ranks (ascending, containing this rank); every member calls it in the
  /// same order. Returns the group's id for the calls below.
  virtual int new_group(const std::vector<int>& ranks) = 0;

  /// In place: buf becomes the reduction over the group of every member's buf.
  virtual std::unique_ptr<Work> all_reduce(int group, CommBuffer buf, ReduceOp op) = 0;
  /// out = the concatenation, in group order, of every member's `in`; counts[i] is member i's
  /// element count (uneven allowed, as MPI_Allgatherv).
  virtual std::unique_ptr<Work> all_gather(int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> counts) = 0;
  /// `in` holds counts[0] + counts[1] + ... elements; out = this member's slice of the
  /// reduction over the group (counts[me] elements).
  virtual std::unique_ptr<Work> reduce_scatter(int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> counts,
                                               ReduceOp op) = 0;
  /// Member i's block j (send_counts[j] elements, blocks in order) goes to member j's block i
  /// (recv_counts[i] elements): every member knows both counts beforehand (as
  /// MPI_Alltoallv). For splits only the senders know, VariableAllToAll::all_to_all_v below.
  virtual std::unique_ptr<Work> all_to_all(int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> send_counts,
                                           std::vector<std::size_t> recv_counts) = 0;
  /// buf becomes member root_member's buf on every member (root_member indexes the group).
  virtual std::unique_ptr<Work> broadcast(int group, CommBuffer buf, int root_member) = 0;
  /// Point to point, outside any group: buf goes to global rank peer_rank, which receives it
  /// with recv(buf of the same bytes, this rank, the same tag). Tags are 0 to 2^24 - 1; sends
  /// of one pair under one tag are received in the order sent.
  virtual std::unique_ptr<Work> send(CommBuffer buf, int peer_rank, int tag) = 0;
  virtual std::unique_ptr<Work> recv(CommBuffer buf, int peer_rank, int tag) = 0;
  /// Completes once every member of the group has issued its barrier.
  virtual std::unique_ptr<Work> barrier(int group) = 0;
};

/// Optional, for a backend whose calls run on a device stream (nccl): it orders them after the
/// host's compute stream and makes that stream wait for them, so neither side blocks the host
/// thread (ProcessGroupNCCL's pattern: the comm stream waits on an event recorded on the
/// current stream; a collective's reader waits with cudaStreamWaitEvent). The host finds it
/// with dynamic_cast on the CommBackend (ABI 3.1). Without it, the host synchronises its
/// compute stream before each call with device buffers and waits for each Work on the host.
/// Called from the thread that issues calls; `stream` is a cudaStream_t of this rank's GPU.
class StreamOrdered {
 public:
  virtual ~StreamOrdered() = default;
  /// The calls issued from now on start only after the work queued on `stream` so far.
  virtual void issue_after(void* stream) = 0;
  /// The work queued on `stream` from now on starts only after `work` completes; the host does
  /// not wait. Returns false when `work` did not come from this backend (the host then waits
  /// for it itself). The host still waits for every Work later, off the critical path, which
  /// is where a timeout or a failed peer is reported.
  virtual bool stream_wait(Work& work, void* stream) = 0;
};

/// Optional (ABI 4.1), found as StreamOrdered is, with dynamic_cast on the CommBackend: the
/// all-to-all whose split sizes are known only at run time, and only to the senders (expert
/// parallelism's dispatch and combine, where a router decides how many tokens go to each rank;
/// torch.distributed.all_to_all_single with input_split_sizes, torchtitan's token dispatch).
/// The backends spmdx ships have it (the host's engine under ucx and local; nccl); a plugin
/// built for ABI 4.0 does not, and the host's comm::all_to_all_v (spmdx/comm/all_to_all_v.h)
/// on it throws std::invalid_argument naming the backend and saying to rebuild its plugin.
/// CommBackend::all_to_all is the call for splits every member knows beforehand.
class VariableAllToAll {
 public:
  virtual ~VariableAllToAll() = default;
  /// Counts are elements of in.dtype (a block's bytes: count x comm_dtype_size(dtype)).
  /// `in` holds one block per group member, in member order: send_counts[j] elements for
  /// member j (send_counts has one entry per member, zeros allowed, and sums to in.count).
  /// `out` has in's dtype; out.count is its capacity in elements, the most this member may
  /// receive (a dropless dispatch: tokens x top_k x group size). The block member i sent this
  /// member arrives packed in member order from out.data (after the blocks of members
  /// 0..i-1); the elements past the received ones are left as they were.
  /// `recv_counts` points at one std::size_t per member, in host memory, valid until the Work
  /// completes; before it completes the backend writes there the elements received from each
  /// member (recv_counts[i] = member i's send_counts[me]). The counts travel with the call:
  /// one exchange of group-size integers, then the data.
  /// Errors: send_counts of the wrong length or sum, or a null recv_counts, fail the call or
  /// its Work (std::invalid_argument, or CommError from Work::wait); more elements arriving
  /// than out.count fails this member's Work naming the counts and the capacity, after the
  /// data was drained, so the other members' Works complete and the group stays usable.
  /// nccl blocks the calling thread until the counts arrived (NCCL's receives take host
  /// counts), as torchtitan's dispatch waits for its split sizes; the engine does not.
  virtual std::unique_ptr<Work> all_to_all_v(int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> send_counts,
                                             std::size_t* recv_counts) = 0;
};

}  // namespace spmdx
