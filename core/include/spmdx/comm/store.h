// The rendezvous store: a small TCP key-value server (set, get that waits, add) that rank 0
// or the launcher serves, and the client every rank uses — the role c10d's TCPStore plays for
// torchrun. Every connection must first present the job's token. Binds loopback unless told
// otherwise.
//
// Wire format (both directions): frames of [u32 length][bytes], little endian. A request is
// a frame with the command ("AUTH", "SET", "GET", "ADD") followed by its argument frames; the
// reply is one frame ("OK", a value, a number, or "ERR <reason>").
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "spmdx/comm.h"

namespace spmdx::comm {

class TcpStoreServer {
 public:
  /// Listens on host:port (port 0: any free port, see port()). Throws CommError when the
  /// address cannot be bound.
  TcpStoreServer(const std::string& host, int port, std::string token);
  ~TcpStoreServer();  ///< stops serving and closes every connection
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;
  int port() const noexcept { return port_; }

 private:
  struct State;
  void serve();
  std::shared_ptr<State> state_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::thread thread_;
};

class TcpStore final : public Store {
 public:
  /// Connects to host:port, retrying until timeout_seconds pass (the server may start later),
  /// and authenticates with `token`. Throws CommError naming host:port and the reason.
  TcpStore(const std::string& host, int port, const std::string& token, double timeout_seconds);
  ~TcpStore() override;
  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key, double timeout_seconds) override;
  std::int64_t add(const std::string& key, std::int64_t delta) override;

 private:
  std::string request(const std::vector<std::string>& frames);
  std::string where_;
  int fd_ = -1;
  std::mutex mutex_;
};

}  // namespace spmdx::comm
