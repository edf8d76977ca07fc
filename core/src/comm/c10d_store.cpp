#include "spmdx/comm/c10d_store.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <chrono>

namespace spmdx::comm {
namespace {

// c10d reads a timeout of 0 as "no timeout": the shortest wait asked for is 1 ms.
std::chrono::milliseconds ms(double seconds) { return std::chrono::milliseconds(std::max<std::int64_t>(1, static_cast<std::int64_t>(seconds * 1000))); }

class C10dStore final : public Store {
 public:
  C10dStore(const std::string& host, int port, std::string prefix, double timeout) : prefix_(std::move(prefix)), where_(host + ":" + std::to_string(port)) {
    c10d::TCPStoreOptions o;
    o.port = static_cast<std::uint16_t>(port);
    o.isServer = false;
    o.waitWorkers = false;
    o.timeout = ms(timeout);
    try {
      store_ = c10::make_intrusive<c10d::TCPStore>(host, o);
    } catch (const std::exception& e) {
      throw CommError("cannot reach torchrun's c10d store at " + where_ + ": " + e.what(), 0);
    }
  }

  void set(const std::string& key, const std::string& value) override {
    guard(key, [&] { store_->set(prefix_ + key, std::vector<std::uint8_t>(value.begin(), value.end())); });
  }

  std::string get(const std::string& key, double timeout_seconds) override {
    std::string out;
    guard(key, [&] {
      store_->wait({prefix_ + key}, ms(timeout_seconds));
      const auto bytes = store_->get(prefix_ + key);
      out.assign(bytes.begin(), bytes.end());
    });
    return out;
  }

  std::int64_t add(const std::string& key, std::int64_t delta) override {
    std::int64_t out = 0;
    guard(key, [&] { out = store_->add(prefix_ + key, delta); });
    return out;
  }

 private:
  template <class F>
  void guard(const std::string& key, F&& f) {
    try {
      f();
    } catch (const std::exception& e) {
      throw CommError("c10d store at " + where_ + ", key '" + key + "': " + e.what(), -1);
    }
  }
  std::string prefix_, where_;
  c10::intrusive_ptr<c10d::TCPStore> store_;
};

}  // namespace

std::unique_ptr<Store> connect_c10d_store(const std::string& host, int port, const std::string& prefix, double timeout_seconds) {
  return std::make_unique<C10dStore>(host, port, prefix, timeout_seconds);
}

}  // namespace spmdx::comm
