#include "spmdx/comm/store.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>

namespace spmdx::comm {
namespace {

using Clock = std::chrono::steady_clock;

bool write_all(int fd, const void* data, std::size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w <= 0) return false;
    p += w;
    n -= static_cast<std::size_t>(w);
  }
  return true;
}

bool read_all(int fd, void* data, std::size_t n) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = ::recv(fd, p, n, 0);
    if (r <= 0) return false;
    p += r;
    n -= static_cast<std::size_t>(r);
  }
  return true;
}

bool write_frame(int fd, const std::string& s) {
  const std::uint32_t n = static_cast<std::uint32_t>(s.size());
  return write_all(fd, &n, 4) && write_all(fd, s.data(), s.size());
}

bool read_frame(int fd, std::string& s) {
  std::uint32_t n = 0;
  if (!read_all(fd, &n, 4) || n > (64u << 20)) return false;
  s.resize(n);
  return read_all(fd, s.data(), n);
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
      std::string cmd, a, b;
      bool authed = false;
      while (!state->stopping && read_frame(fd, cmd)) {
        std::string reply;
        if (cmd == "AUTH") {
          if (!read_frame(fd, a)) break;
          authed = a == state->token;
          reply = authed ? "OK" : "ERR wrong job token";
        } else if (!authed) {
          reply = "ERR not authenticated";
        } else if (cmd == "SET") {
          if (!read_frame(fd, a) || !read_frame(fd, b)) break;
          {
            std::lock_guard l(state->mutex);
            state->data[a] = b;
          }
          state->changed.notify_all();
          reply = "OK";
        } else if (cmd == "GET") {  // a: key, b: timeout in milliseconds
          if (!read_frame(fd, a) || !read_frame(fd, b)) break;
          std::unique_lock l(state->mutex);
          const auto deadline = Clock::now() + std::chrono::milliseconds(std::stoll(b));
          const bool found = state->changed.wait_until(l, deadline, [&] { return state->stopping || state->data.count(a) > 0; });
          reply = found && state->data.count(a) ? "V" + state->data[a] : "ERR timeout";
        } else if (cmd == "ADD") {
          if (!read_frame(fd, a) || !read_frame(fd, b)) break;
          std::int64_t v = 0;
          {
            std::lock_guard l(state->mutex);
            auto& s = state->data[a];
            v = (s.empty() ? 0 : std::stoll(s)) + std::stoll(b);
            s = std::to_string(v);
          }
          state->changed.notify_all();
          reply = std::to_string(v);
        } else {
          reply = "ERR unknown command";
        }
        if (!write_frame(fd, reply)) break;
      }
      ::close(fd);
    });
  }
}

TcpStore::TcpStore(const std::string& host, int port, const std::string& token, double timeout_seconds)
    : where_(host + ":" + std::to_string(port)) {
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_seconds);
  std::string last = "no attempt";
  while (true) {
    addrinfo hints{};
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) == 0) {
      fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
      if (::connect(fd_, res->ai_addr, res->ai_addrlen) == 0) {
        ::freeaddrinfo(res);
        break;
      }
      last = std::strerror(errno);
      ::close(fd_);
      fd_ = -1;
      ::freeaddrinfo(res);
    } else {
      last = "cannot resolve host";
    }
    if (Clock::now() > deadline) {
      throw CommError("store: cannot connect to " + where_ + " (" + last + ") within " + std::to_string(timeout_seconds) +
                          " s: is rank 0 (or the launcher) up, and MASTER_ADDR/MASTER_PORT right?", 0);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const int one = 1;
  ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  const std::string reply = request({"AUTH", token});
  if (reply != "OK") throw CommError("store " + where_ + ": " + reply.substr(reply.rfind("ERR ", 0) == 0 ? 4 : 0) + " (check SPMDX_JOB_TOKEN)", 0);
}

TcpStore::~TcpStore() {
  if (fd_ >= 0) ::close(fd_);
}

std::string TcpStore::request(const std::vector<std::string>& frames) {
  std::lock_guard lock(mutex_);
  for (const auto& f : frames) {
    if (!write_frame(fd_, f)) throw CommError("store " + where_ + ": connection lost (did rank 0 exit?)", 0);
  }
  std::string reply;
  if (!read_frame(fd_, reply)) throw CommError("store " + where_ + ": connection lost (did rank 0 exit?)", 0);
  return reply;
}

void TcpStore::set(const std::string& key, const std::string& value) {
  const std::string r = request({"SET", key, value});
  if (r != "OK") throw CommError("store " + where_ + ": set " + key + ": " + r, 0);
}

std::string TcpStore::get(const std::string& key, double timeout_seconds) {
  const std::string r = request({"GET", key, std::to_string(static_cast<std::int64_t>(timeout_seconds * 1000))});
  if (r.rfind("V", 0) == 0) return r.substr(1);
  throw CommError("store " + where_ + ": key '" + key + "' not set within " + std::to_string(timeout_seconds) + " s (" + r + ")", -1);
}

std::int64_t TcpStore::add(const std::string& key, std::int64_t delta) {
  const std::string r = request({"ADD", key, std::to_string(delta)});
  if (r.rfind("ERR", 0) == 0) throw CommError("store " + where_ + ": add " + key + ": " + r, 0);
  return std::stoll(r);
}

}  // namespace spmdx::comm
