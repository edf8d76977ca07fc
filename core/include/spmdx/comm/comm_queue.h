// CommQueue (docs/DESIGN.md): the bounded ring between the threads that issue collectives
// and the backend's communication thread. Dmitry Vyukov's bounded MPMC queue (1024cores.net,
// 2010): a power-of-two array of cells, each with a sequence number; producers claim a slot by
// compare-and-swap on the tail, the consumer on the head; no lock on either side. A full ring
// makes producers yield (back-pressure). The consumer sleeps on an atomic counter of pushes
// (C++20 atomic wait: a futex), so an idle comm thread costs no CPU. Completion goes back
// through each operation's Work.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <thread>
#include <utility>

namespace spmdx::comm {

template <class T>
class CommQueue {
 public:
  /// `capacity` slots, a power of two >= 2; throws std::invalid_argument otherwise.
  explicit CommQueue(std::size_t capacity) : mask_(capacity - 1), cells_(new Cell[capacity]) {
    if (capacity < 2 || (capacity & (capacity - 1)) != 0) throw std::invalid_argument("CommQueue: capacity must be a power of two >= 2");
    for (std::size_t i = 0; i < capacity; ++i) cells_[i].seq.store(i, std::memory_order_relaxed);
  }
  CommQueue(const CommQueue&) = delete;
  CommQueue& operator=(const CommQueue&) = delete;

  /// Adds `item` unless the ring is full (false; `item` is left as it was). Any thread.
  bool try_push(T& item) {
    std::size_t pos = tail_.load(std::memory_order_relaxed);
    for (;;) {
      Cell& cell = cells_[pos & mask_];
      const std::size_t seq = cell.seq.load(std::memory_order_acquire);
      const auto diff = static_cast<std::intptr_t>(seq) - static_cast<std::intptr_t>(pos);
      if (diff == 0) {
        if (tail_.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed)) {
          cell.value = std::move(item);
          cell.seq.store(pos + 1, std::memory_order_release);
          pushes_.fetch_add(1, std::memory_order_release);
          pushes_.notify_one();
          return true;
        }
      } else if (diff < 0) {
        return false;  // full
      } else {
        pos = tail_.load(std::memory_order_relaxed);
      }
    }
  }

  /// Adds `item`, yielding while the ring is full. Any thread.
  void push(T item) {
    while (!try_push(item)) std::this_thread::yield();
  }

  /// Takes the oldest item into `out` unless the ring is empty (false).
  bool try_pop(T& out) {
    std::size_t pos = head_.load(std::memory_order_relaxed);
    for (;;) {
      Cell& cell = cells_[pos & mask_];
      const std::size_t seq = cell.seq.load(std::memory_order_acquire);
      const auto diff = static_cast<std::intptr_t>(seq) - static_cast<std::intptr_t>(pos + 1);
      if (diff == 0) {
        if (head_.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed)) {
          out = std::move(cell.value);
          cell.value = T();
          cell.seq.store(pos + mask_ + 1, std::memory_order_release);
          return true;
        }
      } else if (diff < 0) {
        return false;  // empty
      } else {
        pos = head_.load(std::memory_order_relaxed);
      }
    }
  }

  /// Takes the oldest item, sleeping while the ring is empty; false once close() was called and
  /// the ring is empty (items pushed before close() are still delivered).
  bool pop_wait(T& out) {
    for (;;) {
      const std::uint64_t seen = pushes_.load(std::memory_order_acquire);
      if (try_pop(out)) return true;
      if (closed_.load(std::memory_order_acquire)) return try_pop(out);
      pushes_.wait(seen, std::memory_order_acquire);
    }
  }

  /// Wakes the consumer for good: pop_wait() returns false once the ring is drained.
  void close() {
    closed_.store(true, std::memory_order_release);
    pushes_.fetch_add(1, std::memory_order_release);
    pushes_.notify_all();
  }
  /// Opens a closed queue again (a backend started anew).
  void reopen() { closed_.store(false, std::memory_order_release); }

 private:
  struct Cell {
    std::atomic<std::size_t> seq{0};
    T value{};
  };
  const std::size_t mask_;
  std::unique_ptr<Cell[]> cells_;
  alignas(64) std::atomic<std::size_t> tail_{0};
  alignas(64) std::atomic<std::size_t> head_{0};
  alignas(64) std::atomic<std::uint64_t> pushes_{0};
  std::atomic<bool> closed_{false};
};

}  // namespace spmdx::comm
