// parallelism.balance = "speed" (job/balance.h): the split of the global batch in whole rows by
// the ranks' measured costs, agreed through a real store; and `spmdx run` with one rank slowed 3x
// by fault injection, whose losses and gradient norms stay those of one rank on the same global
// batch while the split moves.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <functional>
#include <thread>

#include "run_util.h"
#include "spmdx/comm/store.h"
#include "spmdx/job/balance.h"
#include "spmdx/sharding/mesh.h"

namespace spmdx::job {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

TEST(Balance, WholeRowsInProportionToSpeed) {
  // Three ranks, the third 3x slower a row: 14 rows split 6:6:2 (each 6 units of time); 21 as 9:9:3.
  const std::vector<RankCost> slow_third{{0, 1}, {0, 1}, {0, 3}};
  EXPECT_THAT(balanced_rows(14, slow_third), ElementsAre(6, 6, 2));
  EXPECT_THAT(balanced_rows(21, slow_third), ElementsAre(9, 9, 3));
  EXPECT_DOUBLE_EQ(predicted_seconds({6, 6, 2}, slow_third), 6);
  EXPECT_DOUBLE_EQ(predicted_seconds({5, 5, 4}, slow_third), 12);
  // Equal costs: even, the first ranks one more (as torch.chunk's order would not: it is rows / n rounded up).
  EXPECT_THAT(balanced_rows(10, std::vector<RankCost>(3)), ElementsAre(4, 3, 3));
  EXPECT_THAT(balanced_rows(12, std::vector<RankCost>(3)), ElementsAre(4, 4, 4));
  // Every rank keeps a row, however slow.
  EXPECT_THAT(balanced_rows(4, {{0, 1}, {0, 1}, {0, 1000}}), ElementsAre(2, 1, 1));
  // A fixed part (the optimizer's, 3x on the slow rank too): 0.5 + 0.1 r against 1.5 + 0.3 r over
  // 20 rows: 16:4 finishes at 2.1 and 2.7; 17:3 at 2.2 and 2.4; 18:2 at 2.3 and 2.1; 19:1 at 2.4
  // and 1.8: 18:2 is the least maximum.
  EXPECT_THAT(balanced_rows(20, {{0.5, 0.1}, {1.5, 0.3}}), ElementsAre(18, 2));
  EXPECT_THROW(balanced_rows(2, std::vector<RankCost>(3)), std::invalid_argument);
  EXPECT_THROW(balanced_rows(6, {{0, 1}, {0, 0}}), std::invalid_argument);
  EXPECT_THROW(balanced_rows(6, {{0, 1}, {0, NAN}}), std::invalid_argument);
  EXPECT_THROW(balanced_rows(6, {{-1, 1}, {0, 1}}), std::invalid_argument);
  EXPECT_EQ(split_text({6, 6, 2}), "6:6:2");
  // parallelism.memory_budget's bound: no rank above 5 rows; what the fast ranks cannot take
  // goes to the slow one (14 rows as 5:5:4, not 6:6:2).
  EXPECT_THAT(balanced_rows(14, slow_third, 5), ElementsAre(5, 5, 4));
  EXPECT_THAT(balanced_rows(14, slow_third, 6), ElementsAre(6, 6, 2)) << "a bound not reached changes nothing";
  EXPECT_THROW(balanced_rows(16, slow_third, 5), std::invalid_argument) << "16 rows do not fit 3 ranks of at most 5";
}

TEST(Balance, ACostLineIsFittedThroughTheSplitsMeasured) {
  const RankCost line = fit_cost({{2, 0.3}, {4, 0.5}});
  EXPECT_NEAR(line.fixed, 0.1, 1e-12);
  EXPECT_NEAR(line.per_row, 0.1, 1e-12);
  const RankCost one = fit_cost({{4, 0.2}});  // one count of rows: proportional
  EXPECT_DOUBLE_EQ(one.fixed, 0);
  EXPECT_DOUBLE_EQ(one.per_row, 0.05);
  const RankCost noisy = fit_cost({{2, 0.3}, {4, 0.9}});  // fixed < 0: proportional through the newest
  EXPECT_DOUBLE_EQ(noisy.fixed, 0);
  EXPECT_DOUBLE_EQ(noisy.per_row, 0.225);
  const RankCost falling = fit_cost({{2, 0.5}, {4, 0.3}});  // per row <= 0: proportional through the newest
  EXPECT_DOUBLE_EQ(falling.per_row, 0.075);
  EXPECT_THROW(fit_cost({}), std::invalid_argument);
  EXPECT_THROW(fit_cost({{0, 1.0}}), std::invalid_argument);
  EXPECT_THROW(fit_cost({{2, -1.0}}), std::invalid_argument);
}

TEST(Balance, TheDataParallelIndexCountsTheBatchDimsOnly) {
  const sharding::DeviceMesh mesh({{"dp_replicate", 2}, {"dp_shard", 3}, {"tp", 2}}, 12);
  EXPECT_EQ(data_parallel_degree(mesh), 6);
  EXPECT_EQ(data_parallel_index(mesh, {0, 0, 1}), 0);  // tp peers share rows
  EXPECT_EQ(data_parallel_index(mesh, {0, 2, 0}), 2);
  EXPECT_EQ(data_parallel_index(mesh, {1, 1, 1}), 4);
  EXPECT_FALSE(is_data_parallel_dim("tp"));
  EXPECT_TRUE(is_data_parallel_dim("efsdp"));
}

// Three ranks, each a thread with its own client of a real store and its own Balancer over
// `rows` rows (interval 3, threshold 0.05), run `steps` steps, each step taking seconds(rank,
// split) of compute and of wall time. Per rank: the split of each step, and each line said.
struct Ranks {
  std::vector<std::vector<std::vector<std::int64_t>>> splits = std::vector<std::vector<std::vector<std::int64_t>>>(3);
  std::vector<std::vector<std::string>> said = std::vector<std::vector<std::string>>(3);
  std::vector<std::vector<std::int64_t>> changed_after = std::vector<std::vector<std::int64_t>>(3);
};
Ranks run_ranks(std::int64_t rows, std::int64_t steps, const std::function<double(int, const std::vector<std::int64_t>&)>& seconds) {
  comm::TcpStoreServer server("127.0.0.1", 0, "tok");
  Ranks out;
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      const auto i = static_cast<std::size_t>(r);
      comm::TcpStore store("127.0.0.1", server.port(), "tok", 10, r);
      Balancer b(BalanceSpec{true, 3, 0.05, {}}, rows, 3, r, r, 3, store, 10);
      EXPECT_FALSE(b.start(1.0));  // equal priors: the even split
      for (std::int64_t step = 1; step <= steps; ++step) {
        out.splits[i].push_back(b.split());
        const double t = seconds(r, b.split());
        std::string line;
        if (b.after_step(step, t, t, &line)) out.changed_after[i].push_back(step), out.said[i].push_back(line);
      }
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

// Compute times of t = s (20 ms + 10 ms a row) with s = 1, 1, 3 (the third rank 3x slower in
// everything). Every rank must take the same split at the same step: first proportional to the
// even split's times, then, with two counts of rows measured, the split of the exact lines.
TEST(Balance, EveryRankTakesTheSameSplitAtTheSameStep) {
  const std::vector<double> slowness{1, 1, 3};
  const Ranks r = run_ranks(14, 12, [&](int rank, const std::vector<std::int64_t>& split) {
    const auto i = static_cast<std::size_t>(rank);
    return slowness[i] * (0.020 + 0.010 * static_cast<double>(split[i]));
  });
  EXPECT_EQ(r.splits[0], r.splits[1]);
  EXPECT_EQ(r.splits[0], r.splits[2]);
  EXPECT_EQ(r.changed_after[0], r.changed_after[2]);
  ASSERT_EQ(r.splits[0].size(), 12u);
  EXPECT_THAT(r.splits[0].front(), ElementsAre(5, 5, 4));
  // After step 3: the even split's times, 70, 70 and 180 ms for 5, 5 and 4 rows, read as
  // proportional: 14, 14 and 45 ms a row.
  EXPECT_EQ(r.splits[0][3], balanced_rows(14, {{0, 0.014}, {0, 0.014}, {0, 0.045}}));
  // Once two counts of rows are measured the lines are exact, and the split is theirs.
  const auto exact = balanced_rows(14, {{0.020, 0.010}, {0.020, 0.010}, {0.060, 0.030}});
  EXPECT_EQ(r.splits[0].back(), exact);
  EXPECT_THAT(exact, ElementsAre(7, 6, 1));  // 90, 80 and 90 ms, where 6:6:2 takes 120
  ASSERT_FALSE(r.said[0].empty());
  EXPECT_THAT(r.said[0].back(), HasSubstr("rows 7:6:1"));
}

// A split the model chose that runs slower than one measured before (here every uneven split
// pays 200 ms more, as contention the cost lines do not see would): the ranks go back to the
// fastest split measured, say so, and do not take the slower one again.
// After a re-plan the ranks compare what they will run over the data-parallel dims: a rank
// whose collectives differ stops every rank, which names it; equal hashes pass.
TEST(Balance, RanksThatWouldRunOtherCollectivesAreNamed) {
  comm::TcpStoreServer server("127.0.0.1", 0, "tok");
  std::vector<std::string> errors(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      comm::TcpStore store("127.0.0.1", server.port(), "tok", 10, r);
      Balancer b(BalanceSpec{true, 3, 0.05, {}}, 12, 3, r, r, 3, store, 10);
      b.check_same_collectives(42, "the same");
      try {
        b.check_same_collectives(r == 2 ? 7 : 42, "rows 4 on rank " + std::to_string(r));
      } catch (const std::runtime_error& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 3; ++r) {
    EXPECT_THAT(errors[static_cast<std::size_t>(r)], HasSubstr("with rows 4:4:4, rank(s) 2 would run other collectives over the data-parallel mesh dims than rank 0"))
        << "rank " << r;
    EXPECT_THAT(errors[static_cast<std::size_t>(r)], HasSubstr("use parallelism.balance = \"even\"")) << "rank " << r;
  }
}

TEST(Balance, ASplitSlowerThanOneMeasuredBeforeIsLeft) {
  const std::vector<double> slowness{1, 1, 3};
  const std::vector<std::int64_t> even{4, 4, 4};
  const Ranks r = run_ranks(12, 15, [&](int rank, const std::vector<std::int64_t>& split) {
    const auto i = static_cast<std::size_t>(rank);
    return slowness[i] * 0.010 * static_cast<double>(split[i]) + (split == even ? 0 : 0.2);
  });
  EXPECT_EQ(r.splits[0], r.splits[2]);
  ASSERT_EQ(r.splits[0].size(), 15u);
  EXPECT_NE(r.splits[0][3], even);      // the model's split, after step 3
  EXPECT_EQ(r.splits[0][6], even);      // back, after step 6
  EXPECT_EQ(r.splits[0].back(), even);  // and it stays
  ASSERT_EQ(r.said[0].size(), 2u);
  EXPECT_THAT(r.said[0][1], HasSubstr("rows 4:4:4"));
  EXPECT_THAT(r.said[0][1], HasSubstr("back to the fastest split measured since the speeds last drifted: its steps took 120.0 ms"));
}

#ifdef SPMDX_EXE

namespace fs = std::filesystem;

// One run of `spmdx run` on the test corpus: 12 rows of 32 tokens a step (rows long enough that
// a row's work is most of a step's, where a 3x slower rank's rows are worth moving).
test::CommandResult run(const test::TempDir& dir, const std::string& name, int nproc, const std::string& layout, const std::string& extra = "") {
  return test::run_command(extra + "'" SPMDX_EXE "' run '" SPMDX_SOURCE_DIR "/configs/llama_debug.toml' --nproc " + std::to_string(nproc) +
                           " --data.paths '" + (dir / "corpus.txt").string() + "' --training.steps 12 --training.seq_len 32 --training.global_batch_size 12 " +
                           "--parallelism.tensor_parallel_degree 1 " + layout + " --job.dump_folder '" + (dir / name).string() + "' 2>&1");
}

// A layout whose last rank is slowed 3x from the first step: the split moves rows off it, and
// every step's loss and gradient norm is one rank's on the same global batch.
void expect_balanced_like_one_rank(const std::string& layout, int nproc) {
  test::TempDir dir;
  test::corpus_file(dir);
  const auto one = run(dir, "one", 1, "--parallelism.data_parallel_replicate_degree 1 --parallelism.data_parallel_shard_degree 1");
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const std::string slow = "SPMDX_FAULT='slow:rank=" + std::to_string(nproc - 1) + ",factor=3' ";
  const auto r = run(dir, "balanced", nproc, layout + " --parallelism.balance speed --parallelism.balance_interval 3", slow);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("balance: speed; rows per data-parallel rank"));
  EXPECT_THAT(r.output, HasSubstr("[rank 0] balance: after step 3, rows "));
  const auto want = test::rows(dir / "one" / "metrics.jsonl");
  const auto got = test::rows(dir / "balanced" / "metrics.jsonl");
  ASSERT_EQ(got.size(), want.size());
  // The sums over the ranks are another order of the same float32 additions: within 3e-7 (the
  // N-ranks test's bound); a row lost, repeated or weighed wrong moves the loss by 1e-3 or more.
  std::vector<std::int64_t> last;
  int changes = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double loss = want[i].at("loss").get<double>(), norm = want[i].at("grad_norm").get<double>();
    EXPECT_NEAR(got[i].at("loss").get<double>(), loss, 3e-7 * loss) << "step " << i + 1;
    EXPECT_NEAR(got[i].at("grad_norm").get<double>(), norm, 3e-7 * norm) << "step " << i + 1;
    const auto split = got[i].at("balance_rows").get<std::vector<std::int64_t>>();
    std::int64_t sum = 0;
    for (auto s : split) {
      sum += s;
      EXPECT_GE(s, 1);
    }
    EXPECT_EQ(sum, 12) << "step " << i + 1;
    changes += !last.empty() && split != last;
    last = split;
  }
  EXPECT_GE(changes, 1) << "the split never moved";
  // The first re-plan (after step 3) takes rows off the slowed rank's data-parallel index (the
  // last). What comes after depends on the clock: a split measured slower than an earlier one is
  // left for it (Balance.ASplitSlowerThanOneMeasuredBeforeIsLeft), which on a loaded machine can
  // be the even one.
  const auto fourth = got.at(3).at("balance_rows").get<std::vector<std::int64_t>>();
  for (std::size_t j = 0; j + 1 < fourth.size(); ++j) EXPECT_LT(fourth.back(), fourth[j]) << got.at(3).dump();
}

TEST(BalanceRun, DataParallelSlowRankGetsFewerRowsWithOneRanksNumbers) {
  expect_balanced_like_one_rank("--parallelism.data_parallel_replicate_degree 3 --parallelism.data_parallel_shard_degree 1", 3);
}

TEST(BalanceRun, FsdpSlowRankGetsFewerRowsWithOneRanksNumbers) {
  expect_balanced_like_one_rank("--parallelism.data_parallel_replicate_degree 1 --parallelism.data_parallel_shard_degree 3", 3);
}

TEST(BalanceRun, HsdpSlowRankGetsFewerRowsWithOneRanksNumbers) {
  expect_balanced_like_one_rank("--parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 2", 4);
}

// dp 2 x tp 2, rank 3 (the second tp group's) slowed: the group keeps one share, its members the
// same rows, and the group with the slow member gets fewer.
TEST(BalanceRun, TensorParallelGroupsKeepOneShareWithOneRanksNumbers) {
  expect_balanced_like_one_rank(
      "--parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 1 --parallelism.tensor_parallel_degree 2 --training.local_batch_size 6", 4);
}

// strategy = "auto" chooses the layout (never a pipelined one), then the split balances its
// data-parallel ranks from their measured speeds (balance_speeds under auto: AutoSharding's
// AutoWithSpeedBalanceFoldsEachRanksSpeedAndReportsTheSplit).
TEST(BalanceRun, AutoStrategyChoosesTheLayoutThenTheSplitWithOneRanksNumbers) {
  expect_balanced_like_one_rank("--parallelism.strategy auto", 4);
}

// What would do nothing is said, by spmdx compile as by spmdx run's preflight (no ranks here).
TEST(BalanceRun, SettingsThatDoNothingAreSaid) {
  test::TempDir dir;
  test::corpus_file(dir);
  auto compile = [&](const std::string& flags) {
    return test::run_command("'" SPMDX_EXE "' compile '" SPMDX_SOURCE_DIR "/configs/llama_debug.toml' --data.paths '" + (dir / "corpus.txt").string() +
                             "' --training.seq_len 32 --training.global_batch_size 12 --parallelism.tensor_parallel_degree 1 --job.dump_folder '" +
                             (dir / "out").string() + "' " + flags + " 2>&1");
  };
  for (const auto& [flags, says] : std::vector<std::pair<std::string, std::string>>{
           {"--world-size 1 --parallelism.data_parallel_shard_degree 1 --training.local_batch_size 12 --parallelism.balance speed",
            "parallelism.balance = \"speed\" with one data-parallel rank has no batch to split: it does nothing"},
           {"--world-size 3 --parallelism.data_parallel_shard_degree 3 --parallelism.balance speed --training.steps 4 --parallelism.balance_interval 4",
            "parallelism.balance_interval 4 is not less than training.steps 4: the split is never re-planned from measured steps in this run"},
           {"--world-size 3 --parallelism.data_parallel_shard_degree 3 --parallelism.balance_threshold 0.2",
            "parallelism.balance_threshold acts only with parallelism.balance = \"speed\" (it is \"even\"): ignored"},
           {"--world-size 2 --parallelism.data_parallel_shard_degree 2 --training.local_batch_size 6 --training.device cpu --training.devices cpu,auto",
            "training.devices gives each rank its device: training.device = \"cpu\" is not used"}}) {
    const auto r = compile(flags);
    EXPECT_EQ(r.exit_code, 0) << flags << "\n" << r.output;
    EXPECT_THAT(r.output, HasSubstr("warning: ")) << flags;
    EXPECT_THAT(r.output, HasSubstr(says)) << flags << "\n" << r.output;
  }
}

TEST(BalanceRun, WhatItCannotBalanceIsRefusedBeforeAnyRankStarts) {
  test::TempDir dir;
  test::corpus_file(dir);
  for (const auto& [flags, says] : std::vector<std::pair<std::string, std::string>>{
           {"--parallelism.pipeline_parallel_degree 3 --parallelism.data_parallel_shard_degree 1", "with pipeline stages is not supported yet"},
           {"--parallelism.data_parallel_shard_degree 3 --training.local_batch_size 2", "with gradient accumulation (2 microbatches a step)"},
           {"--parallelism.data_parallel_shard_degree 3 --parallelism.balance_interval 1", "parallelism.balance_interval"},
           {"--parallelism.data_parallel_shard_degree 1 --parallelism.data_parallel_replicate_degree 1 --parallelism.context_parallel_degree 3",
            "with context parallelism is not supported yet"},
           {"--parallelism.data_parallel_shard_degree 3 --parallelism.balance_speeds 1,1", "parallelism.balance_speeds gives 2 speeds for 3 data-parallel ranks"},
           {"--parallelism.data_parallel_shard_degree 3 --parallelism.balance fast", "parallelism.balance"}}) {
    const auto r = run(dir, "bad", 3, flags.find("--parallelism.balance ") == std::string::npos ? flags + " --parallelism.balance speed" : flags);
    EXPECT_NE(r.exit_code, 0) << flags;
    EXPECT_THAT(r.output, HasSubstr(says)) << flags << "\n" << r.output;
    EXPECT_THAT(r.output, Not(HasSubstr("step    1"))) << flags;
  }
}

#endif

}  // namespace
}  // namespace spmdx::job
