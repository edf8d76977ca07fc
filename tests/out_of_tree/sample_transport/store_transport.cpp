// store_transport: the smallest transport that moves bytes between rank processes, through the
// job's key-value store (spmdx::Store): a message is a store key, named by sender, receiver, tag
// and its number among that pair's messages under that tag (MPI's matching order). Slow (three
// store round trips a message) and it never frees keys: a sample of the Transport contract for
// third parties, and the out-of-tree test's proof that spmdx's collective engine runs over a
// transport built elsewhere. Capability score 0: "auto" never prefers it; pin it with
// comm.backend = "store_transport:shm=off" (shm=off, or groups on one host bypass it).
#include <spmdx/plugin.h>
#include <spmdx/transport.h>

#include <cstring>
#include <map>
#include <stdexcept>
#include <tuple>

namespace {

class StoreTransport final : public spmdx::Transport {
 public:
  explicit StoreTransport(const spmdx::Options& options) {
    if (!options.empty()) throw std::invalid_argument("store_transport: it takes no options of its own");
  }

  void connect(const spmdx::CommInit& init) override {
    if (init.store == nullptr) throw std::invalid_argument("store_transport: needs the job's store (ranks started by spmdx run or a launcher)");
    store_ = init.store;
    rank_ = init.rank;
    prefix_ = "store_transport/g" + std::to_string(init.generation) + "/";
  }
  std::string describe() const override { return "messages through the job's store"; }
  std::vector<spmdx::CommCapability> capabilities() const override {
    return {{"*", spmdx::MemoryType::host, 0, static_cast<std::size_t>(-1), 0}};
  }

  std::uint64_t isend(int peer, const void* data, std::size_t bytes, std::uint64_t tag) override {
    const std::string key = next_key(rank_, peer, tag, sent_);
    store_->set(key, std::string(static_cast<const char*>(data), bytes));
    store_->add(key + "/ready", 1);  // after the value: a receiver that sees this can get it
    return 0;                        // the store holds a copy: complete at once
  }

  std::uint64_t irecv(int peer, void* data, std::size_t bytes, std::uint64_t tag) override {
    const std::uint64_t id = ++last_id_;
    pending_[id] = {next_key(peer, rank_, tag, received_), data, bytes, peer};
    return id;
  }

  bool test(std::uint64_t request) override {
    // Sends complete at once, so only receives are outstanding; progressing the one tested is
    // enough here (a transport with outstanding sends must progress them too).
    auto it = pending_.find(request);
    if (it == pending_.end()) return true;
    Pending& p = it->second;
    if (store_->add(p.key + "/ready", 0) == 0) return false;
    const std::string value = store_->get(p.key, 5);
    if (value.size() != p.bytes) {
      throw spmdx::CommError("store_transport: rank " + std::to_string(p.peer) + " sent " + std::to_string(value.size()) + " bytes, rank " +
                                 std::to_string(rank_) + " expected " + std::to_string(p.bytes),
                             p.peer);
    }
    if (p.bytes > 0) std::memcpy(p.data, value.data(), p.bytes);
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

  std::string next_key(int from, int to, std::uint64_t tag, Count& count) const {
    const std::uint64_t n = count[{from, to, tag}]++;
    return prefix_ + std::to_string(from) + ">" + std::to_string(to) + "/" + std::to_string(tag) + "/" + std::to_string(n);
  }

  spmdx::Store* store_ = nullptr;
  int rank_ = 0;
  std::string prefix_;
  Count sent_, received_;
  std::map<std::uint64_t, Pending> pending_;
  std::uint64_t last_id_ = 0;
};

void register_store_transport(spmdx::Registrar& r) {
  r.add_transport("store_transport", {{}, [](const spmdx::Options& o) { return std::make_unique<StoreTransport>(o); }});
}

}  // namespace

SPMDX_PLUGIN("store_transport", comm, "0.0.1", "sample out-of-tree transport: messages through the job's store", register_store_transport)
