// What the collective engine's files share: a group, one queued operation, the tag layout and
// block arithmetic. Private to core/src/comm/p2p/.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "spmdx/comm.h"

namespace spmdx::comm {

class ShmChannel;

/// A group made by new_group (group 0: every rank).
struct Group {
  std::vector<int> ranks;  // global ranks, ascending
  int me = 0;              // this rank's index in `ranks`
  std::uint64_t seq = 0;   // collectives issued on this group
  // Shared memory, when every member is on this host: set up at the group's first collective
  // that can use it (0: not yet tried, 1: up, -1: not available). See shm.h.
  int shm_state = 0;
  std::shared_ptr<ShmChannel> shm;
  std::uint64_t shm_round = 0;  // rounds run through `shm`, the same count on every member
};

/// One collective or point-to-point operation, from submission to completion.
struct Op {
  const char* name = "";
  int group = 0;
  Group* g = nullptr;  // null for send/recv; stays valid as groups are added (a deque)
  std::uint64_t seq = 0;
  std::uint16_t step = 0;  // the next tag step of this operation's messages
  std::function<void(Op&)> body;
  /// send/recv: posts the transport request instead of running `body` to completion; the comm
  /// thread then completes the operation when the request does (P2PEngine::progress_posted), so
  /// a send whose receiver is not ready yet holds up neither the collectives queued behind it
  /// nor the other sends and receives (a pipeline's 1F1B exchanges both ways at once).
  std::function<std::pair<std::uint64_t, int>(Op&)> post;
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;
  std::string error;
  int error_peer = -1;
  double started_at = 0, finished_at = 0;  // seconds since the epoch, on the comm thread
};

/// "all_reduce (group 1, #12)": an operation, for errors.
inline std::string op_name(const Op& op) {
  return std::string(op.name) + " (group " + std::to_string(op.group) + ", #" + std::to_string(op.seq) + ")";
}

/// A request posted to the transport and the peer it talks to (whom to name when it fails).
using Request = std::pair<std::uint64_t, int>;

/// tag: sender (16 bits) | group (8) | sequence (24) | step (16)
inline std::uint64_t make_tag(int sender, int group, std::uint64_t seq, std::uint16_t step) {
  return (static_cast<std::uint64_t>(sender & 0xffff) << 48) | (static_cast<std::uint64_t>(group & 0xff) << 40) |
         ((seq & 0xffffff) << 16) | step;
}
/// Tag steps one operation may use (the tag's step field is 16 bits; half is spare).
inline constexpr std::size_t kStepBudget = 32768;

/// memcpy that accepts empty buffers (whose data() may be null) without undefined behaviour.
inline void copy_bytes(void* dst, const void* src, std::size_t n) {
  if (n > 0) std::memcpy(dst, src, n);
}
/// Elements before block i.
inline std::size_t offset_of(const std::vector<std::size_t>& counts, std::size_t i) {
  std::size_t offset = 0;
  for (std::size_t j = 0; j < i; ++j) offset += counts[j];
  return offset;
}
/// Near-even split of n elements in k blocks (the first n % k get one more).
inline std::vector<std::size_t> even_blocks(std::size_t n, std::size_t k) {
  std::vector<std::size_t> counts(k, n / k);
  for (std::size_t i = 0; i < n % k; ++i) ++counts[i];
  return counts;
}
inline char* at(void* base, std::size_t elements, CommDType t) { return static_cast<char*>(base) + elements * comm_dtype_size(t); }

/// How a pipelined reduction cuts blocks into chunks, and the tag steps it reserved: every
/// member reserves as many as the group's largest block has chunks (so that senders and
/// receivers of blocks of different sizes agree); a chunk is at most that block.
struct Chunks {
  std::size_t chunk = 1;   // elements
  std::uint16_t base = 0;  // tag step of chunk 0
  std::size_t pieces(std::size_t count) const { return count == 0 ? 1 : (count + chunk - 1) / chunk; }
  std::size_t piece(std::size_t count, std::size_t c) const { return std::min(chunk, count - std::min(count, c * chunk)); }
};

}  // namespace spmdx::comm
