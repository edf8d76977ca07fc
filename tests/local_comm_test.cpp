// The `local` comm plugin: ranks as threads of one process. Every collective on 2, 3 and 4
// ranks against a reference computed here; two groups at once; a rank in another process is
// refused by name.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <thread>

#include "spmdx/comm/store.h"
#include "spmdx/core/registry.h"

namespace spmdx {
namespace {

using ::testing::HasSubstr;

// Runs body(rank, backend) on `n` threads (backend options: `options`), each with its own initialised local backend.
// With a store, ranks that share a host (all of them here) may share memory (option shm).
void on_ranks(int n, const std::string& job, const std::function<void(int, CommBackend&)>& body, Options options = {},
              bool with_store = false) {
  std::unique_ptr<comm::TcpStoreServer> server;
  std::vector<std::unique_ptr<comm::TcpStore>> stores;
  if (with_store) server = std::make_unique<comm::TcpStoreServer>("127.0.0.1", 0, "tok");
  for (int r = 0; with_store && r < n; ++r) stores.push_back(std::make_unique<comm::TcpStore>("127.0.0.1", server->port(), "tok", 10));
  PluginRegistry registry;
  registry.discover({{BUILTIN_PLUGIN_DIR, PluginSource::Origin::builtin}});
  std::vector<std::unique_ptr<CommBackend>> backends;
  options["job"] = job;
  for (int r = 0; r < n; ++r) backends.push_back(registry.make_comm_backend("local", options));
  std::vector<std::thread> threads;
  std::vector<std::string> errors(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        backends[static_cast<std::size_t>(r)]->init({r, n, 0, with_store ? stores[static_cast<std::size_t>(r)].get() : nullptr, 30});
        body(r, *backends[static_cast<std::size_t>(r)]);
        backends[static_cast<std::size_t>(r)]->finalize();
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[static_cast<std::size_t>(r)], "") << "rank " << r;
}

double input(int rank, std::size_t i) { return static_cast<double>((rank + 1) * static_cast<int>(i % 5 + 1)); }

template <class T>
void check_all_reduce(CommDType dtype, ReduceOp op, int n, std::size_t count) {
  on_ranks(n, "ar", [&](int rank, CommBackend& b) {
    std::vector<T> buf(count);
    for (std::size_t i = 0; i < count; ++i) buf[i] = static_cast<T>(input(rank, i));
    ASSERT_TRUE(b.all_reduce(0, {buf.data(), count, dtype, MemoryType::host}, op)->wait(30));
    for (std::size_t i = 0; i < count; ++i) {
      double want = op == ReduceOp::prod ? 1 : op == ReduceOp::max ? -1e300 : op == ReduceOp::min ? 1e300 : 0;
      for (int r = 0; r < n; ++r) {
        const double x = input(r, i);
        if (op == ReduceOp::sum || op == ReduceOp::avg) want += x;
        if (op == ReduceOp::prod) want = static_cast<double>(static_cast<T>(static_cast<T>(want) * static_cast<T>(x)));  // wraps as T does
        if (op == ReduceOp::max) want = std::max(want, x);
        if (op == ReduceOp::min) want = std::min(want, x);
      }
      if (op == ReduceOp::avg) want /= n;
      ASSERT_NEAR(static_cast<double>(buf[i]), want, 1e-6 * std::abs(want)) << to_string(op) << " element " << i << " rank " << rank;
    }
  });
}

TEST(LocalComm, AllReduceEveryDtypeAndOpOn2To4Ranks) {
  for (int n : {2, 3, 4}) {
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::max, ReduceOp::min, ReduceOp::prod}) {
      check_all_reduce<float>(CommDType::f32, op, n, 7);
      check_all_reduce<double>(CommDType::f64, op, n, 7);
      check_all_reduce<std::int32_t>(CommDType::i32, op, n, 7);
      check_all_reduce<std::int64_t>(CommDType::i64, op, n, 7);
      check_all_reduce<std::uint8_t>(CommDType::u8, op, n, 7);
    }
    check_all_reduce<float>(CommDType::f32, ReduceOp::avg, n, 7);
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{1000003}}) check_all_reduce<float>(CommDType::f32, ReduceOp::sum, n, count);
  }
}

// Each rank's results of an all_reduce (f32 sum of `count` elements), a reduce_scatter (f64
// avg, uneven blocks of count + 37 r elements, member 1's empty) and an all_gather (f32, the
// same blocks) on `n` ranks, with backend `options`.
struct ThreeCollectives {
  std::vector<std::vector<float>> all_reduce;
  std::vector<std::vector<double>> reduce_scatter;
  std::vector<std::vector<float>> all_gather;
};

ThreeCollectives run_three_collectives(int n, std::size_t count, const std::string& job, const Options& options, bool with_store = false) {
  ThreeCollectives run;
  run.all_reduce.resize(static_cast<std::size_t>(n));
  run.reduce_scatter.resize(static_cast<std::size_t>(n));
  run.all_gather.resize(static_cast<std::size_t>(n));
  on_ranks(n, job, [&](int rank, CommBackend& b) {
    const auto me = static_cast<std::size_t>(rank);
    std::vector<float> buf(count);
    for (std::size_t i = 0; i < count; ++i) buf[i] = 1.0f / static_cast<float>(rank * 7 + static_cast<int>(i % 13) + 1);
    ASSERT_TRUE(b.all_reduce(0, {buf.data(), count}, ReduceOp::sum)->wait(30));
    run.all_reduce[me] = buf;
    std::vector<std::size_t> counts(static_cast<std::size_t>(n));  // uneven, member 1's empty
    std::size_t total = 0;
    for (int r = 0; r < n; ++r) total += counts[static_cast<std::size_t>(r)] = r == 1 ? 0 : count + static_cast<std::size_t>(r) * 37;
    std::vector<double> in(total), out(counts[me]);
    for (std::size_t i = 0; i < total; ++i) in[i] = 1.0 / static_cast<double>(rank + static_cast<int>(i % 11) + 1);
    ASSERT_TRUE(b.reduce_scatter(0, {in.data(), total, CommDType::f64}, {out.data(), out.size(), CommDType::f64}, counts, ReduceOp::avg)->wait(30));
    run.reduce_scatter[me] = out;
    std::vector<float> mine(counts[me], static_cast<float>(rank) + 0.5f), all(total);
    ASSERT_TRUE(b.all_gather(0, {mine.data(), mine.size()}, {all.data(), total}, counts)->wait(30));
    run.all_gather[me] = all;
  }, options, with_store);
  return run;
}

// Ring reduce steps and direct reduce-scatters are pipelined in chunks (option chunk_bytes).
// Chunks change neither the order of the additions nor the bits: for each algorithm, results
// with 64-byte chunks (many chunks, more than those in flight, a short last one, blocks of
// different sizes, an empty one) equal those with one message per step.
TEST(LocalComm, PipelinedChunksGiveTheBitsOfOneMessagePerStep) {
  for (int n : {2, 3, 4}) {
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{20001}}) {
      for (const char* direct_max : {"0", "1000000000"}) {  // ring, then direct
        const ThreeCollectives whole = run_three_collectives(n, count, "whole", {{"direct_max_bytes", direct_max}});
        const ThreeCollectives chunked = run_three_collectives(n, count, "chunked", {{"direct_max_bytes", direct_max}, {"chunk_bytes", "64"}});
        for (int r = 0; r < n; ++r) {
          const auto i = static_cast<std::size_t>(r);
          const std::string what = std::to_string(n) + " ranks, count " + std::to_string(count) + ", direct_max_bytes " + direct_max + ", rank " + std::to_string(r);
          ASSERT_EQ(whole.all_reduce[i].size(), count) << what;
          if (count > 0) {  // bit for bit (memcmp of an empty vector's null data() is undefined)
            EXPECT_EQ(0, std::memcmp(whole.all_reduce[i].data(), chunked.all_reduce[i].data(), count * sizeof(float))) << what;
            EXPECT_EQ(0, std::memcmp(whole.all_reduce[i].data(), whole.all_reduce[0].data(), count * sizeof(float))) << what << ": differs from rank 0";
          }
          EXPECT_EQ(whole.reduce_scatter[i], chunked.reduce_scatter[i]) << what;
          EXPECT_EQ(whole.all_gather[i], chunked.all_gather[i]) << what;
          std::size_t o = 0;
          for (int from = 0; from < n; ++from) {
            const std::size_t c = from == 1 ? 0 : count + static_cast<std::size_t>(from) * 37;
            for (std::size_t e = 0; e < c; ++e) ASSERT_EQ(chunked.all_gather[i][o++], static_cast<float>(from) + 0.5f) << what;
          }
        }
        if (count == 20001) {  // and the values are right
          double want = 0;
          for (int r = 0; r < n; ++r) want += 1.0 / (r * 7 + 20000 % 13 + 1);
          EXPECT_NEAR(chunked.all_reduce[0][20000], want, 1e-6);
          double avg = 0;  // reduce_scatter's element 0 of member 0
          for (int r = 0; r < n; ++r) avg += 1.0 / (r + 1);
          EXPECT_NEAR(chunked.reduce_scatter[0][0], avg / n, 1e-12);
        }
      }
    }
  }
  PluginRegistry registry;
  registry.discover({{BUILTIN_PLUGIN_DIR, PluginSource::Origin::builtin}});
  try {
    registry.make_comm_backend("local", {{"chunk_bytes", "12"}});
    ADD_FAILURE() << "chunk_bytes=12 was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("local: option chunk_bytes='12' must be a size in bytes from 64 to 1024G"));
  }
  EXPECT_NO_THROW(registry.make_comm_backend("local", {{"chunk_bytes", "256K"}, {"direct_max_bytes", "0"}}));
  try {
    registry.make_comm_backend("local", {{"shm_chunk_bytes", "128M"}});
    ADD_FAILURE() << "shm_chunk_bytes=128M was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("local: option shm_chunk_bytes='128M' must be a size in bytes from 64 to 64M"));
  }
  EXPECT_THROW(registry.make_comm_backend("local", {{"shm", "yes"}}), std::invalid_argument);
  EXPECT_THROW(registry.make_comm_backend("local", {{"direct_max_bytes", "-1"}}), std::invalid_argument);
  EXPECT_THROW(registry.make_comm_backend("local", {{"direct_max_bytes", "4Q"}}), std::invalid_argument);
}

// Through shared memory each member reduces its own block from every member's copy, in the
// direct algorithm's order (its own, then me+1, me+2, ...): with 64-byte rounds (many rounds,
// slots reused, blocks of different sizes, an empty one) the results are the bits of direct.
TEST(LocalComm, SharedMemoryRoundsGiveTheBitsOfTheDirectAlgorithm) {
  for (int n : {2, 3, 4}) {
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{20001}}) {
      const ThreeCollectives direct = run_three_collectives(n, count, "direct", {{"shm", "off"}, {"direct_max_bytes", "1G"}}, /*with_store=*/true);
      const ThreeCollectives shm = run_three_collectives(n, count, "shm", {{"shm_chunk_bytes", "64"}}, /*with_store=*/true);
      for (int r = 0; r < n; ++r) {
        const auto i = static_cast<std::size_t>(r);
        const std::string what = std::to_string(n) + " ranks, count " + std::to_string(count) + ", rank " + std::to_string(r);
        ASSERT_EQ(shm.all_reduce[i].size(), count) << what;
        // (4 ranks' all_reduce up to 64 KiB is recursive doubling, another order: values only)
        if (count > 0 && (n != 4 || count * sizeof(float) > 65536)) {
          EXPECT_EQ(0, std::memcmp(direct.all_reduce[i].data(), shm.all_reduce[i].data(), count * sizeof(float))) << what;
        }
        for (std::size_t e = 0; e < count; ++e) ASSERT_NEAR(shm.all_reduce[i][e], direct.all_reduce[i][e], 1e-6) << what;
        EXPECT_EQ(direct.reduce_scatter[i], shm.reduce_scatter[i]) << what;
        EXPECT_EQ(direct.all_gather[i], shm.all_gather[i]) << what;
      }
      if (count == 20001) {
        double want = 0;
        for (int r = 0; r < n; ++r) want += 1.0 / (r * 7 + 20000 % 13 + 1);
        EXPECT_NEAR(shm.all_reduce[0][20000], want, 1e-6);
      }
    }
  }
}

TEST(LocalComm, GatherScatterAllToAllBroadcastAndBarrier) {
  for (int n : {2, 3, 4}) {
    on_ranks(n, "mix", [&](int rank, CommBackend& b) {
      std::vector<std::size_t> counts;
      std::size_t total = 0;
      for (int r = 0; r < n; ++r) counts.push_back(static_cast<std::size_t>(r + 2)), total += static_cast<std::size_t>(r + 2);  // uneven
      // all_gather: member r contributes counts[r] copies of r.
      std::vector<float> mine(counts[static_cast<std::size_t>(rank)], static_cast<float>(rank)), all(total);
      ASSERT_TRUE(b.all_gather(0, {mine.data(), mine.size()}, {all.data(), total}, counts)->wait(30));
      std::size_t o = 0;
      for (int r = 0; r < n; ++r) {
        for (std::size_t i = 0; i < counts[static_cast<std::size_t>(r)]; ++i) ASSERT_EQ(all[o++], static_cast<float>(r));
      }
      // reduce_scatter: everyone sends 1..total; member r gets its slice times n.
      std::vector<double> in(total), out(counts[static_cast<std::size_t>(rank)]);
      for (std::size_t i = 0; i < total; ++i) in[i] = static_cast<double>(i + 1);
      ASSERT_TRUE(b.reduce_scatter(0, {in.data(), total, CommDType::f64}, {out.data(), out.size(), CommDType::f64}, counts, ReduceOp::sum)->wait(30));
      std::size_t start = 0;
      for (int r = 0; r < rank; ++r) start += counts[static_cast<std::size_t>(r)];
      for (std::size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], static_cast<double>(n * static_cast<int>(start + i + 1)));
      // all_to_all: block j of member r is 100 r + j, one element each.
      std::vector<std::int64_t> send(static_cast<std::size_t>(n)), recv(static_cast<std::size_t>(n));
      for (int j = 0; j < n; ++j) send[static_cast<std::size_t>(j)] = 100 * rank + j;
      std::vector<std::size_t> ones(static_cast<std::size_t>(n), 1);
      ASSERT_TRUE(b.all_to_all(0, {send.data(), send.size(), CommDType::i64}, {recv.data(), recv.size(), CommDType::i64}, ones, ones)->wait(30));
      for (int j = 0; j < n; ++j) ASSERT_EQ(recv[static_cast<std::size_t>(j)], 100 * j + rank);
      // broadcast from the last member, then a barrier.
      std::vector<float> x(5, rank == n - 1 ? 42.0f : 0.0f);
      ASSERT_TRUE(b.broadcast(0, {x.data(), x.size()}, n - 1)->wait(30));
      for (float v : x) ASSERT_EQ(v, 42.0f);
      ASSERT_TRUE(b.barrier(0)->wait(30));
    });
  }
}

TEST(LocalComm, TwoGroupsRunCollectivesAtTheSameTime) {
  on_ranks(4, "groups", [&](int rank, CommBackend& b) {
    const int pairs = b.new_group(rank < 2 ? std::vector<int>{0, 1} : std::vector<int>{2, 3});
    const int evens_odds = b.new_group(rank % 2 == 0 ? std::vector<int>{0, 2} : std::vector<int>{1, 3});
    std::vector<float> a(1000, static_cast<float>(rank)), c(1000, static_cast<float>(rank));
    auto w1 = b.all_reduce(pairs, {a.data(), a.size()}, ReduceOp::sum);
    auto w2 = b.all_reduce(evens_odds, {c.data(), c.size()}, ReduceOp::sum);
    ASSERT_TRUE(w1->wait(30));
    ASSERT_TRUE(w2->wait(30));
    EXPECT_EQ(a[999], rank < 2 ? 1.0f : 5.0f);
    EXPECT_EQ(c[999], rank % 2 == 0 ? 2.0f : 4.0f);
  });
}

// Pipeline stages post a receive before the send its peer waits for, both ways at once (1F1B's
// exchanges), with collectives of their own groups in between: a send or receive in flight
// holds up nothing behind it, and messages of one pair meet by tag, in any order.
TEST(LocalComm, SendsAndReceivesInFlightHoldUpNothingBehindThem) {
  on_ranks(4, "p2p", [&](int rank, CommBackend& b) {
    const int pair = b.new_group(rank < 2 ? std::vector<int>{0, 1} : std::vector<int>{2, 3});
    const int peer = (rank + 2) % 4;  // the other stage
    const std::size_t n = 1 << 20;    // 4 MiB: past any eager threshold
    std::vector<float> out(n, static_cast<float>(rank + 1)), in(n, 0), out2(n, static_cast<float>(10 * (rank + 1))), in2(n, 0);
    auto r1 = b.recv({in.data(), n}, peer, 7);  // posted first: the peer's send comes later
    std::vector<float> sum(1000, static_cast<float>(rank));
    auto ar = b.all_reduce(pair, {sum.data(), sum.size()}, ReduceOp::sum);
    auto r2 = b.recv({in2.data(), n}, peer, 3);
    auto s2 = b.send({out2.data(), n}, peer, 3);  // the tags in the other order than the receives
    auto s1 = b.send({out.data(), n}, peer, 7);
    ASSERT_TRUE(ar->wait(30));
    ASSERT_TRUE(r1->wait(30));
    ASSERT_TRUE(r2->wait(30));
    ASSERT_TRUE(s1->wait(30));
    ASSERT_TRUE(s2->wait(30));
    EXPECT_EQ(sum[999], rank < 2 ? 1.0f : 5.0f);
    EXPECT_EQ(in[n - 1], static_cast<float>(peer + 1));
    EXPECT_EQ(in2[0], static_cast<float>(10 * (peer + 1)));
  });
}

TEST(LocalComm, RanksInAnotherProcessAreRefusedByName) {
  comm::TcpStoreServer server("127.0.0.1", 0, "tok");
  comm::TcpStore store("127.0.0.1", server.port(), "tok", 10);
  store.set("spmdx/local/g0/pid", "1");  // as if rank 0 were process 1
  PluginRegistry registry;
  registry.discover({{BUILTIN_PLUGIN_DIR, PluginSource::Origin::builtin}});
  auto b = registry.make_comm_backend("local");
  try {
    b->init({1, 2, 0, &store, 10});
    FAIL() << "a rank in another process must be refused";
  } catch (const CommError& e) {
    EXPECT_THAT(e.what(), HasSubstr("local: rank 1 is process"));
    EXPECT_THAT(e.what(), HasSubstr("use ucx for ranks in processes"));
  }
  EXPECT_THROW(registry.make_comm_backend("local", {{"jobb", "x"}}), std::invalid_argument);
}

}  // namespace
}  // namespace spmdx
