// CommQueue: the lock-free ring to the comm thread. The stress test is the one to run under
// the TSan build (cmake --preset tsan && cmake --build --preset tsan --target comm_queue_test).
#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "spmdx/comm/comm_queue.h"

namespace spmdx::comm {
namespace {

TEST(CommQueue, FifoFullAndEmpty) {
  CommQueue<int> q(4);
  int x = 0;
  EXPECT_FALSE(q.try_pop(x));
  for (int i = 1; i <= 4; ++i) {
    int v = i;
    EXPECT_TRUE(q.try_push(v));
  }
  int extra = 5;
  EXPECT_FALSE(q.try_push(extra)) << "four slots";
  EXPECT_EQ(extra, 5) << "a refused item is left as it was";
  for (int i = 1; i <= 4; ++i) {
    ASSERT_TRUE(q.try_pop(x));
    EXPECT_EQ(x, i);
  }
  EXPECT_FALSE(q.try_pop(x));
  EXPECT_THROW(CommQueue<int>(3), std::invalid_argument);
}

TEST(CommQueue, CloseDeliversWhatWasQueuedThenStopsTheConsumer) {
  CommQueue<std::unique_ptr<int>> q(8);
  q.push(std::make_unique<int>(7));
  q.close();
  std::unique_ptr<int> out;
  ASSERT_TRUE(q.pop_wait(out));
  EXPECT_EQ(*out, 7);
  EXPECT_FALSE(q.pop_wait(out));
}

// Four producers push 200,000 numbered items each through a small ring (so they meet it full)
// to one consumer that sleeps when it is empty: every item arrives once, each producer's in order.
TEST(CommQueue, StressManyProducersOneSleepingConsumer) {
  constexpr int kProducers = 4;
  constexpr std::uint64_t kItems = 200000;
  CommQueue<std::uint64_t> q(64);
  std::vector<std::uint64_t> next(kProducers, 0);
  std::atomic<std::uint64_t> received{0};
  std::atomic<bool> ordered{true};
  std::thread consumer([&] {
    std::uint64_t item = 0;
    while (q.pop_wait(item)) {
      const auto producer = static_cast<std::size_t>(item >> 32), n = item & 0xffffffffu;
      if (n != next[producer]) ordered = false;
      next[producer] = n + 1;
      ++received;
    }
  });
  std::vector<std::thread> producers;
  for (int p = 0; p < kProducers; ++p) {
    producers.emplace_back([&, p] {
      for (std::uint64_t i = 0; i < kItems; ++i) {
        q.push((static_cast<std::uint64_t>(p) << 32) | i);
        if (i % 4096 == 0) std::this_thread::sleep_for(std::chrono::microseconds(50));  // let the consumer sleep now and then
      }
    });
  }
  for (auto& t : producers) t.join();
  q.close();
  consumer.join();
  EXPECT_EQ(received.load(), kProducers * kItems);
  EXPECT_TRUE(ordered.load());
  for (int p = 0; p < kProducers; ++p) EXPECT_EQ(next[static_cast<std::size_t>(p)], kItems);
}

}  // namespace
}  // namespace spmdx::comm
