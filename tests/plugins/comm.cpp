// Test comm plugins "test_comm_a" / "test_comm_b" (COMM_NAME): count live backends in a
// variable of their own library, so a test can tell that a library stays mapped and that its
// destructors run after the registry is gone. COMM_CAPS replaces their capability table
// (test_comm_typo: a misspelt operation). COMM_ABI_MINOR declares an older minor of this ABI
// major (test_comm_abi_4_0: a comm plugin of ABI 4.0, from before VariableAllToAll).
#include <spmdx/plugin.h>

#include <atomic>
#include <stdexcept>
#include <type_traits>

#ifndef COMM_CAPS
#define COMM_CAPS {"*", spmdx::MemoryType::host, 0, static_cast<std::size_t>(-1), 0}
#endif

namespace {

std::atomic<int> g_live{0};

using spmdx::Work;

class CountingBackend final : public spmdx::CommBackend {
  // The registry tests need lifecycle only; collectives are the real backends' business.
  template <class T>
  static auto none() {
    throw std::logic_error("test backend " COMM_NAME " has no collectives");
    if constexpr (std::is_same_v<T, int>) return 0;
    else return std::unique_ptr<T>();
  }

 public:
  explicit CountingBackend(std::string tls) : tls_(std::move(tls)) { ++g_live; }
  ~CountingBackend() override { --g_live; }
  void init(const spmdx::CommInit& init) override { init_ = init; }
  void finalize() override { finalized_ = true; }
  void abort() noexcept override {}
  // By default host memory at the lowest score: listed and checkable, never chosen by "auto"
  // over a real backend.
  std::vector<spmdx::CommCapability> capabilities() const override { return {COMM_CAPS}; }
  int new_group(const std::vector<int>&) override { return none<int>(); }
  std::unique_ptr<spmdx::Work> all_reduce(int, spmdx::CommBuffer, spmdx::ReduceOp) override { return none<Work>(); }
  std::unique_ptr<spmdx::Work> all_gather(int, spmdx::CommBuffer, spmdx::CommBuffer, std::vector<std::size_t>) override {
    return none<Work>();
  }
  std::unique_ptr<spmdx::Work> reduce_scatter(int, spmdx::CommBuffer, spmdx::CommBuffer, std::vector<std::size_t>,
                                              spmdx::ReduceOp) override {
    return none<Work>();
  }
  std::unique_ptr<spmdx::Work> all_to_all(int, spmdx::CommBuffer, spmdx::CommBuffer, std::vector<std::size_t>,
                                          std::vector<std::size_t>) override {
    return none<Work>();
  }
  std::unique_ptr<spmdx::Work> broadcast(int, spmdx::CommBuffer, int) override { return none<Work>(); }
  std::unique_ptr<spmdx::Work> send(spmdx::CommBuffer, int, int) override { return none<Work>(); }
  std::unique_ptr<spmdx::Work> recv(spmdx::CommBuffer, int, int) override { return none<Work>(); }
  std::unique_ptr<spmdx::Work> barrier(int) override { return none<Work>(); }
  std::string describe() const override {
    return std::string(COMM_NAME) + " tls=" + tls_ + " rank " + std::to_string(init_.rank) + "/" +
           std::to_string(init_.world_size) + " generation " + std::to_string(init_.generation) +
           " live " + std::to_string(g_live.load()) + (finalized_ ? " finalized" : "");
  }

 private:
  std::string tls_;
  spmdx::CommInit init_;
  bool finalized_ = false;
};

void register_comm(spmdx::Registrar& r) {
  r.add_comm_backend(COMM_NAME, [](const spmdx::Options& options) {
    auto it = options.find("tls");
    return std::make_unique<CountingBackend>(it == options.end() ? "default" : it->second);
  });
}

}  // namespace

#ifdef COMM_ABI_MINOR
namespace {
const spmdx::PluginDescriptor descriptor{SPMDX_ABI_MAJOR, COMM_ABI_MINOR, COMM_NAME, spmdx::PluginKind::comm, "1.0.0",
                                         "test: a comm backend of an older ABI minor", register_comm, SPMDX_TOOLCHAIN, 0};
const spmdx::PluginDescriptor* entry() { return &descriptor; }
}  // namespace
SPMDX_PLUGIN_ENTRY(entry)
#else
SPMDX_PLUGIN(COMM_NAME, comm, "1.0.0", "test: a comm backend that counts its live instances", register_comm)
#endif
