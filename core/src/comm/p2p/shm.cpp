#include "shm.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

#include "spmdx/comm/reduce.h"
#include "spmdx/comm/shm.h"
#include "spmdx/core/log.h"
#include "spmdx/text.h"

namespace spmdx::comm {
namespace {

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

// "<settings> on <host>" (see start()) as {settings, host}; a rank that could not name its
// host wrote "", which matches nobody.
std::pair<std::string, std::string> split_host_id(const std::string& id) {
  const auto on = id.find(" on ");
  return on == std::string::npos ? std::pair<std::string, std::string>{id, ""} : std::pair{id.substr(0, on), id.substr(on + 4)};
}

}  // namespace

int remove_shared_memory_of(long pid) { return ShmChannel::remove_left_by(pid); }

void ShmCollectives::start(const CommInit& init, const P2POptions& options) {
  store_ = init.store;
  rank_ = init.rank;
  generation_ = std::to_string(init.generation);
  on_ = options.shm;
  chunk_bytes_ = options.shm_chunk_bytes;
  host_id_.clear();
  if (store_ == nullptr) return;
  host_id_ = host_id();
  if (!host_id_.empty()) host_id_ = (on_ ? "shm chunk " + std::to_string(chunk_bytes_) : std::string("shm off")) + " on " + host_id_;
  store_->set("spmdx/host/g" + generation_ + "/" + std::to_string(rank_), host_id_);
}

std::size_t ShmCollectives::round_bytes(std::size_t members) const {
  // A segment is 3 x members^2 x this: at most kMaxSegment, in whole cache lines.
  const std::size_t cap = std::max<std::size_t>(64, kMaxSegment / (ShmChannel::kBuffers * members * members) / 64 * 64);
  return std::min(chunk_bytes_, cap);
}

std::string ShmCollectives::get(Op& op, const std::string& key, int rank) {
  Health::Stall stall = health_.stall();
  while (true) {
    try {
      return store_->get(key, 0.5);
    } catch (const CommError& e) {
      if (e.peer() != -1) throw;  // not a timeout: the store is gone
    }
    health_.check_stall(op, stall, rank);
  }
}

ShmChannel* ShmCollectives::channel(Op& op) {
  Group& g = *op.g;
  if (g.shm_state != 0) return g.shm.get();
  g.shm_state = -1;
  if (!on_ || host_id_.empty() || g.ranks.size() < 2) return nullptr;  // shm off, or no store
  const std::string& gen = generation_;
  const auto [settings, host] = split_host_id(host_id_);
  for (int r : g.ranks) {
    const std::string theirs = get(op, "spmdx/host/g" + gen + "/" + std::to_string(r), r);
    if (theirs == host_id_) continue;
    if (const auto [their_settings, their_host] = split_host_id(theirs); their_host == host) {  // same host, other settings
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
  const std::size_t slot_bytes = k * round_bytes(k);
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
      name = get(op, prefix + "name", g.ranks[0]);
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
    const std::string said = get(op, prefix + "m" + std::to_string(m), g.ranks[m]);
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

void ShmCollectives::wait(Op& op, ShmChannel& ch, int counter, std::uint32_t target) {
  const Group& g = *op.g;
  for (std::size_t m = 0; m < g.ranks.size(); ++m) {
    if (static_cast<int>(m) == g.me) continue;
    Health::Stall stall = health_.stall();
    // Sleeps of 10 ms at most between checks: abort() is seen within them.
    while (!ch.wait(static_cast<ShmChannel::Counter>(counter), static_cast<int>(m), target, 10000)) health_.check_stall(op, stall, g.ranks[m]);
  }
}

void ShmCollectives::run(Op& op, ShmChannel& ch, Kind kind, const char* in, char* out, const std::vector<std::size_t>& counts, CommDType dtype,
                         ReduceOp rop) {
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
  ck.chunk = std::max<std::size_t>(1, round_bytes(k) / es);
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
    if (round + 2 > ShmChannel::kBuffers) wait(op, ch, ShmChannel::ready, static_cast<std::uint32_t>(round + 2 - ShmChannel::kBuffers));
    char* mine = ch.slot(static_cast<int>(me), round);
    if (kind == Kind::all_gather) {
      copy_bytes(mine + me * chunk * es, in + r * chunk * es, piece(me, r) * es);
    } else {
      for (std::size_t j = 0; j < k; ++j) copy_bytes(mine + j * chunk * es, in + (offsets[j] + r * chunk) * es, piece(j, r) * es);
    }
    sig.round = static_cast<std::uint32_t>(r);
    ch.sign(round, sig);
    ch.publish(ShmChannel::ready, static_cast<std::uint32_t>(round + 1));
    wait(op, ch, ShmChannel::ready, static_cast<std::uint32_t>(round + 1));
    for (std::size_t j = 0; j < k; ++j) {
      if (!(ch.signature(static_cast<int>(j), round) == sig)) mismatch(op, ch, round, j, sig);
    }
    if (kind != Kind::all_gather) {
      const std::size_t n = piece(me, r);
      char* dst = kind == Kind::reduce_scatter ? out + r * chunk * es : mine + me * chunk * es;
      if (kind == Kind::reduce_scatter) copy_bytes(dst, mine + me * chunk * es, n * es);
      for (std::size_t d = 1; d < k; ++d) {
        reduce_into(dst, ch.slot(static_cast<int>((me + d) % k), round) + me * chunk * es, n, dtype, rop);
      }
      if (rop == ReduceOp::avg) divide(dst, n, dtype, static_cast<double>(k));
      if (kind == Kind::reduce_scatter) continue;
      ch.publish(ShmChannel::reduced, static_cast<std::uint32_t>(round + 1));
      wait(op, ch, ShmChannel::reduced, static_cast<std::uint32_t>(round + 1));
    }
    for (std::size_t j = 0; j < k; ++j) {
      if (kind == Kind::all_gather && j == me) continue;  // already in place
      copy_bytes(out + (offsets[j] + r * chunk) * es, ch.slot(static_cast<int>(j), round) + j * chunk * es, piece(j, r) * es);
    }
  }
}

void ShmCollectives::mismatch(Op& op, ShmChannel& ch, std::uint64_t round, std::size_t member, const ShmChannel::Signature& sig) {
  const Group& g = *op.g;
  const std::size_t k = g.ranks.size();
  const ShmChannel::Signature theirs = ch.signature(static_cast<int>(member), round);
  // Whom to blame: the members outside a strict majority that called the same; with no such
  // majority (two members, say) nobody can tell here which one skipped a call.
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
  std::string what = op_name(op) + ": rank " + std::to_string(g.ranks[member]) + " called " + say(theirs) + " where rank " +
                     std::to_string(rank_) + " called " + say(sig) + ": every member must call the same collectives in the same order";
  if (blamed.size() == 1) {
    health_.report_fault(blamed.front());
    what += " (" + rank_list(blamed) + " differs from the other members)";
  } else {
    health_.report_mismatch(what);
  }
  throw CommError(what, blamed.size() == 1 ? blamed.front() : -1);
}

}  // namespace spmdx::comm
