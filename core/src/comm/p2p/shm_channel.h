// A shared-memory segment that the members of one group on one host map, for the engine's
// shared-memory collectives (as Open MPI's coll/sm and DeepSpeed's CPU shm all_reduce do: every
// member copies its data into the segment once, reads its peers' straight from it, and no
// message passes through a transport or the kernel).
//
// Layout: a header, then per member two 32-bit counters (each on its own cache line), a
// signature per slot, and kBuffers slots of slot_bytes. A member writes only its own slots and counters; peers read
// them after seeing the counter (release/acquire). Waits spin for spin_us, then sleep on a
// futex, which the writer wakes only when someone sleeps.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

namespace spmdx::comm {

class ShmChannel {
 public:
  static constexpr std::uint32_t kBuffers = 3;  // rounds in flight before a slot is reused
  enum Counter : int { ready = 0, reduced = 1 };

  /// Member 0 creates the POSIX shared-memory object `name` ("/spmdx-..."); the others open it.
  /// The creator reserves its pages (posix_fallocate), so a full /dev/shm fails here rather
  /// than with SIGBUS later; a member that opens an object of another size refuses it (another
  /// job's, or a member with other options). Waits spin `spin_us` microseconds before they sleep (spinning pays
  /// when every rank has a core, and costs the peer its core when ranks outnumber cores).
  /// Throws std::runtime_error naming the object and the reason.
  ShmChannel(const std::string& name, bool create, int members, int me, std::size_t slot_bytes, long spin_us);
  ~ShmChannel();  ///< unmaps; the creator also unlinks if unlink() was not called
  ShmChannel(const ShmChannel&) = delete;
  ShmChannel& operator=(const ShmChannel&) = delete;

  /// Removes the name once every member has mapped the segment (it lives while mapped), so a
  /// crash later leaves nothing in /dev/shm.
  void unlink() noexcept;

  /// The name a creator with process id `pid` gives a segment ("/spmdx-<pid>-<tag>").
  static std::string name_for(long pid, const std::string& tag);
  /// Unlinks the segments that process `pid` created and left (it died while a group was
  /// setting up, before every member had mapped them); -1: those over an hour old whose process
  /// no longer exists. Returns how many were removed.
  static int remove_left_by(long pid) noexcept;

  /// What a member runs in a round: peers compare it with theirs, so that members calling
  /// different collectives fail with an error instead of reading each other's data wrongly.
  struct Signature {
    std::uint64_t seq = 0;    // the group's collective number
    std::uint32_t what = 0;   // kind | dtype << 8 | reduce op << 16
    std::uint32_t round = 0;  // within the collective
    std::uint64_t count = 0;  // elements, all blocks
    std::uint64_t blocks = 0; // a hash of the block sizes
    bool operator==(const Signature&) const = default;
  };
  /// This member's signature for global round `round` (write before publishing `ready`).
  void sign(std::uint64_t round, const Signature& s) noexcept;
  /// `member`'s signature for `round` (read after its `ready` reached round + 1).
  Signature signature(int member, std::uint64_t round) const noexcept;

  std::size_t slot_bytes() const noexcept { return slot_bytes_; }
  /// The slot of `member` for global round `round` (round % kBuffers).
  char* slot(int member, std::uint64_t round) const noexcept;
  /// Sets this member's counter to `value` (release) and wakes sleepers.
  void publish(Counter c, std::uint32_t value) noexcept;
  /// True once `member`'s counter has reached `target` (wrap-around safe), waiting up to
  /// `timeout_us` microseconds: spin, then sleep on the futex.
  bool wait(Counter c, int member, std::uint32_t target, long timeout_us) noexcept;

 private:
  struct alignas(64) Line {
    std::atomic<std::uint32_t> value{0};
  };
  char* member_base(int member) const noexcept;
  std::atomic<std::uint32_t>& counter(Counter c, int member) const noexcept;
  std::atomic<std::uint32_t>& sleepers() const noexcept;

  std::string name_;
  bool owner_ = false;
  int me_ = 0;
  std::size_t slot_bytes_ = 0;
  long spin_us_ = 0;
  std::size_t member_bytes_ = 0;  // counters + slots of one member
  std::size_t header_bytes_ = 0;
  std::size_t size_ = 0;
  char* base_ = nullptr;
};

}  // namespace spmdx::comm
