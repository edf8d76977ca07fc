// The engine's shared-memory component (UCC's tl/shm, Open MPI's coll/sm): all_reduce,
// reduce_scatter and all_gather of a group whose members share a host, through one segment per
// group (shm_channel.h): each member copies its data in once, reduces its own block straight
// from every peer's copy, and copies the result out, in rounds that stay in the last-level
// cache. Private to core/src/comm/p2p/; runs on the engine's communication thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "health.h"
#include "op.h"
#include "shm_channel.h"
#include "spmdx/comm/p2p.h"

namespace spmdx::comm {

class ShmCollectives {
 public:
  enum class Kind { all_reduce, reduce_scatter, all_gather };

  explicit ShmCollectives(Health& health) : health_(health) {}

  /// Every rank says in the store where it runs and how it would share memory; members of a
  /// group share memory only if they all say the same (one host, shm on, the same
  /// shm_chunk_bytes). Without a store nothing is shared.
  void start(const CommInit& init, const P2POptions& options);
  /// The group's channel, set up at its first use (collectively: every member calls it at the
  /// same collective), or null when shm is off, some member is on another host or cannot map it.
  ShmChannel* channel(Op& op);
  /// The collective through `ch`, in rounds of up to shm_chunk_bytes per block. Throws
  /// CommError naming the rank that called another collective (or every member's call, with
  /// no majority to blame).
  void run(Op& op, ShmChannel& ch, Kind kind, const char* in, char* out, const std::vector<std::size_t>& counts, CommDType dtype,
           ReduceOp rop);

 private:
  void wait(Op& op, ShmChannel& ch, int counter, std::uint32_t target);
  // Bytes of each block per round on a group of `members`: shm_chunk_bytes, less where the
  // segment would pass kMaxSegment.
  std::size_t round_bytes(std::size_t members) const;
  // A store read that member `rank` has yet to write; waits as a collective does.
  std::string get(Op& op, const std::string& key, int rank);
  // Member `member` signed another collective than `mine` for `round`: blames the members
  // outside a strict majority that called the same, and throws.
  [[noreturn]] void mismatch(Op& op, ShmChannel& ch, std::uint64_t round, std::size_t member, const ShmChannel::Signature& mine);

  static constexpr std::size_t kMaxSegment = std::size_t{256} << 20;  // bytes of one group's segment
  Health& health_;
  Store* store_ = nullptr;
  int rank_ = 0;
  std::string generation_;
  bool on_ = true;
  std::size_t chunk_bytes_ = std::size_t{256} << 10;
  std::string host_id_;  // "<settings> on <hostname boot-id>": ranks with the same one share memory
};

}  // namespace spmdx::comm
