// Fault tolerance (issue 48): real jobs of 3 and 4 ranks over ucx, ranks killed, stopped and
// held by SPMDX_FAULT. What is asserted is what a user would check: the job finishes, the
// survivors never stop, every step has one row of metrics, the groups' states are bitwise equal
// afterwards (the final checkpoint's shard files, read back here, not spmdx's own check alone),
// the job stops naming the groups when too few are left, and nothing stays in /dev/shm.
// The losses against an independent PyTorch re-computation of what was trained (fewer rows
// while a group was away) are tests/reference/llama3_reference.py --fault-tolerance's (CTest's
// reference_llama3_fault_tolerance).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "run_util.h"

namespace spmdx {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;

std::set<std::string> shm_entries() {
  std::set<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/dev/shm", ec)) out.insert(e.path().filename().string());
  return out;
}

// A tiny Llama on `groups` replica groups of `per_group` ranks (FSDP inside a group of 2), with
// a checkpoint at the last step only.
struct Job {
  test::TempDir dir;
  fs::path out = dir / "job";
  int groups = 3, per_group = 1, steps = 16;
  std::string extra;
  std::string fault;
  test::CommandResult run() const {
    const int nproc = groups * per_group;
    return test::run_command("SPMDX_FAULT='" + fault + "' '" SPMDX_EXE "' run '" SPMDX_SOURCE_DIR "/configs/llama_fsdp.toml' --nproc " +
                             std::to_string(nproc) + " --data.paths '" + test::corpus_file(dir) + "' --training.global_batch_size " +
                             std::to_string(2 * nproc) + " --training.seq_len 32 --training.steps " + std::to_string(steps) +
                             " --parallelism.data_parallel_replicate_degree " + std::to_string(groups) + " --parallelism.data_parallel_shard_degree " +
                             std::to_string(per_group) + " --fault_tolerance.enable true --checkpoint.enable true --checkpoint.interval 1000 --job.dump_folder '" +
                             out.string() + "' " + extra);
  }
  std::vector<nlohmann::json> rows() const { return test::rows(out / "metrics.jsonl"); }
  // The final checkpoint's shard file of `rank`, whole.
  std::string shard(int rank) const { return test::read_file(out / "checkpoint" / ("step-" + std::to_string(steps)) / ("rank" + std::to_string(rank) + ".bin")); }
};

// Every step once, in order: no commit lost or repeated.
void expect_every_step_once(const std::vector<nlohmann::json>& rows, int steps) {
  std::vector<int> seen;
  for (const auto& r : rows) seen.push_back(r.at("step").get<int>());
  std::vector<int> want;
  for (int s = 1; s <= steps; ++s) want.push_back(s);
  EXPECT_EQ(seen, want);
}

// Ranks of the same coordinates in every group hold the same bytes.
void expect_groups_equal(const Job& job) {
  for (int c = 0; c < job.per_group; ++c) {
    const std::string first = job.shard(c);
    ASSERT_FALSE(first.empty());
    for (int g = 1; g < job.groups; ++g) {
      EXPECT_TRUE(job.shard(g * job.per_group + c) == first) << "rank " << g * job.per_group + c << " differs from rank " << c;
    }
  }
}

// 3 groups of one rank (plain DDP): rank 1 dies at step 5; the others train on; the group is
// restarted and, once back (by step 9: rank 0 holds there until it is), trains in lockstep.
TEST(FaultTolerance, ThreeReplicaGroupsTrainThroughAKillAndTakeTheGroupBack) {
  const auto shm_before = shm_entries();
  Job job;
  // The third fault's backend call never comes (a step has a few): the job says so at the end.
  job.fault = "kill:rank=1,step=5;hold:rank=0,step=9,at=commit;slow:rank=2,step=3,at=collective,index=40";
  job.extra = "--max-restarts 1 --fault_tolerance.process_group_timeout_ms 60000";
  const auto r = job.run();
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("SPMDX_FAULT: slow of rank 2 at backend call 40 of step 3 never fired"));
  EXPECT_THAT(r.output, Not(HasSubstr("kill of rank 1 at start of step 5 never fired")));
  EXPECT_THAT(r.output, HasSubstr("rank 1 was killed by signal Killed: replica group 1 (rank 1) is lost; 2 of 3 replica groups train on"));
  EXPECT_THAT(r.output, HasSubstr("started replica group 1 (rank 1) again"));
  EXPECT_THAT(r.output, HasSubstr("[rank 1] replica group 1 (rank 1) (restart 1): given the live groups' state; trains from step"));
  // The survivors never stopped: neither was restarted.
  EXPECT_THAT(r.output, Not(HasSubstr("started replica group 0")));
  EXPECT_THAT(r.output, Not(HasSubstr("started replica group 2")));
  EXPECT_THAT(r.output, HasSubstr("the 3 live replica groups hold bitwise-equal states after step 16"));
  const auto rows = job.rows();
  expect_every_step_once(rows, job.steps);
  for (const auto& row : rows) {
    const int step = row.at("step").get<int>();
    const auto live = row.at("replicas").get<std::vector<int>>();
    if (step < 5 || step > 9) {
      EXPECT_EQ(live, (std::vector<int>{0, 1, 2})) << "step " << step;
    }
    EXPECT_EQ(row.at("samples").get<int>(), 2 * static_cast<int>(live.size())) << "step " << step;  // 2 rows a group
  }
  expect_groups_equal(job);
  EXPECT_EQ(shm_entries(), shm_before);
}

// A checkpoint due while a group is away is written whole by the live groups (the away rank's
// shards are the same coordinates' bytes): whether or not the group comes back, every interval
// is saved, and a job resumes from it.
TEST(FaultTolerance, ACheckpointWhileAGroupIsAwayIsWholeAndResumes) {
  Job job;
  job.steps = 12;
  // The restarted rank comes up only once step 6 is committed: the group is away at step 5's
  // save, whatever the machine's speed; rank 0 holds at step 7 until it is back.
  job.fault = "kill:rank=1,step=4;hold:rank=1,step=6,at=restart;hold:rank=0,step=7,at=commit";
  job.extra = "--max-restarts 1 --fault_tolerance.process_group_timeout_ms 60000 --checkpoint.interval 5";
  const auto r = job.run();
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("SPMDX_FAULT: rank 1, restarted, holds until the live groups have committed step 6"));
  for (int step : {5, 10, 12}) {
    const fs::path dir = job.out / "checkpoint" / ("step-" + std::to_string(step));
    ASSERT_TRUE(fs::exists(dir / "metadata.json")) << dir << "\n" << r.output;
    for (int rank = 1; rank < 3; ++rank) {
      EXPECT_EQ(test::read_file(dir / ("rank" + std::to_string(rank) + ".bin")), test::read_file(dir / "rank0.bin")) << dir << " rank " << rank;
    }
  }
  const auto rows = job.rows();
  EXPECT_EQ(rows.at(4).at("replicas").get<std::vector<int>>(), (std::vector<int>{0, 2}));  // step 5: group 1 away
  expect_every_step_once(rows, job.steps);
  expect_groups_equal(job);
  // A new job from the step-5 checkpoint, every group live: it resumes, and trains on.
  Job again;
  again.steps = 7;
  fs::create_directories(again.out / "checkpoint");
  fs::copy(job.out / "checkpoint" / "step-5", again.out / "checkpoint" / "step-5", fs::copy_options::recursive);
  const auto r2 = again.run();
  ASSERT_EQ(r2.exit_code, 0) << r2.output;
  EXPECT_THAT(r2.output, HasSubstr("resumed from"));
  const auto rows2 = again.rows();
  ASSERT_FALSE(rows2.empty());
  EXPECT_EQ(rows2.back().at("step").get<int>(), 7);
}

// HSDP: 2 groups of 2 ranks, FSDP inside each; rank 3 dies as it issues a collective of step 5
// (mid-backward): its group's other rank is stopped with it, and both come back.
TEST(FaultTolerance, HsdpGroupsOfTwoRanksLoseOneMidStepAndRecoverShardByShard) {
  const auto shm_before = shm_entries();
  Job job;
  job.groups = 2, job.per_group = 2, job.steps = 14;
  // Rank 3, restarted, asks to join once step 6 is committed: steps 5 (again) and 6 run on
  // group 0 alone.
  job.fault = "kill:rank=3,step=5,at=collective,index=4;hold:rank=3,step=6,at=restart;hold:rank=0,step=9,at=commit";
  job.extra = "--max-restarts 1 --fault_tolerance.process_group_timeout_ms 60000";
  const auto r = job.run();
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("SPMDX_FAULT: rank 3 kills itself (SIGKILL) as it issues backend call 4 of step 5"));
  EXPECT_THAT(r.output, HasSubstr("replica group 1 (ranks 2-3) is lost; 1 of 2 replica groups train on"));
  EXPECT_THAT(r.output, HasSubstr("fault tolerance: step 5 dropped by every replica group"));
  EXPECT_THAT(r.output, Not(HasSubstr("started replica group 0")));
  const auto rows = job.rows();
  expect_every_step_once(rows, job.steps);
  for (const auto& row : rows) {
    const int step = row.at("step").get<int>();
    const auto live = row.at("replicas").get<std::vector<int>>();
    // Steps 5 and 6 on group 0 alone; group 1 back by step 10 (rank 0 held at step 9).
    if (step < 5 || step > 9) {
      EXPECT_EQ(live, (std::vector<int>{0, 1})) << "step " << step;
    } else if (step <= 6) {
      EXPECT_EQ(live, std::vector<int>{0}) << "step " << step;
    }
    EXPECT_EQ(row.at("samples").get<int>(), 4 * static_cast<int>(live.size())) << "step " << step;  // 4 rows a group
    EXPECT_EQ(row.value("dropped", 0) > 0, step == 5) << "step " << step;  // step 5 was dropped, then committed
  }
  expect_groups_equal(job);
  EXPECT_EQ(shm_entries(), shm_before);
}

// A kill during the commit (after the optimizer's kernels, before the vote), and the live
// group that gives a restarted one its state killed in the middle of the transfer: the next
// live group gives it, and the state is still everyone's.
TEST(FaultTolerance, KillsDuringTheCommitAndDuringAStateTransfer) {
  Job job;
  job.steps = 14;
  // rank 1 dies at step 3; rank 0 holds at step 3's commit until group 1 is back, so the state
  // moves right after; rank 0, giving it, dies after 2 tensors; rank 2 dies in step 10's commit.
  job.fault = "kill:rank=1,step=3;hold:rank=0,step=3,at=commit;kill:rank=0,step=2,at=recovery,index=2;kill:rank=2,step=10,at=commit";
  job.extra = "--max-restarts 3 --fault_tolerance.process_group_timeout_ms 60000";
  const auto r = job.run();
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("SPMDX_FAULT: rank 0 kills itself (SIGKILL) after 2 tensors of the state transfer after step 2"));
  EXPECT_THAT(r.output, HasSubstr("SPMDX_FAULT: rank 2 kills itself (SIGKILL) at commit of step 10"));
  EXPECT_THAT(r.output, HasSubstr("3 rank failures"));
  const auto rows = job.rows();
  expect_every_step_once(rows, job.steps);
  EXPECT_THAT(r.output, HasSubstr("live replica groups hold bitwise-equal states after step 14"));
}

// Two groups lost at once, below min_replica_size: the job stops at once, naming both; no rank
// is left waiting.
TEST(FaultTolerance, TwoGroupsLostBelowTheMinimumStopTheJobNamingThem) {
  const auto shm_before = shm_entries();
  Job job;
  job.steps = 10;
  job.fault = "kill:rank=1,step=4;kill:rank=2,step=4";
  job.extra = "--max-restarts 5 --fault_tolerance.min_replica_size 2";
  const auto r = job.run();
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("fewer than fault_tolerance.min_replica_size = 2 (lost: replica group 1 (rank 1), replica group 2 (rank 2))"));
  EXPECT_THAT(r.output, HasSubstr("the job stops: run it again to resume from its newest checkpoint"));
  EXPECT_EQ(shm_entries(), shm_before);
}

// A hung rank (here asleep for a minute) is alive but silent: the others name it after 2 x the
// timeout, the launcher kills it, and its group is restarted.
TEST(FaultTolerance, AHungRankIsNamedKilledAndItsGroupRestarted) {
  Job job;
  job.steps = 10;
  job.fault = "slow:rank=2,step=4,seconds=60;hold:rank=0,step=7,at=commit";
  job.extra = "--max-restarts 1 --fault_tolerance.process_group_timeout_ms 2000";
  const auto r = job.run();
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("rank 2 neither voted nor exited within 2 x fault_tolerance.process_group_timeout_ms (hung, or stopped): killing it"));
  EXPECT_THAT(r.output, HasSubstr("started replica group 2 (rank 2) again"));
  expect_every_step_once(job.rows(), job.steps);
  expect_groups_equal(job);
}

// The soak: 10 kills in 100 steps, round the 3 groups (each kill after every group is back):
// no hang, no commit lost, every group equal at the end, nothing left in /dev/shm.
TEST(FaultTolerance, TenKillsInAHundredStepsLoseNothing) {
  const auto shm_before = shm_entries();
  Job job;
  job.steps = 100;
  for (int i = 0; i < 10; ++i) {
    const int step = 5 + 9 * i, rank = i % 3;
    job.fault += "hold:rank=" + std::to_string((rank + 1) % 3) + ",step=" + std::to_string(step - 1) + ",at=commit;kill:rank=" + std::to_string(rank) +
                 ",step=" + std::to_string(step) + (i % 2 == 0 ? "" : ",at=collective,index=" + std::to_string(1 + (i / 2) % 3)) + ";";
  }
  job.extra = "--max-restarts 10 --fault_tolerance.process_group_timeout_ms 60000";
  const auto r = job.run();
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("fault tolerance: 10 rank failures, 10 replica group restarts"));
  EXPECT_THAT(r.output, Not(HasSubstr("never fired")));
  // Rank 0, restarted, leads again and says so (the rank that led while it was away does not).
  EXPECT_THAT(r.output, HasSubstr("given the live groups' state: replica group 0 (rank 0)"));
  expect_every_step_once(job.rows(), job.steps);
  expect_groups_equal(job);
  EXPECT_EQ(shm_entries(), shm_before);
}

// Every group that held the state is lost while it is given to the restarted ones: the job
// stops, exit 1, saying why (no group is left waiting for a state nobody has).
TEST(FaultTolerance, NoGroupLeftWithTheStateStopsTheJob) {
  const auto shm_before = shm_entries();
  Job job;
  job.groups = 2, job.steps = 20;
  job.fault = "kill:rank=1,step=3;hold:rank=1,step=8,at=restart;hold:rank=0,step=10,at=start;kill:rank=0,step=10,at=recovery,index=2";
  job.extra = "--max-restarts 3 --fault_tolerance.process_group_timeout_ms 2000";
  const auto r = job.run();
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("every live replica group is one being given the state"));
  EXPECT_THAT(r.output, HasSubstr("the job stops"));
  EXPECT_EQ(shm_entries(), shm_before);
}

// The last live rank stops (SIGSTOP) with no live peer to miss its vote: the launcher sees it
// stopped, and after 2 x the timeout kills it; with the other group still away, the job ends.
TEST(FaultTolerance, AStoppedRankWithNoLivePeerIsFoundByTheLauncher) {
  Job job;
  job.groups = 2, job.steps = 20;
  // Rank 1, restarted, asks to join only after step 20, which never comes: group 1 stays away.
  job.fault = "kill:rank=1,step=3;hold:rank=1,step=20,at=restart;stop:rank=0,step=8";
  job.extra = "--max-restarts 1 --fault_tolerance.process_group_timeout_ms 1000";
  const auto r = job.run();
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("rank 0 was stopped (SIGSTOP) for 2 x fault_tolerance.process_group_timeout_ms: killing it"));
  EXPECT_THAT(r.output, HasSubstr("only 0 of 2 replica groups are left"));
}

// What is refused before any rank starts.
TEST(FaultTolerance, ConfigsItCannotServeAreRefusedNamingTheKey) {
  test::TempDir dir;
  const std::string base = "'" SPMDX_SOURCE_DIR "/configs/llama_fsdp.toml' --data.paths '" + test::corpus_file(dir) + "' --job.dump_folder '" +
                           (dir / "out").string() + "' --training.global_batch_size 4 --training.seq_len 32 --training.steps 2 ";
  auto no_groups = test::run_command("'" SPMDX_EXE "' run " + base + "--nproc 2 --fault_tolerance.enable true");
  EXPECT_NE(no_groups.exit_code, 0);
  EXPECT_THAT(no_groups.output, HasSubstr("fault_tolerance.enable = true needs replica groups to fall back on"));
  auto restarts = test::run_command("'" SPMDX_EXE "' run " + base + "--nproc 2 --max-restarts 2");
  EXPECT_NE(restarts.exit_code, 0);
  EXPECT_THAT(restarts.output, HasSubstr("--max-restarts 2 starts lost replica groups again, under fault_tolerance.enable = true"));
  auto size = test::run_command("'" SPMDX_EXE "' run " + base +
                                "--nproc 2 --parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 1 "
                                "--fault_tolerance.enable true --fault_tolerance.group_size 3");
  EXPECT_NE(size.exit_code, 0);
  EXPECT_THAT(size.output, HasSubstr("fault_tolerance.group_size = 3 replica groups, but parallelism.data_parallel_replicate_degree = 2"));
  auto fault = test::run_command("SPMDX_FAULT='kill:rank=0,step=1,at=lunch' '" SPMDX_EXE "' run " + base +
                                 "--nproc 2 --parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 1 --fault_tolerance.enable true");
  EXPECT_NE(fault.exit_code, 0);
  EXPECT_THAT(fault.output, HasSubstr("at='lunch' is not start, collective, commit, recovery or restart"));
  auto restart_kill = test::run_command("SPMDX_FAULT='kill:rank=0,at=restart' '" SPMDX_EXE "' run " + base +
                                        "--nproc 2 --parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 1 --fault_tolerance.enable true");
  EXPECT_NE(restart_kill.exit_code, 0);
  EXPECT_THAT(restart_kill.output, HasSubstr("at=restart goes with slow (sleep seconds=X) or hold (until step=S is committed)"));
  const std::string two = "--nproc 2 --parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 1 --fault_tolerance.enable true ";
  auto diloco = test::run_command("'" SPMDX_EXE "' run " + base + two + "--fault_tolerance.semi_sync_method diloco");
  EXPECT_NE(diloco.exit_code, 0);
  EXPECT_THAT(diloco.output, HasSubstr("spmdx does not support TorchFT's semi-synchronous training (local_sgd, diloco)"));
  auto misspelt = test::run_command("'" SPMDX_EXE "' run " + base + two + "--fault_tolerance.min_replicas 1");
  EXPECT_NE(misspelt.exit_code, 0);
  EXPECT_THAT(misspelt.output, HasSubstr("unknown key 'fault_tolerance.min_replicas'"));
  auto floor = test::run_command("'" SPMDX_EXE "' run " + base + two + "--fault_tolerance.min_replica_size 2");
  EXPECT_NE(floor.exit_code, 0);
  EXPECT_THAT(floor.output, HasSubstr("fault_tolerance.min_replica_size = 2 with 2 replica groups: the job could never lose one"));
  auto autos = test::run_command("'" SPMDX_EXE "' run " + base + two + "--parallelism.strategy auto");
  EXPECT_NE(autos.exit_code, 0);
  EXPECT_THAT(autos.output, HasSubstr("fault tolerance with parallelism.strategy = \"auto\" is not supported yet"));
  auto cp = test::run_command("'" SPMDX_EXE "' run " + base +
                              "--nproc 4 --parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 1 "
                              "--parallelism.context_parallel_degree 2 --fault_tolerance.enable true");
  EXPECT_NE(cp.exit_code, 0);
  EXPECT_THAT(cp.output, HasSubstr("fault tolerance with context parallelism is not supported yet"));
  // SPMDX_FAULT is checked once, before any rank starts.
  auto twice = test::run_command("SPMDX_FAULT='kill:rank=1,rank=0,step=1' '" SPMDX_EXE "' run " + base + two);
  EXPECT_NE(twice.exit_code, 0);
  EXPECT_THAT(twice.output, HasSubstr("'rank' given twice in 'kill:rank=1,rank=0,step=1'"));
  EXPECT_THAT(twice.output, Not(HasSubstr("[rank 0]")));
  auto restart_plain = test::run_command("SPMDX_FAULT='slow:rank=0,at=restart' '" SPMDX_EXE "' run " + base + "--nproc 2");
  EXPECT_NE(restart_plain.exit_code, 0);
  EXPECT_THAT(restart_plain.output, HasSubstr("SPMDX_FAULT: slow at=restart acts under fault tolerance: set fault_tolerance.enable = true"));
}

}  // namespace
}  // namespace spmdx
