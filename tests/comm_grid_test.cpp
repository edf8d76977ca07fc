// One conformance grid for the comm backends (gloo's Combine(transports, sizes, counts)): every
// backend configuration x world size 1-4 x element count 0, 1, 7, 1,000,003, and in each cell
// all seven dtypes through all_reduce (every reduce op), reduce_scatter and all_gather with
// uneven blocks (one empty), all_to_all, all_to_all_v (split sizes only the senders know, zero
// blocks among them) and broadcast, against one oracle computed here.
// Ranks run as threads of this process, each with its own backend instance (UCX: one worker
// per thread) and, for shared memory, a store; a single cell reruns with --gtest_filter.
// Inputs are small integers so that every dtype holds every sum and product exactly; only the
// averages of f16 and bf16 round.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <thread>
#include <tuple>

#include "spmdx/comm/all_to_all_v.h"
#include "spmdx/comm/store.h"
#include "spmdx/core/registry.h"

namespace spmdx {
namespace {

// The backend configurations: the algorithms (ring, direct), pipelined chunks, and UCX with
// and without its shared-memory path.
const std::vector<std::string> kBackends = {"local", "local:chunk_bytes=64", "ucx:tls=self,sm,tcp", "ucx:tls=self,sm,tcp;shm=off",
                                            "ucx:tls=self,sm,tcp;shm_chunk_bytes=64", "ucx:tls=self,sm,tcp;direct_max_bytes=0"};

// Element i of rank r's input: 1, 2 or 3.
double input(int rank, std::size_t i) { return static_cast<double>(1 + (static_cast<std::size_t>(rank) + i) % 3); }

// Values stored as `dtype` and read back as double (f16 and bf16 by their bit layouts).
struct Typed {
  CommDType dtype;
  std::vector<unsigned char> bytes;

  Typed(CommDType t, std::size_t n) : dtype(t), bytes(n * comm_dtype_size(t)) {}
  std::size_t size() const { return bytes.size() / comm_dtype_size(dtype); }
  CommBuffer buffer() { return {bytes.data(), size(), dtype, MemoryType::host}; }

  void set(std::size_t i, double v) {
    unsigned char* p = bytes.data() + i * comm_dtype_size(dtype);
    switch (dtype) {
      case CommDType::f32: { const float x = static_cast<float>(v); std::memcpy(p, &x, 4); break; }
      case CommDType::f64: std::memcpy(p, &v, 8); break;
      case CommDType::i32: { const auto x = static_cast<std::int32_t>(v); std::memcpy(p, &x, 4); break; }
      case CommDType::i64: { const auto x = static_cast<std::int64_t>(v); std::memcpy(p, &x, 8); break; }
      case CommDType::u8: *p = static_cast<unsigned char>(v); break;
      case CommDType::bf16: {  // the high half of the f32 (the inputs are exact in bf16)
        const float x = static_cast<float>(v);
        std::uint32_t u;
        std::memcpy(&u, &x, 4);
        const auto h = static_cast<std::uint16_t>(u >> 16);
        std::memcpy(p, &h, 2);
        break;
      }
      case CommDType::f16: {  // small non-negative integers: exact
        const float x = static_cast<float>(v);
        std::uint32_t u;
        std::memcpy(&u, &x, 4);
        const int e = static_cast<int>((u >> 23) & 0xff) - 127 + 15;
        const auto h = x == 0 ? std::uint16_t{0} : static_cast<std::uint16_t>((e << 10) | ((u >> 13) & 0x3ff));
        std::memcpy(p, &h, 2);
        break;
      }
    }
  }

  double get(std::size_t i) const {
    const unsigned char* p = bytes.data() + i * comm_dtype_size(dtype);
    switch (dtype) {
      case CommDType::f32: { float x; std::memcpy(&x, p, 4); return x; }
      case CommDType::f64: { double x; std::memcpy(&x, p, 8); return x; }
      case CommDType::i32: { std::int32_t x; std::memcpy(&x, p, 4); return x; }
      case CommDType::i64: { std::int64_t x; std::memcpy(&x, p, 8); return static_cast<double>(x); }
      case CommDType::u8: return *p;
      case CommDType::bf16: {
        std::uint16_t h;
        std::memcpy(&h, p, 2);
        const std::uint32_t u = static_cast<std::uint32_t>(h) << 16;
        float x;
        std::memcpy(&x, &u, 4);
        return x;
      }
      case CommDType::f16: {
        std::uint16_t h;
        std::memcpy(&h, p, 2);
        const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
        return e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
      }
    }
    return 0;
  }
};

bool is_float(CommDType t) { return t == CommDType::f32 || t == CommDType::f64 || t == CommDType::f16 || t == CommDType::bf16; }

// The oracle: op over the ranks' inputs at element i.
double reduced(ReduceOp op, int n, std::size_t i) {
  double acc = op == ReduceOp::prod ? 1 : op == ReduceOp::max ? -1e300 : op == ReduceOp::min ? 1e300 : 0;
  for (int r = 0; r < n; ++r) {
    const double x = input(r, i);
    if (op == ReduceOp::sum || op == ReduceOp::avg) acc += x;
    else if (op == ReduceOp::prod) acc *= x;
    else if (op == ReduceOp::max) acc = std::max(acc, x);
    else acc = std::min(acc, x);
  }
  return op == ReduceOp::avg ? acc / n : acc;
}

double tolerance(CommDType t, double want) {
  const double rel = t == CommDType::f16 || t == CommDType::bf16 ? 8e-3 : t == CommDType::f32 ? 1e-6 : 1e-12;
  return rel * std::abs(want);
}

// Runs body(rank, backend) on `n` threads, each with its own backend made from `spec` and its
// own client of one store.
void on_ranks(const std::string& spec, int n, const std::function<void(int, CommBackend&)>& body) {
  comm::TcpStoreServer server("127.0.0.1", 0, "grid");
  std::vector<std::unique_ptr<comm::TcpStore>> stores;
  PluginRegistry registry;
  registry.discover({{BUILTIN_PLUGIN_DIR, PluginSource::Origin::builtin}});
  std::vector<std::unique_ptr<CommBackend>> backends;
  for (int r = 0; r < n; ++r) {
    stores.push_back(std::make_unique<comm::TcpStore>("127.0.0.1", server.port(), "grid", 30));
    const bool local = spec.rfind("local", 0) == 0;
    backends.push_back(registry.make_comm_backend_from_spec(local ? spec + (spec.find(':') == std::string::npos ? ":" : ";") + "job=grid" : spec));
  }
  std::vector<std::thread> threads;
  std::vector<std::string> errors(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      const auto i = static_cast<std::size_t>(r);
      try {
        backends[i]->init({r, n, 0, stores[i].get(), 60});
        body(r, *backends[i]);
        backends[i]->finalize();
      } catch (const std::exception& e) {
        errors[i] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[static_cast<std::size_t>(r)], "") << spec << " rank " << r;
}

const std::vector<CommDType> kDtypes = {CommDType::f32, CommDType::f64, CommDType::f16, CommDType::bf16, CommDType::i32, CommDType::i64, CommDType::u8};

const char* name(CommDType t) {
  static const char* names[] = {"f32", "f64", "f16", "bf16", "i32", "i64", "u8"};
  return names[static_cast<int>(t)];
}

class CommGrid : public ::testing::TestWithParam<std::tuple<std::string, int, std::size_t>> {};

TEST_P(CommGrid, EveryCollectiveAndDtypeMatchesTheOracle) {
  const auto& [spec, n, count] = GetParam();
  // The big count runs in f32 and u8 only: the other dtypes take the same code paths, and a
  // million elements of each in every cell would be most of the suite's time.
  const bool big = count > 100000;
  on_ranks(spec, n, [&, n = n, count = count](int rank, CommBackend& b) {
    const int group = b.new_group([&] {
      std::vector<int> all;
      for (int r = 0; r < n; ++r) all.push_back(r);
      return all;
    }());
    for (CommDType t : kDtypes) {
      if (big && t != CommDType::f32 && t != CommDType::u8) continue;
      SCOPED_TRACE(std::string(name(t)) + " rank " + std::to_string(rank));
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::prod, ReduceOp::max, ReduceOp::min, ReduceOp::avg}) {
        if (op == ReduceOp::avg && !is_float(t)) continue;
        Typed x(t, count);
        for (std::size_t i = 0; i < count; ++i) x.set(i, input(rank, i));
        ASSERT_TRUE(b.all_reduce(group, x.buffer(), op)->wait(60));
        for (std::size_t i = 0; i < count; ++i) {
          const double want = reduced(op, n, i);
          ASSERT_NEAR(x.get(i), want, tolerance(t, want)) << "all_reduce " << to_string(op) << " element " << i;
        }
      }
      // Uneven blocks, member 1's empty: count + 3 r elements for member r.
      std::vector<std::size_t> counts(static_cast<std::size_t>(n));
      std::size_t total = 0;
      for (int r = 0; r < n; ++r) total += counts[static_cast<std::size_t>(r)] = r == 1 ? 0 : count + 3 * static_cast<std::size_t>(r);
      std::size_t start = 0;
      for (int r = 0; r < rank; ++r) start += counts[static_cast<std::size_t>(r)];
      const std::size_t mine = counts[static_cast<std::size_t>(rank)];
      Typed in(t, total), out(t, mine);
      for (std::size_t i = 0; i < total; ++i) in.set(i, input(rank, i));
      ASSERT_TRUE(b.reduce_scatter(group, in.buffer(), out.buffer(), counts, ReduceOp::sum)->wait(60));
      for (std::size_t i = 0; i < mine; ++i) ASSERT_EQ(out.get(i), reduced(ReduceOp::sum, n, start + i)) << "reduce_scatter element " << i;
      Typed block(t, mine), all(t, total);
      for (std::size_t i = 0; i < mine; ++i) block.set(i, input(rank, i));
      ASSERT_TRUE(b.all_gather(group, block.buffer(), all.buffer(), counts)->wait(60));
      for (int r = 0, at = 0; r < n; at += static_cast<int>(counts[static_cast<std::size_t>(r)]), ++r) {
        for (std::size_t i = 0; i < counts[static_cast<std::size_t>(r)]; ++i) {
          ASSERT_EQ(all.get(static_cast<std::size_t>(at) + i), input(r, i)) << "all_gather from rank " << r << " element " << i;
        }
      }
      // all_to_all: block j of rank r holds (count + j) elements valued input(r, j).
      std::vector<std::size_t> send(static_cast<std::size_t>(n)), recv(static_cast<std::size_t>(n));
      std::size_t send_total = 0, recv_total = 0;
      for (int j = 0; j < n; ++j) send_total += send[static_cast<std::size_t>(j)] = (big ? 7 : count) + static_cast<std::size_t>(j);
      for (int j = 0; j < n; ++j) recv_total += recv[static_cast<std::size_t>(j)] = (big ? 7 : count) + static_cast<std::size_t>(rank);
      Typed a(t, send_total), c(t, recv_total);
      for (int j = 0, at = 0; j < n; at += static_cast<int>(send[static_cast<std::size_t>(j)]), ++j) {
        for (std::size_t i = 0; i < send[static_cast<std::size_t>(j)]; ++i) a.set(static_cast<std::size_t>(at) + i, input(rank, static_cast<std::size_t>(j)));
      }
      ASSERT_TRUE(b.all_to_all(group, a.buffer(), c.buffer(), send, recv)->wait(60));
      for (int j = 0, at = 0; j < n; at += static_cast<int>(recv[static_cast<std::size_t>(j)]), ++j) {
        for (std::size_t i = 0; i < recv[static_cast<std::size_t>(j)]; ++i) {
          ASSERT_EQ(c.get(static_cast<std::size_t>(at) + i), input(j, static_cast<std::size_t>(rank))) << "all_to_all from rank " << j;
        }
      }
      // all_to_all_v: rank r sends rank j sent(r, j) elements, valued (r, j, i) as below; some
      // blocks are empty (r + j a multiple of 3: every world has one). The receiver is told no
      // counts; its buffer has 5 elements to spare, holding a sentinel that must stay.
      auto sent = [&](int r, int j) -> std::size_t {
        return (r + j) % 3 == 0 ? 0 : (big ? 7 : count) + static_cast<std::size_t>(r) + 2 * static_cast<std::size_t>(j);
      };
      auto element = [](int r, int j, std::size_t i) { return static_cast<double>((31 * r + 7 * j + static_cast<int>(i % 89)) % 97 + 1); };
      const double sentinel = 200;
      std::vector<std::size_t> vsend(static_cast<std::size_t>(n));
      std::size_t vsend_total = 0, vrecv_total = 0;
      for (int j = 0; j < n; ++j) vsend_total += vsend[static_cast<std::size_t>(j)] = sent(rank, j);
      for (int j = 0; j < n; ++j) vrecv_total += sent(j, rank);
      Typed va(t, vsend_total), vc(t, vrecv_total + 5);
      for (int j = 0, at = 0; j < n; at += static_cast<int>(vsend[static_cast<std::size_t>(j)]), ++j) {
        for (std::size_t i = 0; i < vsend[static_cast<std::size_t>(j)]; ++i) va.set(static_cast<std::size_t>(at) + i, element(rank, j, i));
      }
      for (std::size_t i = 0; i < vc.size(); ++i) vc.set(i, sentinel);
      std::vector<std::size_t> vrecv(static_cast<std::size_t>(n), 12345);
      ASSERT_TRUE(comm::all_to_all_v(b, group, va.buffer(), vc.buffer(), vsend, vrecv.data())->wait(60));
      std::size_t vat = 0;
      for (int j = 0; j < n; ++j) {
        ASSERT_EQ(vrecv[static_cast<std::size_t>(j)], sent(j, rank)) << "all_to_all_v's count from rank " << j;
        for (std::size_t i = 0; i < sent(j, rank); ++i, ++vat) {
          ASSERT_EQ(vc.get(vat), element(j, rank, i)) << "all_to_all_v from rank " << j << " element " << i;
        }
      }
      for (; vat < vc.size(); ++vat) ASSERT_EQ(vc.get(vat), sentinel) << "all_to_all_v wrote past the received elements, at " << vat;
      // broadcast from the last member.
      Typed bc(t, count);
      for (std::size_t i = 0; i < count; ++i) bc.set(i, input(rank, i));
      ASSERT_TRUE(b.broadcast(group, bc.buffer(), n - 1)->wait(60));
      for (std::size_t i = 0; i < count; ++i) ASSERT_EQ(bc.get(i), input(n - 1, i)) << "broadcast element " << i;
    }
  });
}

std::string cell_name(const ::testing::TestParamInfo<CommGrid::ParamType>& info) {
  std::string spec = std::get<0>(info.param);
  for (char& ch : spec) {
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return spec + "_world" + std::to_string(std::get<1>(info.param)) + "_count" + std::to_string(std::get<2>(info.param));
}

// all_to_all_v into a buffer too small: that rank's Work fails naming the counts and its
// capacity; the senders' complete, and the group goes on to its next collective.
TEST(CommGridAllToAllV, MoreThanTheCapacityFailsThatRankAloneNamingTheCounts) {
  for (const std::string spec : {"local", "ucx:tls=self,sm,tcp"}) {
    on_ranks(spec, 3, [&](int rank, CommBackend& b) {
      std::vector<std::int32_t> in(9, rank + 1), out(rank == 2 ? 4 : 9, -1);
      std::vector<std::size_t> recv(3);
      auto work = comm::all_to_all_v(b, 0, {in.data(), in.size(), CommDType::i32}, {out.data(), out.size(), CommDType::i32}, {3, 3, 3}, recv.data());
      if (rank == 2) {
        try {
          work->wait(60);
          ADD_FAILURE() << spec << ": rank 2 received 9 elements into 4";
        } catch (const std::exception& e) {
          EXPECT_THAT(e.what(), ::testing::HasSubstr("the members sent this rank 9 elements (3, 3, 3, in member order) but out.count is 4"));
        }
      } else {
        ASSERT_TRUE(work->wait(60));
        EXPECT_EQ(out, (std::vector<std::int32_t>{1, 1, 1, 2, 2, 2, 3, 3, 3}));
      }
      EXPECT_EQ(recv, (std::vector<std::size_t>{3, 3, 3}));
      std::int32_t one = 1;
      ASSERT_TRUE(b.all_reduce(0, {&one, 1, CommDType::i32}, ReduceOp::sum)->wait(60));
      EXPECT_EQ(one, 3);
    });
  }
}

// Counts that do not add up to the send buffer fail the call, naming them.
TEST(CommGridAllToAllV, SendCountsThatDoNotMatchTheBufferAreNamed) {
  on_ranks("local", 2, [&](int, CommBackend& b) {
    std::vector<float> in(4), out(4);
    std::vector<std::size_t> recv(2);
    try {
      comm::all_to_all_v(b, 0, {in.data(), 4}, {out.data(), 4}, {1, 2}, recv.data())->wait(60);
      ADD_FAILURE() << "counts of 3 elements for a buffer of 4 were taken";
    } catch (const std::exception& e) {
      EXPECT_THAT(e.what(), ::testing::HasSubstr("send_counts (2 entries, 3 elements) do not match the group's 2 members or in.count 4"));
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Grid, CommGrid,
                         ::testing::Combine(::testing::ValuesIn(kBackends), ::testing::Values(1, 2, 3, 4),
                                            ::testing::Values(std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1000003})),
                         cell_name);

}  // namespace
}  // namespace spmdx
