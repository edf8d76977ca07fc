// Test plugin "test_flaky": a transport that moves messages through the job's store (as
// tests/out_of_tree/sample_transport does) and can be made to fail, for comm.fallback's tests:
//   kill_rank=R;kill_after=N  on rank R, after N messages sent, the transport is dead: every
//                             send and receive throws CommError, as a link that went down
//   refuse_rank=R             on rank R, connect() throws CommError: a backend that cannot
//                             start on one rank of the job
// Use with shm=off (the engine's option), so that groups on one host use it.
#include <spmdx/options.h>
#include <spmdx/plugin.h>
#include <spmdx/transport.h>

#include <cstring>
#include <map>
#include <tuple>

namespace {

class FlakyTransport final : public spmdx::Transport {
 public:
  explicit FlakyTransport(const spmdx::Options& options) {
    spmdx::OptionReader o("test_flaky", options);
    kill_rank_ = static_cast<int>(o.get_int("kill_rank", -1, -1, 1 << 20));
    kill_after_ = o.get_int("kill_after", 0, 0, std::int64_t{1} << 40);
    refuse_rank_ = static_cast<int>(o.get_int("refuse_rank", -1, -1, 1 << 20));
    o.done();
  }

  void connect(const spmdx::CommInit& init) override {
    if (init.rank == refuse_rank_) throw spmdx::CommError("test_flaky: rank " + std::to_string(init.rank) + " refuses to connect (refuse_rank)", -1);
    store_ = init.store;
    rank_ = init.rank;
    prefix_ = "test_flaky/g" + std::to_string(init.generation) + "/";
  }
  std::string describe() const override { return "test_flaky (messages through the store)"; }
  std::vector<spmdx::CommCapability> capabilities() const override {
    return {{"*", spmdx::MemoryType::host, 0, static_cast<std::size_t>(-1), 0}};
  }

  std::uint64_t isend(int peer, const void* data, std::size_t bytes, std::uint64_t tag) override {
    check_alive();
    ++sends_;
    const std::string key = next_key(rank_, peer, tag, sent_);
    store_->set(key, std::string(static_cast<const char*>(data), bytes));
    store_->add(key + "/ready", 1);
    return 0;
  }

  std::uint64_t irecv(int peer, void* data, std::size_t bytes, std::uint64_t tag) override {
    check_alive();
    const std::uint64_t id = ++last_id_;
    pending_[id] = {next_key(peer, rank_, tag, received_), data, bytes, peer};
    return id;
  }

  bool test(std::uint64_t request) override {
    check_alive();
    auto it = pending_.find(request);
    if (it == pending_.end()) return true;
    Pending& p = it->second;
    if (store_->add(p.key + "/ready", 0) == 0) return false;
    const std::string value = store_->get(p.key, 5);
    if (p.bytes > 0) std::memcpy(p.data, value.data(), std::min(p.bytes, value.size()));
    pending_.erase(it);
    return true;
  }

 private:
  struct Pending {
    std::string key;
    void* data;
    std::size_t bytes;
    int peer;
  };
  using Count = std::map<std::tuple<int, int, std::uint64_t>, std::uint64_t>;

  void check_alive() const {
    if (rank_ == kill_rank_ && sends_ >= kill_after_) {
      throw spmdx::CommError("test_flaky: the transport of rank " + std::to_string(rank_) + " is dead (killed after " + std::to_string(kill_after_) +
                                 " messages: kill_rank, kill_after)",
                             rank_);  // this rank's own link is down: blame it
    }
  }
  std::string next_key(int from, int to, std::uint64_t tag, Count& count) const {
    const std::uint64_t n = count[{from, to, tag}]++;
    return prefix_ + std::to_string(from) + ">" + std::to_string(to) + "/" + std::to_string(tag) + "/" + std::to_string(n);
  }

  int kill_rank_ = -1, refuse_rank_ = -1;
  std::int64_t kill_after_ = 0, sends_ = 0;
  spmdx::Store* store_ = nullptr;
  int rank_ = 0;
  std::string prefix_;
  Count sent_, received_;
  std::map<std::uint64_t, Pending> pending_;
  std::uint64_t last_id_ = 0;
};

void register_flaky(spmdx::Registrar& r) {
  r.add_transport("test_flaky", {{"kill_rank", "kill_after", "refuse_rank"},
                                 [](const spmdx::Options& o) { return std::make_unique<FlakyTransport>(o); }});
}

}  // namespace

SPMDX_PLUGIN("test_flaky", comm, "1.0.0", "test: a store transport that can be made to fail", register_flaky)
