// exec::all_to_all_single (core/src/exec/comm_lowering.h): torch.distributed.all_to_all_single
// with split sizes only the senders know, over the local backend's real engine on 3 ranks as
// threads. Rows along the leading dim; some splits empty; the receiver learns its split sizes
// from the call, its output is as many rows as it may receive, zeros past those received.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <thread>

#include "../core/src/exec/comm_lowering.h"
#include "spmdx/core/registry.h"

namespace spmdx {
namespace {

// Runs body(rank, backend) on `n` threads, each with its own initialised local backend.
void on_ranks(int n, const std::string& job, const std::function<void(int, CommBackend&)>& body) {
  PluginRegistry registry;
  registry.discover({{BUILTIN_PLUGIN_DIR, PluginSource::Origin::builtin}});
  std::vector<std::unique_ptr<CommBackend>> backends;
  for (int r = 0; r < n; ++r) backends.push_back(registry.make_comm_backend("local", {{"job", job}}));
  std::vector<std::thread> threads;
  std::vector<std::string> errors(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      const auto i = static_cast<std::size_t>(r);
      try {
        backends[i]->init({r, n, 0, nullptr, 30});
        body(r, *backends[i]);
        backends[i]->finalize();
      } catch (const std::exception& e) {
        errors[i] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[static_cast<std::size_t>(r)], "") << "rank " << r;
}

// Rows rank r sends rank j (a router's choice): none where r + j is a multiple of 3.
std::int64_t rows(int r, int j) { return (r + j) % 3 == 0 ? 0 : 1 + r + 2 * j; }
// Element c of row i of the block r sends j.
float element(int r, int j, std::int64_t i, std::int64_t c) { return static_cast<float>(1000 * r + 100 * j + 10 * i + c); }

TEST(AllToAllSingle, UnevenSplitsKnownOnlyToTheSendersArriveInMemberOrder) {
  constexpr int n = 3;
  on_ranks(n, "a2a_single", [&](int rank, CommBackend& b) {
    std::vector<std::int64_t> splits;
    std::vector<at::Tensor> blocks;
    for (int j = 0; j < n; ++j) {
      splits.push_back(rows(rank, j));
      at::Tensor block = at::empty({rows(rank, j), 2});
      for (std::int64_t i = 0; i < rows(rank, j); ++i) {
        for (std::int64_t c = 0; c < 2; ++c) block[i][c] = element(rank, j, i, c);
      }
      blocks.push_back(block);
    }
    const at::Tensor x = at::cat(blocks);
    const std::int64_t capacity = 20;  // at most 5 + 5 + 5 rows arrive here
    bool ordered = false;
    auto l = exec::all_to_all_single(b, 0, x, splits, capacity, [&] { ordered = true; });
    EXPECT_TRUE(ordered);
    ASSERT_TRUE(l.work->wait(30));
    const at::Tensor out = l.finish();
    EXPECT_EQ(out.sizes().vec(), (std::vector<std::int64_t>{capacity, 2}));
    std::vector<std::int64_t> want_splits;
    for (int j = 0; j < n; ++j) want_splits.push_back(rows(j, rank));
    EXPECT_EQ(l.output_split_sizes(), want_splits);
    std::int64_t at = 0;
    for (int j = 0; j < n; ++j) {
      for (std::int64_t i = 0; i < rows(j, rank); ++i, ++at) {
        for (std::int64_t c = 0; c < 2; ++c) ASSERT_EQ(out[at][c].item<float>(), element(j, rank, i, c)) << "from rank " << j << " row " << i;
      }
    }
    for (; at < capacity; ++at) ASSERT_EQ(out[at].abs().sum().item<float>(), 0.0f) << "row " << at << " past those received";
  });
}

TEST(AllToAllSingle, SplitSizesThatDoNotCoverTheRowsAreNamed) {
  on_ranks(1, "a2a_single_bad", [&](int, CommBackend& b) {
    EXPECT_THAT([&] { exec::all_to_all_single(b, 0, at::zeros({4, 3}), {3}, 4, [] {}); },
                ::testing::ThrowsMessage<std::invalid_argument>(::testing::HasSubstr("input split sizes sum to 3 rows, x has 4")));
  });
}

}  // namespace
}  // namespace spmdx
