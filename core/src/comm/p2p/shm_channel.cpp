#include "shm_channel.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <signal.h>

#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <stdexcept>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SPMDX_PAUSE() _mm_pause()
#else
#define SPMDX_PAUSE() std::atomic_signal_fence(std::memory_order_seq_cst)
#endif

namespace spmdx::comm {
namespace {

constexpr std::size_t kLine = 64;

std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

bool reached(std::uint32_t value, std::uint32_t target) { return static_cast<std::int32_t>(value - target) >= 0; }

long futex(std::atomic<std::uint32_t>* addr, int op, std::uint32_t value, const timespec* timeout) {
  // Not FUTEX_PRIVATE_FLAG: the word is shared between processes.
  return syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(addr), op, value, timeout, nullptr, 0);
}

}  // namespace

ShmChannel::ShmChannel(const std::string& name, bool create, int members, int me, std::size_t slot_bytes, long spin_us)
    : name_(name), owner_(create), me_(me), slot_bytes_(round_up(slot_bytes, kLine)), spin_us_(spin_us) {
  header_bytes_ = kLine;  // sleepers
  member_bytes_ = (2 + kBuffers) * kLine + kBuffers * slot_bytes_;
  static_assert(sizeof(Signature) <= kLine);
  size_ = header_bytes_ + static_cast<std::size_t>(members) * member_bytes_;
  const int fd = create ? shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600) : shm_open(name.c_str(), O_RDWR, 0600);
  auto fail = [&](const std::string& what, int err) {
    const std::string msg = "shared memory " + name + ": " + what + (err != 0 ? std::string(": ") + std::strerror(err) : "");
    if (fd >= 0) {
      close(fd);
      if (create) shm_unlink(name.c_str());  // made here: not someone else's of the same name
    }
    throw std::runtime_error(msg);
  };
  if (fd < 0) fail(create ? "cannot create" : "cannot open", errno);
  if (!create) {  // made by member 0 for the same group: the same size, or another job's object
    struct stat st {};
    if (fstat(fd, &st) != 0) fail("cannot stat", errno);
    if (static_cast<std::size_t>(st.st_size) != size_) {
      fail("is " + std::to_string(st.st_size) + " bytes where this member expects " + std::to_string(size_), 0);
    }
  }
  if (create) {
    if (ftruncate(fd, static_cast<off_t>(size_)) != 0) fail("cannot size to " + std::to_string(size_) + " bytes", errno);
    // Reserve the pages now: on a full tmpfs (a container's 64 MiB /dev/shm) touching them
    // later would be SIGBUS.
    if (const int err = posix_fallocate(fd, 0, static_cast<off_t>(size_)); err != 0) {
      fail("cannot reserve " + std::to_string(size_) + " bytes (is /dev/shm full or small?)", err);
    }
  }
  void* p = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) fail("cannot map " + std::to_string(size_) + " bytes", errno);
  close(fd);
  base_ = static_cast<char*>(p);
}

std::string ShmChannel::name_for(long pid, const std::string& tag) { return "/spmdx-" + std::to_string(pid) + "-" + tag; }

int ShmChannel::remove_left_by(long pid) noexcept {
  int removed = 0;
  std::error_code ec;
  for (std::filesystem::directory_iterator it("/dev/shm", ec), end; !ec && it != end; it.increment(ec)) {
    const std::string file = it->path().filename().string();
    if (file.rfind("spmdx-", 0) != 0) continue;
    char* after = nullptr;
    const long owner = std::strtol(file.c_str() + 6, &after, 10);
    if (after == nullptr || *after != '-' || owner <= 0) continue;
    bool stale = false;
    if (pid < 0) {
      // Its owner is gone, and it is an hour old: a process in another pid namespace that
      // shares /dev/shm looks gone from here, but keeps a segment only while its group sets up.
      std::error_code age_ec;
      const auto written = std::filesystem::last_write_time(it->path(), age_ec);
      stale = kill(static_cast<pid_t>(owner), 0) != 0 && errno == ESRCH && !age_ec &&
              std::filesystem::file_time_type::clock::now() - written > std::chrono::hours(1);
    }
    if ((pid < 0 ? stale : owner == pid) && shm_unlink(("/" + file).c_str()) == 0) ++removed;
  }
  return removed;
}

ShmChannel::~ShmChannel() {
  if (base_ != nullptr) munmap(base_, size_);
  unlink();
}

void ShmChannel::unlink() noexcept {
  if (owner_) shm_unlink(name_.c_str());
  owner_ = false;
}

// A member's part: its 2 counter lines, kBuffers signature lines, then kBuffers slots.
char* ShmChannel::member_base(int member) const noexcept { return base_ + header_bytes_ + static_cast<std::size_t>(member) * member_bytes_; }

char* ShmChannel::slot(int member, std::uint64_t round) const noexcept {
  return member_base(member) + (2 + kBuffers) * kLine + (round % kBuffers) * slot_bytes_;
}

void ShmChannel::sign(std::uint64_t round, const Signature& s) noexcept {
  std::memcpy(member_base(me_) + (2 + round % kBuffers) * kLine, &s, sizeof s);
}

ShmChannel::Signature ShmChannel::signature(int member, std::uint64_t round) const noexcept {
  Signature s;
  std::memcpy(&s, member_base(member) + (2 + round % kBuffers) * kLine, sizeof s);
  return s;
}

std::atomic<std::uint32_t>& ShmChannel::counter(Counter c, int member) const noexcept {
  return *reinterpret_cast<std::atomic<std::uint32_t>*>(member_base(member) + static_cast<std::size_t>(c) * kLine);
}

std::atomic<std::uint32_t>& ShmChannel::sleepers() const noexcept { return *reinterpret_cast<std::atomic<std::uint32_t>*>(base_); }

void ShmChannel::publish(Counter c, std::uint32_t value) noexcept {
  auto& word = counter(c, me_);
  word.store(value, std::memory_order_seq_cst);
  // A sleeper counts itself before it checks the word, and this store comes before this load
  // (both seq_cst): either it sees the new value or this sees it and wakes it.
  if (sleepers().load(std::memory_order_seq_cst) != 0) futex(&word, FUTEX_WAKE, INT_MAX, nullptr);
}

bool ShmChannel::wait(Counter c, int member, std::uint32_t target, long timeout_us) noexcept {
  auto& word = counter(c, member);
  const auto spin_end = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
  do {
    for (int i = 0; i < 64; ++i) {
      if (reached(word.load(std::memory_order_acquire), target)) return true;
      SPMDX_PAUSE();
    }
  } while (std::chrono::steady_clock::now() < spin_end);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(timeout_us);
  while (true) {
    const std::uint32_t seen = word.load(std::memory_order_acquire);
    if (reached(seen, target)) return true;
    const auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - std::chrono::steady_clock::now()).count();
    if (left <= 0) return false;
    const timespec ts{static_cast<time_t>(left / 1000000000), static_cast<long>(left % 1000000000)};
    sleepers().fetch_add(1, std::memory_order_seq_cst);
    if (!reached(word.load(std::memory_order_seq_cst), target)) futex(&word, FUTEX_WAIT, seen, &ts);
    sleepers().fetch_sub(1, std::memory_order_seq_cst);
  }
}

}  // namespace spmdx::comm
