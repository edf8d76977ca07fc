#include "spmdx/launch/launcher.h"

#include <fcntl.h>
#include <sched.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <set>
#include <algorithm>
#include <stdexcept>
#include <thread>

#include "spmdx/comm/health.h"
#include "spmdx/comm/shm.h"
#include "spmdx/comm/store.h"
#include "spmdx/launch/replica_groups.h"
#include "spmdx/text.h"
#include "spmdx/hooks/fr_trace.h"

extern char** environ;

namespace spmdx::launch {
namespace {

std::optional<int> env_int(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (*end != '\0' || x < 0) throw std::invalid_argument(std::string(name) + "=" + v + " is not a non-negative integer");
  return static_cast<int>(x);
}

std::string random_token() {
  std::random_device rd;
  std::string t;
  const char* hex = "0123456789abcdef";
  for (int i = 0; i < 32; ++i) t += hex[rd() % 16];
  return t;
}

volatile sig_atomic_t g_signal = 0;
volatile sig_atomic_t g_dump_requests = 0;  // SIGUSR1: passed on to the ranks (flight recorder dumps)
void on_signal(int sig) { g_signal = sig; }
void on_usr1(int) { g_dump_requests = g_dump_requests + 1; }

}  // namespace

RankEnv rank_env() {
  RankEnv e;
  if (auto r = env_int("RANK")) {
    e.rank = *r;
    e.world_size = env_int("WORLD_SIZE").value_or(1);
    e.local_rank = env_int("LOCAL_RANK").value_or(e.rank);
    e.local_world_size = env_int("LOCAL_WORLD_SIZE").value_or(e.world_size);
    // Who set RANK: spmdx run's launcher, torchrun's agent, or a person (or script) by hand.
    e.source = std::getenv("SPMDX_STORE_HOSTED") ? "spmdx" : std::getenv("TORCHELASTIC_RUN_ID") ? "torchrun" : "RANK";
  } else if (auto s = env_int("SLURM_PROCID")) {
    e.rank = *s;
    e.world_size = env_int("SLURM_NTASKS").value_or(1);
    e.local_rank = env_int("SLURM_LOCALID").value_or(0);
    e.local_world_size = env_int("SLURM_NTASKS_PER_NODE").value_or(e.world_size);
    e.source = "slurm";
    e.world_size_from = "SLURM_NTASKS";
  } else if (auto o = env_int("OMPI_COMM_WORLD_RANK")) {
    e.rank = *o;
    e.world_size = env_int("OMPI_COMM_WORLD_SIZE").value_or(1);
    e.local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK").value_or(0);
    e.local_world_size = env_int("OMPI_COMM_WORLD_LOCAL_SIZE").value_or(e.world_size);
    e.source = "openmpi";
    e.world_size_from = "OMPI_COMM_WORLD_SIZE";
  } else {
    // A rank variable missing while others are set is a mistake in how the rank was started,
    // not a one-rank job: it would train alone while its job waits for it.
    for (const char* var : {"WORLD_SIZE", "LOCAL_RANK"}) {
      if (const char* v = std::getenv(var); v != nullptr && *v != '\0' && !(std::string(var) == "WORLD_SIZE" && std::string(v) == "1")) {
        throw std::invalid_argument(std::string(var) + "=" + v +
                                    " is set but RANK is not: set RANK (0 .. WORLD_SIZE-1) for each rank, as torchrun does, or unset " + var +
                                    " to run one rank");
      }
    }
    e.source = "single";
  }
  if (e.local_world_size < 1 || e.local_world_size > e.world_size || e.local_rank >= e.local_world_size) {
    throw std::invalid_argument("LOCAL_RANK=" + std::to_string(e.local_rank) + " and LOCAL_WORLD_SIZE=" + std::to_string(e.local_world_size) + " (with " +
                                e.world_size_from + "=" + std::to_string(e.world_size) +
                                ") cannot be: the local rank counts the ranks of this host from 0, and a host holds at most the whole job");
  }
  if (e.rank >= e.world_size) {
    throw std::invalid_argument("rank " + std::to_string(e.rank) + " is not below world size " + std::to_string(e.world_size));
  }
  if (const char* a = std::getenv("MASTER_ADDR")) e.master_addr = a;
  e.master_port = env_int("MASTER_PORT").value_or(29500);
  if (e.master_port < 1 || e.master_port > 65535) {
    throw std::invalid_argument("MASTER_PORT=" + std::to_string(e.master_port) + " is not a TCP port (1 to 65535)");
  }
  if (const char* t = std::getenv("SPMDX_JOB_TOKEN")) e.token = t;
  e.store_hosted = std::getenv("SPMDX_STORE_HOSTED") != nullptr;
  if (const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE"); agent != nullptr && std::string(agent) == "True") e.c10d_store = true;
  if (const char* id = std::getenv("TORCHELASTIC_RUN_ID")) e.run_id = id;
  // torchrun restarts failed workers under the same run id and store: a restart is a new job.
  if (const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT"); restart != nullptr && !e.run_id.empty()) e.run_id += std::string("-") + restart;
  return e;
}

namespace {

// The job's store: the one this launcher serves (on one node, or as node 0), or node 0's.
struct JobStore {
  std::string token, addr = "127.0.0.1";
  int port = 0;
  std::unique_ptr<comm::TcpStoreServer> server;
};

JobStore serve_store(const LaunchOptions& o) {
  JobStore s;
  if (o.nnodes == 1) {
    s.token = random_token();
    s.server = std::make_unique<comm::TcpStoreServer>(s.addr, 0, s.token);
    s.port = s.server->port();
  } else {
    const char* t = std::getenv("SPMDX_JOB_TOKEN");
    if (t == nullptr || *t == '\0') {
      throw std::invalid_argument("launch: with --nnodes > 1, set SPMDX_JOB_TOKEN to the same secret on every node");
    }
    if (o.master_addr.empty() || o.master_port <= 0) throw std::invalid_argument("launch: with --nnodes > 1, give --master-addr and --master-port");
    s.token = t;
    s.addr = o.master_addr;
    s.port = o.master_port;
    if (o.node_rank == 0) s.server = std::make_unique<comm::TcpStoreServer>(s.addr, s.port, s.token);
  }
  return s;
}

void catch_signals() {
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  struct sigaction usr1 {};
  usr1.sa_handler = on_usr1;
  sigaction(SIGUSR1, &usr1, nullptr);
}

struct Child {
  pid_t pid = -1;
  int out = -1;  // read end of its stdout+stderr
  std::string partial;
  bool running = true;
  int status = 0;
};

// The launcher's environment with `env` set over it, as "KEY=value" strings.
std::vector<std::string> environment_with(const std::map<std::string, std::string>& env) {
  std::vector<std::string> strings;
  for (char** e = environ; *e; ++e) {
    const std::string kv = *e;
    if (!env.count(kv.substr(0, kv.find('=')))) strings.push_back(kv);
  }
  for (const auto& [k, v] : env) strings.push_back(k + "=" + v);
  return strings;
}

// Starts argv with its stdout and stderr on one pipe; returns posix_spawn's error (0: started).
int spawn_rank(const std::vector<std::string>& argv, std::vector<std::string> strings, Child& child) {
  std::vector<char*> envp, args;
  for (auto& s : strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> argv_copy = argv;
  for (auto& a : argv_copy) args.push_back(a.data());
  args.push_back(nullptr);
  int pipefd[2];
  if (pipe(pipefd) != 0) throw std::runtime_error("launcher: pipe failed");
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, pipefd[1], 1);
  posix_spawn_file_actions_adddup2(&fa, pipefd[1], 2);
  posix_spawn_file_actions_addclose(&fa, pipefd[0]);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, argv[0].c_str(), &fa, nullptr, args.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  close(pipefd[1]);
  if (rc == 0) child = {pid, pipefd[0], "", true, 0};
  return rc;
}

// What local rank r of this node is told: who it is and where the store is.
std::map<std::string, std::string> rank_variables(const LaunchOptions& o, const JobStore& store, int r) {
  std::map<std::string, std::string> vars{{"RANK", std::to_string(o.node_rank * o.nproc + r)}, {"WORLD_SIZE", std::to_string(o.nproc * o.nnodes)},
                                          {"LOCAL_RANK", std::to_string(r)},                  {"LOCAL_WORLD_SIZE", std::to_string(o.nproc)},
                                          {"MASTER_ADDR", store.addr},                         {"MASTER_PORT", std::to_string(store.port)},
                                          {"SPMDX_JOB_TOKEN", store.token},                    {"SPMDX_STORE_HOSTED", "1"}};
  // --cpu-affinity: this rank's CPUs, and its share of them for intra-op threads; empty without
  // it, so that values left in the launcher's environment do not reach the ranks.
  vars["SPMDX_CPU_AFFINITY"] = vars["SPMDX_CPU_SHARE"] = "";
  if (!o.cpu_affinity.empty()) {
    vars["SPMDX_CPU_AFFINITY"] = o.cpu_affinity.at(static_cast<std::size_t>(r));
    std::ostringstream share;
    share << cpu_shares(o.cpu_affinity).at(static_cast<std::size_t>(r));
    vars["SPMDX_CPU_SHARE"] = share.str();
  }
  return vars;
}

// This node's ranks, each told who it is and where the store is.
std::vector<Child> spawn_ranks(const LaunchOptions& o, const std::vector<std::string>& argv, const JobStore& store) {
  const int nproc = o.nproc;
  std::vector<Child> children(static_cast<std::size_t>(nproc));
  for (int r = 0; r < nproc; ++r) {
    if (const int rc = spawn_rank(argv, environment_with(rank_variables(o, store, r)), children[static_cast<std::size_t>(r)]); rc != 0) {
      for (auto& c : children) {
        if (c.pid > 0) kill(c.pid, SIGKILL);
      }
      throw std::runtime_error("launcher: cannot start " + argv[0] + ": " + std::strerror(rc));
    }
  }
  return children;
}

// Watches this node's ranks until every one has exited: relays their output, passes signals
// on, and when one fails chooses the rank to blame and stops the others.
class Supervisor {
 public:
  Supervisor(const LaunchOptions& o, const JobStore& store, std::vector<Child> children, std::vector<std::string> argv)
      : o_(o), store_(store), children_(std::move(children)), running_(children_.size()), argv_(std::move(argv)),
        stopped_by_us_(children_.size(), false), attempt_(static_cast<std::size_t>(std::max(0, o.ft_groups)), 0) {
    for (int g = 0; g < o.ft_groups; ++g) live_.push_back({g, 0});
    min_live_ = live_.size();
  }

  void supervise() {
    while (running_ > 0) {
      std::vector<pollfd> fds;
      for (auto& c : children_) fds.push_back({c.out, POLLIN, 0});
      poll(fds.data(), fds.size(), 100);
      for (std::size_t r = 0; r < children_.size(); ++r) {
        if (children_[r].out >= 0 && (fds[r].revents & (POLLIN | POLLHUP))) relay_output(r);
        reap(r);
      }
      if (fault_tolerant() && failed_rank_ < 0 && g_signal == 0) poll_replica_groups();
      if (failed_rank_ < 0 && blame_rank_ >= 0 && (std::chrono::steady_clock::now() >= blame_deadline_ || running_ == 0)) settle_blame();
      if (g_dump_requests != 0) {  // kill -USR1 <launcher>: every rank dumps, the run goes on
        g_dump_requests = 0;
        stop_all(SIGUSR1);
      }
      if (g_signal != 0 && kill_deadline_ == std::chrono::steady_clock::time_point::max()) {
        stop_all(g_signal);
        kill_deadline_ = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      }
      if (std::chrono::steady_clock::now() > kill_deadline_) stop_all(SIGKILL);
    }
  }

  // What the ranks wrote last, once they have all exited.
  void drain_output() {
    for (auto& c : children_) {
      if (c.out >= 0) {
        char buf[4096];
        ssize_t n;
        while ((n = read(c.out, buf, sizeof buf)) > 0) c.partial.append(buf, static_cast<std::size_t>(n));
        close(c.out);
      }
      if (!c.partial.empty()) std::cout << "[rank " << o_.node_rank * o_.nproc + (&c - children_.data()) << "] " << c.partial << "\n";
      comm::remove_shared_memory_of(c.pid);  // a rank killed while its groups set up shared memory
    }
  }

  // Says which rank failed and how, then what fault tolerance survived; the launcher's exit
  // code (0: none failed).
  int blame() const {
    const int rc = blame_rank();
    if (failures_ > 0) {
      std::cerr << o_.command << ": fault tolerance: " << failures_ << " rank failure" << (failures_ == 1 ? "" : "s") << ", " << restarts_used_
                << " replica group restart" << (restarts_used_ == 1 ? "" : "s") << " (--max-restarts " << o_.max_restarts << "); the live replica groups went as low as "
                << min_live_ << " of " << o_.ft_groups << "\n";
    }
    return rc;
  }

  int blame_rank() const {
    if (failed_rank_ < 0) return 0;
    if (blame_from_flight_recorder()) return 1;
    if (blame_priority_ == 0 && !named_by_ranks_ && !mismatch_.empty()) {
      std::cerr << o_.command << ": the ranks called different collectives (" << mismatch_ << "); which rank skipped or added one cannot be told "
                << "from the collective alone: run with --hooks.enable flight_recorder and the launcher names it (rank " << failed_rank_ << " "
                << failure_ << " first)" << others_stopped() << "\n";
      return 1;
    }
    std::cerr << o_.command << ": rank " << failed_rank_ << " " << failure_ << others_stopped() << "\n";
    return 1;
  }

 private:
  int rank_of(std::size_t r) const { return o_.node_rank * o_.nproc + static_cast<int>(r); }
  // The end of a failure's line: what happened to the rest of the job (nothing, with one rank).
  const char* others_stopped() const { return o_.nproc * o_.nnodes > 1 ? "; the other ranks were stopped" : ""; }

  void stop_all(int sig) {
    for (auto& c : children_) {
      if (!c.running) continue;
      kill(c.pid, sig);
      if (sig == SIGTERM || sig == SIGINT) kill(c.pid, SIGCONT);  // a stopped rank (kill -STOP) acts on it only when continued
    }
  }

  // Prints rank r's complete lines, each under its rank's prefix.
  void relay_output(std::size_t r) {
    auto& c = children_[r];
    char buf[4096];
    const ssize_t n = read(c.out, buf, sizeof buf);
    if (n <= 0) {
      close(c.out);
      c.out = -1;
      return;
    }
    c.partial.append(buf, static_cast<std::size_t>(n));
    std::size_t nl;
    while ((nl = c.partial.find('\n')) != std::string::npos) {
      std::cout << "[rank " << rank_of(r) << "] " << c.partial.substr(0, nl) << "\n" << std::flush;
      c.partial.erase(0, nl + 1);
    }
  }

  void reap(std::size_t r) {
    auto& c = children_[r];
    // Under fault tolerance a stopped rank is seen too (WUNTRACED): it is hung, and may have no
    // live peer left to say so.
    if (!c.running || waitpid(c.pid, &c.status, WNOHANG | (fault_tolerant() ? WUNTRACED : 0)) != c.pid) return;
    if (WIFSTOPPED(c.status)) {
      stopped_at_[r] = std::chrono::steady_clock::now();
      return;
    }
    c.running = false;
    --running_;
    const bool ok = WIFEXITED(c.status) && WEXITSTATUS(c.status) == 0;
    if (stopped_by_us_[r]) {  // a rank of a lost replica group, stopped with it
      stopped_by_us_[r] = false;
      return;
    }
    if (!ok && failed_rank_ < 0 && fault_tolerant() && g_signal == 0 && !job_stopped_by_ranks() && lose_group(r)) return;
    if (!ok && failed_rank_ < 0) consider_blaming(rank_of(r), c.status);
  }

  // ---- fault tolerance (LaunchOptions::ft_groups) ----
  bool fault_tolerant() const { return o_.ft_groups > 0 && o_.nnodes == 1; }
  // Whether a rank's vote stopped the job (replica_groups.h's kStopKey): then a rank's exit is
  // the job's end, not a group to restart.
  bool job_stopped_by_ranks() {
    try {
      return store().add(ft::kStopKey, 0) > 0;
    } catch (const std::exception&) {
      return false;
    }
  }
  static bool still_stopped(pid_t pid) {  // /proc/PID/stat's state: T (stopped) or t (traced)
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string all((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
    const auto close = all.rfind(')');
    return close != std::string::npos && close + 2 < all.size() && (all[close + 2] == 'T' || all[close + 2] == 't');
  }
  comm::TcpStore& store() {
    if (!ft_store_) ft_store_ = std::make_unique<comm::TcpStore>(store_.addr, store_.port, store_.token, 10);
    return *ft_store_;
  }
  std::string how(int status) const {
    return WIFEXITED(status) ? "exited with code " + std::to_string(WEXITSTATUS(status)) : killed_by(WTERMSIG(status), oom_kills_at_start_, oom_kill_count());
  }
  void publish() {
    ++epoch_;
    store().set(ft::members_key(epoch_), ft::members_text(live_));
    store().add(ft::kEpochKey, 1);
  }

  // Local rank r failed. Once every rank joined the job, its replica group is lost rather than
  // the job: its other ranks are stopped, the others are told, and it is started again while
  // restarts are left. Returns false when the job stops as without fault tolerance.
  bool lose_group(std::size_t r) {
    try {
      if (!ft_started_) ft_started_ = store().add(ft::kStartedKey, 0) >= o_.nproc;
      if (!ft_started_) return false;  // before every rank joined: the job stops, naming the rank
      const int G = o_.ft_ranks_per_group, g = static_cast<int>(r) / G;
      ++failures_;
      for (int q = g * G; q < (g + 1) * G; ++q) {
        if (q != static_cast<int>(r) && children_[static_cast<std::size_t>(q)].running) {
          kill(children_[static_cast<std::size_t>(q)].pid, SIGKILL);
          stopped_by_us_[static_cast<std::size_t>(q)] = true;
        }
      }
      pending_.erase(g);
      const auto was = std::find_if(live_.begin(), live_.end(), [&](const ft::GroupAttempt& x) { return x.group == g; });
      if (was != live_.end()) {
        live_.erase(was);
        publish();
      }
      min_live_ = std::min(min_live_, live_.size());
      if (static_cast<int>(live_.size()) < o_.ft_min_replicas) {
        std::vector<int> lost;
        for (int x = 0; x < o_.ft_groups; ++x) {
          if (std::none_of(live_.begin(), live_.end(), [&](const ft::GroupAttempt& l) { return l.group == x; })) lost.push_back(x);
        }
        std::string names;
        for (int x : lost) names += (names.empty() ? "" : ", ") + ft::group_text(x, G);
        failed_rank_ = rank_of(r);
        failure_ = how(children_[r].status) + ", and only " + std::to_string(live_.size()) + " of " + std::to_string(o_.ft_groups) +
                   " replica groups are left, fewer than fault_tolerance.min_replica_size = " + std::to_string(o_.ft_min_replicas) + " (lost: " + names +
                   "); the job stops: run it again to resume from its newest checkpoint (checkpoint.enable = true)" +
                   (live_.empty() ? std::string() : ", or allow fewer live groups (fault_tolerance.min_replica_size)");
        stop_all(SIGTERM);
        kill_deadline_ = std::chrono::steady_clock::now() + std::chrono::seconds(5);
        return true;
      }
      std::cout << o_.command << ": rank " << rank_of(r) << " " << how(children_[r].status) << ": " << ft::group_text(g, G) << " is lost; " << live_.size()
                << " of " << o_.ft_groups << " replica groups train on" << std::endl;
      if (restarts_used_ < o_.max_restarts) {
        ++restarts_used_;
        restart_.push_back(g);  // once its ranks are all reaped
      } else {
        std::cout << o_.command << ": no restarts left (--max-restarts " << o_.max_restarts << "): " << ft::group_text(g, G) << " stays lost" << std::endl;
        store().add(ft::kLostForGoodKey, 1);
      }
      return true;
    } catch (const std::exception& e) {
      std::cerr << o_.command << ": fault tolerance: cannot reach the job's store (" << e.what() << "): the job stops" << std::endl;
      return false;
    }
  }

  // Every 100 ms: groups to start again, restarted groups ready to join, and ranks the others
  // found hung.
  void poll_replica_groups() {
    try {
      if (!ft_started_) {
        ft_started_ = store().add(ft::kStartedKey, 0) >= o_.nproc;
        if (!ft_started_) return;
      }
      const int G = o_.ft_ranks_per_group;
      for (auto it = restart_.begin(); it != restart_.end();) {
        const int g = *it;
        bool reaped = true;
        for (int q = g * G; q < (g + 1) * G; ++q) reaped = reaped && !children_[static_cast<std::size_t>(q)].running;
        if (!reaped) {
          ++it;
          continue;
        }
        const int attempt = ++attempt_[static_cast<std::size_t>(g)];
        for (int q = g * G; q < (g + 1) * G; ++q) {
          Child& c = children_[static_cast<std::size_t>(q)];
          if (c.out >= 0) {  // what the lost process wrote last
            char buf[4096];
            ssize_t n;
            while ((n = read(c.out, buf, sizeof buf)) > 0) c.partial.append(buf, static_cast<std::size_t>(n));
            close(c.out);
            c.out = -1;
          }
          if (!c.partial.empty()) std::cout << "[rank " << rank_of(static_cast<std::size_t>(q)) << "] " << c.partial << "\n";
          comm::remove_shared_memory_of(c.pid);
          auto vars = rank_variables(o_, store_, q);
          vars[ft::kRestartEnv] = std::to_string(attempt);
          if (const int rc = spawn_rank(argv_, environment_with(vars), c); rc != 0) {
            throw std::runtime_error("cannot start " + argv_[0] + " again: " + std::strerror(rc));
          }
          ++running_;
        }
        pending_[g] = attempt;
        std::cout << o_.command << ": started " << ft::group_text(g, G) << " again (its restart " << attempt << "; the job has used " << restarts_used_ << " of --max-restarts "
                  << o_.max_restarts << ")" << std::endl;
        it = restart_.erase(it);
      }
      for (auto it = pending_.begin(); it != pending_.end();) {
        const ft::GroupAttempt ga{it->first, it->second};
        if (store().add(ft::ready_key(ga), 0) < G) {
          ++it;
          continue;
        }
        live_.push_back(ga);
        std::sort(live_.begin(), live_.end());
        publish();
        std::cout << o_.command << ": " << ft::group_text(ga.group, G) << " (restart " << ga.attempt
                  << ") is ready: the live groups give it their state after their current step" << std::endl;
        it = pending_.erase(it);
      }
      for (std::size_t q = 0; q < children_.size(); ++q) {  // stopped longer than 2 x the timeout: hung
        if (!stopped_at_[q] || !children_[q].running) continue;
        if (!still_stopped(children_[q].pid)) {
          stopped_at_[q].reset();
          continue;
        }
        if (std::chrono::duration<double>(std::chrono::steady_clock::now() - *stopped_at_[q]).count() < 2 * o_.ft_timeout_seconds) continue;
        stopped_at_[q].reset();
        if (!suspects_killed_.insert(children_[q].pid).second) continue;
        std::cout << o_.command << ": rank " << rank_of(q) << " was stopped (SIGSTOP) for 2 x fault_tolerance.process_group_timeout_ms: killing it" << std::endl;
        kill(children_[q].pid, SIGKILL);
      }
      if (const std::int64_t n = store().add(ft::kSuspectCountKey, 0); n > suspects_seen_) {
        suspects_seen_ = n;
        std::stringstream list(store().get(ft::kSuspectKey, 5));
        std::string item;
        while (std::getline(list, item, ',')) {
          const int q = std::atoi(item.c_str()) - o_.node_rank * o_.nproc;
          if (q < 0 || q >= o_.nproc || !children_[static_cast<std::size_t>(q)].running) continue;
          if (!suspects_killed_.insert(children_[static_cast<std::size_t>(q)].pid).second) continue;  // named by several ranks
          std::cout << o_.command << ": rank " << rank_of(static_cast<std::size_t>(q))
                    << " neither voted nor exited within 2 x fault_tolerance.process_group_timeout_ms (hung, or stopped): killing it" << std::endl;
          kill(children_[static_cast<std::size_t>(q)].pid, SIGKILL);
        }
      }
    } catch (const std::exception& e) {
      std::cerr << o_.command << ": fault tolerance: " << e.what() << std::endl;
    }
  }

  void consider_blaming(int rank, int status) {
    const int priority = WIFEXITED(status) ? 0 : WTERMSIG(status) == SIGABRT ? 1 : 2;
    if (priority > blame_priority_ || (priority == blame_priority_ && rank < blame_rank_)) {  // ties: the lowest rank
      blame_priority_ = priority;
      blame_rank_ = rank;
      blame_ = WIFEXITED(status) ? "exited with code " + std::to_string(WEXITSTATUS(status)) : killed_by(WTERMSIG(status), oom_kills_at_start_, oom_kill_count());
    }
    if (blame_deadline_ == std::chrono::steady_clock::time_point::max()) {
      blame_deadline_ = std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
    }
  }

  // The wait for other failures is over: blame the rank chosen, and stop the others.
  void settle_blame() {
    failed_rank_ = blame_rank_;
    failure_ = blame_;
    if (blame_priority_ == 0) ask_the_ranks();  // it exited with an error: did the ranks name another one?
    if (g_signal == 0) {
      stop_all(SIGTERM);
      kill_deadline_ = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    }
  }

  void ask_the_ranks() {
    try {
      comm::TcpStore store(store_.addr, store_.port, store_.token, 1);
      if (store.add(std::string(comm::kMismatchKey) + "_reported", 0) > 0) mismatch_ = store.get(comm::kMismatchKey, 1);
      if (store.add(std::string(comm::kFaultKey) + "_reported", 0) > 0) {
        const int named = std::stoi(store.get(comm::kFaultKey, 1));
        if (named != failed_rank_ && named >= 0 && named < o_.nproc * o_.nnodes) {
          failure_ = "was named by the other ranks as the one that failed (rank " + std::to_string(failed_rank_) + " " + blame_ +
                     " reporting it)";
          failed_rank_ = named;
        }
        named_by_ranks_ = true;
      }
    } catch (const std::exception&) {
      // no store any more, or nothing in it: blame the rank that exited
    }
  }

  // Ranks that failed alike (each exited with an error, e.g. members that called different
  // collectives) blame each other: their flight recorder dumps say which one diverged.
  // Also when the ranks named one: the dumps say what it skipped. Ranks named for a skip are
  // trusted over a weaker finding (one that only says a rank never issued a collective).
  // Returns whether it blamed the ranks the dumps name.
  bool blame_from_flight_recorder() const {
    if (blame_priority_ != 0 || o_.flight_recorder_dir.empty()) return false;
    try {
      const hooks::FrAnalysis a = hooks::analyze_flight_recorder(o_.flight_recorder_dir);
      const bool strong = !a.findings.empty() && (a.findings.front().kind == hooks::FrFinding::Kind::skipped ||
                                                  a.findings.front().ranks == std::vector<int>{failed_rank_} || !named_by_ranks_);
      if (strong && a.findings.front().kind != hooks::FrFinding::Kind::stalled && !a.findings.front().ranks.empty()) {
        const auto& f = a.findings.front();
        std::cerr << o_.command << ": " << rank_list(f.ranks) << " diverged, as the flight recorder's dumps show: " << f.message
                  << " (spmdx fr-trace " << o_.flight_recorder_dir << " prints every finding)" << others_stopped() << "\n";
        return true;
      }
    } catch (const std::exception&) {
      // no dumps, or not from this run: blame the rank that exited
    }
    return false;
  }

  const LaunchOptions& o_;
  const JobStore& store_;
  std::vector<Child> children_;
  std::size_t running_;
  int failed_rank_ = -1;
  std::string failure_;
  std::chrono::steady_clock::time_point kill_deadline_ = std::chrono::steady_clock::time_point::max();
  // The rank to blame, chosen among those that fail within 500 ms of the first: killed by a
  // signal from outside (kill -9, a crash) before one that aborted (a comm library that found
  // its peer gone aborts: UCX's shared-memory transports do) before one that exited with an
  // error (it reports a peer's failure). A dying process can stay unreaped longer than the
  // peers it takes down.
  int blame_rank_ = -1, blame_priority_ = -1;
  std::optional<OomKillCount> oom_kills_at_start_ = oom_kill_count();  // a rank SIGKILLed: was it the out-of-memory killer?
  bool named_by_ranks_ = false;  // the ranks named the rank that failed (through the store)
  std::string mismatch_;         // ranks found members calling different collectives (kMismatchKey)
  std::string blame_;
  std::chrono::steady_clock::time_point blame_deadline_ = std::chrono::steady_clock::time_point::max();
  // Fault tolerance: what starts a rank again, the ranks stopped with their group, each
  // group's restarts, the live groups (the membership of epoch_), the groups waiting to be
  // started again or to be ready, and the counts for the summary.
  std::vector<std::string> argv_;
  std::vector<bool> stopped_by_us_;
  std::vector<std::optional<std::chrono::steady_clock::time_point>> stopped_at_ = std::vector<std::optional<std::chrono::steady_clock::time_point>>(children_.size());
  std::vector<int> attempt_;
  std::vector<ft::GroupAttempt> live_;
  std::int64_t epoch_ = 0;
  std::vector<int> restart_;
  std::map<int, int> pending_;
  std::unique_ptr<comm::TcpStore> ft_store_;
  bool ft_started_ = false;
  int failures_ = 0, restarts_used_ = 0;
  std::size_t min_live_ = 0;
  std::int64_t suspects_seen_ = 0;
  std::set<pid_t> suspects_killed_;
};

}  // namespace

int launch(const LaunchOptions& o, const std::vector<std::string>& argv) {
  if (o.nproc < 1 || o.nnodes < 1 || o.node_rank < 0 || o.node_rank >= o.nnodes) {
    throw std::invalid_argument("launch: need --nproc >= 1 and 0 <= --node-rank < --nnodes");
  }
  if (o.max_restarts > 0 && o.ft_groups == 0) {
    throw std::invalid_argument("--max-restarts restarts lost replica groups: it needs fault_tolerance.enable = true (spmdx does not restart a whole job; "
                                "resume it from its checkpoint with checkpoint.enable)");
  }
  if (o.ft_groups > 0 && o.nnodes > 1) throw std::invalid_argument("fault_tolerance.enable = true runs on one node (--nnodes 1) for now");
  const JobStore store = serve_store(o);
  catch_signals();
  if (o.ft_groups > 0) {  // epoch 0: every group, before any rank reads it
    std::vector<ft::GroupAttempt> all;
    for (int g = 0; g < o.ft_groups; ++g) all.push_back({g, 0});
    comm::TcpStore client(store.addr, store.port, store.token, 10);
    ft::publish_membership(client, 0, all);
  }
  Supervisor job(o, store, spawn_ranks(o, argv, store), argv);
  job.supervise();
  job.drain_output();
  if (g_signal != 0) {
    std::cerr << o.command << ": stopped by " << strsignal(g_signal) << "; every rank was stopped\n";
    return 128 + g_signal;  // as a shell reports a process ended by that signal
  }
  return job.blame();
}

std::optional<std::int64_t> read_oom_kill(const std::string& file) {
  std::ifstream in(file);
  std::string key;
  std::int64_t value = 0;
  while (in >> key >> value) {
    if (key == "oom_kill") return value;
  }
  return std::nullopt;
}

std::optional<OomKillCount> oom_kill_count() {
  // "0::/path" in /proc/self/cgroup: this process's cgroup v2 (a hybrid or v1 host has no
  // memory.events there, and the machine's count is the one left).
  std::ifstream cgroups("/proc/self/cgroup");
  for (std::string line; std::getline(cgroups, line);) {
    if (line.rfind("0::", 0) != 0) continue;
    const std::string file = "/sys/fs/cgroup" + (line.size() > 4 ? line.substr(3) : "") + "/memory.events";
    if (auto kills = read_oom_kill(file)) return OomKillCount{*kills, file};
  }
  if (auto kills = read_oom_kill("/proc/vmstat")) return OomKillCount{*kills, "/proc/vmstat"};
  return std::nullopt;
}

std::string killed_by(int signal, const std::optional<OomKillCount>& before, const std::optional<OomKillCount>& after) {
  std::string said = std::string("was killed by signal ") + strsignal(signal);
  if (signal != SIGKILL) return said;
  const std::string todo = "spmdx compile prints the planned peak memory of a rank; lower training.local_batch_size or training.seq_len, or set "
                           "parallelism.memory_budget for spmdx to fit the job";
  if (!before || !after || before->file != after->file) {
    return said + " (SIGKILL: sent by a person, a scheduler, or the kernel's out-of-memory killer, as dmesg would show; for memory, " + todo + ")";
  }
  if (after->kills > before->kills) {
    return said + ", most likely by the kernel's out-of-memory killer (oom_kill in " + after->file + " rose from " + std::to_string(before->kills) +
           " to " + std::to_string(after->kills) + " while the job ran): " + todo;
  }
  return said;
}

std::int64_t usable_cpus() {
  cpu_set_t set;
  return sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : static_cast<std::int64_t>(std::thread::hardware_concurrency());
}

std::vector<int> parse_cpu_list(const std::string& list) {
  auto bad = [&](const std::string& why) { return std::invalid_argument("CPU list '" + list + "': " + why + " (taskset's form: 0,2-3,8-15:2)"); };
  if (!list.empty() && list.back() == ',') throw bad("it ends with ','");
  std::set<int> out;
  std::stringstream in(list);
  std::string part;
  while (std::getline(in, part, ',')) {
    auto cpu = [&](const std::string& s) {
      if (s.empty() || s.size() > 6 || s.find_first_not_of("0123456789") != std::string::npos) {
        throw bad("'" + part + "' is not a CPU number, a range a-b or a range with a stride a-b:s");
      }
      const int n = std::stoi(s);
      if (n >= CPU_SETSIZE) throw bad("CPU " + s + " is past the " + std::to_string(CPU_SETSIZE) + " a CPU set holds");
      return n;
    };
    // a, a-b, or a-b:s (every s-th CPU from a to b, util-linux's cpulist form, as taskset -c 0-7:2).
    const auto colon = part.find(':');
    const std::string range = part.substr(0, colon);
    const auto dash = range.find('-');
    if (colon != std::string::npos && dash == std::string::npos) throw bad("the stride of '" + part + "' needs a range a-b:s");
    const int lo = cpu(range.substr(0, dash)), hi = dash == std::string::npos ? lo : cpu(range.substr(dash + 1));
    const int stride = colon == std::string::npos ? 1 : cpu(part.substr(colon + 1));
    if (hi < lo) throw bad("the range " + part + " runs backwards");
    if (stride < 1) throw bad("the stride of " + part + " is 0");
    for (int c = lo; c <= hi; c += stride) out.insert(c);
  }
  if (out.empty()) throw bad("no CPU named");
  return {out.begin(), out.end()};
}

std::vector<std::string> cpu_affinity_lists(const std::string& spec, int nproc) {
  std::vector<std::string> lists;
  std::stringstream in(spec);
  std::string one;
  while (std::getline(in, one, ';')) lists.push_back(one);
  if (!spec.empty() && spec.back() == ';') lists.push_back("");
  if (static_cast<int>(lists.size()) != nproc) {
    throw std::invalid_argument("--cpu-affinity '" + spec + "' gives " + std::to_string(lists.size()) + " CPU lists for " + std::to_string(nproc) +
                                " ranks (--nproc): one list a local rank, ';' between them, e.g. 0;1;1");
  }
  cpu_set_t own;
  const bool known = sched_getaffinity(0, sizeof own, &own) == 0;
  for (std::size_t r = 0; r < lists.size(); ++r) {
    std::vector<int> cpus;
    try {
      cpus = parse_cpu_list(lists[r]);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument("--cpu-affinity, local rank " + std::to_string(r) + ": " + e.what());
    }
    for (const int c : cpus) {
      if (known && !CPU_ISSET(c, &own)) {
        throw std::invalid_argument("--cpu-affinity, local rank " + std::to_string(r) + ": CPU " + std::to_string(c) + " is not among the " +
                                    std::to_string(CPU_COUNT(&own)) + " CPUs this process may use (see taskset -cp $$ or nproc)");
      }
    }
  }
  return lists;
}

std::vector<double> cpu_shares(const std::vector<std::string>& lists) {
  std::map<int, int> users;
  std::vector<std::vector<int>> cpus;
  for (const auto& l : lists) {
    cpus.push_back(parse_cpu_list(l));
    for (const int c : cpus.back()) ++users[c];
  }
  std::vector<double> out;
  for (const auto& mine : cpus) {
    double share = 0;
    for (const int c : mine) share += 1.0 / users[c];
    out.push_back(share);
  }
  return out;
}

double cpu_share(const RankEnv& env) {
  const char* v = std::getenv("SPMDX_CPU_SHARE");
  if (!env.store_hosted || v == nullptr || *v == '\0') return 0;
  char* end = nullptr;
  const double x = std::strtod(v, &end);
  return *end == '\0' && x > 0 && x <= static_cast<double>(usable_cpus()) ? x : 0;
}

std::string apply_cpu_affinity(const RankEnv& env) {
  const char* v = std::getenv("SPMDX_CPU_AFFINITY");
  if (!env.store_hosted || v == nullptr || *v == '\0') return "";
  std::vector<int> cpus;
  try {
    cpus = parse_cpu_list(v);
  } catch (const std::invalid_argument& e) {
    throw std::runtime_error(std::string("SPMDX_CPU_AFFINITY: ") + e.what());
  }
  cpu_set_t set;
  CPU_ZERO(&set);
  for (const int c : cpus) CPU_SET(c, &set);
  if (sched_setaffinity(0, sizeof set, &set) != 0 || sched_getaffinity(0, sizeof set, &set) != 0) {
    throw std::runtime_error(std::string("SPMDX_CPU_AFFINITY='") + v + "': the kernel refused it (" + std::strerror(errno) + "): name CPUs this job may use");
  }
  std::string out;  // the kernel's set, read back, in taskset's form
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (!CPU_ISSET(c, &set)) continue;
    int last = c;
    while (last + 1 < CPU_SETSIZE && CPU_ISSET(last + 1, &set)) ++last;
    out += (out.empty() ? "" : ",") + std::to_string(c) + (last > c ? "-" + std::to_string(last) : "");
    c = last;
  }
  return out;
}

}  // namespace spmdx::launch
