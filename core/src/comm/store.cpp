#include "spmdx/comm/store.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>

#include "spmdx/core/log.h"
#include "spmdx/text.h"

namespace spmdx::comm {
namespace {

using Clock = std::chrono::steady_clock;

constexpr std::uint32_t kMaxFrame = 64u << 20;
const std::string kHello = "HELLO spmdx-store " + std::to_string(kStoreProtocol);
const std::string kWelcome = "SPMDX-STORE " + std::to_string(kStoreProtocol);

enum class Io { ok, closed, timeout, garbage };

// Milliseconds left until `deadline`, rounded up (at least 0), for poll(): rounding down would
// spin through the last millisecond.
int ms_left(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::microseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : static_cast<int>(std::min<long long>((left + 999) / 1000, 1 << 30));
}

// Waits until fd is ready for `events` or the deadline passes.
Io wait_ready(int fd, short events, Clock::time_point deadline) {
  while (true) {
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, ms_left(deadline));
    if (n > 0) return Io::ok;
    if (n == 0) return Io::timeout;
    if (errno != EINTR) return Io::closed;
  }
}

Io write_all(int fd, const void* data, std::size_t n, Clock::time_point deadline) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    if (const Io w = wait_ready(fd, POLLOUT, deadline); w != Io::ok) return w;
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (k <= 0) return Io::closed;
    p += k;
    n -= static_cast<std::size_t>(k);
  }
  return Io::ok;
}

Io read_all(int fd, void* data, std::size_t n, Clock::time_point deadline) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    if (const Io w = wait_ready(fd, POLLIN, deadline); w != Io::ok) return w;
    const ssize_t k = ::recv(fd, p, n, MSG_DONTWAIT);
    if (k < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (k <= 0) return Io::closed;
    p += k;
    n -= static_cast<std::size_t>(k);
  }
  return Io::ok;
}

Io write_frame(int fd, const std::string& s, Clock::time_point deadline) {
  const std::uint32_t n = static_cast<std::uint32_t>(s.size());
  const Io a = write_all(fd, &n, 4, deadline);
  return a != Io::ok ? a : write_all(fd, s.data(), s.size(), deadline);
}

// A frame; `garbage` when its length is beyond any store frame (s: the 4 bytes read, which are
// then what another service sent, e.g. "HTTP" or "SSH-").
Io read_frame(int fd, std::string& s, Clock::time_point deadline) {
  std::uint32_t n = 0;
  if (const Io a = read_all(fd, &n, 4, deadline); a != Io::ok) return a;
  if (n > kMaxFrame) {
    s.assign(reinterpret_cast<const char*>(&n), 4);
    return Io::garbage;
  }
  s.resize(n);
  return read_all(fd, s.data(), n, deadline);
}

// The server's side: blocking reads (one thread per connection; the destructor shuts sockets).
const Clock::time_point kNever = Clock::time_point::max();

// What a reply looks like in a message: printable, at most 60 characters.
std::string shown(const std::string& s) {
  std::string out;
  for (char c : s.substr(0, 60)) out += (c >= 32 && c < 127) ? c : '?';
  return "'" + out + (s.size() > 60 ? "...'" : "'");
}

std::string peer_address(int fd) {
  sockaddr_in a{};
  socklen_t len = sizeof a;
  char host[INET_ADDRSTRLEN] = "?";
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) ::inet_ntop(AF_INET, &a.sin_addr, host, sizeof host);
  return host;
}

}  // namespace

struct TcpStoreServer::State {
  std::string token;
  std::mutex mutex;
  std::condition_variable changed;
  std::map<std::string, std::string> data;
  std::atomic<bool> stopping{false};
  std::mutex clients_mutex;
  std::vector<int> client_fds;
  std::vector<std::thread> clients;
};

TcpStoreServer::TcpStoreServer(const std::string& host, int port, std::string token) : state_(std::make_shared<State>()) {
  state_->token = std::move(token);
  listen_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
  const int one = 1;
  ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  if (::inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1 ||
      ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(listen_fd_, 128) != 0) {
    const std::string why = std::strerror(errno);
    ::close(listen_fd_);
    throw CommError("store: cannot listen on " + host + ":" + std::to_string(port) + ": " + why +
                        " (pick another MASTER_PORT, or free this one)", -1);
  }
  socklen_t len = sizeof addr;
  ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  port_ = ntohs(addr.sin_port);
  thread_ = std::thread([this] { serve(); });
}

TcpStoreServer::~TcpStoreServer() {
  state_->stopping = true;
  ::shutdown(listen_fd_, SHUT_RDWR);
  ::close(listen_fd_);
  thread_.join();
  {
    std::lock_guard lock(state_->clients_mutex);
    for (int fd : state_->client_fds) ::shutdown(fd, SHUT_RDWR);
  }
  state_->changed.notify_all();
  for (auto& t : state_->clients) t.join();
}

void TcpStoreServer::serve() {
  while (!state_->stopping) {
    pollfd p{listen_fd_, POLLIN, 0};
    if (::poll(&p, 1, 200) <= 0) continue;
    const int fd = ::accept(listen_fd_, nullptr, nullptr);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    std::lock_guard lock(state_->clients_mutex);
    state_->client_fds.push_back(fd);
    state_->clients.emplace_back([state = state_, fd] {
      std::string cmd, a, b, c;
      bool hello = false, authed = false;
      auto read = [&](std::string& s) { return read_frame(fd, s, kNever) == Io::ok; };
      while (!state->stopping && read(cmd)) {
        std::string reply;
        if (cmd.rfind("HELLO ", 0) == 0) {
          hello = cmd == kHello;
          reply = hello ? kWelcome
                        : "ERR this spmdx store speaks protocol " + std::to_string(kStoreProtocol) + ", the client asked for " + shown(cmd.substr(6)) +
                              ": run the same spmdx on every rank and launcher";
        } else if (cmd == "AUTH") {
          if (!read(a)) break;
          if (!hello) {  // a client of protocol 1 sends AUTH <token> first, and nothing else
            reply = "ERR this spmdx store speaks protocol " + std::to_string(kStoreProtocol) +
                    " and the client an older one: run the same spmdx on every rank and launcher";
          } else {
            if (!read(b)) break;  // the rank, or -1
            authed = a == state->token;
            reply = authed ? "OK" : "ERR wrong job token";
            if (!authed) {
              {
                std::lock_guard l(state->mutex);
                state->data[kRejectedKey] += (b == "-1" ? std::string("a client") : "rank " + b) + " from " + peer_address(fd) + ": wrong job token\n";
                auto& count = state->data[kRejectedCountKey];
                count = std::to_string((count.empty() ? 0 : std::stoll(count)) + 1);
              }
              state->changed.notify_all();
            }
          }
        } else if (!authed) {
          reply = "ERR not authenticated";
        } else if (cmd == "SET") {
          if (!read(a) || !read(b)) break;
          {
            std::lock_guard l(state->mutex);
            state->data[a] = b;
          }
          state->changed.notify_all();
          reply = "OK";
        } else if (cmd == "GET") {  // a: key, b: timeout in milliseconds
          if (!read(a) || !read(b)) break;
          std::unique_lock l(state->mutex);
          long long ms = 0;
          try {
            ms = std::stoll(b);
          } catch (const std::logic_error&) {
          }
          const auto deadline = Clock::now() + std::chrono::milliseconds(std::max(0LL, ms));
          const bool found = state->changed.wait_until(l, deadline, [&] { return state->stopping || state->data.count(a) > 0; });
          reply = found && state->data.count(a) ? "V" + state->data[a] : "ERR timeout";
        } else if (cmd == "ADD") {
          if (!read(a) || !read(b)) break;
          std::int64_t v = 0;
          try {
            std::lock_guard l(state->mutex);
            auto& s = state->data[a];
            v = (s.empty() ? 0 : std::stoll(s)) + std::stoll(b);
            s = std::to_string(v);
            reply = std::to_string(v);
          } catch (const std::logic_error&) {
            reply = "ERR not an integer";
          }
          state->changed.notify_all();
        } else {
          reply = "ERR unknown command";
        }
        if (write_frame(fd, reply, kNever) != Io::ok) break;
      }
      ::close(fd);
    });
  }
}

TcpStore::TcpStore(const std::string& host, int port, const std::string& token, double timeout_seconds, int rank)
    : where_(host + ":" + std::to_string(port)), timeout_(timeout_seconds) {
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_seconds));
  auto waited = [&] { return std::chrono::duration<double>(Clock::now() - start).count(); };
  double next_log = 5;
  if (host.find(':') != std::string::npos) {
    throw CommError("store: MASTER_ADDR " + host + " is an IPv6 address; the store speaks IPv4: give an IPv4 address or a host name with one (127.0.0.1 for this host)", 0);
  }
  std::string last = "no attempt";
  while (true) {
    addrinfo hints{};
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) == 0) {
      fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
      int rc = ::connect(fd_, res->ai_addr, res->ai_addrlen);
      if (rc != 0 && errno == EINPROGRESS) {  // a host that drops packets: wait no longer than the deadline
        const Io w = wait_ready(fd_, POLLOUT, std::min(deadline, Clock::now() + std::chrono::seconds(5)));
        int err = 0;
        socklen_t len = sizeof err;
        if (w == Io::ok && ::getsockopt(fd_, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0) rc = 0;
        else errno = w == Io::timeout ? ETIMEDOUT : err;
      }
      ::freeaddrinfo(res);
      if (rc == 0) break;
      last = std::strerror(errno);
      ::close(fd_);
      fd_ = -1;
    } else {
      last = "cannot resolve host";
    }
    if (Clock::now() > deadline) {
      throw CommError("store: cannot connect to " + where_ + " (" + last + ") within " + seconds_text(timeout_seconds) +
                          " s: is rank 0 (or the launcher) up, and MASTER_ADDR/MASTER_PORT right?", 0);
    }
    if (waited() >= next_log) {
      SPMDX_INFO("waiting for the store at " << where_ << " to accept a connection (" << last << "; " << seconds_text(waited()) << " s of "
                                             << seconds_text(timeout_seconds) << " s)");
      next_log += 15;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const int one = 1;
  ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  // The handshake: a spmdx store answers at once. Whatever else holds the port answers
  // something else, closes, or stays silent until the deadline (logged after 5 s).
  const auto fail = [&](const std::string& why) {
    ::close(fd_);
    fd_ = -1;
    throw CommError("store " + where_ + ": " + why, 0);
  };
  const auto hello_deadline = std::max(deadline, Clock::now() + std::chrono::seconds(1));
  std::string reply;
  Io io = write_frame(fd_, kHello, hello_deadline);
  // Wait for the answer's first byte in slices, saying after 5 s (then every 15 s) what it
  // waits for; then read the answer whole, by the same deadline.
  const auto hello_start = Clock::now();
  auto next_say = hello_start + std::chrono::seconds(5);
  while (io == Io::ok) {
    io = wait_ready(fd_, POLLIN, std::min(hello_deadline, next_say));
    if (io != Io::timeout || Clock::now() >= hello_deadline) break;
    SPMDX_INFO("the store at " << where_ << " accepted a connection but has not answered the spmdx store handshake for "
                               << seconds_text(std::chrono::duration<double>(Clock::now() - hello_start).count()) << " s (of "
                               << seconds_text(timeout_seconds) << " s): is another service on MASTER_PORT " << port << "?");
    next_say = Clock::now() + std::chrono::seconds(15);
    io = Io::ok;
  }
  if (io == Io::ok) io = read_frame(fd_, reply, hello_deadline);
  switch (io) {
    case Io::timeout:
      fail("accepted the connection but did not answer the spmdx store handshake within " + seconds_text(timeout_seconds) +
           " s (comm.timeout_seconds): another service, or a stopped process, holds MASTER_PORT " + std::to_string(port) +
           "; pick another MASTER_PORT or free this one");
      break;
    case Io::closed:
      fail("closed the connection at the spmdx store handshake: not a spmdx store (another service on MASTER_PORT " + std::to_string(port) +
           "?), or it is shutting down");
      break;
    case Io::garbage:
      fail("answered the spmdx store handshake with " + shown(reply) + "..., not as a spmdx store does: another service holds MASTER_PORT " +
           std::to_string(port) + "; pick another MASTER_PORT or free this one");
      break;
    case Io::ok:
      break;
  }
  if (reply == "ERR not authenticated") {
    fail("an older spmdx store (protocol 1, without a handshake) answers there; this spmdx speaks protocol " + std::to_string(kStoreProtocol) +
         ": run the same spmdx on every rank and launcher");
  }
  if (reply != kWelcome) {
    fail("answered the spmdx store handshake with " + shown(reply) + (reply.rfind("ERR ", 0) == 0 ? "" : ": not a spmdx store (another service on MASTER_PORT?)"));
  }
  reply = request({"AUTH", token, std::to_string(rank)}, timeout_seconds, "authentication");
  if (reply != "OK") {
    fail(reply.substr(reply.rfind("ERR ", 0) == 0 ? 4 : 0) +
         (token.empty() ? " (SPMDX_JOB_TOKEN is not set here, and the store has one: set the job's token on every rank and launcher)"
                        : " (check SPMDX_JOB_TOKEN: every rank and launcher of a job needs the same)"));
  }
}

TcpStore::~TcpStore() {
  if (fd_ >= 0) ::close(fd_);
}

std::string TcpStore::request(const std::vector<std::string>& frames, double seconds, const std::string& what) {
  std::lock_guard lock(mutex_);
  if (fd_ < 0) throw CommError("store " + where_ + ": not connected", 0);
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  std::string reply;
  Io io = Io::ok;
  for (const auto& f : frames) {
    if (io == Io::ok) io = write_frame(fd_, f, deadline);
  }
  if (io == Io::ok) io = read_frame(fd_, reply, deadline);
  if (io == Io::ok) return reply;
  // The connection is out of step with the server now: close it.
  ::close(fd_);
  fd_ = -1;
  if (io == Io::timeout) {
    throw CommError("store " + where_ + " did not answer " + what + " within " + seconds_text(seconds) +
                        " s: is the process serving it (rank 0 or the launcher) stopped or overloaded?", 0);
  }
  if (io == Io::garbage) throw CommError("store " + where_ + " answered " + what + " with " + shown(reply) + "..., not as a spmdx store does", 0);
  throw CommError("store " + where_ + ": connection lost during " + what + " (did rank 0 or the launcher exit?)", 0);
}

void TcpStore::set(const std::string& key, const std::string& value) {
  const std::string r = request({"SET", key, value}, timeout_, "set '" + key + "'");
  if (r != "OK") throw CommError("store " + where_ + ": set " + key + ": " + r, 0);
}

std::string TcpStore::get(const std::string& key, double timeout_seconds) {
  // In slices, so that a long wait says what it waits for: after 5 s, then every 30 s.
  const auto start = Clock::now();
  const double total = std::max(0.0, timeout_seconds);
  double next_log = 5;
  while (true) {
    const double waited = std::chrono::duration<double>(Clock::now() - start).count();
    const double slice = std::max(0.0, std::min(total - waited, next_log - waited));
    const std::string r =
        request({"GET", key, std::to_string(static_cast<std::int64_t>(slice * 1000))}, slice + std::max(5.0, timeout_), "get '" + key + "'");
    if (r.rfind("V", 0) == 0) return r.substr(1);
    if (r != "ERR timeout") throw CommError("store " + where_ + ": get '" + key + "': " + r, 0);
    const double now = std::chrono::duration<double>(Clock::now() - start).count();
    if (now >= total) break;
    if (now >= next_log) {
      SPMDX_INFO("waiting for key '" << key << "' in the store at " << where_ << " (" << seconds_text(now) << " s of " << seconds_text(total) << " s)");
      next_log += 30;
    }
  }
  throw CommError("store " + where_ + ": key '" + key + "' not set within " + seconds_text(total) + " s", -1);
}

std::int64_t TcpStore::add(const std::string& key, std::int64_t delta) {
  const std::string r = request({"ADD", key, std::to_string(delta)}, timeout_, "add '" + key + "'");
  if (r.rfind("ERR", 0) == 0) throw CommError("store " + where_ + ": add " + key + ": " + r, 0);
  std::int64_t v = 0;
  const auto [end, ec] = std::from_chars(r.data(), r.data() + r.size(), v);
  if (ec != std::errc() || end != r.data() + r.size()) {
    throw CommError("store " + where_ + " answered add '" + key + "' with " + shown(r) + ", not a number: not a spmdx store, or a broken one", 0);
  }
  return v;
}

}  // namespace spmdx::comm
