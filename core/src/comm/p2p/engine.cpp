// The engine's spine: the queue from the issuing threads to the communication
// thread, the comm thread's loop, and the waits every algorithm shares.
#include "engine.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>

#include "spmdx/core/clock.h"
#include "spmdx/text.h"

namespace spmdx::comm {

class P2PEngine::OpWork final : public Work {
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

std::unique_ptr<CommBackend> make_p2p_backend(std::string name, std::unique_ptr<Transport> transport, P2POptions options) {
  return std::make_unique<P2PEngine>(std::move(name), std::move(transport), options);
}

P2PEngine::P2PEngine(std::string name, std::unique_ptr<Transport> transport, P2POptions options)
    : name_(std::move(name)), transport_(std::move(transport)), options_(options) {}

P2PEngine::~P2PEngine() { finalize(); }

void P2PEngine::init(const CommInit& init) {
  if (!transport_) throw std::logic_error(name_ + ": init after finalize; make a new backend");
  connect_transport(init);
  rank_ = init.rank;
  world_size_ = init.world_size;
  shm_.start(init, options_);
  groups_.clear();
  Group all;
  for (int r = 0; r < world_size_; ++r) all.ranks.push_back(r);
  all.me = rank_;
  groups_.push_back(std::move(all));
  aborted_ = false;
  first_failure_.clear();
  first_failure_peer_ = -1;
  queue_.reopen();
  thread_ = std::thread([this] { run(); });
  health_.start(init);
}

void P2PEngine::connect_transport(const CommInit& init) {
  // A plugin's own message may not say whose it is or what it was doing: say so, keeping the
  // type (CommError's peer, invalid_argument's "fix the config") for the callers.
  const std::string context = name_ + " transport, rank " + std::to_string(init.rank) + " connecting to " + std::to_string(init.world_size) + " ranks: ";
  auto prefixed = [&](const std::exception& e) {
    const std::string what = e.what();
    return what.rfind(name_ + ":", 0) == 0 || what.rfind(name_ + " ", 0) == 0 ? what : context + what;
  };
  try {
    transport_->connect(init);
  } catch (const CommError& e) {
    throw CommError(prefixed(e), e.peer());
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(prefixed(e));
  } catch (const std::exception& e) {
    throw std::runtime_error(prefixed(e));
  }
}

void P2PEngine::stop() {
  queue_.close();  // the comm thread drains what is queued, then ends
  if (thread_.joinable()) thread_.join();
  health_.stop();
  std::lock_guard lock(mutex_);
  for (Group& g : groups_) g.shm.reset(), g.shm_state = 0;  // unmapped now, not when the backend goes
}

void P2PEngine::finalize() {
  stop();
  transport_.reset();  // after the comm thread, the transport's only caller, has ended
}

void P2PEngine::abort() noexcept {
  aborted_ = true;  // queued operations fail at once; one in progress fails at its next poll
}

std::string P2PEngine::describe() const {
  return name_ + " (" + (transport_ ? transport_->describe() : std::string("finalized")) + ", " + options_.str() + ") rank " +
         std::to_string(rank_) + "/" + std::to_string(world_size_);
}

bool P2PEngine::use_direct(std::size_t members, std::size_t bytes) const {
  return members > 1 && members <= kDirectMaxMembers && bytes <= options_.direct_max_bytes;
}

int P2PEngine::new_group(const std::vector<int>& ranks) {
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

std::unique_ptr<Work> P2PEngine::submit(const char* name, int group, std::function<void(Op&)> body,
                                        std::function<std::pair<std::uint64_t, int>(Op&)> post) {
  auto op = std::make_shared<Op>();
  op->name = name;
  op->group = group;
  op->body = std::move(body);
  op->post = std::move(post);
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

void P2PEngine::run() {
  auto idle_since = Health::Clock::now();
  while (true) {
    std::shared_ptr<Op> op;
    if (posted_.empty()) {
      if (!queue_.pop_wait(op)) return;  // closed and drained
    } else if (!queue_.try_pop(op)) {
      // Sends and receives in flight, nothing queued: poll them, backing off as wait_all does
      // (ranks share few cores with their compute threads).
      const auto now = Health::Clock::now();
      if (progress_posted()) {
        idle_since = now;
      } else if (now - idle_since > std::chrono::microseconds(2000)) {
        std::this_thread::sleep_for(std::chrono::microseconds(now - idle_since > std::chrono::milliseconds(50) ? 200 : 20));
      } else if (now - idle_since > std::chrono::microseconds(20)) {
        std::this_thread::yield();
      }
      continue;
    }
    idle_since = Health::Clock::now();
    std::string error;
    int peer = -1;
    const double started_at = wall_seconds();
    if (aborted_) {
      error = std::string(op->name) + " aborted: " + (first_failure_.empty() ? "the backend was aborted" : "an earlier collective failed: " + first_failure_);
      peer = first_failure_peer_;
    } else {
      try {
        if (op->post) {  // a send or receive: posted now, completed by progress_posted
          const auto [request, to] = op->post(*op);
          posted_.push_back({op, request, to, health_.stall(), started_at});
          progress_posted();
          continue;
        }
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
    finish(*op, error, peer, started_at);
    if (!posted_.empty()) progress_posted();
  }
}

void P2PEngine::finish(Op& op, const std::string& error, int peer, double started_at) {
  {
    std::lock_guard lock(op.mutex);
    op.done = true;
    op.error = error;
    op.error_peer = peer;
    op.started_at = started_at;
    op.finished_at = wall_seconds();
  }
  op.cv.notify_all();
}

bool P2PEngine::progress_posted() {
  bool any = false;
  for (std::size_t i = 0; i < posted_.size();) {
    Posted& p = posted_[i];
    std::string error;
    int blamed = -1;
    bool done = false;
    try {
      try {
        done = transport_->test(p.request);
      } catch (const CommError& e) {
        transport_failed(*p.op, p.peer, e);
      }
      if (!done) health_.check_stall(*p.op, p.stall, p.peer);
    } catch (const CommError& e) {
      error = e.what(), blamed = e.peer(), done = true;
      if (first_failure_.empty()) first_failure_ = error, first_failure_peer_ = blamed;
      aborted_ = true;
    }
    if (!done) {
      ++i;
      continue;
    }
    finish(*p.op, error, blamed, p.started_at);
    posted_.erase(posted_.begin() + static_cast<std::ptrdiff_t>(i));
    any = true;
  }
  return any;
}

void P2PEngine::wait_all(Op& op, const std::vector<Request>& requests) {
  Health::Stall stall = health_.stall();
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
        transport_failed(op, requests[i].second, e);
      }
      if (ok) done[i] = true, --left, progressed = true;
    }
    if (left == 0) break;
    const auto now = Health::Clock::now();
    if (progressed) stall.last_progress = now;
    int silent = -1;
    for (std::size_t i = 0; i < requests.size(); ++i) {
      if (!done[i]) silent = requests[i].second;
    }
    health_.check_stall(op, stall, silent);
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

char* P2PEngine::scratch(std::size_t slot, std::size_t bytes) {
  auto& s = scratch_[slot];
  if (s.size < bytes) {  // grown, never shrunk, never zeroed: no page faults or memset per call
    s.data.reset(new char[bytes]);
    s.size = bytes;
  }
  return s.data.get();
}

void P2PEngine::sendrecv(Op& op, int to, const void* sbuf, std::size_t sbytes, int from, void* rbuf, std::size_t rbytes,
                         int explicit_step) {
  const std::uint16_t step = explicit_step >= 0 ? static_cast<std::uint16_t>(explicit_step) : op.step++;
  std::vector<Request> reqs;
  if (from >= 0) reqs.emplace_back(post_recv(op, from, rbuf, rbytes, make_tag(from, op.group, op.seq, step)), from);
  if (to >= 0) reqs.emplace_back(post_send(op, to, sbuf, sbytes, make_tag(rank_, op.group, op.seq, step)), to);
  wait_all(op, reqs);
}

std::uint64_t P2PEngine::post_send(Op& op, int to, const void* data, std::size_t bytes, std::uint64_t tag) {
  try {
    return transport_->isend(to, data, bytes, tag);
  } catch (const CommError& e) {
    transport_failed(op, to, e);
  }
}

std::uint64_t P2PEngine::post_recv(Op& op, int from, void* data, std::size_t bytes, std::uint64_t tag) {
  try {
    return transport_->irecv(from, data, bytes, tag);
  } catch (const CommError& e) {
    transport_failed(op, from, e);
  }
}

void P2PEngine::transport_failed(Op& op, int peer, const CommError& e) {
  // Said in the store, so that the peers waiting on this rank fail at their next check rather
  // than at the timeout; a peer that already exited because another rank failed is not the one
  // to blame. A transport that names the rank at fault (itself, for a link of its own that went
  // down) is believed over the peer it was talking to.
  const int at_fault = e.peer() >= 0 ? e.peer() : peer;
  int blamed = health_.reported_fault();
  if (blamed < 0) {
    health_.report_fault(at_fault);
    blamed = at_fault;
  }
  throw CommError(op_name(op) + " failed talking to rank " + std::to_string(peer) + ": " + e.what() +
                      (blamed != at_fault ? "; rank " + std::to_string(blamed) + " failed first" : ""),
                  blamed);
}

}  // namespace spmdx::comm
