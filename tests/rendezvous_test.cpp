// Rendezvous as users get it wrong: a store port held by something that is not a spmdx store,
// ranks started by hand with different configs or world sizes, a wrong job token, a rank that
// never comes. Every blocking step has a deadline and every failure names what did not answer
// or what differs, on every rank.
#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <thread>

#include "run_util.h"
#include "spmdx/comm/store.h"
#include "spmdx/launch/rendezvous.h"

namespace spmdx {
namespace {

using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// A TCP listener on a free loopback port that does `serve` with each connection it accepts
// (nothing: it never accepts, so connections wait in its backlog).
class Listener {
 public:
  explicit Listener(std::function<void(int)> serve = nullptr) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(fd_, 8) != 0) throw std::runtime_error("listen");
    socklen_t len = sizeof a;
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    if (serve) {
      thread_ = std::thread([this, serve] {
        const int c = ::accept(fd_, nullptr, nullptr);
        if (c >= 0) {
          serve(c);
          ::close(c);
        }
      });
    }
  }
  ~Listener() {
    ::shutdown(fd_, SHUT_RDWR);
    ::close(fd_);
    if (thread_.joinable()) thread_.join();
  }
  int port() const { return port_; }

 private:
  int fd_ = -1, port_ = 0;
  std::thread thread_;
};

// Reads and drops what the client sends until it closes the connection: a listener that has
// said its piece keeps the connection open as long as the client does, however slowly the
// client gets to read it (a sleep before closing could be outlasted by a client on a busy
// machine, which would then read a reset instead of the answer).
void drain(int fd) {
  char buf[256];
  while (::recv(fd, buf, sizeof buf, 0) > 0) {
  }
}

void send_frame(int fd, const std::string& s) {
  const std::uint32_t n = static_cast<std::uint32_t>(s.size());
  ::send(fd, &n, 4, MSG_NOSIGNAL);
  ::send(fd, s.data(), s.size(), MSG_NOSIGNAL);
}

std::string connect_error(int port, double timeout, const std::string& token = "tok", int rank = 1) {
  try {
    comm::TcpStore store("127.0.0.1", port, token, timeout, rank);
  } catch (const CommError& e) {
    return e.what();
  }
  return "";
}

TEST(Store, AListenerThatNeverAnswersFailsAtTheDeadlineNamingTheAddress) {
  Listener silent;  // accepts (the kernel's backlog) and never answers, as a stopped process
  const auto t0 = Clock::now();
  const std::string e = connect_error(silent.port(), 1.5);
  EXPECT_GE(since(t0), 1.4);
  EXPECT_LT(since(t0), 30.0);  // at the deadline, not never
  EXPECT_THAT(e, HasSubstr("store 127.0.0.1:" + std::to_string(silent.port()) + ": accepted the connection but did not answer the spmdx store handshake within 1.5 s"));
  EXPECT_THAT(e, HasSubstr("pick another MASTER_PORT"));
}

TEST(Store, AnotherServiceOrAnOlderStoreFailsAtOnceSayingWhatAnswered) {
  struct Case {
    std::string name;
    std::function<void(int)> serve;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {"http", [](int c) { ::send(c, "HTTP/1.1 400 Bad Request\r\n\r\n", 28, MSG_NOSIGNAL); drain(c); },
       "answered the spmdx store handshake with 'HTTP'..., not as a spmdx store does"},
      {"closes", [](int) {}, "closed the connection at the spmdx store handshake: not a spmdx store"},
      {"protocol 1", [](int c) { send_frame(c, "ERR not authenticated"); drain(c); },
       "an older spmdx store (protocol 1, without a handshake) answers there"},
      {"other frame", [](int c) { send_frame(c, "hello there"); drain(c); },
       "answered the spmdx store handshake with 'hello there': not a spmdx store"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    Listener l(c.serve);
    const auto t0 = Clock::now();
    EXPECT_THAT(connect_error(l.port(), 90), HasSubstr(c.expected));
    EXPECT_LT(since(t0), 45.0);  // at once, not at the 90 s deadline
  }
}

TEST(Store, RequestsToAStoreThatStopsAnsweringFailAtTheirDeadline) {
  // Answers the handshake and the authentication, then nothing (a stopped process).
  Listener l([](int c) {
    std::uint32_t n = 0;
    std::string buf(256, ' ');
    for (int frame = 0; frame < 4; ++frame) {  // HELLO, AUTH, token, rank
      ::recv(c, &n, 4, MSG_WAITALL);
      ::recv(c, buf.data(), n, MSG_WAITALL);
      if (frame == 0) send_frame(c, "SPMDX-STORE 2");
      if (frame == 3) send_frame(c, "OK");
    }
    drain(c);  // and never answers
  });
  comm::TcpStore store("127.0.0.1", l.port(), "tok", 1.0, 0);
  const auto t0 = Clock::now();
  try {
    store.set("spmdx/x", "1");
    FAIL() << "set returned";
  } catch (const CommError& e) {
    EXPECT_THAT(e.what(), HasSubstr("did not answer set 'spmdx/x' within 1 s"));
  }
  EXPECT_LT(since(t0), 30.0);  // at the deadline, not never
}

// A listener that passes the handshake and then answers nonsense is named, not "stoll".
TEST(Store, AnAnswerThatIsNotAStoresIsNamed) {
  Listener l([](int c) {
    std::uint32_t n = 0;
    std::string buf(256, ' ');
    for (int frame = 0; frame < 7; ++frame) {  // HELLO, AUTH token rank, ADD key delta
      if (::recv(c, &n, 4, MSG_WAITALL) != 4) return;
      ::recv(c, buf.data(), n, MSG_WAITALL);
      if (frame == 0) send_frame(c, "SPMDX-STORE 2");
      if (frame == 3) send_frame(c, "OK");
      if (frame == 6) send_frame(c, "HELLO");
    }
    drain(c);
  });
  comm::TcpStore store("127.0.0.1", l.port(), "tok", 5.0, 1);
  try {
    store.add("spmdx/rdzv/claim/1", 1);
    FAIL() << "add returned";
  } catch (const CommError& e) {
    EXPECT_THAT(e.what(), HasSubstr("answered add 'spmdx/rdzv/claim/1' with 'HELLO', not a number"));
  }
}

TEST(Store, AWrongTokenIsRefusedAndRecordedForTheRanksThatWait) {
  comm::TcpStoreServer server("127.0.0.1", 0, "tok");
  EXPECT_THAT(connect_error(server.port(), 5, "other", 3), HasSubstr("wrong job token (check SPMDX_JOB_TOKEN"));
  comm::TcpStore store("127.0.0.1", server.port(), "tok", 5, 0);
  EXPECT_EQ(store.get(comm::kRejectedKey, 1), "rank 3 from 127.0.0.1: wrong job token\n");
  store.set("k", "v");
  EXPECT_EQ(store.get("k", 1), "v");
  EXPECT_EQ(store.add("n", 2), 2);
  const auto t0 = Clock::now();
  EXPECT_THROW(store.get("never", 0.3), CommError);
  EXPECT_LT(since(t0), 30.0);  // at the deadline, not never
}

// Ranks as threads, each with its own connection to one store.
struct Job {
  comm::TcpStoreServer server{"127.0.0.1", 0, "tok"};
  std::string where() const { return "127.0.0.1:" + std::to_string(server.port()); }
  launch::RankIdentity rank(int r, int world_size) const {
    launch::RankIdentity me;
    me.rank = r;
    me.world_size = world_size;
    me.host = "h";
    me.local_rank = r;  // every rank on one host
    me.local_world_size = world_size;
    me.version = "spmdx test";
    me.token = "tok";
    me.settings = {{"optimizer.lr", "0.0008"}, {"training.steps", "10"}};
    return me;
  }
  // Runs each identity's rendezvous on a thread of its own; the message each threw ("" for none).
  std::vector<std::string> run(const std::vector<launch::RankIdentity>& ranks, double timeout = 10) const {
    std::vector<std::future<std::string>> results;
    for (const auto& me : ranks) {
      results.push_back(std::async(std::launch::async, [this, me, timeout] {
        try {
          comm::TcpStore store("127.0.0.1", server.port(), me.token, timeout, me.rank);
          launch::rendezvous(store, me, timeout, where());
        } catch (const CommError& e) {
          return std::string(e.what());
        }
        return std::string();
      }));
    }
    std::vector<std::string> out;
    for (auto& f : results) out.push_back(f.get());
    return out;
  }
};

TEST(Rendezvous, RanksThatAgreeJoin) {
  Job job;
  const auto out = job.run({job.rank(0, 3), job.rank(1, 3), job.rank(2, 3)});
  for (const auto& e : out) EXPECT_EQ(e, "");
}

TEST(Rendezvous, EveryRankFailsWithOneMessageNamingTheSettingThatDiffersAndTheRanks) {
  Job job;
  auto odd = job.rank(2, 3);
  odd.settings["optimizer.lr"] = "0.003";
  odd.settings["hooks.timeline.steps"] = "\"4\"";
  const auto out = job.run({job.rank(0, 3), job.rank(1, 3), odd});
  for (const auto& e : out) {
    EXPECT_THAT(e, HasSubstr("rendezvous at " + job.where() + ": the ranks were started with different configs: "));
    // Rank 0 refuses as soon as the odd rank arrives: rank 1 may not have joined yet.
    EXPECT_THAT(e, ::testing::AnyOf(HasSubstr("rank 2 has optimizer.lr = 0.003, ranks 0, 1 have 0.0008"),
                                    HasSubstr("rank 2 has optimizer.lr = 0.003, rank 0 has 0.0008")));
    EXPECT_THAT(e, HasSubstr("rank 2 has hooks.timeline.steps = \"4\", rank"));
  }
  EXPECT_EQ(out[0], out[1]);
  EXPECT_EQ(out[0], out[2]);
}

TEST(Rendezvous, AWorldSizeThatDiffersIsNamedWithItsVariable) {
  Job job;
  auto big = job.rank(1, 4);
  big.world_size_from = "SLURM_NTASKS";
  const auto out = job.run({job.rank(0, 2), big});
  for (const auto& e : out) EXPECT_THAT(e, HasSubstr("the world size differs: rank 1 has SLURM_NTASKS=4, rank 0 has WORLD_SIZE=2"));
  // Rank 0 with the larger world size learns it as soon as rank 1 arrives, not at its timeout.
  Job bigger;
  const auto t0 = Clock::now();
  const auto out3 = bigger.run({bigger.rank(0, 3), bigger.rank(1, 2)}, 90);
  EXPECT_LT(since(t0), 45.0);  // not at the 90 s timeout
  for (const auto& e : out3) EXPECT_THAT(e, HasSubstr("the world size differs: rank 1 has WORLD_SIZE=2, rank 0 has WORLD_SIZE=3"));
  // A rank beyond rank 0's world learns it from the verdict.
  Job other;
  const auto out2 = other.run({other.rank(0, 2), other.rank(1, 2), other.rank(3, 4)});
  EXPECT_EQ(out2[0], "");
  EXPECT_THAT(out2[2], HasSubstr("rank 0 runs a job of 2 ranks, rank 3 was started with WORLD_SIZE=4"));
}

TEST(Rendezvous, ARankThatNeverComesIsNamedAtTheTimeoutOnEveryRank) {
  Job job;
  const auto t0 = Clock::now();
  const auto out = job.run({job.rank(0, 3), job.rank(1, 3)}, 1.5);
  EXPECT_LT(since(t0), 30.0);  // at the timeout, not never
  for (const auto& e : out) EXPECT_THAT(e, HasSubstr("rank 0 waited 1.5 s (comm.timeout_seconds) for rank 2 of 3 to join"));
}

TEST(Rendezvous, ARankRefusedForItsTokenIsNamedByTheRanksWaitingForIt) {
  Job job;
  auto wrong = job.rank(1, 2);
  wrong.token = "secret";
  const auto t0 = Clock::now();
  const auto out = job.run({job.rank(0, 2), wrong}, 90);
  EXPECT_LT(since(t0), 45.0);  // not at the 90 s timeout
  EXPECT_THAT(out[0], HasSubstr("rank 1 from 127.0.0.1 could not join: the store refused its job token"));
  EXPECT_THAT(out[1], HasSubstr("wrong job token"));
}

// LOCAL_WORLD_SIZE and LOCAL_RANK must describe the hosts as they are: they decide shared
// memory and each rank's share of the cores.
TEST(Rendezvous, LocalRanksThatDoNotDescribeTheHostsAreRefused) {
  Job job;
  auto a = job.rank(0, 2), b = job.rank(1, 2);
  b.local_world_size = 1;
  b.local_rank = 0;
  for (const auto& e : job.run({a, b})) EXPECT_THAT(e, HasSubstr("ranks 0, 1 run on host h, but rank 1 has LOCAL_WORLD_SIZE=1"));
  Job same;
  auto c = same.rank(0, 2), d = same.rank(1, 2);
  d.local_rank = 0;
  for (const auto& e : same.run({c, d})) EXPECT_THAT(e, HasSubstr("ranks 0, 1 run on host h and two of them have LOCAL_RANK=0"));
  Job two_hosts;  // one rank on each of two hosts: LOCAL_WORLD_SIZE 1, LOCAL_RANK 0 each
  auto e = two_hosts.rank(0, 2), f = two_hosts.rank(1, 2);
  e.local_world_size = f.local_world_size = 1;
  f.local_rank = 0;
  f.host = "other";
  for (const auto& m : two_hosts.run({e, f})) EXPECT_EQ(m, "");
}

// Every rank fails at once, naming the rank two processes claimed, not only the second one.
TEST(Rendezvous, TwoProcessesWithTheSameRankAreRefusedOnEveryRank) {
  Job job;
  const auto t0 = Clock::now();
  const auto out = job.run({job.rank(0, 3), job.rank(1, 3), job.rank(1, 3)}, 90);
  EXPECT_LT(since(t0), 45.0);  // not at the 90 s timeout
  for (const auto& e : out) EXPECT_THAT(e, HasSubstr("two processes joined this job as rank 1"));
}

// Rank variables that cannot make a job are refused at once, before any store is touched.
TEST(Rendezvous, RankVariablesThatCannotMakeAJobAreRefusedAtOnce) {
  test::TempDir dir;
  const std::string run = "'" SPMDX_EXE "' run '" SPMDX_SOURCE_DIR "/configs/mlp_dp.toml' --data.paths '" + test::corpus_file(dir) +
                          "' --job.dump_folder '" + (dir / "out").string() + "'";
  auto r = test::run_command("env -u RANK WORLD_SIZE=2 LOCAL_RANK=1 " + run);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("WORLD_SIZE=2 is set but RANK is not"));
  EXPECT_THAT(r.output, ::testing::Not(HasSubstr("done:")));
  r = test::run_command("env RANK=1 WORLD_SIZE=2 MASTER_PORT=70000 " + run);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("MASTER_PORT=70000 is not a TCP port (1 to 65535)"));
}

// Real rank processes started by hand, as torchrun or srun starts them.
TEST(Rendezvous, RanksStartedByHandWithAnotherLearningRateFailAtOnceNamingIt) {
  test::TempDir dir;
  const std::string env = "WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(29000 + ::getpid() % 900) +
                          " SPMDX_JOB_TOKEN=t";
  const std::string run = "'" SPMDX_EXE "' run '" SPMDX_SOURCE_DIR "/configs/mlp_dp.toml' --parallelism.data_parallel_replicate_degree 2 "
                          "--training.steps 3 --comm.timeout_seconds 100 --data.paths '" + test::corpus_file(dir) + "' --job.dump_folder '" +
                          (dir / "out").string() + "'";
  const auto t0 = Clock::now();
  auto r = test::run_command("{ (env RANK=0 LOCAL_RANK=0 " + env + " " + run + " > '" + (dir / "r0.log").string() + "' 2>&1; echo rank0=$?) & env RANK=1 LOCAL_RANK=1 " +
                             env + " " + run + " --optimizer.lr 3e-3; echo rank1=$?; wait; }");
  EXPECT_LT(since(t0), 60.0) << r.output;  // not the 100 s timeout
  std::ifstream in(dir / "r0.log");
  const std::string r0((std::istreambuf_iterator<char>(in)), {});
  for (const std::string& out : {r.output, r0}) {
    EXPECT_THAT(out, HasSubstr("the ranks were started with different configs: rank 1 has optimizer.lr = 0.003, rank 0 has 8e-04")) << out;
  }
  EXPECT_THAT(r.output, HasSubstr("rank0=1"));
  EXPECT_THAT(r.output, HasSubstr("rank1=1"));
  EXPECT_THAT(r0, HasSubstr("[rank 0] waiting for 2 ranks to join at 127.0.0.1:"));  // no launcher to name the rank: it names itself, once
  EXPECT_THAT(r0, ::testing::Not(HasSubstr("rank 0: waiting")));
}

// A config's warning is the same for every rank: said once, by spmdx's launcher (--nproc) or,
// for ranks started by hand as torchrun starts them, by the host's local rank 0; never again by
// a rank once the job runs.
TEST(Rendezvous, AConfigWarningIsSaidOnceHoweverTheRanksStart) {
  test::TempDir dir;
  const std::string warning = "lr_scheduler.warmup_steps 5 is more than the 2 steps of the schedule";
  auto count = [&](const std::string& out) {
    int n = 0;
    for (std::size_t at = out.find(warning); at != std::string::npos; at = out.find(warning, at + 1)) ++n;
    return n;
  };
  const std::string args = " run '" SPMDX_SOURCE_DIR "/configs/mlp_dp.toml' --parallelism.data_parallel_replicate_degree 2 --training.steps 2 "
                           "--lr_scheduler.warmup_steps 5 --data.paths '" + test::corpus_file(dir) + "'";
  auto launched = test::run_command("'" SPMDX_EXE "'" + args + " --nproc 2 --job.dump_folder '" + (dir / "launched").string() + "' 2>&1");
  ASSERT_EQ(launched.exit_code, 0) << launched.output;
  EXPECT_EQ(count(launched.output), 1) << launched.output;
  const std::string env = "WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(29000 + (::getpid() + 450) % 900) +
                          " SPMDX_JOB_TOKEN=t";
  const std::string run = "'" SPMDX_EXE "'" + args + " --job.dump_folder '" + (dir / "by_hand").string() + "'";
  auto by_hand = test::run_command("{ (env RANK=0 LOCAL_RANK=0 " + env + " " + run + " > '" + (dir / "r0.log").string() + "' 2>&1; echo rank0=$?) & env RANK=1 LOCAL_RANK=1 " +
                                   env + " " + run + " 2>&1; echo rank1=$?; wait; }");
  std::ifstream in(dir / "r0.log");
  const std::string r0((std::istreambuf_iterator<char>(in)), {});
  EXPECT_THAT(by_hand.output, HasSubstr("rank0=0")) << by_hand.output << r0;
  EXPECT_THAT(by_hand.output, HasSubstr("rank1=0")) << by_hand.output << r0;
  EXPECT_EQ(count(r0), 1) << r0;
  EXPECT_EQ(count(by_hand.output), 0) << by_hand.output;
}

}  // namespace
}  // namespace spmdx
