#include "health.h"

#include <algorithm>

#include "spmdx/comm/health.h"
#include "spmdx/text.h"

namespace spmdx::comm {

void Health::start(const CommInit& init) {
  store_ = init.store;
  rank_ = init.rank;
  world_size_ = init.world_size;
  timeout_ = init.timeout_seconds;
  prefix_ = "spmdx/heartbeat/g" + std::to_string(init.generation) + "/";
  stopping_ = false;
  if (store_ == nullptr) return;
  thread_ = std::thread([this] {
    std::unique_lock lock(mutex_);
    while (!stopping_) {
      try {
        store_->add(prefix_ + std::to_string(rank_), 1);
      } catch (const std::exception&) {
        // the store is gone (rank 0 or the launcher exited): collectives will say so
      }
      cv_.wait_for(lock, std::chrono::milliseconds(300));
    }
  });
}

void Health::stop() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Health::report_fault(int peer) {
  if (store_ == nullptr || peer < 0) return;
  try {
    if (store_->add(prefix_ + "fault_reported", 1) == 1) store_->set(prefix_ + "fault", std::to_string(peer));
    // And for the launcher, across backend generations (see kFaultKey).
    if (store_->add(std::string(kFaultKey) + "_reported", 1) == 1) store_->set(kFaultKey, std::to_string(peer));
  } catch (const std::exception&) {
  }
}

void Health::report_mismatch(const std::string& what) {
  if (store_ == nullptr) return;
  try {
    if (store_->add(std::string(kMismatchKey) + "_reported", 1) == 1) store_->set(kMismatchKey, what);
  } catch (const std::exception&) {
  }
}

int Health::reported_fault() {
  if (store_ == nullptr) return -1;
  try {
    if (store_->add(prefix_ + "fault_reported", 0) == 0) return -1;
    return std::stoi(store_->get(prefix_ + "fault", 5));
  } catch (const std::exception&) {
    return -1;
  }
}

std::vector<int> Health::dead_ranks() {
  if (store_ == nullptr) return {};
  std::vector<std::int64_t> before(static_cast<std::size_t>(world_size_));
  try {
    for (int r = 0; r < world_size_; ++r) before[static_cast<std::size_t>(r)] = store_->add(prefix_ + std::to_string(r), 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    std::vector<int> dead;
    for (int r = 0; r < world_size_; ++r) {
      if (store_->add(prefix_ + std::to_string(r), 0) == before[static_cast<std::size_t>(r)]) dead.push_back(r);
    }
    // This rank's own heartbeat must have advanced: otherwise the store or this machine is too
    // slow to tell, and nobody is called dead.
    if (std::find(dead.begin(), dead.end(), rank_) != dead.end()) return {};
    return dead;
  } catch (const std::exception&) {
    return {};
  }
}

void Health::check_stall(Op& op, Stall& s, int silent) {
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
    const std::string what = op_name(op) + " timed out after " + seconds_text(timeout_) + " s";
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

}  // namespace spmdx::comm
