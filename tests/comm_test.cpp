// The ucx backend across real processes: 2, 3 and 4 ranks started as torchrun would start them
// (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), the store served here. Each worker checks every
// collective, dtype and reduce op against a reference (comm_worker.cpp).
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include "spmdx/comm/store.h"
#include "test_util.h"

extern char** environ;

namespace spmdx {
namespace {

using ::testing::HasSubstr;

struct RankResult {
  int exit_code = -1;  // -signal when killed
  std::string output;
};

// Starts `world` workers with `extra` environment and waits for all (killing them after
// `limit_seconds`).
std::vector<RankResult> run_ranks(int world, const std::map<std::string, std::string>& extra, double limit_seconds = 240) {
  comm::TcpStoreServer server("127.0.0.1", 0, "test-token");
  test::TempDir dir;
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    std::map<std::string, std::string> env{{"RANK", std::to_string(r)},       {"WORLD_SIZE", std::to_string(world)},
                                           {"LOCAL_RANK", std::to_string(r)}, {"LOCAL_WORLD_SIZE", std::to_string(world)},
                                           {"MASTER_ADDR", "127.0.0.1"},       {"MASTER_PORT", std::to_string(server.port())},
                                           {"SPMDX_JOB_TOKEN", "test-token"}};
    for (const auto& [k, v] : extra) env[k] = v;
    std::vector<std::string> strings;
    for (char** e = environ; *e; ++e) {
      const std::string kv = *e;
      if (!env.count(kv.substr(0, kv.find('=')))) strings.push_back(kv);
    }
    for (const auto& [k, v] : env) strings.push_back(k + "=" + v);
    std::vector<char*> envp;
    for (auto& s : strings) envp.push_back(s.data());
    envp.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    const std::string out = (dir / ("rank" + std::to_string(r))).string();
    posix_spawn_file_actions_addopen(&fa, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    char* argv[] = {const_cast<char*>(COMM_WORKER), nullptr};
    pid_t pid = 0;
    EXPECT_EQ(posix_spawn(&pid, COMM_WORKER, &fa, nullptr, argv, envp.data()), 0);
    posix_spawn_file_actions_destroy(&fa);
    pids.push_back(pid);
  }
  std::vector<RankResult> results(static_cast<std::size_t>(world));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(limit_seconds);
  for (int r = 0; r < world; ++r) {
    int status = 0;
    while (waitpid(pids[static_cast<std::size_t>(r)], &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        for (pid_t p : pids) kill(p, SIGKILL);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    auto& res = results[static_cast<std::size_t>(r)];
    res.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
    std::ifstream in(dir / ("rank" + std::to_string(r)));
    std::stringstream s;
    s << in.rdbuf();
    res.output = s.str();
  }
  return results;
}

TEST(CommUcx, EveryCollectiveDtypeAndOpOn2And3And4Ranks) {
  for (int world : {2, 3, 4}) {
    std::map<std::string, std::string> env;
    if (world == 4) env["SPMDX_TEST_BIG"] = "1";  // 64 MiB all_reduce too
    auto results = run_ranks(world, env);
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(results[static_cast<std::size_t>(r)].exit_code, 0) << "world " << world << " rank " << r << ":\n" << results[static_cast<std::size_t>(r)].output;
      EXPECT_THAT(results[static_cast<std::size_t>(r)].output, HasSubstr("checked"));
    }
    std::printf("world %d: %s", world, results[0].output.c_str());
  }
}

// Ranks on one host run all_reduce, reduce_scatter and all_gather through a shared-memory
// segment per group, unlinked once every member mapped it; with shm=off, over UCX's messages.
TEST(CommUcx, OneHostSharesMemoryAndShmOffGoesThroughTheTransport) {
  for (int world : {2, 3}) {
    for (const char* shm : {"on", "off"}) {
      auto results = run_ranks(world, {{"SPMDX_TEST_OPTIONS", std::string("shm=") + shm}});
      for (const auto& r : results) {
        EXPECT_EQ(r.exit_code, 0) << r.output;
        EXPECT_THAT(r.output, HasSubstr(std::string("shared memory: ") + (shm == std::string("on") ? "unlinked" : "none"))) << r.output;
      }
    }
  }
}

// 64-byte rounds: every collective of more than a few elements runs many rounds, reusing each
// slot, over blocks of uneven sizes (3 ranks).
TEST(CommUcx, SharedMemoryInSmallRoundsGivesTheSameResults) {
  auto results = run_ranks(3, {{"SPMDX_TEST_OPTIONS", "shm_chunk_bytes=64"}});
  for (const auto& r : results) {
    EXPECT_EQ(r.exit_code, 0) << r.output;
    // Through shared memory, not the transport it falls back to when a segment cannot be mapped.
    EXPECT_THAT(r.output, HasSubstr("shared memory: unlinked")) << r.output;
  }
}

// Members that call different collectives fail with an error that says what each called
// (through shared memory, each member's round carries what it runs).
TEST(CommUcx, MembersCallingDifferentCollectivesFailSayingWhatEachCalled) {
  auto results = run_ranks(3, {{"SPMDX_TEST_MODE", "mismatch"}}, 60);
  for (const auto& r : results) {
    EXPECT_EQ(r.exit_code, 3) << r.output;
    EXPECT_THAT(r.output, HasSubstr("all_reduce #0 of 2000 f32 sum"));
    EXPECT_THAT(r.output, HasSubstr("all_reduce #0 of 1000 f32 sum"));
    EXPECT_THAT(r.output, HasSubstr("every member must call the same collectives"));
    // and the backend is aborted: the next collective fails at once, naming the first failure
    EXPECT_THAT(r.output, ::testing::ContainsRegex("then after 0\\.[0-9]+ s: all_reduce aborted: an earlier collective failed: all_reduce \\(group 0, #0\\)"));
  }
  std::printf("%s", results[0].output.c_str());
  // A member that passes no elements at all is caught too (every collective has a round).
  results = run_ranks(3, {{"SPMDX_TEST_MODE", "mismatch"}, {"SPMDX_TEST_RANK1_COUNT", "0"}}, 60);
  for (const auto& r : results) {
    EXPECT_EQ(r.exit_code, 3) << r.output;
    EXPECT_THAT(r.output, HasSubstr("all_reduce #0 of 0 f32 sum"));
    EXPECT_THAT(r.output, HasSubstr("all_reduce #0 of 1000 f32 sum"));
  }
}

// Ranks whose shared-memory options differ do not share memory (a segment sized by one
// member's options would be read by another's): they warn, naming the options, and run every
// collective through the transport, correctly.
TEST(CommUcx, RanksWithOtherShmOptionsWarnAndUseTheTransport) {
  for (const char* rank1 : {"shm_chunk_bytes=64", "shm=off"}) {
    auto results = run_ranks(3, {{"SPMDX_TEST_OPTIONS_RANK1", rank1}});
    for (const auto& r : results) {
      EXPECT_EQ(r.exit_code, 0) << r.output;
      EXPECT_THAT(r.output, HasSubstr("shared memory: none")) << rank1;
    }
    EXPECT_THAT(results[0].output, HasSubstr("does not share memory: rank 1 has shm " + std::string(rank1[4] == 'c' ? "chunk 64" : "off")))
        << results[0].output;
  }
}

// abort() from another thread fails a collective that waits on peers who never come, at once.
TEST(CommUcx, AbortUnblocksAWaitingCollective) {
  for (const char* shm : {"on", "off"}) {
    auto results = run_ranks(2, {{"SPMDX_TEST_MODE", "abort"}, {"SPMDX_TEST_OPTIONS", std::string("shm=") + shm}}, 60);
    const std::string& out = results[0].output;
    EXPECT_EQ(results[0].exit_code, 3) << out;
    EXPECT_THAT(out, HasSubstr("aborted"));
    const auto at = out.find("CommError after ");
    ASSERT_NE(at, std::string::npos) << out;
    EXPECT_LT(std::stod(out.substr(at + 16)), 2.0) << "shm=" << shm << ": " << out;
  }
}

TEST(CommUcx, TwoGroupsRunConcurrently) {
  auto results = run_ranks(4, {{"SPMDX_TEST_MODE", "groups"}});
  for (const auto& r : results) EXPECT_EQ(r.exit_code, 0) << r.output;
}

TEST(CommUcx, OverTcpToo) {
  auto results = run_ranks(2, {{"SPMDX_TEST_TLS", "tcp,self"}, {"SPMDX_TEST_OPTIONS", "shm=off"}});  // every byte over TCP
  for (const auto& r : results) {
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_THAT(r.output, HasSubstr("shared memory: none"));
  }
}

TEST(CommUcx, ARankThatDiesIsNamedByTheOthersWithinTheTimeout) {
  const auto start = std::chrono::steady_clock::now();
  auto results = run_ranks(4, {{"SPMDX_TEST_MODE", "die"}, {"SPMDX_TEST_TIMEOUT", "3"}}, 60);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(results[1].exit_code, 9);
  for (int r : {0, 2, 3}) {
    EXPECT_EQ(results[static_cast<std::size_t>(r)].exit_code, 3) << results[static_cast<std::size_t>(r)].output;
    EXPECT_THAT(results[static_cast<std::size_t>(r)].output, HasSubstr("CommError peer=1"));
    EXPECT_THAT(results[static_cast<std::size_t>(r)].output, HasSubstr("all_reduce"));
    EXPECT_THAT(results[static_cast<std::size_t>(r)].output, HasSubstr("rank 1"));
  }
  // Within about the 3 s timeout, not the default 120 s (run_ranks kills them all at 60 s):
  // 45 s leaves room for starting 4 ranks on a loaded machine.
  EXPECT_LT(seconds, 45) << "the others did not fail fast";
}

// A rank that stops answering, heartbeat included (SIGSTOP: as a node that vanished, which no
// local launcher notices), fails the others after two heartbeat checks, long before the
// collective's timeout (100 s here), naming it. The checks take about 12 s (a stall of 5 s,
// then two checks 5 s apart; a third when this machine is too busy for a rank's own heartbeat
// to advance in one); rank 1 stays stopped for 60 s, so that failing by 45 s can only be the
// heartbeat's doing, not rank 1's death, however loaded the machine.
TEST(CommUcx, ARankWhoseHeartbeatStopsIsNamedBeforeTheTimeout) {
  auto results = run_ranks(4, {{"SPMDX_TEST_MODE", "stop"}, {"SPMDX_TEST_TIMEOUT", "100"}}, 100);
  EXPECT_EQ(results[1].exit_code, -SIGKILL) << "rank 1 is ended by its own child after 60 s";
  for (int r : {0, 2, 3}) {
    const std::string& out = results[static_cast<std::size_t>(r)].output;
    EXPECT_EQ(results[static_cast<std::size_t>(r)].exit_code, 3) << out;
    EXPECT_THAT(out, HasSubstr("CommError peer=1 after"));
    EXPECT_THAT(out, ::testing::ContainsRegex("rank 1 (stopped \\(no heartbeat|failed \\(reported by a peer)"));
    const auto at = out.find(" after ");
    ASSERT_NE(at, std::string::npos) << out;
    EXPECT_LT(std::stod(out.substr(at + 7)), 45.0) << "rank " << r << " failed late: " << out;
  }
  std::printf("%s", results[0].output.c_str());
}

}  // namespace
}  // namespace spmdx
