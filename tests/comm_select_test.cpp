// Backends chosen by score (spmdx/comm/score_map.h): the pick per operation, memory and size; a
// scored backend that routes each call to its pick across real ranks (threads over `local`)
// and still gives the right sums; what comm.backend = "auto" keeps from the built-in plugins.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <thread>

#include "spmdx/comm/all_to_all_v.h"
#include "spmdx/comm/score_map.h"
#include "spmdx/core/registry.h"

namespace spmdx::comm {
namespace {

using ::testing::HasSubstr;
constexpr std::size_t kAny = static_cast<std::size_t>(-1);

TEST(ChooseBackend, HighestCoveringScoreWinsPerOperationMemoryAndSize) {
  const std::vector<std::vector<CommCapability>> caps = {
      {{"*", MemoryType::host, 0, kAny, 10}},                                          // 0: ucx-like
      {{"*", MemoryType::cuda, 0, kAny, 100}, {"*", MemoryType::host, 0, kAny, 1}},  // 1: nccl-like
      {{"all_reduce", MemoryType::host, 0, 4096, 50}},                                 // 2: small all_reduce only
  };
  EXPECT_EQ(choose_backend(caps, "all_reduce", MemoryType::host, 4096), 2);
  EXPECT_EQ(choose_backend(caps, "all_reduce", MemoryType::host, 4097), 0);
  EXPECT_EQ(choose_backend(caps, "all_gather", MemoryType::host, 16), 0);
  EXPECT_EQ(choose_backend(caps, "all_gather", MemoryType::cuda, 16), 1);
  EXPECT_EQ(choose_backend({{{"*", MemoryType::host, 0, kAny, 5}}, {{"*", MemoryType::host, 0, kAny, 5}}}, "barrier", MemoryType::host, 0), 0)
      << "ties go to the first listed, the same on every rank";
  EXPECT_EQ(choose_backend({caps[0]}, "all_reduce", MemoryType::cuda, 16), -1);
}

// A member of a scored backend: the local backend with the capabilities a test gives, counting
// the collectives it was handed.
class Counted final : public CommBackend {
 public:
  Counted(std::unique_ptr<CommBackend> inner, std::vector<CommCapability> caps, std::atomic<int>& calls)
      : inner_(std::move(inner)), caps_(std::move(caps)), calls_(calls) {}
  void init(const CommInit& init) override {
    generations_.push_back(init.generation);
    inner_->init(init);
  }
  void finalize() override { inner_->finalize(); }
  void abort() noexcept override { inner_->abort(); }
  std::string describe() const override { return inner_->describe(); }
  std::vector<CommCapability> capabilities() const override { return caps_; }
  int new_group(const std::vector<int>& ranks) override { return inner_->new_group(ranks); }
  std::unique_ptr<Work> all_reduce(int g, CommBuffer b, ReduceOp op) override { return ++calls_, inner_->all_reduce(g, b, op); }
  std::unique_ptr<Work> all_gather(int g, CommBuffer in, CommBuffer out, std::vector<std::size_t> c) override {
    return ++calls_, inner_->all_gather(g, in, out, std::move(c));
  }
  std::unique_ptr<Work> reduce_scatter(int g, CommBuffer in, CommBuffer out, std::vector<std::size_t> c, ReduceOp op) override {
    return ++calls_, inner_->reduce_scatter(g, in, out, std::move(c), op);
  }
  std::unique_ptr<Work> all_to_all(int g, CommBuffer in, CommBuffer out, std::vector<std::size_t> s, std::vector<std::size_t> r) override {
    return ++calls_, inner_->all_to_all(g, in, out, std::move(s), std::move(r));
  }
  std::unique_ptr<Work> broadcast(int g, CommBuffer b, int root) override { return ++calls_, inner_->broadcast(g, b, root); }
  std::unique_ptr<Work> send(CommBuffer b, int peer, int tag) override { return ++calls_, inner_->send(b, peer, tag); }
  std::unique_ptr<Work> recv(CommBuffer b, int peer, int tag) override { return ++calls_, inner_->recv(b, peer, tag); }
  std::unique_ptr<Work> barrier(int g) override { return ++calls_, inner_->barrier(g); }
  std::vector<std::int64_t> generations_;

 private:
  std::unique_ptr<CommBackend> inner_;
  std::vector<CommCapability> caps_;
  std::atomic<int>& calls_;
};

TEST(CapabilityProblem, TyposEmptyRangesNegativeScoresAndEmptyTablesAreNamed) {
  EXPECT_EQ(capability_problem({{"*", MemoryType::host, 0, kAny, 10}, {"all_reduce", MemoryType::cuda, 0, 4096, 50}}), "");
  EXPECT_EQ(capability_problem({}), "it declares no capabilities (CommCapability: operation, memory, sizes, score), so it serves nothing");
  EXPECT_EQ(capability_problem({{"*", MemoryType::host, 0, kAny, 1}, {"all_reduse", MemoryType::host, 0, kAny, 5}}),
            "capability 1 (all_reduse, host) names operation 'all_reduse', which is neither \"*\" nor one of all_reduce, all_gather, "
            "reduce_scatter, all_to_all, all_to_all_v, broadcast, send, recv, barrier (did you mean all_reduce?)");
  EXPECT_EQ(capability_problem({{"*", MemoryType::host, 4096, 16, 5}}),
            "capability 0 (*, host) covers no size: min_bytes 4096 is above max_bytes 16");
  EXPECT_EQ(capability_problem({{"*", MemoryType::host, 0, kAny, -3}}), "capability 0 (*, host) has a negative score -3 (scores are 0 or more; higher wins)");
}

TEST(ScoredBackend, RoutesEachCallToItsPickAndSumsRight) {
  constexpr int n = 3;
  PluginRegistry registry;
  registry.discover({{BUILTIN_PLUGIN_DIR, PluginSource::Origin::builtin}});
  std::atomic<int> small_calls{0}, big_calls{0};
  std::vector<std::unique_ptr<CommBackend>> ranks;
  std::vector<Counted*> smalls;
  for (int r = 0; r < n; ++r) {
    auto small = std::make_unique<Counted>(registry.make_comm_backend("local", {{"job", "scored_small"}}),
                                           std::vector<CommCapability>{{"all_reduce", MemoryType::host, 0, 1024, 50}}, small_calls);
    auto big = std::make_unique<Counted>(registry.make_comm_backend("local", {{"job", "scored_big"}}),
                                         std::vector<CommCapability>{{"*", MemoryType::host, 0, kAny, 1}}, big_calls);
    smalls.push_back(small.get());
    std::vector<std::pair<std::string, std::unique_ptr<CommBackend>>> members;
    members.emplace_back("small", std::move(small));
    members.emplace_back("big", std::move(big));
    ranks.push_back(make_scored_backend(std::move(members)));
  }
  EXPECT_EQ(ranks[0]->capabilities().size(), 2u);
  std::vector<std::string> errors(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        CommBackend& b = *ranks[static_cast<std::size_t>(r)];
        b.init({r, n, 2, nullptr, 30});
        const int sub = b.new_group({0, 1, 2});
        std::vector<float> small(16, static_cast<float>(r + 1)), big(1000, static_cast<float>(r + 1));  // 64 and 4000 bytes
        b.all_reduce(sub, {small.data(), small.size(), CommDType::f32, MemoryType::host}, ReduceOp::sum)->wait(30);
        b.all_reduce(0, {big.data(), big.size(), CommDType::f32, MemoryType::host}, ReduceOp::sum)->wait(30);
        std::vector<float> gathered(3 * 16);
        b.all_gather(0, {small.data(), 16, CommDType::f32, MemoryType::host}, {gathered.data(), gathered.size(), CommDType::f32, MemoryType::host},
                     {16, 16, 16})
            ->wait(30);
        b.barrier(sub)->wait(30);
        if (small[0] != 6 || big[999] != 6 || gathered[0] != 6 || gathered[47] != 6) errors[static_cast<std::size_t>(r)] = "wrong sums";
        b.finalize();
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[static_cast<std::size_t>(r)], "") << "rank " << r;
  EXPECT_EQ(small_calls, n) << "the 64-byte all_reduce on every rank";
  EXPECT_EQ(big_calls, 3 * n) << "the 4000-byte all_reduce, the all_gather and the barrier";
  EXPECT_EQ(smalls[0]->generations_, std::vector<std::int64_t>{(std::int64_t{1} << 40) + 2})
      << "each member its own store generation, beyond any a plain backend's hot-swaps reach";
}

// all_to_all_v goes to the member that scores best for it, when that member has it
// (VariableAllToAll); a member without it is named.
TEST(ScoredBackend, AllToAllVGoesToItsPickOrNamesAPickWithoutIt) {
  constexpr int n = 2;
  PluginRegistry registry;
  registry.discover({{BUILTIN_PLUGIN_DIR, PluginSource::Origin::builtin}});
  std::atomic<int> calls{0};
  std::vector<std::unique_ptr<CommBackend>> ranks;
  for (int r = 0; r < n; ++r) {
    std::vector<std::pair<std::string, std::unique_ptr<CommBackend>>> members;
    members.emplace_back("engine", registry.make_comm_backend("local", {{"job", "scored_v"}}));
    // Best for all_to_all but not all_to_all_v: without VariableAllToAll, it must not get it.
    members.emplace_back("counted", std::make_unique<Counted>(registry.make_comm_backend("local", {{"job", "scored_v_counted"}}),
                                                              std::vector<CommCapability>{{"all_to_all", MemoryType::host, 0, kAny, 50}}, calls));
    ranks.push_back(make_scored_backend(std::move(members)));
  }
  std::vector<std::string> errors(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        CommBackend& b = *ranks[static_cast<std::size_t>(r)];
        b.init({r, n, 0, nullptr, 30});
        // Rank 0 sends rank 1 three elements and itself none; rank 1 sends each one.
        std::vector<std::int64_t> in = r == 0 ? std::vector<std::int64_t>{7, 8, 9} : std::vector<std::int64_t>{10, 11}, out(4, -1);
        std::vector<std::size_t> send = r == 0 ? std::vector<std::size_t>{0, 3} : std::vector<std::size_t>{1, 1}, recv(2);
        comm::all_to_all_v(b, 0, {in.data(), in.size(), CommDType::i64}, {out.data(), 4, CommDType::i64}, send, recv.data())->wait(30);
        const auto want = r == 0 ? std::vector<std::int64_t>{10, -1, -1, -1} : std::vector<std::int64_t>{7, 8, 9, 11};
        if (out != want || recv != (r == 0 ? std::vector<std::size_t>{0, 1} : std::vector<std::size_t>{3, 1})) errors[static_cast<std::size_t>(r)] = "wrong blocks";
        b.finalize();
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[static_cast<std::size_t>(r)], "") << "rank " << r;
  EXPECT_EQ(calls, 0);

  std::vector<std::pair<std::string, std::unique_ptr<CommBackend>>> members;
  members.emplace_back("counted", std::make_unique<Counted>(registry.make_comm_backend("local", {{"job", "scored_v_only"}}),
                                                            std::vector<CommCapability>{{"*", MemoryType::host, 0, kAny, 1}}, calls));
  auto b = make_scored_backend(std::move(members));
  b->init({0, 1, 0, nullptr, 5});
  std::int64_t x = 1, y = 0;
  std::size_t got = 0;
  EXPECT_THAT([&] { comm::all_to_all_v(*b, 0, {&x, 1, CommDType::i64}, {&y, 1, CommDType::i64}, {1}, &got); },
              ::testing::ThrowsMessage<std::invalid_argument>(HasSubstr("has no all_to_all_v (VariableAllToAll, plugin ABI 4.1)")));
  b->finalize();
}

TEST(ScoredBackend, CallNoMemberServesIsRefusedByName) {
  PluginRegistry registry;
  registry.discover({{BUILTIN_PLUGIN_DIR, PluginSource::Origin::builtin}});
  std::atomic<int> calls{0};
  std::vector<std::pair<std::string, std::unique_ptr<CommBackend>>> members;
  members.emplace_back("host", std::make_unique<Counted>(registry.make_comm_backend("local", {{"job", "scored_refuse"}}),
                                                         std::vector<CommCapability>{{"*", MemoryType::host, 0, kAny, 1}}, calls));
  auto b = make_scored_backend(std::move(members));
  b->init({0, 1, 0, nullptr, 5});
  float x = 1;
  try {
    b->all_reduce(0, {&x, 1, CommDType::f32, MemoryType::cuda}, ReduceOp::sum);
    FAIL() << "a CUDA buffer went to a host-only backend";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("serves all_reduce of 4 bytes in cuda memory"));
  }
  EXPECT_EQ(calls, 0);
}

TEST(AutoBackend, KeepsUcxForHostMemoryAndSaysWhyOthersAreLeftOut) {
  PluginRegistry registry;
  registry.discover({{BUILTIN_PLUGIN_DIR, PluginSource::Origin::builtin}});
  const std::vector<Candidate> found = auto_candidates(registry, {MemoryType::host}, true);
  std::map<std::string, std::string> why;
  for (const auto& c : found) why[c.name] = c.backend ? "kept" : c.why_not;
  EXPECT_EQ(why.at("ucx"), "kept");
  EXPECT_EQ(why.at("local"), "in-process only (ranks here are processes)");
  if (why.count("nccl")) {  // built here: no CUDA device, or one whose host score loses to ucx's
    EXPECT_THAT(why.at("nccl"), ::testing::AnyOf(HasSubstr("no usable CUDA device"), HasSubstr("never chosen: for every operation and size another backend scores higher")));
  }
  // With one backend kept, "auto" is that backend itself.
  EXPECT_THAT(make_job_backend(registry, "auto", {MemoryType::host}, true)->describe(), HasSubstr("ucx (UCX_TLS="));
  // Ranks as threads of one process: local is a candidate too, and ucx outscores it everywhere.
  PluginRegistry threads;
  threads.discover({{BUILTIN_PLUGIN_DIR, PluginSource::Origin::builtin}});
  for (const auto& c : auto_candidates(threads, {MemoryType::host}, false)) {
    if (c.name == "local") {
      EXPECT_EQ(c.why_not, "never chosen: for every operation and size another backend scores higher (or as high, with a name first in order)");
    }
  }
}

TEST(AutoBackend, NoneThatMovesTheMemoryIsAClearError) {
  PluginRegistry registry;
  registry.discover({{BUILTIN_PLUGIN_DIR, PluginSource::Origin::builtin}});
  std::unique_ptr<CommBackend> b;
  try {
    b = make_job_backend(registry, "auto", {MemoryType::cuda}, true);
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("comm.backend = \"auto\" found no comm backend that moves cuda memory between ranks; left out: "));
    EXPECT_THAT(e.what(), HasSubstr("ucx (moves no cuda memory)"));
    return;
  }
  EXPECT_THAT(b->describe(), HasSubstr("nccl")) << "on a machine with a CUDA device only nccl moves CUDA memory";
}

}  // namespace
}  // namespace spmdx::comm
