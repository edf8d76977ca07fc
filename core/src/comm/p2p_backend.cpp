#include "spmdx/comm/p2p_backend.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <type_traits>

#include "spmdx/core/clock.h"
#include "spmdx/core/log.h"
#include "spmdx/core/text.h"
#include "shm_channel.h"

namespace spmdx::comm {
namespace {

using Clock = std::chrono::steady_clock;

// memcpy that accepts empty buffers (whose data() may be null) without undefined behaviour.
void copy_bytes(void* dst, const void* src, std::size_t n) {
  if (n > 0) std::memcpy(dst, src, n);
}

// IEEE half and bfloat16 <-> float.
float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000) << 16;
  std::uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal
      exp = 127 - 15 + 1;
      while (!(mant & 0x400)) mant <<= 1, --exp;
      bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000 | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  copy_bytes(&f, &bits, 4);
  return f;
}

std::uint16_t float_to_half(float f) {
  std::uint32_t x;
  copy_bytes(&x, &f, 4);
  const std::uint32_t sign = (x >> 16) & 0x8000;
  const int exp = static_cast<int>((x >> 23) & 0xff) - 127 + 15;
  std::uint32_t mant = x & 0x7fffff;
  if (((x >> 23) & 0xff) == 0xff) return static_cast<std::uint16_t>(sign | 0x7c00 | (mant ? 0x200 : 0));
  if (exp >= 31) return static_cast<std::uint16_t>(sign | 0x7c00);
  if (exp <= 0) {
    if (exp < -10) return static_cast<std::uint16_t>(sign);
    mant |= 0x800000;
    const int shift = 14 - exp;
    std::uint32_t h = mant >> shift;
    if ((mant >> (shift - 1)) & 1) ++h;  // round half up
    return static_cast<std::uint16_t>(sign | h);
  }
  std::uint32_t h = sign | (static_cast<std::uint32_t>(exp) << 10) | (mant >> 13);
  if ((mant & 0x1fff) > 0x1000 || ((mant & 0x1fff) == 0x1000 && (h & 1))) ++h;  // round to nearest even
  return static_cast<std::uint16_t>(h);
}

float bf16_to_float(std::uint16_t b) {
  const std::uint32_t bits = static_cast<std::uint32_t>(b) << 16;
  float f;
  copy_bytes(&f, &bits, 4);
  return f;
}

std::uint16_t float_to_bf16(float f) {
  std::uint32_t x;
  copy_bytes(&x, &f, 4);
  if ((x & 0x7fffffff) > 0x7f800000) return static_cast<std::uint16_t>((x >> 16) | 0x40);  // NaN stays NaN
  x += 0x7fff + ((x >> 16) & 1);  // round to nearest even
  return static_cast<std::uint16_t>(x >> 16);
}

template <class T>
T apply(T a, T b, ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg: return static_cast<T>(a + b);
    case ReduceOp::max: return std::max(a, b);
    case ReduceOp::min: return std::min(a, b);
    case ReduceOp::prod: return static_cast<T>(a * b);
  }
  return a;
}

// The hot loop of float all_reduce and reduce_scatter, compiled for AVX-512, AVX2 and the
// baseline, picked at load time (GCC's function multiversioning).
__attribute__((target_clones("avx512f", "avx2", "default"))) void sum_f32(float* __restrict d, const float* __restrict s, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) d[i] += s[i];
}

template <class T>
void reduce_typed(void* dst, const void* src, std::size_t n, ReduceOp op) {
  if constexpr (std::is_same_v<T, float>) {
    if (op == ReduceOp::sum || op == ReduceOp::avg) return sum_f32(static_cast<float*>(dst), static_cast<const float*>(src), n);
  }
  T* __restrict d = static_cast<T*>(dst);
  const T* __restrict s = static_cast<const T*>(src);
  // One loop per op, so that the compiler vectorises each.
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg:
      for (std::size_t i = 0; i < n; ++i) d[i] = static_cast<T>(d[i] + s[i]);
      break;
    case ReduceOp::max:
      for (std::size_t i = 0; i < n; ++i) d[i] = d[i] < s[i] ? s[i] : d[i];
      break;
    case ReduceOp::min:
      for (std::size_t i = 0; i < n; ++i) d[i] = s[i] < d[i] ? s[i] : d[i];
      break;
    case ReduceOp::prod:
      for (std::size_t i = 0; i < n; ++i) d[i] = static_cast<T>(d[i] * s[i]);
      break;
  }
}

template <float (*To)(std::uint16_t), std::uint16_t (*From)(float)>
void reduce_16(void* dst, const void* src, std::size_t n, ReduceOp op) {
  auto* d = static_cast<std::uint16_t*>(dst);
  const auto* s = static_cast<const std::uint16_t*>(src);
  for (std::size_t i = 0; i < n; ++i) d[i] = From(apply(To(d[i]), To(s[i]), op));
}

std::size_t offset_of(const std::vector<std::size_t>& counts, std::size_t i) {
  std::size_t o = 0;
  for (std::size_t j = 0; j < i; ++j) o += counts[j];
  return o;
}

// Near-even split of n elements in k blocks (the first n % k get one more).
std::vector<std::size_t> even_blocks(std::size_t n, std::size_t k) {
  std::vector<std::size_t> out(k, n / k);
  for (std::size_t i = 0; i < n % k; ++i) ++out[i];
  return out;
}

char* at(void* base, std::size_t elements, CommDType t) { return static_cast<char*>(base) + elements * comm_dtype_size(t); }

// "hostname boot-id": ranks that print the same run on one machine (one kernel), so they can
// map the same shared memory. Empty when the host name cannot be read.
std::string host_id() {
  char name[256] = {};
  if (gethostname(name, sizeof name - 1) != 0) return "";
  std::string id = name;
  if (FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    char boot[64] = {};
    if (std::fgets(boot, sizeof boot, f) != nullptr) id += " " + std::string(boot, std::strcspn(boot, "\n"));
    std::fclose(f);
  }
  return id;
}

// The processes of this job on this host: LOCAL_WORLD_SIZE (torchrun's, and spmdx run's), or
// at least the group's members.
std::size_t local_ranks(std::size_t members) {
  const char* v = std::getenv("LOCAL_WORLD_SIZE");
  const long n = v ? std::atol(v) : 0;
  return std::max(members, n > 0 ? static_cast<std::size_t>(n) : 0);
}

std::size_t usable_cpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) != 0) return 1;
  return static_cast<std::size_t>(CPU_COUNT(&set));
}

}  // namespace

void reduce_into(void* dst, const void* src, std::size_t count, CommDType dtype, ReduceOp op) {
  switch (dtype) {
    case CommDType::f32: reduce_typed<float>(dst, src, count, op); break;
    case CommDType::f64: reduce_typed<double>(dst, src, count, op); break;
    case CommDType::i32: reduce_typed<std::int32_t>(dst, src, count, op); break;
    case CommDType::i64: reduce_typed<std::int64_t>(dst, src, count, op); break;
    case CommDType::u8: reduce_typed<std::uint8_t>(dst, src, count, op); break;
    case CommDType::f16: reduce_16<half_to_float, float_to_half>(dst, src, count, op); break;
    case CommDType::bf16: reduce_16<bf16_to_float, float_to_bf16>(dst, src, count, op); break;
  }
}

void divide(void* data, std::size_t n, CommDType dtype, double divisor) {
  auto div = [&](auto* p) {
    for (std::size_t i = 0; i < n; ++i) p[i] = static_cast<std::remove_reference_t<decltype(*p)>>(p[i] / divisor);
  };
  switch (dtype) {
    case CommDType::f32: div(static_cast<float*>(data)); break;
    case CommDType::f64: div(static_cast<double*>(data)); break;
    case CommDType::i32: div(static_cast<std::int32_t*>(data)); break;
    case CommDType::i64: div(static_cast<std::int64_t*>(data)); break;
    case CommDType::u8: div(static_cast<std::uint8_t*>(data)); break;
    case CommDType::f16: {
      auto* p = static_cast<std::uint16_t*>(data);
      for (std::size_t i = 0; i < n; ++i) p[i] = float_to_half(static_cast<float>(half_to_float(p[i]) / divisor));
      break;
    }
    case CommDType::bf16: {
      auto* p = static_cast<std::uint16_t*>(data);
      for (std::size_t i = 0; i < n; ++i) p[i] = float_to_bf16(static_cast<float>(bf16_to_float(p[i]) / divisor));
      break;
    }
  }
}

struct P2PBackend::Op {
  const char* name = "";
  int group = 0;
  Group* g = nullptr;  // null for send/recv; stays valid as groups are added (a deque)
  std::uint64_t seq = 0;
  std::uint16_t step = 0;
  std::function<void(Op&)> body;
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;
  std::string error;
  int error_peer = -1;
  double started_at = 0, finished_at = 0;  // seconds since the epoch, on the comm thread
};

class P2PBackend::OpWork final : public Work {
 public:
  explicit OpWork(std::shared_ptr<Op> op) : op_(std::move(op)) {}
  bool wait(double timeout_seconds) override {
    std::unique_lock lock(op_->mutex);
    if (!op_->cv.wait_for(lock, std::chrono::duration<double>(timeout_seconds), [&] { return op_->done; })) return false;
    if (!op_->error.empty()) throw CommError(op_->error, op_->error_peer);
    return true;
  }
  bool test() override {
    std::lock_guard lock(op_->mutex);
    return op_->done;
  }
  bool times(double& started_at, double& finished_at) const override {
    std::lock_guard lock(op_->mutex);
    if (!op_->done) return false;
    started_at = op_->started_at;
    finished_at = op_->finished_at;
    return true;
  }

 private:
  std::shared_ptr<Op> op_;
};

P2PBackend::P2PBackend() = default;

P2PBackend::~P2PBackend() { stop(); }

void P2PBackend::start(Transport* transport, const CommInit& init) {
  transport_ = transport;
  const int rank = init.rank, world_size = init.world_size;
  rank_ = rank;
  world_size_ = world_size;
  timeout_ = init.timeout_seconds;
  store_ = init.store;
  heartbeat_prefix_ = "spmdx/heartbeat/g" + std::to_string(init.generation) + "/";
  generation_ = init.generation;
  // Every rank says where it runs and how it would share memory; members of a group share
  // memory only if they all say the same (one host, shm on, the same shm_chunk_bytes).
  host_id_.clear();
  if (store_ != nullptr) {
    host_id_ = host_id();
    if (!host_id_.empty()) host_id_ = (shm_ ? "shm chunk " + std::to_string(shm_chunk_bytes_) : std::string("shm off")) + " on " + host_id_;
    store_->set("spmdx/host/g" + std::to_string(generation_) + "/" + std::to_string(rank), host_id_);
  }
  groups_.clear();
  Group all;
  for (int r = 0; r < world_size; ++r) all.ranks.push_back(r);
  all.me = rank;
  groups_.push_back(std::move(all));
  stopping_ = false;
  aborted_ = false;
  first_failure_.clear();
  first_failure_peer_ = -1;
  queue_.reopen();
  thread_ = std::thread([this] { run(); });
  if (store_ != nullptr) {
    heartbeat_ = std::thread([this] {
      std::unique_lock lock(heartbeat_mutex_);
      while (!stopping_) {
        try {
          store_->add(heartbeat_prefix_ + std::to_string(rank_), 1);
        } catch (const std::exception&) {
          // the store is gone (rank 0 or the launcher exited): collectives will say so
        }
        heartbeat_cv_.wait_for(lock, std::chrono::milliseconds(300));
      }
    });
  }
}

void P2PBackend::report_fault(int peer) {
  if (store_ == nullptr || peer < 0) return;
  try {
    if (store_->add(heartbeat_prefix_ + "fault_reported", 1) == 1) store_->set(heartbeat_prefix_ + "fault", std::to_string(peer));
    // And for the launcher, across backend generations (see kFaultKey).
    if (store_->add(std::string(kFaultKey) + "_reported", 1) == 1) store_->set(kFaultKey, std::to_string(peer));
  } catch (const std::exception&) {
  }
}

void P2PBackend::report_mismatch(const std::string& what) {
  if (store_ == nullptr) return;
  try {
    if (store_->add(std::string(kMismatchKey) + "_reported", 1) == 1) store_->set(kMismatchKey, what);
  } catch (const std::exception&) {
  }
}

int P2PBackend::reported_fault() {
  if (store_ == nullptr) return -1;
  try {
    if (store_->add(heartbeat_prefix_ + "fault_reported", 0) == 0) return -1;
    return std::stoi(store_->get(heartbeat_prefix_ + "fault", 5));
  } catch (const std::exception&) {
    return -1;
  }
}

std::vector<int> P2PBackend::dead_ranks() {
  if (store_ == nullptr) return {};
  std::vector<std::int64_t> before(static_cast<std::size_t>(world_size_));
  try {
    for (int r = 0; r < world_size_; ++r) before[static_cast<std::size_t>(r)] = store_->add(heartbeat_prefix_ + std::to_string(r), 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    std::vector<int> dead;
    for (int r = 0; r < world_size_; ++r) {
      if (store_->add(heartbeat_prefix_ + std::to_string(r), 0) == before[static_cast<std::size_t>(r)]) dead.push_back(r);
    }
    // This rank's own heartbeat must have advanced: otherwise the store or this machine is too
    // slow to tell, and nobody is called dead.
    if (std::find(dead.begin(), dead.end(), rank_) != dead.end()) return {};
    return dead;
  } catch (const std::exception&) {
    return {};
  }
}

void P2PBackend::stop() {
  {
    std::lock_guard lock(mutex_);
    std::lock_guard hb(heartbeat_mutex_);
    stopping_ = true;
  }
  queue_.close();  // the comm thread drains what is queued, then ends
  heartbeat_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (heartbeat_.joinable()) heartbeat_.join();
  std::lock_guard lock(mutex_);
  for (Group& g : groups_) g.shm.reset(), g.shm_state = 0;  // unmapped now, not when the backend goes
}

void P2PBackend::abort() noexcept {
  aborted_ = true;  // queued operations fail at once; one in progress fails at its next poll
}

bool P2PBackend::take_option(const std::string& plugin, const std::string& key, const std::string& value) {
  if (key == "shm") {
    if (value != "on" && value != "off") throw std::invalid_argument(plugin + ": option shm='" + value + "' must be on or off");
    shm_ = value == "on";
    return true;
  }
  if (key != "chunk_bytes" && key != "direct_max_bytes" && key != "shm_chunk_bytes") return false;
  const std::uint64_t least = key == "direct_max_bytes" ? 0 : 64;
  std::uint64_t bytes = 0;
  bool ok = !value.empty() && value.find_first_of("-+ ") == std::string::npos;
  try {
    if (ok) bytes = spmdx::parse_bytes(value);
  } catch (const std::exception&) {
    ok = false;
  }
  const bool shm_chunk = key == "shm_chunk_bytes";
  if (!ok || bytes < least || bytes > (shm_chunk ? std::uint64_t{64} << 20 : std::uint64_t{1} << 40)) {
    throw std::invalid_argument(plugin + ": option " + key + "='" + value + "' must be a size in bytes from " + std::to_string(least) +
                                (shm_chunk ? " to 64M" : " to 1024G") + " (examples: 262144, 256K, 4M)");
  }
  (key == "chunk_bytes" ? chunk_bytes_ : key == "direct_max_bytes" ? direct_max_bytes_ : shm_chunk_bytes_) = static_cast<std::size_t>(bytes);
  return true;
}

std::string P2PBackend::option_str() const {
  return "chunk_bytes=" + std::to_string(chunk_bytes_) + ", direct_max_bytes=" + std::to_string(direct_max_bytes_) +
         ", shm=" + (shm_ ? "on" : "off") + ", shm_chunk_bytes=" + std::to_string(shm_chunk_bytes_);
}

bool P2PBackend::use_direct(std::size_t members, std::size_t bytes) const {
  return members > 1 && members <= kDirectMaxMembers && bytes <= direct_max_bytes_;
}

int P2PBackend::new_group(const std::vector<int>& ranks) {
  auto me = std::find(ranks.begin(), ranks.end(), rank_);
  if (me == ranks.end()) throw std::invalid_argument("new_group: rank " + std::to_string(rank_) + " is not a member");
  std::lock_guard lock(mutex_);
  if (groups_.size() >= 255) throw std::invalid_argument("new_group: at most 255 groups");
  Group g;
  g.ranks = ranks;
  g.me = static_cast<int>(me - ranks.begin());
  groups_.push_back(std::move(g));
  return static_cast<int>(groups_.size() - 1);
}

std::unique_ptr<Work> P2PBackend::submit(const char* name, int group, std::function<void(Op&)> body) {
  auto op = std::make_shared<Op>();
  op->name = name;
  op->group = group;
  op->body = std::move(body);
  {
    std::lock_guard lock(mutex_);
    if (group == kPointToPoint) {
      op->group = 0xff;  // send/recv: the tag is the caller's, no group sequence
    } else if (group < 0 || group >= static_cast<int>(groups_.size())) {
      throw std::invalid_argument(std::string(name) + ": no group " + std::to_string(group));
    } else {
      op->g = &groups_[static_cast<std::size_t>(group)];
      op->seq = op->g->seq++;
    }
    queue_.push(op);
  }
  return std::make_unique<OpWork>(op);
}

void P2PBackend::run() {
  while (true) {
    std::shared_ptr<Op> op;
    if (!queue_.pop_wait(op)) return;  // closed and drained
    std::string error;
    int peer = -1;
    const double started_at = wall_seconds();
    if (aborted_) {
      error = std::string(op->name) + " aborted: " + (first_failure_.empty() ? "the backend was aborted" : "an earlier collective failed: " + first_failure_);
      peer = first_failure_peer_;
    } else {
      try {
        op->body(*op);
      } catch (const CommError& e) {
        error = e.what();
        peer = e.peer();
        // A failed collective leaves its peers mid-operation: the ones queued after it fail at
        // once rather than each waiting out the timeout (as NCCL's communicator, aborted on
        // an error). The caller may be unwinding past all of them.
        first_failure_ = error;
        first_failure_peer_ = peer;
        aborted_ = true;
      } catch (const std::exception& e) {
        error = std::string(op->name) + ": " + e.what();
      }
    }
    {
      std::lock_guard lock(op->mutex);
      op->done = true;
      op->error = error;
      op->error_peer = peer;
      op->started_at = started_at;
      op->finished_at = wall_seconds();
    }
    op->cv.notify_all();
  }
}

struct P2PBackend::Stall {
  explicit Stall(double timeout)
      : deadline(Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout))) {}
  Clock::time_point deadline;
  Clock::time_point last_progress = Clock::now();
  Clock::time_point next_check = last_progress;
  std::vector<int> suspects;  // ranks without a heartbeat at the last check
};

void P2PBackend::check_stall(Op& op, Stall& s, int silent) {
  if (aborted_) throw CommError(std::string(op.name) + " aborted", -1);
  const auto now = Clock::now();
  // Stuck for a while: a rank that a peer already blamed, or whose heartbeat stopped in two
  // checks in a row, fails this wait now rather than at the timeout (a peer on another node
  // that died is not seen by this node's launcher).
  if (now - s.last_progress > std::chrono::seconds(5) && now >= s.next_check) {
    s.next_check = now + std::chrono::seconds(5);
    const std::string what = op_name(op);
    if (const int blamed = reported_fault(); blamed >= 0) {
      throw CommError(what + " failed: rank " + std::to_string(blamed) + " failed (reported by a peer)", blamed);
    }
    const std::vector<int> dead = dead_ranks();
    std::vector<int> confirmed;
    for (int r : dead) {
      if (std::find(s.suspects.begin(), s.suspects.end(), r) != s.suspects.end()) confirmed.push_back(r);
    }
    s.suspects = dead;
    if (!confirmed.empty()) {
      report_fault(confirmed.front());
      throw CommError(what + " failed: " + rank_list(confirmed) + " stopped (no heartbeat in two checks 5 s apart)", confirmed.front());
    }
  }
  if (now > s.deadline) {
    const std::string what = op_name(op) + " timed out after " + std::to_string(timeout_) + " s";
    if (const int blamed = reported_fault(); blamed >= 0) {
      throw CommError(what + ": rank " + std::to_string(blamed) + " failed (reported by a peer)", blamed);
    }
    const std::vector<int> dead = dead_ranks();
    if (!dead.empty()) {
      report_fault(dead.front());
      throw CommError(what + ": " + rank_list(dead) + " stopped (no heartbeat)", dead.front());
    }
    throw CommError(what + " waiting for rank " + std::to_string(silent) + " (hung, or not calling this collective)", silent);
  }
}

void P2PBackend::wait_all(Op& op, const std::vector<std::pair<std::uint64_t, int>>& requests) {
  Stall stall(timeout_);
  std::vector<bool> done(requests.size(), false);
  std::size_t left = requests.size();
  while (left > 0) {
    bool progressed = false;
    for (std::size_t i = 0; i < requests.size(); ++i) {
      if (done[i]) continue;
      bool ok = false;
      try {
        ok = transport_->test(requests[i].first);
      } catch (const CommError& e) {
        // A peer that already exited because another rank failed is not the one to blame.
        const int peer = requests[i].second;
        int blamed = reported_fault();
        if (blamed < 0) {
          report_fault(peer);
          blamed = peer;
        }
        throw CommError(op_name(op) + " failed talking to rank " + std::to_string(peer) + ": " + e.what() +
                            (blamed != peer ? "; rank " + std::to_string(blamed) + " failed first" : ""),
                        blamed);
      }
      if (ok) done[i] = true, --left, progressed = true;
    }
    if (left == 0) break;
    const auto now = Clock::now();
    if (progressed) stall.last_progress = now;
    int silent = -1;
    for (std::size_t i = 0; i < requests.size(); ++i) {
      if (!done[i]) silent = requests[i].second;
    }
    check_stall(op, stall, silent);
    // Back off by how long nothing has completed: poll hard while a peer is mid-message (a
    // ring step's partner is usually microseconds behind), yield the core for a while, then
    // sleep, since ranks share few cores with their compute threads.
    const auto idle = now - stall.last_progress;
    if (idle > std::chrono::microseconds(2000)) {
      std::this_thread::sleep_for(std::chrono::microseconds(idle > std::chrono::milliseconds(50) ? 200 : 20));
    } else if (idle > std::chrono::microseconds(20)) {
      std::this_thread::yield();
    }
  }
}

namespace {
// tag: sender (16 bits) | group (8) | sequence (24) | step (16)
std::uint64_t make_tag(int sender, int group, std::uint64_t seq, std::uint16_t step) {
  return (static_cast<std::uint64_t>(sender & 0xffff) << 48) | (static_cast<std::uint64_t>(group & 0xff) << 40) |
         ((seq & 0xffffff) << 16) | step;
}
}  // namespace

char* P2PBackend::scratch(std::size_t slot, std::size_t bytes) {
  auto& s = scratch_[slot];
  if (s.size < bytes) {  // grown, never shrunk, never zeroed: no page faults or memset per call
    s.data.reset(new char[bytes]);
    s.size = bytes;
  }
  return s.data.get();
}

void P2PBackend::sendrecv(Op& op, int to, const void* sbuf, std::size_t sbytes, int from, void* rbuf, std::size_t rbytes,
                          int explicit_step) {
  const std::uint16_t step = explicit_step >= 0 ? static_cast<std::uint16_t>(explicit_step) : op.step++;
  std::vector<std::pair<std::uint64_t, int>> reqs;
  if (from >= 0) reqs.emplace_back(transport_->irecv(from, rbuf, rbytes, make_tag(from, op.group, op.seq, step)), from);
  if (to >= 0) reqs.emplace_back(transport_->isend(to, sbuf, sbytes, make_tag(rank_, op.group, op.seq, step)), to);
  wait_all(op, reqs);
}

P2PBackend::Chunks P2PBackend::reserve_chunks(Op& op, std::size_t max_count, std::size_t element_size, std::size_t max_chunks) {
  Chunks c;
  c.chunk = std::min(std::max<std::size_t>({1, chunk_bytes_ / element_size, (max_count + max_chunks - 1) / max_chunks}),
                     std::max<std::size_t>(1, max_count));
  c.base = op.step;
  op.step = static_cast<std::uint16_t>(op.step + c.pieces(max_count));
  return c;
}

int remove_shared_memory_of(long pid) { return ShmChannel::remove_left_by(pid); }

std::string P2PBackend::op_name(const Op& op) {
  return std::string(op.name) + " (group " + std::to_string(op.group) + ", #" + std::to_string(op.seq) + ")";
}

void P2PBackend::send_chunks(Op& op, const Chunks& ck, int to, const char* block, std::size_t count, std::size_t element_size,
                              std::vector<std::pair<std::uint64_t, int>>& sends) {
  for (std::size_t c = 0; c < ck.pieces(count); ++c) {
    sends.emplace_back(transport_->isend(to, block + c * ck.chunk * element_size, ck.piece(count, c) * element_size,
                                         make_tag(rank_, op.group, op.seq, static_cast<std::uint16_t>(ck.base + c))),
                       to);
  }
}

void P2PBackend::reduce_step(Op& op, int to, const void* sbuf, std::size_t scount, int from, void* dst, std::size_t rcount,
                             std::size_t max_count, CommDType dtype, ReduceOp rop) {
  // Pipelined in chunks (as NCCL's and Open MPI's rings are): up to kDepth chunk receives in
  // flight into scratch slots that stay in cache, each reduced into `dst` as it lands while
  // the next ones arrive. Unchunked, a step writes the whole incoming block to memory and
  // reads it back to reduce; here the incoming bytes are reduced from cache.
  constexpr std::size_t kDepth = 4;
  const std::size_t es = comm_dtype_size(dtype);
  // 2(k-1) ring steps share the tag's step budget.
  const Chunks ck = reserve_chunks(op, max_count, es, std::max<std::size_t>(1, kStepBudget / op.g->ranks.size()));
  std::vector<std::pair<std::uint64_t, int>> sends;
  send_chunks(op, ck, to, static_cast<const char*>(sbuf), scount, es, sends);
  const std::size_t nrecv = ck.pieces(rcount);
  char* slots = scratch(0, kDepth * ck.chunk * es);
  auto slot = [&](std::size_t c) { return slots + (c % kDepth) * ck.chunk * es; };
  std::vector<std::uint64_t> recvs(nrecv);
  auto post = [&](std::size_t c) {
    recvs[c] = transport_->irecv(from, slot(c), ck.piece(rcount, c) * es, make_tag(from, op.group, op.seq, static_cast<std::uint16_t>(ck.base + c)));
  };
  for (std::size_t c = 0; c < std::min(kDepth, nrecv); ++c) post(c);
  for (std::size_t c = 0; c < nrecv; ++c) {
    wait_all(op, {{recvs[c], from}});  // also progresses the sends
    reduce_into(static_cast<char*>(dst) + c * ck.chunk * es, slot(c), ck.piece(rcount, c), dtype, rop);
    if (c + kDepth < nrecv) post(c + kDepth);
  }
  wait_all(op, sends);
}

void P2PBackend::direct_reduce_scatter(Op& op, const char* in, const std::vector<std::size_t>& counts, char* dst, CommDType dtype,
                                       ReduceOp rop) {
  // Every member sends block j of its input straight to member j and reduces the k-1 blocks it
  // receives into its own, chunk by chunk, in member order after itself (me+1, me+2, ...).
  // The same bytes as the ring, but no step waits for another: with more ranks than cores the
  // ring's chain of k-1 dependent steps is what costs.
  constexpr std::size_t kDepth = 2;
  const Group& g = *op.g;
  const std::size_t k = g.ranks.size(), me = static_cast<std::size_t>(g.me), es = comm_dtype_size(dtype);
  const Chunks ck = reserve_chunks(op, *std::max_element(counts.begin(), counts.end()), es, kStepBudget / 2);  // one step, then the all-gather's
  std::vector<std::pair<std::uint64_t, int>> sends;
  for (std::size_t d = 1; d < k; ++d) {
    const std::size_t j = (me + d) % k;
    send_chunks(op, ck, g.ranks[j], in + offset_of(counts, j) * es, counts[j], es, sends);
  }
  const std::size_t n = ck.pieces(counts[me]);
  char* slots = scratch(0, kDepth * (k - 1) * ck.chunk * es);
  auto slot = [&](std::size_t c, std::size_t d) { return slots + ((c % kDepth) * (k - 1) + (d - 1)) * ck.chunk * es; };
  std::vector<std::uint64_t> recvs(n * (k - 1));
  auto post = [&](std::size_t c) {
    for (std::size_t d = 1; d < k; ++d) {
      const int from = g.ranks[(me + d) % k];
      recvs[c * (k - 1) + d - 1] = transport_->irecv(from, slot(c, d), ck.piece(counts[me], c) * es,
                                                     make_tag(from, op.group, op.seq, static_cast<std::uint16_t>(ck.base + c)));
    }
  };
  for (std::size_t c = 0; c < std::min(kDepth, n); ++c) post(c);
  for (std::size_t c = 0; c < n; ++c) {
    for (std::size_t d = 1; d < k; ++d) {
      wait_all(op, {{recvs[c * (k - 1) + d - 1], g.ranks[(me + d) % k]}});
      reduce_into(dst + c * ck.chunk * es, slot(c, d), ck.piece(counts[me], c), dtype, rop);
    }
    if (c + kDepth < n) post(c + kDepth);
  }
  wait_all(op, sends);
}

void P2PBackend::direct_all_gather(Op& op, char* out, const std::vector<std::size_t>& counts, CommDType dtype) {
  // Every member sends its block to every other and receives theirs in place, all at once.
  const Group& g = *op.g;
  const std::size_t k = g.ranks.size(), me = static_cast<std::size_t>(g.me), es = comm_dtype_size(dtype);
  const std::uint16_t step = op.step++;
  std::vector<std::pair<std::uint64_t, int>> reqs;
  for (std::size_t d = 1; d < k; ++d) {
    const std::size_t j = (me + k - d) % k;
    reqs.emplace_back(transport_->irecv(g.ranks[j], out + offset_of(counts, j) * es, counts[j] * es, make_tag(g.ranks[j], op.group, op.seq, step)),
                      g.ranks[j]);
  }
  for (std::size_t d = 1; d < k; ++d) {
    const int to = g.ranks[(me + d) % k];
    reqs.emplace_back(transport_->isend(to, out + offset_of(counts, me) * es, counts[me] * es, make_tag(rank_, op.group, op.seq, step)), to);
  }
  wait_all(op, reqs);
}

std::size_t P2PBackend::shm_round_bytes(std::size_t members) const {
  // A segment is 3 x members^2 x this: at most kShmMaxSegment, in whole cache lines.
  const std::size_t cap = std::max<std::size_t>(64, kShmMaxSegment / (ShmChannel::kBuffers * members * members) / 64 * 64);
  return std::min(shm_chunk_bytes_, cap);
}

ShmChannel* P2PBackend::shm_channel(Op& op) {
  Group& g = *op.g;
  if (g.shm_state != 0) return g.shm.get();
  g.shm_state = -1;
  if (!shm_ || host_id_.empty() || g.ranks.size() < 2) return nullptr;  // shm off, or no store
  const std::string gen = std::to_string(generation_);
  // A store read that a member has yet to write; waits as a collective does (a member that
  // died or hangs is named, see check_stall).
  auto get = [&](const std::string& key, int rank) {
    Stall stall(timeout_);
    while (true) {
      try {
        return store_->get(key, 0.5);
      } catch (const CommError& e) {
        if (e.peer() != -1) throw;  // not a timeout: the store is gone
      }
      check_stall(op, stall, rank);
    }
  };
  // "<settings> on <host>" (see start()) as {settings, host}; a rank that could not name its
  // host wrote "", which matches nobody.
  auto split = [](const std::string& id) {
    const auto on = id.find(" on ");
    return on == std::string::npos ? std::pair<std::string, std::string>{id, ""} : std::pair{id.substr(0, on), id.substr(on + 4)};
  };
  const auto [settings, host] = split(host_id_);
  for (int r : g.ranks) {
    const std::string theirs = get("spmdx/host/g" + gen + "/" + std::to_string(r), r);
    if (theirs == host_id_) continue;
    if (const auto [their_settings, their_host] = split(theirs); their_host == host) {  // same host, other settings
      SPMDX_WARN("comm: group " << op.group << " (" << rank_list(g.ranks) << ") does not share memory: rank " << r << " has "
                                << their_settings << ", rank " << rank_ << " " << settings << " (give every rank the same shm options)");
    }
    return nullptr;
  }
  // Member 0 creates the segment and names it in the store; every member says whether it
  // mapped it; all use it only if every one did (the same answer on every member).
  std::string members;
  for (int r : g.ranks) members += (members.empty() ? "" : ",") + std::to_string(r);
  const std::string prefix = "spmdx/shm/g" + gen + "/" + std::to_string(op.group) + "/" + members + "/";
  const std::size_t k = g.ranks.size();
  // Spin before sleeping only when this host's ranks each have a core: measured here (2 cores),
  // 50 us of spinning made 2 ranks' small all_reduce 10x faster (6 vs 60 us) and 4 ranks' 64 MiB
  // one 1.7x slower than sleeping at once.
  const long spin_us = local_ranks(k) <= usable_cpus() ? 50 : 0;
  const std::size_t slot_bytes = k * shm_round_bytes(k);
  std::shared_ptr<ShmChannel> ch;
  std::string error;
  try {
    std::string name;
    if (g.me == 0) {
      static std::atomic<int> made{0};
      ShmChannel::remove_left_by(-1);  // from processes that died setting up a group (not under spmdx run)
      // The process id names the creator for the sweeps; a random part keeps the names of
      // jobs in other pid namespaces that share /dev/shm apart.
      name = ShmChannel::name_for(getpid(), gen + "-" + std::to_string(op.group) + "-" + std::to_string(made++) + "-" +
                                                std::to_string(std::random_device{}()));
      try {
        ch = std::make_shared<ShmChannel>(name, true, static_cast<int>(k), 0, slot_bytes, spin_us);
      } catch (...) {
        store_->set(prefix + "name", "");
        throw;
      }
      store_->set(prefix + "name", name);
    } else {
      name = get(prefix + "name", g.ranks[0]);
      if (name.empty()) throw std::runtime_error("member 0 (rank " + std::to_string(g.ranks[0]) + ") could not create it");
      ch = std::make_shared<ShmChannel>(name, false, static_cast<int>(k), g.me, slot_bytes, spin_us);
    }
  } catch (const CommError&) {
    throw;  // the store is gone: the collective fails as any other would
  } catch (const std::exception& e) {
    error = e.what();
  }
  store_->set(prefix + "m" + std::to_string(g.me), error.empty() ? "ok" : error);
  for (std::size_t m = 0; m < k; ++m) {
    const std::string said = get(prefix + "m" + std::to_string(m), g.ranks[m]);
    if (said != "ok" && error.empty()) error = "rank " + std::to_string(g.ranks[m]) + ": " + said;
  }
  if (!error.empty()) {
    SPMDX_WARN("comm: group " << op.group << " (" << rank_list(g.ranks) << ") cannot share memory, so it uses the transport: " << error);
    return nullptr;
  }
  ch->unlink();  // every member has it mapped
  g.shm = std::move(ch);
  g.shm_state = 1;
  return g.shm.get();
}

void P2PBackend::shm_wait(Op& op, ShmChannel& ch, int counter, std::uint32_t target) {
  const Group& g = *op.g;
  for (std::size_t m = 0; m < g.ranks.size(); ++m) {
    if (static_cast<int>(m) == g.me) continue;
    Stall stall(timeout_);
    // Sleeps of 10 ms at most between checks: abort() is seen within them.
    while (!ch.wait(static_cast<ShmChannel::Counter>(counter), static_cast<int>(m), target, 10000)) check_stall(op, stall, g.ranks[m]);
  }
}

void P2PBackend::shm_collective(Op& op, ShmChannel& ch, ShmKind kind, const char* in, char* out, const std::vector<std::size_t>& counts,
                                CommDType dtype, ReduceOp rop) {
  // Each round moves up to `chunk` elements of every block through this member's slot:
  //   1. copy them in (all_gather: only its own block's) and publish `ready`;
  //   2. reduce_scatter, all_reduce: once every member is ready, reduce block `me` from every
  //      member's slot (own first, then me+1, me+2, ...: one member reduces each block, so
  //      every member gets the same bits), into `out` or (all_reduce) in place in the slot,
  //      then publish `reduced`;
  //   3. all_gather, all_reduce: once every member has reduced (all_gather: is ready), copy
  //      every block's piece out of its owner's slot.
  // A slot is written again kBuffers rounds later, once every member has begun the round
  // before (so has finished reading it).
  Group& g = *op.g;
  const std::size_t k = g.ranks.size(), me = static_cast<std::size_t>(g.me), es = comm_dtype_size(dtype);
  Chunks ck;  // a round's piece of each block: as the ring cuts its chunks
  ck.chunk = std::max<std::size_t>(1, shm_round_bytes(k) / es);
  const std::size_t chunk = ck.chunk;
  // At least one round, empty if need be (pieces(0) is 1): members compare what they run in
  // every round, so a member that calls this with no elements while the others have some is
  // caught too.
  const std::size_t rounds = ck.pieces(*std::max_element(counts.begin(), counts.end()));
  std::vector<std::size_t> offsets(k);
  for (std::size_t j = 1; j < k; ++j) offsets[j] = offsets[j - 1] + counts[j - 1];
  auto piece = [&](std::size_t j, std::size_t r) { return ck.piece(counts[j], r); };
  ShmChannel::Signature sig;
  sig.seq = op.seq;
  sig.what = static_cast<std::uint32_t>(kind) | static_cast<std::uint32_t>(dtype) << 8 | static_cast<std::uint32_t>(rop) << 16;
  sig.count = offsets[k - 1] + counts[k - 1];
  for (std::size_t c : counts) sig.blocks = sig.blocks * 1000003 + c;
  for (std::size_t r = 0; r < rounds; ++r) {
    const std::uint64_t round = g.shm_round++;
    if (round + 2 > ShmChannel::kBuffers) shm_wait(op, ch, ShmChannel::ready, static_cast<std::uint32_t>(round + 2 - ShmChannel::kBuffers));
    char* mine = ch.slot(static_cast<int>(me), round);
    if (kind == ShmKind::all_gather) {
      copy_bytes(mine + me * chunk * es, in + r * chunk * es, piece(me, r) * es);
    } else {
      for (std::size_t j = 0; j < k; ++j) copy_bytes(mine + j * chunk * es, in + (offsets[j] + r * chunk) * es, piece(j, r) * es);
    }
    sig.round = static_cast<std::uint32_t>(r);
    ch.sign(round, sig);
    ch.publish(ShmChannel::ready, static_cast<std::uint32_t>(round + 1));
    shm_wait(op, ch, ShmChannel::ready, static_cast<std::uint32_t>(round + 1));
    for (std::size_t j = 0; j < k; ++j) {
      const ShmChannel::Signature theirs = ch.signature(static_cast<int>(j), round);
      if (!(theirs == sig)) {
        // Whom to blame: the members outside a strict majority that called the same; with no
        // such majority (two members, say) nobody can tell here which one skipped a call.
        std::vector<int> blamed;
        for (std::size_t a = 0; a < k && blamed.empty(); ++a) {
          std::vector<int> others;
          const ShmChannel::Signature x = ch.signature(static_cast<int>(a), round);
          for (std::size_t b = 0; b < k; ++b) {
            if (!(ch.signature(static_cast<int>(b), round) == x)) others.push_back(g.ranks[b]);
          }
          if (2 * others.size() < k) blamed = others;
        }
        auto say = [&](const ShmChannel::Signature& x) {
          static const char* kinds[] = {"all_reduce", "reduce_scatter", "all_gather"};
          const auto kind_of = x.what & 0xff;
          return std::string(kind_of < 3 ? kinds[kind_of] : "?") + " #" + std::to_string(x.seq) + " of " + std::to_string(x.count) + " " +
                 to_string(static_cast<CommDType>((x.what >> 8) & 0xff)) +
                 (kind_of == 2 ? "" : std::string(" ") + to_string(static_cast<ReduceOp>((x.what >> 16) & 0xff))) +
                 (x.blocks != sig.blocks && x.count == sig.count ? " (other block sizes)" : "");
        };
        std::string what = op_name(op) + ": rank " + std::to_string(g.ranks[j]) + " called " + say(theirs) + " where rank " +
                           std::to_string(rank_) + " called " + say(sig) + ": every member must call the same collectives in the same order";
        if (blamed.size() == 1) {
          report_fault(blamed.front());
          what += " (" + rank_list(blamed) + " differs from the other members)";
        } else {
          report_mismatch(what);
        }
        throw CommError(what, blamed.size() == 1 ? blamed.front() : -1);
      }
    }
    if (kind != ShmKind::all_gather) {
      const std::size_t n = piece(me, r);
      char* dst = kind == ShmKind::reduce_scatter ? out + r * chunk * es : mine + me * chunk * es;
      if (kind == ShmKind::reduce_scatter) copy_bytes(dst, mine + me * chunk * es, n * es);
      for (std::size_t d = 1; d < k; ++d) {
        reduce_into(dst, ch.slot(static_cast<int>((me + d) % k), round) + me * chunk * es, n, dtype, rop);
      }
      if (rop == ReduceOp::avg) divide(dst, n, dtype, static_cast<double>(k));
      if (kind == ShmKind::reduce_scatter) continue;
      ch.publish(ShmChannel::reduced, static_cast<std::uint32_t>(round + 1));
      shm_wait(op, ch, ShmChannel::reduced, static_cast<std::uint32_t>(round + 1));
    }
    for (std::size_t j = 0; j < k; ++j) {
      if (kind == ShmKind::all_gather && j == me) continue;  // already in place
      copy_bytes(out + (offsets[j] + r * chunk) * es, ch.slot(static_cast<int>(j), round) + j * chunk * es, piece(j, r) * es);
    }
  }
}

std::unique_ptr<Work> P2PBackend::all_gather(int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> counts) {
  return submit("all_gather", group, [this, in, out, counts](Op& op) {
    const Group& g = *op.g;
    const std::size_t k = g.ranks.size(), me = static_cast<std::size_t>(g.me);
    if (counts.size() != k || counts[me] != in.count || offset_of(counts, k) != out.count) {
      throw std::invalid_argument("counts do not match the group size or the buffers");
    }
    copy_bytes(at(out.data, offset_of(counts, me), out.dtype), in.data, in.bytes());
    if (ShmChannel* ch = k > 1 ? shm_channel(op) : nullptr) {
      shm_collective(op, *ch, ShmKind::all_gather, static_cast<const char*>(in.data), static_cast<char*>(out.data), counts, out.dtype, ReduceOp::sum);
      return;
    }
    if (use_direct(k, out.bytes())) {
      direct_all_gather(op, static_cast<char*>(out.data), counts, out.dtype);
      return;
    }
    const int next = g.ranks[(me + 1) % k], prev = g.ranks[(me + k - 1) % k];
    const std::size_t es = comm_dtype_size(out.dtype);
    for (std::size_t s = 0; s + 1 < k; ++s) {  // ring: pass along the block received last
      const std::size_t send_block = (me + k - s) % k, recv_block = (me + k - s - 1) % k;
      sendrecv(op, next, at(out.data, offset_of(counts, send_block), out.dtype), counts[send_block] * es, prev,
               at(out.data, offset_of(counts, recv_block), out.dtype), counts[recv_block] * es);
    }
  });
}

std::unique_ptr<Work> P2PBackend::reduce_scatter(int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> counts,
                                                 ReduceOp rop) {
  return submit("reduce_scatter", group, [this, in, out, counts, rop](Op& op) {
    const Group& g = *op.g;
    const std::size_t k = g.ranks.size(), me = static_cast<std::size_t>(g.me);
    if (counts.size() != k || offset_of(counts, k) != in.count || counts[me] != out.count) {
      throw std::invalid_argument("counts do not match the group size or the buffers");
    }
    const std::size_t es = comm_dtype_size(in.dtype);
    if (ShmChannel* ch = k > 1 ? shm_channel(op) : nullptr) {
      shm_collective(op, *ch, ShmKind::reduce_scatter, static_cast<const char*>(in.data), static_cast<char*>(out.data), counts, in.dtype, rop);
      return;
    }
    if (use_direct(k, in.bytes())) {
      copy_bytes(out.data, at(in.data, offset_of(counts, me), in.dtype), out.bytes());
      direct_reduce_scatter(op, static_cast<const char*>(in.data), counts, static_cast<char*>(out.data), in.dtype, rop);
      if (rop == ReduceOp::avg) divide(out.data, out.count, out.dtype, static_cast<double>(k));
      return;
    }
    char* work = scratch(1, in.bytes());
    const std::size_t max_count = *std::max_element(counts.begin(), counts.end());
    copy_bytes(work, in.data, in.bytes());
    const int next = g.ranks[(me + 1) % k], prev = g.ranks[(me + k - 1) % k];
    for (std::size_t s = 0; s + 1 < k; ++s) {  // ring: after k-1 steps block `me` holds every member's sum
      const std::size_t send_block = (me + 2 * k - s - 1) % k, recv_block = (me + 2 * k - s - 2) % k;
      reduce_step(op, next, work + offset_of(counts, send_block) * es, counts[send_block], prev, work + offset_of(counts, recv_block) * es,
                  counts[recv_block], max_count, in.dtype, rop);
    }
    copy_bytes(out.data, work + offset_of(counts, me) * es, out.bytes());
    if (rop == ReduceOp::avg) divide(out.data, out.count, out.dtype, static_cast<double>(k));
  });
}

std::unique_ptr<Work> P2PBackend::all_reduce(int group, CommBuffer buf, ReduceOp rop) {
  return submit("all_reduce", group, [this, buf, rop](Op& op) {
    const Group& g = *op.g;
    const std::size_t k = g.ranks.size(), me = static_cast<std::size_t>(g.me);
    if (k == 1) return;
    if (ShmChannel* ch = shm_channel(op)) {
      shm_collective(op, *ch, ShmKind::all_reduce, static_cast<const char*>(buf.data), static_cast<char*>(buf.data), even_blocks(buf.count, k),
                     buf.dtype, rop);
      return;
    }
    const std::size_t es = comm_dtype_size(buf.dtype);
    const bool power_of_two = (k & (k - 1)) == 0;
    if (power_of_two && buf.bytes() <= 64 * 1024) {
      // Recursive doubling: log2(k) exchanges of the whole buffer (latency-bound sizes).
      char* incoming = scratch(0, buf.bytes());
      for (std::size_t dist = 1; dist < k; dist <<= 1) {
        const int peer = g.ranks[me ^ dist];
        sendrecv(op, peer, buf.data, buf.bytes(), peer, incoming, buf.bytes());
        // Same operand order on both sides (lower member first), so every rank gets the same bits.
        if ((me & dist) == 0) {
          reduce_into(buf.data, incoming, buf.count, buf.dtype, rop);
        } else {
          reduce_into(incoming, buf.data, buf.count, buf.dtype, rop);
          copy_bytes(buf.data, incoming, buf.bytes());
        }
      }
    } else {
      // Ring: reduce-scatter then all-gather of near-even blocks (bandwidth-optimal).
      // (or both halves direct, see use_direct)
      const auto counts = even_blocks(buf.count, k);
      const bool direct = use_direct(k, buf.bytes());
      char* mine = at(buf.data, offset_of(counts, me), buf.dtype);
      const int next = g.ranks[(me + 1) % k], prev = g.ranks[(me + k - 1) % k];
      if (direct) {
        direct_reduce_scatter(op, static_cast<char*>(buf.data), counts, mine, buf.dtype, rop);
      } else {
        for (std::size_t s = 0; s + 1 < k; ++s) {
          const std::size_t send_block = (me + 2 * k - s - 1) % k, recv_block = (me + 2 * k - s - 2) % k;
          reduce_step(op, next, at(buf.data, offset_of(counts, send_block), buf.dtype), counts[send_block], prev,
                      at(buf.data, offset_of(counts, recv_block), buf.dtype), counts[recv_block], counts[0], buf.dtype, rop);
        }
      }
      // Each member divides only the block it reduced, before passing it on: k times less work
      // than dividing the whole buffer afterwards, and the same bits on every member.
      if (rop == ReduceOp::avg) divide(mine, counts[me], buf.dtype, static_cast<double>(k));
      if (direct) {
        direct_all_gather(op, static_cast<char*>(buf.data), counts, buf.dtype);
        return;
      }
      for (std::size_t s = 0; s + 1 < k; ++s) {
        const std::size_t send_block = (me + k - s) % k, recv_block = (me + k - s - 1) % k;
        sendrecv(op, next, at(buf.data, offset_of(counts, send_block), buf.dtype), counts[send_block] * es, prev,
                 at(buf.data, offset_of(counts, recv_block), buf.dtype), counts[recv_block] * es);
      }
      return;
    }
    if (rop == ReduceOp::avg) divide(buf.data, buf.count, buf.dtype, static_cast<double>(k));
  });
}

std::unique_ptr<Work> P2PBackend::all_to_all(int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> send_counts,
                                             std::vector<std::size_t> recv_counts) {
  return submit("all_to_all", group, [this, in, out, send_counts, recv_counts](Op& op) {
    const Group& g = *op.g;
    const std::size_t k = g.ranks.size(), me = static_cast<std::size_t>(g.me);
    if (send_counts.size() != k || recv_counts.size() != k || offset_of(send_counts, k) != in.count ||
        offset_of(recv_counts, k) != out.count) {
      throw std::invalid_argument("counts do not match the group size or the buffers");
    }
    const std::size_t es = comm_dtype_size(in.dtype);
    copy_bytes(at(out.data, offset_of(recv_counts, me), out.dtype), at(in.data, offset_of(send_counts, me), in.dtype),
                send_counts[me] * es);
    for (std::size_t s = 1; s < k; ++s) {  // pairwise exchange
      const std::size_t to = (me + s) % k, from = (me + k - s) % k;
      sendrecv(op, g.ranks[to], at(in.data, offset_of(send_counts, to), in.dtype), send_counts[to] * es, g.ranks[from],
               at(out.data, offset_of(recv_counts, from), out.dtype), recv_counts[from] * es);
    }
  });
}

std::unique_ptr<Work> P2PBackend::broadcast(int group, CommBuffer buf, int root_member) {
  return submit("broadcast", group, [this, buf, root_member](Op& op) {
    const Group& g = *op.g;
    const std::size_t k = g.ranks.size();
    const std::size_t vr = (static_cast<std::size_t>(g.me) + k - static_cast<std::size_t>(root_member)) % k;  // root is 0
    auto real = [&](std::size_t v) { return g.ranks[(v + static_cast<std::size_t>(root_member)) % k]; };
    // Binomial tree: receive from the parent, then send to the children; a message's step is
    // its tree level, so parent and child agree on it.
    std::size_t mask = 1;
    int level = 0;
    while (mask < k) {
      if (vr & mask) {
        sendrecv(op, -1, nullptr, 0, real(vr - mask), buf.data, buf.bytes(), level);
        break;
      }
      mask <<= 1;
      ++level;
    }
    for (mask >>= 1, --level; mask > 0; mask >>= 1, --level) {
      if (vr + mask < k) sendrecv(op, real(vr + mask), buf.data, buf.bytes(), -1, nullptr, 0, level);
    }
  });
}

std::unique_ptr<Work> P2PBackend::send(CommBuffer buf, int peer_rank, int tag) {
  return submit("send", kPointToPoint, [this, buf, peer_rank, tag](Op& op) {
    op.seq = static_cast<std::uint64_t>(tag);
    sendrecv(op, peer_rank, buf.data, buf.bytes(), -1, nullptr, 0);
  });
}

std::unique_ptr<Work> P2PBackend::recv(CommBuffer buf, int peer_rank, int tag) {
  return submit("recv", kPointToPoint, [this, buf, peer_rank, tag](Op& op) {
    op.seq = static_cast<std::uint64_t>(tag);
    sendrecv(op, -1, nullptr, 0, peer_rank, buf.data, buf.bytes());
  });
}

std::unique_ptr<Work> P2PBackend::barrier(int group) {
  return submit("barrier", group, [this](Op& op) {
    const Group& g = *op.g;
    const std::size_t k = g.ranks.size(), me = static_cast<std::size_t>(g.me);
    char token = 0, incoming = 0;
    for (std::size_t dist = 1; dist < k; dist <<= 1) {  // dissemination barrier (Hensgen et al. 1988)
      sendrecv(op, g.ranks[(me + dist) % k], &token, 1, g.ranks[(me + k - dist) % k], &incoming, 1);
    }
  });
}

}  // namespace spmdx::comm
