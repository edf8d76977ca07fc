// The rendezvous store: a small TCP key-value server (set, get that waits, add) that rank 0
// or the launcher serves, and the client every rank uses — the role c10d's TCPStore plays for
// torchrun. Binds loopback unless told otherwise.
//
// Wire format (both directions): frames of [u32 length][bytes], little endian. A request is
// a frame with the command followed by its argument frames; the reply is one frame ("OK", a
// value, a number, or "ERR <reason>"). A connection starts with a handshake and then
// authentication:
//   "HELLO spmdx-store 2"             -> "SPMDX-STORE 2"  (protocol 2; "ERR ..." for another)
//   "AUTH" <token> <rank>             -> "OK" | "ERR wrong job token"
// so that a port held by another service, a stopped process or an older spmdx store fails at
// once or at a deadline, never waits silently. The server records each refused token under
// kRejectedKey ("rank R from ADDR: wrong job token"), so that the ranks waiting for that rank
// can say why it never joined.
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

/// The store's wire protocol version (the handshake's); 1 had no handshake.
inline constexpr int kStoreProtocol = 2;
/// Where the server lists the connections it refused for a wrong job token, one line each.
inline constexpr const char* kRejectedKey = "spmdx/store/rejected";
/// How many connections the server refused (an integer key, for polling with add 0).
inline constexpr const char* kRejectedCountKey = "spmdx/store/rejected_count";

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
  /// shakes hands and authenticates with `token` as `rank` (-1: not a rank, e.g. the
  /// launcher). Logs what it waits for after 5 s. Throws CommError naming host:port and what
  /// did not answer: nothing listening, a listener that does not answer the handshake within
  /// the timeout or answers as something else (another service, an older spmdx store), or a
  /// wrong job token.
  TcpStore(const std::string& host, int port, const std::string& token, double timeout_seconds, int rank = -1);
  ~TcpStore() override;
  /// set and add wait at most the constructor's timeout_seconds for the server's answer; get
  /// waits timeout_seconds for the key (logging what it waits for after 5 s, then every 30 s).
  /// All throw CommError naming the store, the command and the key.
  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key, double timeout_seconds) override;
  std::int64_t add(const std::string& key, std::int64_t delta) override;
  const std::string& address() const noexcept { return where_; }

 private:
  std::string request(const std::vector<std::string>& frames, double seconds, const std::string& what);
  std::string where_;
  double timeout_ = 300;
  int fd_ = -1;
  std::mutex mutex_;
};

}  // namespace spmdx::comm
