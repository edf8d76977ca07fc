// local: N ranks as threads of one process, for tests and debugging (as PyTorch's threaded
// process group, torch.testing._internal.distributed.multi_threaded_pg). A transport: in-process
// mailboxes with MPI-style tag matching; the collectives are the host's engine (ring, recursive
// doubling, pairwise, binomial tree, shared memory), so a test over `local` runs the same
// algorithms as `ucx` without processes. Never for ranks in separate processes: the plugin is
// flagged in-process only, and with a store connect() checks that every rank shares this
// process and fails naming the rank otherwise.
//
// Options: job, a name that tells apart several jobs in one process (default "default"); and
// the engine's (chunk_bytes, direct_max_bytes, shm, shm_chunk_bytes).
#include <unistd.h>

#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <unordered_map>

#include "spmdx/plugin.h"
#include "spmdx/transport.h"

namespace {

using spmdx::CommError;

// The mailboxes of one job in this process: per destination rank, the messages that arrived
// before their receive was posted, and the receives posted before their message.
struct World {
  struct Message {
    int from;
    std::uint64_t tag;
    std::vector<char> bytes;
  };
  struct Receive {
    int from;
    std::uint64_t tag;
    void* data;
    std::size_t bytes;
    std::uint64_t id;
  };
  explicit World(int world_size) : unexpected(static_cast<std::size_t>(world_size)), posted(static_cast<std::size_t>(world_size)) {}
  std::mutex mutex;
  std::vector<std::deque<Message>> unexpected;
  std::vector<std::deque<Receive>> posted;
  std::map<std::pair<int, std::uint64_t>, std::string> done;  // (rank, request) -> "" or the error
};

std::shared_ptr<World> join_world(const std::string& key, int world_size) {
  static std::mutex mutex;
  static std::map<std::string, std::weak_ptr<World>> worlds;
  std::lock_guard lock(mutex);
  auto& slot = worlds[key];
  auto world = slot.lock();
  if (!world) {
    world = std::make_shared<World>(world_size);
    slot = world;
  }
  if (world->posted.size() != static_cast<std::size_t>(world_size)) {
    throw std::invalid_argument("local: job '" + key + "' already has " + std::to_string(world->posted.size()) + " ranks, not " + std::to_string(world_size));
  }
  return world;
}

class LocalTransport final : public spmdx::Transport {
 public:
  explicit LocalTransport(const spmdx::Options& options) {
    if (auto it = options.find("job"); it != options.end()) job_ = it->second;
  }

  void connect(const spmdx::CommInit& init) override {
    if (init.store != nullptr && init.world_size > 1) {  // every rank must be a thread of this process
      const std::string key = "spmdx/local/g" + std::to_string(init.generation) + "/pid";
      if (init.rank == 0) init.store->set(key, std::to_string(::getpid()));
      const std::string pid = init.store->get(key, init.timeout_seconds);
      if (pid != std::to_string(::getpid())) {
        throw CommError("local: rank " + std::to_string(init.rank) + " is process " + std::to_string(::getpid()) + ", rank 0 is process " + pid +
                            "; the local backend runs ranks as threads of one process (tests, debugging): use ucx for ranks in processes",
                        0);
      }
    }
    world_ = join_world(job_ + "/g" + std::to_string(init.generation), init.world_size);
    rank_ = init.rank;
  }

  std::string describe() const override { return "threads of one process, job " + job_; }

  std::vector<spmdx::CommCapability> capabilities() const override {
    return {{"*", spmdx::MemoryType::host, 0, static_cast<std::size_t>(-1), 1}};
  }

  std::uint64_t isend(int peer, const void* data, std::size_t bytes, std::uint64_t tag) override {
    std::lock_guard lock(world_->mutex);
    auto& posted = world_->posted.at(static_cast<std::size_t>(peer));
    for (auto it = posted.begin(); it != posted.end(); ++it) {
      if (it->from != rank_ || it->tag != tag) continue;
      std::string error;
      if (it->bytes != bytes) {
        error = "local: rank " + std::to_string(rank_) + " sent " + std::to_string(bytes) + " bytes, rank " + std::to_string(peer) + " expected " +
                std::to_string(it->bytes) + " (the ranks are running different collectives)";
      } else if (bytes > 0) {
        std::memcpy(it->data, data, bytes);
      }
      world_->done[{peer, it->id}] = error;
      posted.erase(it);
      if (!error.empty()) throw CommError(error, peer);
      return 0;  // delivered: done at once
    }
    const char* p = static_cast<const char*>(data);
    world_->unexpected.at(static_cast<std::size_t>(peer)).push_back({rank_, tag, std::vector<char>(p, p + bytes)});
    return 0;  // buffered: the caller may reuse its buffer
  }

  std::uint64_t irecv(int peer, void* data, std::size_t bytes, std::uint64_t tag) override {
    std::lock_guard lock(world_->mutex);
    auto& queue = world_->unexpected.at(static_cast<std::size_t>(rank_));
    for (auto it = queue.begin(); it != queue.end(); ++it) {
      if (it->from != peer || it->tag != tag) continue;
      if (it->bytes.size() != bytes) {
        const std::string error = "local: rank " + std::to_string(peer) + " sent " + std::to_string(it->bytes.size()) + " bytes, rank " +
                                  std::to_string(rank_) + " expected " + std::to_string(bytes) + " (the ranks are running different collectives)";
        queue.erase(it);
        throw CommError(error, peer);
      }
      if (bytes > 0) std::memcpy(data, it->bytes.data(), bytes);
      queue.erase(it);
      return 0;
    }
    const std::uint64_t id = ++next_;
    world_->posted.at(static_cast<std::size_t>(rank_)).push_back({peer, tag, data, bytes, id});
    peers_[id] = peer;
    return id;
  }

  bool test(std::uint64_t id) override {
    if (id == 0) return true;
    std::lock_guard lock(world_->mutex);
    auto it = world_->done.find({rank_, id});
    if (it == world_->done.end()) return false;
    const std::string error = it->second;
    world_->done.erase(it);
    const int peer = peers_[id];
    peers_.erase(id);
    if (!error.empty()) throw CommError(error, peer);
    return true;
  }

  ~LocalTransport() override {  // forget receives still posted (an aborted operation)
    if (!world_) return;
    std::lock_guard lock(world_->mutex);
    auto& posted = world_->posted.at(static_cast<std::size_t>(rank_));
    for (auto it = posted.begin(); it != posted.end();) it = peers_.count(it->id) ? posted.erase(it) : std::next(it);
  }

 private:
  std::string job_ = "default";
  std::shared_ptr<World> world_;
  int rank_ = 0;
  std::uint64_t next_ = 0;
  std::unordered_map<std::uint64_t, int> peers_;
};

void register_local(spmdx::Registrar& r) {
  r.add_transport("local", {{"job"}, [](const spmdx::Options& options) { return std::make_unique<LocalTransport>(options); }});
}

}  // namespace

SPMDX_PLUGIN_WITH_FLAGS("local", comm, "0.2.0", "N ranks as threads of one process (tests, debugging): in-process mailboxes under the host's collectives",
                        register_local, spmdx::kPluginInProcessOnly)
