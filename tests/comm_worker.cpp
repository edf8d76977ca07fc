// One rank of a multi-process comm test, started by comm_test.cpp with the torchrun variables
// (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) plus SPMDX_JOB_TOKEN and SPMDX_TEST_MODE:
//   collectives  every collective x dtype x reduce op x element count against a reference
//                computed locally (every rank can compute every rank's inputs)
//   groups       two groups running collectives concurrently
//   die          rank 1 exits before a collective; the others must fail naming it
//   stop         rank 1 freezes (SIGSTOP); the others must fail naming it
//   mismatch     rank 1 all_reduces other than 1000 elements (SPMDX_TEST_RANK1_COUNT, default
//                2000); all must fail saying so
//   abort        rank 0 waits in a collective the others skip until abort() (another thread)
// SPMDX_TEST_OPTIONS ("key=value;...") and SPMDX_TEST_TLS are the ucx plugin's options
// (SPMDX_TEST_OPTIONS_RANK1: rank 1's, when they should differ).
// Prints "checked N" and exits 0, or prints the failure and exits 1 (3: the expected CommError).
#include <spmdx/comm.h>
#include <spmdx/comm/all_to_all_v.h>
#include <spmdx/comm/reduce.h>
#include <spmdx/comm/store.h>
#include <spmdx/core/registry.h>

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <thread>
#include <vector>

namespace {

using namespace spmdx;

int env_int(const char* name) {
  const char* v = std::getenv(name);
  if (!v) {
    std::fprintf(stderr, "missing %s\n", name);
    std::exit(2);
  }
  return std::atoi(v);
}

// Element i of rank r's input: small integers, exact in every dtype (u8: non-negative;
// prod: 1 or 2 so that products stay small).
double value(int r, std::size_t i, ReduceOp op, CommDType t) {
  if (op == ReduceOp::prod) return static_cast<double>(1 + (r + i) % 2);
  const double v = static_cast<double>((static_cast<std::size_t>(r + 1) * 31 + i * 7) % 13);
  return t == CommDType::u8 ? v : v - 6;
}

void put(std::vector<char>& buf, std::size_t i, CommDType t, double v) {
  switch (t) {
    case CommDType::f32: reinterpret_cast<float*>(buf.data())[i] = static_cast<float>(v); break;
    case CommDType::f64: reinterpret_cast<double*>(buf.data())[i] = v; break;
    case CommDType::i32: reinterpret_cast<std::int32_t*>(buf.data())[i] = static_cast<std::int32_t>(v); break;
    case CommDType::i64: reinterpret_cast<std::int64_t*>(buf.data())[i] = static_cast<std::int64_t>(v); break;
    case CommDType::u8: reinterpret_cast<std::uint8_t*>(buf.data())[i] = static_cast<std::uint8_t>(v); break;
    case CommDType::f16:
    case CommDType::bf16: {  // reuse the backend's conversions through a one-element reduction
      std::vector<float> f{static_cast<float>(v)};
      std::uint16_t h = 0;
      // exact for the small integers used here: build the 16-bit pattern from the float
      std::uint32_t bits;
      std::memcpy(&bits, f.data(), 4);
      if (t == CommDType::bf16) {
        h = static_cast<std::uint16_t>(bits >> 16);
      } else {
        const std::uint32_t sign = (bits >> 16) & 0x8000;
        const int e = static_cast<int>((bits >> 23) & 0xff) - 127 + 15;
        h = v == 0 ? static_cast<std::uint16_t>(sign) : static_cast<std::uint16_t>(sign | (static_cast<std::uint32_t>(e) << 10) | ((bits & 0x7fffff) >> 13));
      }
      reinterpret_cast<std::uint16_t*>(buf.data())[i] = h;
      break;
    }
  }
}

double get(const std::vector<char>& buf, std::size_t i, CommDType t) {
  switch (t) {
    case CommDType::f32: return reinterpret_cast<const float*>(buf.data())[i];
    case CommDType::f64: return reinterpret_cast<const double*>(buf.data())[i];
    case CommDType::i32: return reinterpret_cast<const std::int32_t*>(buf.data())[i];
    case CommDType::i64: return static_cast<double>(reinterpret_cast<const std::int64_t*>(buf.data())[i]);
    case CommDType::u8: return reinterpret_cast<const std::uint8_t*>(buf.data())[i];
    case CommDType::f16:
    case CommDType::bf16: {
      std::vector<char> one(4, 0);
      // widen through reduce_into with a zero: 0 + x = x, computed in float
      std::vector<char> zero(2, 0), x(2);
      std::memcpy(x.data(), buf.data() + 2 * i, 2);
      comm::reduce_into(zero.data(), x.data(), 1, t, ReduceOp::sum);
      std::uint16_t h;
      std::memcpy(&h, zero.data(), 2);
      if (t == CommDType::bf16) {
        const std::uint32_t bits = static_cast<std::uint32_t>(h) << 16;
        float f;
        std::memcpy(&f, &bits, 4);
        return f;
      }
      const int e = (h >> 10) & 0x1f;
      const double m = (h & 0x3ff) / 1024.0;
      const double mag = e == 0 ? m * std::pow(2.0, -14) : (1 + m) * std::pow(2.0, e - 15);
      return (h & 0x8000) ? -mag : mag;
    }
  }
  return 0;
}

double reduce_ref(const std::vector<double>& xs, ReduceOp op, CommDType t) {
  double acc = xs[0];
  for (std::size_t i = 1; i < xs.size(); ++i) {
    switch (op) {
      case ReduceOp::sum:
      case ReduceOp::avg: acc += xs[i]; break;
      case ReduceOp::max: acc = std::max(acc, xs[i]); break;
      case ReduceOp::min: acc = std::min(acc, xs[i]); break;
      case ReduceOp::prod: acc *= xs[i]; break;
    }
  }
  if (op == ReduceOp::avg) {
    acc /= static_cast<double>(xs.size());
    if (t == CommDType::i32 || t == CommDType::i64 || t == CommDType::u8) acc = std::trunc(acc);
  }
  return acc;
}

bool close(double got, double want, CommDType t) {
  const double tol = (t == CommDType::f16 || t == CommDType::bf16) ? 1e-2 : 1e-6;
  return std::abs(got - want) <= tol * std::max(1.0, std::abs(want));
}

struct Checker {
  int rank, world;
  long checks = 0;
  void fail(const std::string& what) {
    std::printf("rank %d FAIL %s\n", rank, what.c_str());
    std::fflush(stdout);
    std::exit(1);
  }
};

const char* dtype_name(CommDType t) {
  const char* names[] = {"f32", "f64", "f16", "bf16", "i32", "i64", "u8"};
  return names[static_cast<int>(t)];
}

void run_collectives(CommBackend& b, int group, const std::vector<int>& members, Checker& c, bool big) {
  const int k = static_cast<int>(members.size());
  int me = 0;
  while (members[static_cast<std::size_t>(me)] != c.rank) ++me;
  const double timeout = 120;
  std::vector<std::size_t> counts_list{0, 1, 7, 1000003};
  const std::vector<CommDType> dtypes{CommDType::f32, CommDType::f64, CommDType::f16, CommDType::bf16, CommDType::i32, CommDType::i64, CommDType::u8};
  const std::vector<ReduceOp> ops{ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min, ReduceOp::prod};
  for (CommDType t : dtypes) {
    const std::size_t es = comm_dtype_size(t);
    for (std::size_t n : counts_list) {
      if (n > 1000 && t != CommDType::f32 && t != CommDType::bf16) continue;  // large sizes: two dtypes keep the test quick
      for (ReduceOp op : ops) {
        if (n > 1000 && op != ReduceOp::sum && op != ReduceOp::max) continue;
        std::vector<char> buf(n * es);
        for (std::size_t i = 0; i < n; ++i) put(buf, i, t, value(c.rank, i, op, t));
        if (!b.all_reduce(group, {buf.data(), n, t}, op)->wait(timeout)) c.fail("all_reduce timed out");
        for (std::size_t i = 0; i < n; ++i) {
          std::vector<double> xs;
          for (int m : members) xs.push_back(value(m, i, op, t));
          const double want = reduce_ref(xs, op, t);
          if (!close(get(buf, i, t), want, t)) {
            c.fail(std::string("all_reduce ") + dtype_name(t) + " " + to_string(op) + " n=" + std::to_string(n) + " i=" + std::to_string(i) +
                   ": got " + std::to_string(get(buf, i, t)) + " want " + std::to_string(want));
          }
        }
        ++c.checks;
        // reduce_scatter with uneven blocks (torch.chunk of n over k)
        std::vector<std::size_t> counts(static_cast<std::size_t>(k));
        const std::size_t chunk = (n + static_cast<std::size_t>(k) - 1) / static_cast<std::size_t>(k);
        for (int j = 0; j < k; ++j) {
          const std::size_t start = std::min(n, static_cast<std::size_t>(j) * chunk);
          counts[static_cast<std::size_t>(j)] = std::min(n, start + chunk) - start;
        }
        std::vector<char> in(n * es), out(counts[static_cast<std::size_t>(me)] * es);
        for (std::size_t i = 0; i < n; ++i) put(in, i, t, value(c.rank, i, op, t));
        if (!b.reduce_scatter(group, {in.data(), n, t}, {out.data(), counts[static_cast<std::size_t>(me)], t}, counts, op)->wait(timeout)) {
          c.fail("reduce_scatter timed out");
        }
        std::size_t offset = 0;
        for (int j = 0; j < me; ++j) offset += counts[static_cast<std::size_t>(j)];
        for (std::size_t i = 0; i < counts[static_cast<std::size_t>(me)]; ++i) {
          std::vector<double> xs;
          for (int m : members) xs.push_back(value(m, offset + i, op, t));
          if (!close(get(out, i, t), reduce_ref(xs, op, t), t)) c.fail(std::string("reduce_scatter ") + dtype_name(t) + " " + to_string(op));
        }
        ++c.checks;
      }
      // all_gather, uneven: member j contributes n + j elements
      std::vector<std::size_t> counts;
      for (int j = 0; j < k; ++j) counts.push_back(n + static_cast<std::size_t>(j));
      std::size_t total = 0;
      for (auto x : counts) total += x;
      std::vector<char> in(counts[static_cast<std::size_t>(me)] * es), out(total * es);
      for (std::size_t i = 0; i < counts[static_cast<std::size_t>(me)]; ++i) put(in, i, t, value(c.rank, i, ReduceOp::sum, t));
      if (!b.all_gather(group, {in.data(), counts[static_cast<std::size_t>(me)], t}, {out.data(), total, t}, counts)->wait(timeout)) {
        c.fail("all_gather timed out");
      }
      std::size_t o = 0;
      for (int j = 0; j < k; ++j) {
        for (std::size_t i = 0; i < counts[static_cast<std::size_t>(j)]; ++i, ++o) {
          if (!close(get(out, o, t), value(members[static_cast<std::size_t>(j)], i, ReduceOp::sum, t), t)) c.fail(std::string("all_gather ") + dtype_name(t));
        }
      }
      ++c.checks;
      // all_to_all: block for member j has n + j elements (so receive sizes differ per sender)
      std::vector<std::size_t> send_counts, recv_counts;
      for (int j = 0; j < k; ++j) send_counts.push_back(n + static_cast<std::size_t>(j));
      for (int j = 0; j < k; ++j) recv_counts.push_back(n + static_cast<std::size_t>(me));
      std::size_t sn = 0, rn = 0;
      for (auto x : send_counts) sn += x;
      for (auto x : recv_counts) rn += x;
      std::vector<char> a(sn * es), z(rn * es);
      o = 0;
      for (int j = 0; j < k; ++j) {
        for (std::size_t i = 0; i < send_counts[static_cast<std::size_t>(j)]; ++i, ++o) put(a, o, t, value(c.rank * 10 + j, i, ReduceOp::sum, t));
      }
      if (!b.all_to_all(group, {a.data(), sn, t}, {z.data(), rn, t}, send_counts, recv_counts)->wait(timeout)) c.fail("all_to_all timed out");
      o = 0;
      for (int j = 0; j < k; ++j) {
        for (std::size_t i = 0; i < recv_counts[static_cast<std::size_t>(j)]; ++i, ++o) {
          if (!close(get(z, o, t), value(members[static_cast<std::size_t>(j)] * 10 + me, i, ReduceOp::sum, t), t)) c.fail(std::string("all_to_all ") + dtype_name(t));
        }
      }
      ++c.checks;
      // all_to_all_v: member i sends member j vsent(i, j) elements (none when i + j is a
      // multiple of 3), which the receiver is not told; 3 elements to spare hold a sentinel.
      auto vsent = [n](int i, int j) -> std::size_t { return (i + j) % 3 == 0 ? 0 : n + static_cast<std::size_t>(i + 2 * j); };
      std::vector<std::size_t> vsend;
      std::size_t vsn = 0, vrn = 0;
      for (int j = 0; j < k; ++j) vsn += vsend.emplace_back(vsent(me, j));
      for (int j = 0; j < k; ++j) vrn += vsent(j, me);
      std::vector<char> va(vsn * es), vz((vrn + 3) * es);
      o = 0;
      for (int j = 0; j < k; ++j) {
        for (std::size_t i = 0; i < vsend[static_cast<std::size_t>(j)]; ++i, ++o) put(va, o, t, value(c.rank * 10 + j + 5, i, ReduceOp::sum, t));
      }
      for (std::size_t i = 0; i < vrn + 3; ++i) put(vz, i, t, 7);
      std::vector<std::size_t> vrecv(static_cast<std::size_t>(k));
      if (!comm::all_to_all_v(b, group, {va.data(), vsn, t}, {vz.data(), vrn + 3, t}, vsend, vrecv.data())->wait(timeout)) c.fail("all_to_all_v timed out");
      o = 0;
      for (int j = 0; j < k; ++j) {
        if (vrecv[static_cast<std::size_t>(j)] != vsent(j, me)) c.fail(std::string("all_to_all_v count from member ") + std::to_string(j));
        for (std::size_t i = 0; i < vsent(j, me); ++i, ++o) {
          if (!close(get(vz, o, t), value(members[static_cast<std::size_t>(j)] * 10 + me + 5, i, ReduceOp::sum, t), t)) c.fail(std::string("all_to_all_v ") + dtype_name(t));
        }
      }
      for (; o < vrn + 3; ++o) {
        if (get(vz, o, t) != 7) c.fail(std::string("all_to_all_v wrote past the received elements, ") + dtype_name(t));
      }
      ++c.checks;
      // broadcast from the last member
      std::vector<char> bb(n * es);
      for (std::size_t i = 0; i < n; ++i) put(bb, i, t, value(c.rank, i, ReduceOp::sum, t));
      if (!b.broadcast(group, {bb.data(), n, t}, k - 1)->wait(timeout)) c.fail("broadcast timed out");
      for (std::size_t i = 0; i < n; ++i) {
        if (!close(get(bb, i, t), value(members.back(), i, ReduceOp::sum, t), t)) c.fail(std::string("broadcast ") + dtype_name(t));
      }
      ++c.checks;
    }
  }
  if (big) {  // 64 MiB of f32, summed
    const std::size_t n = (64u << 20) / 4;
    std::vector<float> x(n);
    for (std::size_t i = 0; i < n; ++i) x[i] = static_cast<float>((c.rank + static_cast<int>(i % 5)));
    if (!b.all_reduce(group, {x.data(), n, CommDType::f32}, ReduceOp::sum)->wait(timeout)) c.fail("64 MiB all_reduce timed out");
    for (std::size_t i = 0; i < n; i += 4099) {
      float want = 0;
      for (int m : members) want += static_cast<float>(m + static_cast<int>(i % 5));
      if (x[i] != want) c.fail("64 MiB all_reduce wrong at " + std::to_string(i));
    }
    ++c.checks;
  }
  if (!b.barrier(group)->wait(timeout)) c.fail("barrier timed out");
}

// The ucx plugin's options: SPMDX_TEST_TLS and SPMDX_TEST_OPTIONS ("key=value;key=value"), or
// rank 1's own SPMDX_TEST_OPTIONS_RANK1.
Options backend_options(int rank) {
  Options options;
  if (const char* tls = std::getenv("SPMDX_TEST_TLS")) options["tls"] = tls;
  const char* rank1 = std::getenv("SPMDX_TEST_OPTIONS_RANK1");  // rank 1's instead, when set
  if (const char* o = rank == 1 && rank1 ? rank1 : std::getenv("SPMDX_TEST_OPTIONS")) {  // "key=value;key=value"
    std::string rest = o;
    while (!rest.empty()) {
      const std::string kv = rest.substr(0, rest.find(';'));
      rest = kv.size() < rest.size() ? rest.substr(kv.size() + 1) : "";
      options[kv.substr(0, kv.find('='))] = kv.substr(kv.find('=') + 1);
    }
  }
  return options;
}

// Modes die and stop: rank 1 dies or freezes after a warm-up; the others must fail naming it.
void lose_rank1(CommBackend& b, Checker& c, const std::string& mode, double timeout) {
  const int rank = c.rank;
  float x = 1;
  if (!b.all_reduce(0, {&x, 1, CommDType::f32}, ReduceOp::sum)->wait(60)) c.fail("warm-up timed out");
  const auto warm = std::chrono::steady_clock::now();
  if (rank == 1 && mode == "die") std::_Exit(9);  // dies without a word
  if (rank == 1) {  // hangs, its heartbeat too (as a node that vanished); a child ends it after 60 s
    if (fork() == 0) {
      std::this_thread::sleep_for(std::chrono::seconds(60));
      kill(getppid(), SIGKILL);
      std::_Exit(0);
    }
    raise(SIGSTOP);
  }
  std::vector<float> big(1 << 16, 1.0f);
  try {
    b.all_reduce(0, {big.data(), big.size(), CommDType::f32}, ReduceOp::sum)->wait(timeout + 30);
    c.fail("the collective succeeded without rank 1");
  } catch (const CommError& e) {
    std::printf("rank %d CommError peer=%d after %.1f s: %s\n", rank, e.peer(),
                std::chrono::duration<double>(std::chrono::steady_clock::now() - warm).count(), e.what());
    std::fflush(stdout);
    std::_Exit(3);
  }
}

// Mode mismatch: rank 1 all_reduces twice as many elements as the others: every rank must fail
// naming the difference, not return sums of the wrong elements.
void mismatch_counts(CommBackend& b, Checker& c) {
  const int rank = c.rank;
  const char* count1 = std::getenv("SPMDX_TEST_RANK1_COUNT");
  std::vector<float> x(rank == 1 ? (count1 ? std::strtoul(count1, nullptr, 10) : 2000) : 1000, 1.0f);
  try {
    b.all_reduce(0, {x.data(), x.size(), CommDType::f32}, ReduceOp::sum)->wait(60);
    c.fail("mismatched all_reduce succeeded");
  } catch (const CommError& e) {
    std::printf("rank %d CommError peer=%d: %s\n", rank, e.peer(), e.what());
  }
  // The failure aborted the backend: a later collective fails at once, naming it.
  const auto start = std::chrono::steady_clock::now();
  try {
    b.all_reduce(0, {x.data(), x.size(), CommDType::f32}, ReduceOp::sum)->wait(60);
    c.fail("a collective after the failure succeeded");
  } catch (const CommError& e) {
    std::printf("rank %d then after %.2f s: %s\n", rank, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
                e.what());
  }
  std::fflush(stdout);
  std::_Exit(3);
}

// Mode abort: rank 0 waits in a collective the others never join, until another thread aborts
// the backend after 1 s; the others leave after 4 s.
void abort_a_wait(CommBackend& b, Checker& c) {
  float x = 1;
  if (!b.all_reduce(0, {&x, 1, CommDType::f32}, ReduceOp::sum)->wait(60)) c.fail("warm-up timed out");
  if (c.rank != 0) {
    std::this_thread::sleep_for(std::chrono::seconds(4));
    std::_Exit(0);
  }
  std::vector<float> big(1 << 18, 1.0f);
  const auto start = std::chrono::steady_clock::now();
  std::thread aborter([&] {
    std::this_thread::sleep_for(std::chrono::seconds(1));
    b.abort();
  });
  try {
    b.all_reduce(0, {big.data(), big.size(), CommDType::f32}, ReduceOp::sum)->wait(60);
    c.fail("the collective succeeded without the others");
  } catch (const CommError& e) {
    std::printf("rank 0 CommError after %.2f s: %s\n", std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
                e.what());
  }
  aborter.join();
  std::fflush(stdout);
  std::_Exit(3);
}

// Whether this process maps a group's shared memory, already unlinked ("(deleted)").
void print_shared_memory(int rank) {
  std::ifstream maps("/proc/self/maps");
  std::string line, shm = "none";
  while (std::getline(maps, line)) {
    if (line.find("/dev/shm/spmdx-") != std::string::npos) shm = line.find("(deleted)") != std::string::npos ? "unlinked" : "linked";
  }
  std::printf("rank %d shared memory: %s\n", rank, shm.c_str());
}

}  // namespace

int main() {
  const int rank = env_int("RANK"), world = env_int("WORLD_SIZE"), port = env_int("MASTER_PORT");
  const std::string mode = std::getenv("SPMDX_TEST_MODE") ? std::getenv("SPMDX_TEST_MODE") : "collectives";
  const double timeout = std::getenv("SPMDX_TEST_TIMEOUT") ? std::atof(std::getenv("SPMDX_TEST_TIMEOUT")) : 120;
  try {
    comm::TcpStore store(std::getenv("MASTER_ADDR") ? std::getenv("MASTER_ADDR") : "127.0.0.1", port,
                         std::getenv("SPMDX_JOB_TOKEN") ? std::getenv("SPMDX_JOB_TOKEN") : "", 30);
    PluginRegistry registry;
    registry.discover(plugin_search_path({}));
    auto backend = registry.make_comm_backend("ucx", backend_options(rank));
    backend->init({rank, world, 0, &store, timeout});
    Checker c{rank, world};
    std::vector<int> all;
    for (int r = 0; r < world; ++r) all.push_back(r);
    if (mode == "collectives") {
      run_collectives(*backend, 0, all, c, std::getenv("SPMDX_TEST_BIG") != nullptr);
    } else if (mode == "groups") {
      // Even and odd ranks each form a group; both run collectives at the same time.
      std::vector<int> even, odd;
      for (int r = 0; r < world; ++r) (r % 2 ? odd : even).push_back(r);
      const int g_even = rank % 2 ? -1 : backend->new_group(even);
      const int g_odd = rank % 2 ? backend->new_group(odd) : -1;
      run_collectives(*backend, rank % 2 ? g_odd : g_even, rank % 2 ? odd : even, c, false);
      run_collectives(*backend, 0, all, c, false);
    } else if (mode == "die" || mode == "stop") {
      lose_rank1(*backend, c, mode, timeout);
    }
    if (mode == "mismatch") mismatch_counts(*backend, c);
    if (mode == "abort") abort_a_wait(*backend, c);
    print_shared_memory(rank);
    backend->finalize();
    std::printf("rank %d checked %ld\n", rank, c.checks);
    return 0;
  } catch (const std::exception& e) {
    std::printf("rank %d ERROR %s\n", rank, e.what());
    return 1;
  }
}
