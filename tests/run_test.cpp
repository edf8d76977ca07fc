// `spmdx run` as a user runs it: real rank processes started by the launcher, talking over the
// ucx plugin. N ranks give the one-rank losses; bad configs fail before any rank starts; a
// failing rank stops the job with its name.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <sched.h>
#include <signal.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <tuple>

#include "run_util.h"
#include "spmdx/launch/launcher.h"

namespace spmdx {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;

using test::corpus_file;
using test::losses;
using test::rows;

test::CommandResult spmdx_run(const std::string& args) {
  return test::run_command("'" SPMDX_EXE "' run " + args);
}

struct Layout {
  std::string name;
  int nproc;
  std::string flags;
};

// How CTest lists a case: its name ("fsdp2xtp2+sp").
void PrintTo(const Layout& l, std::ostream* os) { *os << l.name; }

// One test per layout (each a one-rank run and the layout's, 20 steps), so that each stays well
// inside CTest's limit on a loaded 2-core machine.
class EveryLayout : public ::testing::TestWithParam<Layout> {};

TEST_P(EveryLayout, NRanksGiveTheLossesOfOneRank) {
  const Layout& layout = GetParam();
  const std::string& name = layout.name;
  test::TempDir dir;
  const std::string data = corpus_file(dir);
  const std::string common = " --data.paths '" + data + "' --training.steps 20 --training.global_batch_size 8 --training.seq_len 32";
  auto one = spmdx_run("'" SPMDX_SOURCE_DIR "/configs/llama_fsdp.toml' --nproc 1 --job.dump_folder '" + (dir / "one").string() + "'" + common);
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const auto want = losses(dir / "one" / "metrics.jsonl");
  ASSERT_EQ(want.size(), 20u);
  EXPECT_LT(want.back(), want.front());
  auto r = spmdx_run("'" SPMDX_SOURCE_DIR "/configs/llama_fsdp.toml' --nproc " + std::to_string(layout.nproc) + " " + layout.flags + " --job.dump_folder '" +
                     (dir / name).string() + "'" + common);
  ASSERT_EQ(r.exit_code, 0) << name << "\n" << r.output;
  EXPECT_THAT(r.output, HasSubstr("[rank 0] step   20 | loss"));
  EXPECT_EQ(r.output.find("loss parallel: cross entropy on the logits sharded on the vocabulary over tp") != std::string::npos,
            name.find("+lp") != std::string::npos) << name;
  if (name.find("+sp") != std::string::npos) {
    EXPECT_THAT(r.output, HasSubstr("sequence parallel: the norms and the residual stream are sharded on the sequence over tp"));
  }
  const auto got = losses(dir / name / "metrics.jsonl");
  ASSERT_EQ(got.size(), want.size()) << name;
  // What float32 gives with other reduction orders: at most 1.8e-7 for the loss and 1.4e-7 for
  // the gradient norm here (a step's ulp is 1e-7 of it); a dropped term or a wrong scale is far
  // more.
  const auto norms = test::column(dir / name / "metrics.jsonl", "grad_norm"), want_norms = test::column(dir / "one" / "metrics.jsonl", "grad_norm");
  for (std::size_t i = 0; i < want.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], 3e-7 * std::abs(want[i])) << name << " step " << i + 1;
    EXPECT_NEAR(norms[i], want_norms[i], 3e-7 * std::abs(want_norms[i])) << name << " step " << i + 1;
  }
  std::ifstream in(dir / name / "metrics.jsonl");
  std::string line;
  std::getline(in, line);
  const auto row = nlohmann::json::parse(line);
  for (const char* key : {"step", "loss", "tokens_per_s", "step_ms", "compute_ms", "comm_ms", "exposed_comm_ms", "overlap_ratio", "peak_mem_bytes"}) {
    EXPECT_TRUE(row.contains(key)) << key;
  }
}

const std::string kDp = "--parallelism.data_parallel_shard_degree 1 --parallelism.data_parallel_replicate_degree ";
const std::string kTp = "--parallelism.data_parallel_shard_degree 1 --parallelism.tensor_parallel_degree ";

INSTANTIATE_TEST_SUITE_P(
    Run, EveryLayout,
    ::testing::Values(
        Layout{"dp2", 2, kDp + "2"}, Layout{"dp4", 4, kDp + "4"}, Layout{"fsdp2", 2, "--parallelism.data_parallel_shard_degree -1"},
        Layout{"fsdp4", 4, "--parallelism.data_parallel_shard_degree -1"}, Layout{"tp2", 2, kTp + "2"}, Layout{"tp4", 4, kTp + "4"},
        Layout{"fsdp2xtp2", 4, "--parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 2"},
        Layout{"dp2xtp2", 4, "--parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 1 --parallelism.tensor_parallel_degree 2"},
        Layout{"tp4+sp", 4, kTp + "4 --parallelism.enable_sequence_parallel true"},
        Layout{"tp4+sp+lp", 4, kTp + "4 --parallelism.enable_sequence_parallel true --parallelism.disable_loss_parallel false"},
        Layout{"fsdp2xtp2+sp", 4, "--parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 2 --parallelism.enable_sequence_parallel true"},
        Layout{"dp2xtp2+lp", 4,
               "--parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 1 --parallelism.tensor_parallel_degree 2 "
               "--parallelism.disable_loss_parallel false"}),
    [](const ::testing::TestParamInfo<Layout>& info) {
      std::string n = info.param.name;
      for (char& c : n) {
        if (c == '+') c = '_';
      }
      return n;
    });

// Pipeline stages, each rank a process, activations and gradients between them through the comm
// backend's send and recv: 5 steps give the losses and gradient norms of one rank (the same
// global batch; the microbatches' gradients summed in another order: within 1e-5), for each
// schedule, 2 and 4 stages, 4 and 8 microbatches, and stages composed with FSDP and with TP and
// sequence parallelism (4-D meshes but for dp_replicate).
TEST(Run, PipelineStagesGiveTheLossesOfOneRank) {
  test::TempDir dir;
  const std::string common = " --data.paths '" + corpus_file(dir) + "' --training.steps 5 --training.global_batch_size 8 --training.seq_len 32 --model.n_layers 4";
  const std::string config = "'" SPMDX_SOURCE_DIR "/configs/llama_fsdp.toml'";
  const std::string validation = " --validation.enable true --validation.paths '" + corpus_file(dir) + "' --validation.freq 5 --validation.steps 2";
  auto one = spmdx_run(config + " --nproc 1 --job.dump_folder '" + (dir / "one").string() + "'" + common + validation);
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const auto want = losses(dir / "one" / "metrics.jsonl");
  const auto want_norms = test::column(dir / "one" / "metrics.jsonl", "grad_norm");
  const auto want_val = test::column_where_present(dir / "one" / "metrics.jsonl", "val_loss");
  ASSERT_EQ(want.size(), 5u);
  ASSERT_EQ(want_val.size(), 1u);
  const std::string pp = " --parallelism.data_parallel_shard_degree 1 --parallelism.pipeline_parallel_degree ";
  const std::vector<std::tuple<std::string, int, std::string, std::string>> layouts = {
      {"pp2 1F1B", 2, pp + "2", "2 stages (mesh dim pp) of 1 rank, schedule 1F1B, 8 microbatches"},
      {"pp2 GPipe", 2, pp + "2 --parallelism.pipeline_parallel_schedule GPipe --parallelism.pipeline_parallel_microbatch_size 2",
       "schedule GPipe, 4 microbatches"},
      {"pp4 1F1B", 4, pp + "4" + validation, "4 stages (mesh dim pp) of 1 rank, schedule 1F1B, 8 microbatches"},
      {"pp4 GPipe", 4, pp + "4 --parallelism.pipeline_parallel_schedule GPipe", "schedule GPipe, 8 microbatches"},
      {"pp2 Interleaved1F1B", 2, pp + "2 --parallelism.pipeline_parallel_schedule Interleaved1F1B", "schedule Interleaved1F1B, 8 microbatches"},
      {"pp2xfsdp2", 4, " --parallelism.pipeline_parallel_degree 2 --parallelism.data_parallel_shard_degree 2 --hooks.enable flight_recorder",
       "2 stages (mesh dim pp) of 2 ranks"},
      {"pp2xtp2+sp", 4, pp + "2 --parallelism.tensor_parallel_degree 2 --parallelism.enable_sequence_parallel true", "2 stages (mesh dim pp) of 2 ranks"},
  };
  for (const auto& [name, nproc, flags, says] : layouts) {
    const auto folder = dir / name.substr(0, name.find(' ')) / name.substr(name.find(' ') + 1);
    auto r = spmdx_run(config + " --nproc " + std::to_string(nproc) + flags + " --job.dump_folder '" + folder.string() + "'" + common);
    ASSERT_EQ(r.exit_code, 0) << name << "\n" << r.output;
    EXPECT_THAT(r.output, HasSubstr(says)) << name;
    const auto got = losses(folder / "metrics.jsonl");
    const auto norms = test::column(folder / "metrics.jsonl", "grad_norm");
    ASSERT_EQ(got.size(), want.size()) << name;
    for (std::size_t i = 0; i < want.size(); ++i) {
      EXPECT_NEAR(got[i], want[i], 1e-5 * std::abs(want[i])) << name << " step " << i + 1;
      EXPECT_NEAR(norms[i], want_norms[i], 1e-5 * std::abs(want_norms[i])) << name << " step " << i + 1;
    }
    // Rank 0's measured peak is its stage's planned one (a send's tensor goes once it is sent).
    const auto peak = test::column(folder / "metrics.jsonl", "peak_mem_bytes"), planned = test::column(folder / "metrics.jsonl", "planned_peak_mem_bytes");
    EXPECT_NEAR(peak.back(), planned.back(), 0.02 * planned.back()) << name;
    if (flags.find("validation") != std::string::npos) {  // the held-out loss through the stages, forward only
      const auto val = test::column_where_present(folder / "metrics.jsonl", "val_loss");
      ASSERT_EQ(val.size(), 1u) << name;
      EXPECT_NEAR(val[0], want_val[0], 1e-5 * std::abs(want_val[0])) << name;
    }
    if (flags.find("flight_recorder") != std::string::npos) {  // the stages' dumps (with their sends and recvs) read back whole
      auto fr = test::run_command("'" SPMDX_EXE "' fr-trace '" + (folder / "hooks" / "flight_recorder").string() + "'");
      EXPECT_EQ(fr.exit_code, 0) << fr.output;
      EXPECT_THAT(fr.output, HasSubstr("no mismatch"));
    }
  }
  // bfloat16 against one rank in bfloat16: the stages exchange the bf16 residual alone, each
  // layer's float32 cast of it made on the stage that reads it (rounding: sums in another order).
  const std::string bf16 = " --training.mixed_precision_param bfloat16";
  auto one_bf16 = spmdx_run(config + " --nproc 1" + bf16 + " --job.dump_folder '" + (dir / "one-bf16").string() + "'" + common);
  ASSERT_EQ(one_bf16.exit_code, 0) << one_bf16.output;
  auto pp_bf16 = spmdx_run(config + " --nproc 2" + pp + "2" + bf16 + " --job.dump_folder '" + (dir / "pp2-bf16").string() + "'" + common);
  ASSERT_EQ(pp_bf16.exit_code, 0) << pp_bf16.output;
  const auto want_bf16 = losses(dir / "one-bf16" / "metrics.jsonl"), got_bf16 = losses(dir / "pp2-bf16" / "metrics.jsonl");
  ASSERT_EQ(got_bf16.size(), want_bf16.size());
  for (std::size_t i = 0; i < want_bf16.size(); ++i) EXPECT_NEAR(got_bf16[i], want_bf16[i], 1e-3 * std::abs(want_bf16[i])) << "pp2 bf16 step " << i + 1;
}

// Context parallelism, each rank a process: the sequence split over cp (load-balanced or in
// order), attention all-gathering k and v or (rotate_method auto) splitting batch or heads: 5
// steps give the losses and gradient norms of one rank, alone and composed with FSDP, DDP, TP
// with sequence and loss parallelism, and pipeline stages; the held-out loss too.
// strategy = "auto": the launcher plans every layout of 4 ranks, keeps the choice in
// auto_plan.json, and every rank runs it: the losses and gradient norms of one rank.
TEST(Run, AutoStrategyGivesTheLossesOfOneRank) {
  if (!std::filesystem::exists(BUILTIN_PLUGIN_DIR "/libspmdx_auto.so")) GTEST_SKIP() << "the auto planner is not built (no COIN-OR CBC: scripts/setup)";
  test::TempDir dir;
  const std::string common = " --data.paths '" + corpus_file(dir) + "' --training.steps 4 --training.global_batch_size 8 --training.seq_len 32 --model.n_layers 2";
  const std::string config = "'" SPMDX_SOURCE_DIR "/configs/llama_fsdp.toml'";
  auto one = spmdx_run(config + " --nproc 1 --job.dump_folder '" + (dir / "one").string() + "'" + common);
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const auto want = losses(dir / "one" / "metrics.jsonl");
  const auto want_norms = test::column(dir / "one" / "metrics.jsonl", "grad_norm");
  for (const std::string planner : {"auto", "greedy"}) {
    const auto folder = dir / ("auto-" + planner);
    auto r = spmdx_run(config + " --nproc 4 --parallelism.strategy auto --parallelism.planner " + planner + " --job.dump_folder '" + folder.string() + "'" + common);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_THAT(r.output, HasSubstr("auto: chose ")) << planner;
    EXPECT_TRUE(std::filesystem::exists(folder / "auto_plan.json"));
    EXPECT_TRUE(std::filesystem::exists(folder / "auto_report.txt"));
    const auto got = losses(folder / "metrics.jsonl");
    const auto norms = test::column(folder / "metrics.jsonl", "grad_norm");
    ASSERT_EQ(got.size(), want.size()) << planner;
    for (std::size_t i = 0; i < want.size(); ++i) {
      EXPECT_NEAR(got[i], want[i], 1e-5 * std::abs(want[i])) << planner << " step " << i + 1;
      EXPECT_NEAR(norms[i], want_norms[i], 1e-5 * std::abs(want_norms[i])) << planner << " step " << i + 1;
    }
  }
  // A budget only pipelined layouts meet (compile's ranking: the least peak without stages, less
  // a byte): auto chooses pipeline stages, and they train the losses of one rank.
  const auto folder = dir / "auto-pp";
  const std::string greedy = " --parallelism.strategy auto --parallelism.planner greedy --job.dump_folder '" + folder.string() + "'" + common;
  const auto ranking = test::run_command("'" SPMDX_EXE "' compile " + config + " --world-size 4 --json" + greedy);
  ASSERT_EQ(ranking.exit_code, 0) << ranking.output;
  std::int64_t flat = 0, piped = 0;
  const auto report = nlohmann::json::parse(ranking.output.substr(ranking.output.find('{')));
  for (const auto& p : report.at("auto").at("plans")) {
    ASSERT_EQ(p.at("error"), "") << p.dump();
    std::int64_t& least = p.at("stages") == 1 ? flat : piped;
    least = least == 0 ? p.at("peak_bytes").get<std::int64_t>() : std::min(least, p.at("peak_bytes").get<std::int64_t>());
  }
  ASSERT_LT(piped, flat) << ranking.output;
  std::filesystem::remove(folder / "auto_plan.json");
  auto r = spmdx_run(config + " --nproc 4 --parallelism.memory_budget " + std::to_string(flat - 1) + greedy);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("auto: chose pp 2 x "));
  EXPECT_THAT(r.output, HasSubstr("pipeline: 2 stages"));
  const auto got = losses(folder / "metrics.jsonl");
  const auto norms = test::column(folder / "metrics.jsonl", "grad_norm");
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], 1e-5 * std::abs(want[i])) << "pp step " << i + 1;
    EXPECT_NEAR(norms[i], want_norms[i], 1e-5 * std::abs(want_norms[i])) << "pp step " << i + 1;
  }
}

// Document masking (model.attn_mask_type = "block_causal", torchtitan's): each line of the corpus
// a document (BOS line EOS), several in every 64-token row; fsdp 2, tp 2 and cp 2 (the document
// ids of the load-balanced sequence counted in natural order) give the one rank's losses, and
// they are not the causal mask's.
TEST(Run, BlockCausalGivesTheLossesOfOneRankOnEveryLayout) {
  test::TempDir dir;
  const std::string common = " --data.paths '" + corpus_file(dir) + "' --data.document_separator '\n' --training.steps 3 --training.global_batch_size 4 " +
                             "--training.seq_len 64 --model.n_layers 2 --model.attn_mask_type block_causal";
  const std::string config = "'" SPMDX_SOURCE_DIR "/configs/llama_fsdp.toml'";
  const std::string one_rank = " --parallelism.data_parallel_shard_degree 1";
  auto one = spmdx_run(config + " --nproc 1 --job.dump_folder '" + (dir / "one").string() + "'" + common + one_rank);
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const auto want = losses(dir / "one" / "metrics.jsonl");
  ASSERT_EQ(want.size(), 3u);
  auto causal = spmdx_run(config + " --nproc 1 --job.dump_folder '" + (dir / "causal").string() + "'" + common + one_rank + " --model.attn_mask_type causal");
  ASSERT_EQ(causal.exit_code, 0) << causal.output;
  EXPECT_GT(std::abs(losses(dir / "causal" / "metrics.jsonl")[0] - want[0]), 1e-4);
  const std::vector<std::pair<std::string, std::string>> layouts = {
      {"fsdp2", " --parallelism.data_parallel_shard_degree 2"},
      {"tp2", one_rank + " --parallelism.tensor_parallel_degree 2"},
      {"cp2", one_rank + " --parallelism.context_parallel_degree 2"},
  };
  for (const auto& [name, flags] : layouts) {
    auto r = spmdx_run(config + " --nproc 2 --job.dump_folder '" + (dir / name).string() + "'" + common + flags);
    ASSERT_EQ(r.exit_code, 0) << name << "\n" << r.output;
    const auto got = losses(dir / name / "metrics.jsonl");
    ASSERT_EQ(got.size(), want.size()) << name;
    for (std::size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-5 * std::abs(want[i])) << name << " step " << i + 1;
  }
  // A value that is neither: the key and the allowed values named.
  auto bad = spmdx_run(config + " --nproc 1 --job.dump_folder '" + (dir / "bad").string() + "'" + common + one_rank + " --model.attn_mask_type document");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_THAT(bad.output, HasSubstr("model.attn_mask_type"));
  EXPECT_THAT(bad.output, HasSubstr("block_causal"));
}

TEST(Run, ContextParallelGivesTheLossesOfOneRank) {
  test::TempDir dir;
  const std::string common = " --data.paths '" + corpus_file(dir) + "' --training.steps 5 --training.global_batch_size 4 --training.seq_len 32 --model.n_layers 2";
  const std::string config = "'" SPMDX_SOURCE_DIR "/configs/llama_fsdp.toml'";
  const std::string validation = " --validation.enable true --validation.paths '" + corpus_file(dir) + "' --validation.freq 5 --validation.steps 2";
  auto one = spmdx_run(config + " --nproc 1 --job.dump_folder '" + (dir / "one").string() + "'" + common + validation);
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const auto want = losses(dir / "one" / "metrics.jsonl");
  const auto want_norms = test::column(dir / "one" / "metrics.jsonl", "grad_norm");
  const auto want_val = test::column_where_present(dir / "one" / "metrics.jsonl", "val_loss");
  ASSERT_EQ(want.size(), 5u);
  ASSERT_EQ(want_val.size(), 1u);
  const std::string cp = " --parallelism.data_parallel_shard_degree 1 --parallelism.context_parallel_degree ";
  const std::vector<std::tuple<std::string, int, std::string, std::string>> layouts = {
      {"cp2", 2, cp + "2" + validation, "context parallel: cp 2, 16 of 32 tokens a rank, load-balanced (4 pieces: rank r of cp holds pieces r and 3 - r); attention: 2 of 2 split their query rows"},
      {"cp4", 4, cp + "4", "cp 4, 8 of 32 tokens a rank, load-balanced (8 pieces"},
      {"cp2-in-order", 2, cp + "2 --parallelism.context_parallel_load_balance false", "in order (parallelism.context_parallel_load_balance = false)"},
      {"cp4-auto", 4, cp + "4 --parallelism.context_parallel_rotate_method auto", "split batch or heads by all_to_all"},
      {"fsdp2xcp2", 4, " --parallelism.data_parallel_shard_degree 2 --parallelism.context_parallel_degree 2", "mesh dp_shard=2 x cp=2"},
      {"dp2xcp2", 4, cp + "2 --parallelism.data_parallel_replicate_degree 2", "mesh dp_replicate=2 x cp=2"},
      {"cp2xtp2+sp+lp", 4, cp + "2 --parallelism.tensor_parallel_degree 2 --parallelism.enable_sequence_parallel true --parallelism.disable_loss_parallel false",
       "mesh cp=2 x tp=2"},
      {"pp2xcp2", 4, cp + "2 --parallelism.pipeline_parallel_degree 2", "mesh pp=2 x cp=2"},
      {"cp2-bf16", 2, cp + "2 --training.mixed_precision_param bfloat16", "mesh cp=2"},
  };
  // bfloat16 against one rank in bfloat16 (the loss's rows paired alike: with the logits cast
  // before cross entropy, the labels alone once went sequence-major, 2% off at step 1).
  auto one_bf16 = spmdx_run(config + " --nproc 1 --training.mixed_precision_param bfloat16 --job.dump_folder '" + (dir / "one-bf16").string() + "'" + common);
  ASSERT_EQ(one_bf16.exit_code, 0) << one_bf16.output;
  for (const auto& [name, nproc, flags, says] : layouts) {
    const auto folder = dir / name;
    auto r = spmdx_run(config + " --nproc " + std::to_string(nproc) + flags + " --job.dump_folder '" + folder.string() + "'" + common);
    ASSERT_EQ(r.exit_code, 0) << name << "\n" << r.output;
    EXPECT_THAT(r.output, HasSubstr(says)) << name;
    const auto got = losses(folder / "metrics.jsonl");
    const auto norms = test::column(folder / "metrics.jsonl", "grad_norm");
    const bool bf16 = name.find("bf16") != std::string::npos;
    const auto& ref = bf16 ? losses(dir / "one-bf16" / "metrics.jsonl") : want;
    const auto& ref_norms = bf16 ? test::column(dir / "one-bf16" / "metrics.jsonl", "grad_norm") : want_norms;
    const double tolerance = bf16 ? 1e-3 : 1e-6, norm_tolerance = bf16 ? 1e-2 : 1e-6;  // bfloat16's rounding in another order of sums
    ASSERT_EQ(got.size(), ref.size()) << name;
    for (std::size_t i = 0; i < ref.size(); ++i) {
      EXPECT_NEAR(got[i], ref[i], tolerance * std::abs(ref[i])) << name << " step " << i + 1;
      EXPECT_NEAR(norms[i], ref_norms[i], norm_tolerance * std::abs(ref_norms[i])) << name << " step " << i + 1;
    }
    const auto peak = test::column(folder / "metrics.jsonl", "peak_mem_bytes"), planned = test::column(folder / "metrics.jsonl", "planned_peak_mem_bytes");
    EXPECT_NEAR(peak.back(), planned.back(), 0.02 * planned.back()) << name;
    if (flags.find("validation") != std::string::npos) {
      const auto val = test::column_where_present(folder / "metrics.jsonl", "val_loss");
      ASSERT_EQ(val.size(), 1u) << name;
      EXPECT_NEAR(val[0], want_val[0], 1e-6 * std::abs(want_val[0])) << name;
    }
  }
}

// Activation checkpointing recomputes forward values in the backward (TP's all_reduce issued
// again, FSDP's parameters gathered again): the same losses bit for bit, on one rank and on
// FSDP x TP, with less memory held at the peak.
TEST(Run, ActivationCheckpointingChangesNoLossAndLowersThePeak) {
  test::TempDir dir;
  const std::string common = " --data.paths '" + corpus_file(dir) + "' --training.steps 3 --training.global_batch_size 8 --training.seq_len 64";
  for (const auto& [layout, nproc] : std::vector<std::pair<std::string, int>>{
           {"--parallelism.data_parallel_shard_degree 1 --training.local_batch_size 8", 1},  // one microbatch: the whole batch's activations
           {"--parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 2 --training.local_batch_size 4", 4}}) {
    std::map<std::string, std::vector<double>> loss, peak;
    std::map<std::string, std::vector<double>> collectives;
    for (const std::string mode : {"none", "full", "selective", "full_keep"}) {
      const fs::path out = dir / (mode + std::to_string(nproc));
      const std::string flags = mode == "full_keep" ? "full --activation_checkpoint.keep_collective_outputs true" : mode;
      auto r = spmdx_run("'" SPMDX_SOURCE_DIR "/configs/llama_fsdp.toml' --nproc " + std::to_string(nproc) + " " + layout +
                         " --activation_checkpoint.mode " + flags + " --job.dump_folder '" + out.string() + "'" + common);
      ASSERT_EQ(r.exit_code, 0) << mode << "\n" << r.output;
      if (mode != "none") {
        EXPECT_THAT(r.output, HasSubstr("activation checkpointing " + mode.substr(0, mode.find('_'))));
      }
      loss[mode] = losses(out / "metrics.jsonl");
      peak[mode] = test::column(out / "metrics.jsonl", "peak_mem_bytes");
      collectives[mode] = test::column(out / "metrics.jsonl", "collectives");
    }
    EXPECT_EQ(loss["full"], loss["none"]) << nproc << " ranks";
    EXPECT_EQ(loss["selective"], loss["none"]) << nproc << " ranks";
    EXPECT_EQ(loss["full_keep"], loss["none"]) << nproc << " ranks";
    EXPECT_LT(peak["full"].back(), 0.8 * peak["none"].back()) << nproc << " ranks";
    EXPECT_LT(peak["selective"].back(), peak["none"].back()) << nproc << " ranks";
    // Keeping the collectives' outputs: the calls of no checkpointing, for a peak in between.
    EXPECT_EQ(collectives["full_keep"].back(), collectives["none"].back()) << nproc << " ranks";
    EXPECT_LT(peak["full_keep"].back(), peak["none"].back()) << nproc << " ranks";
    EXPECT_GE(peak["full_keep"].back(), peak["full"].back()) << nproc << " ranks";
    if (nproc > 1) {
      EXPECT_LT(collectives["full_keep"].back(), collectives["full"].back()) << "TP's collectives were issued again";
    }
  }
}

// Mixed precision (bf16 parameters for the forward and backward, f32 master weights, AdamW and
// gradient reduction) on the main job's model and mesh: 50 steps track the f32 losses within 2%
// at every step, hold less memory, and the banner says what ran.
TEST(Run, Bf16MixedPrecisionTracksTheF32LossCurveOnFsdpTimesTp) {
  test::TempDir dir;
  const std::string common = "'" SPMDX_SOURCE_DIR "/configs/llama_debug.toml' --nproc 4 --data.paths '" + corpus_file(dir) +
                             "' --training.steps 50 --training.seq_len 32 --training.local_batch_size 4";
  std::map<std::string, std::vector<double>> loss, peak;
  for (const std::string param : {"float32", "bfloat16"}) {
    auto r = spmdx_run(common + " --training.mixed_precision_param " + param + " --job.dump_folder '" + (dir / param).string() + "'");
    ASSERT_EQ(r.exit_code, 0) << param << "\n" << r.output;
    if (param == "bfloat16") {
      EXPECT_THAT(r.output, HasSubstr("mixed precision: bfloat16 parameters, float32 reduce"));
    }
    loss[param] = losses(dir / param / "metrics.jsonl");
    peak[param] = test::column(dir / param / "metrics.jsonl", "peak_mem_bytes");
    // MFU in every row, torchtitan's (metrics.py): tflops = FLOPs per token x tokens/s per rank /
    // 1e12, with FLOPs per token 6 x non-embedding parameters + 12 x layers x heads x head_dim x
    // seq_len (get_dense_model_nparams_and_flops; the parameters as compile counts them:
    // debugmodel has 6 layers of 16 heads of 16); mfu = 100 x tflops / the rank's peak.
    EXPECT_THAT(r.output, HasSubstr("mfu: torchtitan's (FLOPs per token x tokens/s per rank / peak), against "));
    EXPECT_THAT(r.output, HasSubstr(" " + param + " a rank = "));
    const auto c = test::run_command("'" SPMDX_EXE "' compile '" SPMDX_SOURCE_DIR "/configs/llama_debug.toml' --training.seq_len 32 --json");
    ASSERT_EQ(c.exit_code, 0) << c.output;
    const auto model = nlohmann::json::parse(c.output.substr(c.output.find('{'))).at("model");
    const double flops_per_token =
        6.0 * (model.at("parameters").get<double>() - model.at("embedding_parameters").get<double>()) + 12.0 * 6 * 16 * 16 * 32;
    const auto tps = test::column(dir / param / "metrics.jsonl", "tokens_per_s"), tflops = test::column(dir / param / "metrics.jsonl", "tflops");
    const auto mfu = test::column(dir / param / "metrics.jsonl", "mfu"), peak_tflops = test::column(dir / param / "metrics.jsonl", "peak_tflops");
    ASSERT_EQ(tflops.size(), 50u);
    ASSERT_EQ(mfu.size(), 50u);
    for (std::size_t s = 0; s < 50; ++s) {
      EXPECT_NEAR(tflops[s], flops_per_token * tps[s] / 4 / 1e12, 1e-9 * tflops[s]) << param << " step " << s + 1;
      EXPECT_GT(peak_tflops[s], 0);
      EXPECT_NEAR(mfu[s], 100 * tflops[s] / peak_tflops[s], 1e-9 * mfu[s]) << param << " step " << s + 1;
    }
  }
  ASSERT_EQ(loss["bfloat16"].size(), 50u);
  ASSERT_EQ(loss["float32"].size(), 50u);
  EXPECT_NE(loss["bfloat16"], loss["float32"]) << "the bf16 run computed in float32";
  for (std::size_t s = 0; s < 50; ++s) EXPECT_NEAR(loss["bfloat16"][s], loss["float32"][s], 0.02 * loss["float32"][s]) << "step " << s + 1;
  EXPECT_LT(loss["bfloat16"].back(), 0.8 * loss["bfloat16"].front()) << "it learns";
  EXPECT_LT(peak["bfloat16"].back(), peak["float32"].back());
}

// float16 with dynamic loss scaling, as torch.amp.GradScaler: at the default scale the losses
// track float32's within 2% at every step; from a scale the backward cannot hold (2^24) the
// first steps overflow, are skipped and halve the scale until it fits, and then it learns; a
// resume from a checkpoint taken after the skips continues with the same scale and losses.
TEST(Run, Float16LossScalingTracksF32SkipsOverflowsAndResumesWithItsScale) {
  test::TempDir dir;
  const std::string common = "'" SPMDX_SOURCE_DIR "/configs/llama_fsdp.toml' --nproc 2 --data.paths '" + corpus_file(dir) +
                             "' --training.steps 16 --training.global_batch_size 8 --training.seq_len 32";
  ASSERT_EQ(spmdx_run(common + " --job.dump_folder '" + (dir / "f32").string() + "'").exit_code, 0);
  auto f16 = spmdx_run(common + " --training.mixed_precision_param float16 --job.dump_folder '" + (dir / "f16").string() + "'");
  ASSERT_EQ(f16.exit_code, 0) << f16.output;
  EXPECT_THAT(f16.output, HasSubstr("mixed precision: float16 parameters, float32 reduce"));
  EXPECT_THAT(f16.output, HasSubstr("dynamic loss scale from 65536"));
  const auto want = losses(dir / "f32" / "metrics.jsonl");
  const auto got = rows(dir / "f16" / "metrics.jsonl");
  ASSERT_EQ(got.size(), 16u);
  for (std::size_t i = 0; i < got.size(); ++i) {
    EXPECT_FALSE(got[i].at("skipped").get<bool>()) << "step " << i + 1;
    EXPECT_NEAR(got[i].at("loss").get<double>(), want[i], 0.02 * want[i]) << "step " << i + 1;
  }
  EXPECT_NE(got[5].at("loss").get<double>(), want[5]) << "the float16 run computed in float32";

  const std::string overflow = common + " --training.mixed_precision_param float16 --training.grad_scaler_init_scale 16777216"
                                        " --checkpoint.enable true --checkpoint.interval 8";
  auto skips = spmdx_run(overflow + " --job.dump_folder '" + (dir / "skips").string() + "'");
  ASSERT_EQ(skips.exit_code, 0) << skips.output;
  EXPECT_THAT(skips.output, HasSubstr("(overflow: update skipped)"));
  const auto run = rows(dir / "skips" / "metrics.jsonl");
  ASSERT_EQ(run.size(), 16u);
  std::size_t skipped = 0;
  while (skipped < run.size() && run[skipped].at("skipped").get<bool>()) {
    EXPECT_EQ(run[skipped].at("loss_scale").get<double>(), std::ldexp(1.0, 24 - static_cast<int>(skipped))) << "step " << skipped + 1;
    EXPECT_TRUE(run[skipped].at("grad_norm").is_null()) << "an overflowed step's norm is inf (null in JSON)";
    ++skipped;
  }
  ASSERT_GE(skipped, 1u) << "2^24 did not overflow float16";
  ASSERT_LE(skipped, 7u);
  for (std::size_t i = skipped; i < run.size(); ++i) EXPECT_FALSE(run[i].at("skipped").get<bool>()) << "step " << i + 1;
  double tail = 0;  // the last 4 losses' mean: one batch's loss varies by a few percent
  for (std::size_t i = run.size() - 4; i < run.size(); ++i) tail += run[i].at("loss").get<double>() / 4;
  EXPECT_LT(tail, 0.98 * run[skipped].at("loss").get<double>()) << "it learns after the skips";

  // Resume at step 8 from the first run's checkpoint.
  fs::create_directories(dir / "resumed" / "checkpoint");
  fs::copy(dir / "skips" / "checkpoint" / "step-8", dir / "resumed" / "checkpoint" / "step-8", fs::copy_options::recursive);
  auto resumed = spmdx_run(overflow + " --job.dump_folder '" + (dir / "resumed").string() + "'");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_THAT(resumed.output, HasSubstr("resumed from"));
  const auto again = rows(dir / "resumed" / "metrics.jsonl");
  ASSERT_EQ(again.size(), 8u);
  for (std::size_t i = 0; i < again.size(); ++i) {
    EXPECT_EQ(again[i].at("step").get<int>(), static_cast<int>(i) + 9);
    EXPECT_EQ(again[i].at("loss").get<double>(), run[i + 8].at("loss").get<double>()) << "step " << i + 9;
    EXPECT_EQ(again[i].at("loss_scale").get<double>(), run[i + 8].at("loss_scale").get<double>()) << "step " << i + 9;
  }
  // The updates AdamW applied are kept across precisions: resumed as float32, the checkpoint at
  // step 16 counts the first run's 8 - skipped and the 8 of the resumed one.
  fs::create_directories(dir / "as_f32" / "checkpoint");
  fs::copy(dir / "skips" / "checkpoint" / "step-8", dir / "as_f32" / "checkpoint" / "step-8", fs::copy_options::recursive);
  auto as_f32 = spmdx_run(common + " --checkpoint.enable true --checkpoint.interval 8 --job.dump_folder '" + (dir / "as_f32").string() + "'");
  ASSERT_EQ(as_f32.exit_code, 0) << as_f32.output;
  std::ifstream meta(dir / "as_f32" / "checkpoint" / "step-16" / "metadata.json");
  const auto saved = nlohmann::json::parse(meta);
  EXPECT_EQ(saved.at("optimizer_steps").get<std::size_t>(), 16 - skipped);
  EXPECT_FALSE(saved.contains("grad_scaler")) << "float32 keeps no loss scale";
}

TEST(Run, ABadSelectiveCheckpointOptionFailsBeforeAnyRankStarts) {
  auto r = spmdx_run("'" SPMDX_SOURCE_DIR "/configs/mlp_dp.toml' --nproc 2 --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option every2");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.output, HasSubstr("activation_checkpoint.selective_ac_option = \"every2\": use \"op\""));
  EXPECT_THAT(r.output, ::testing::Not(HasSubstr("[rank")));
  auto keep = spmdx_run("'" SPMDX_SOURCE_DIR "/configs/mlp_dp.toml' --nproc 2 --activation_checkpoint.keep_collective_outputs true");
  EXPECT_EQ(keep.exit_code, 1);
  EXPECT_THAT(keep.output, HasSubstr("activation_checkpoint.mode = \"none\" recomputes nothing"));
  EXPECT_THAT(keep.output, ::testing::Not(HasSubstr("[rank")));
}

// The RuntimePlan changes when collectives run, never what they compute: bucketing (small
// buckets: many of them), prefetch and overlap on give the losses of all of them off, up to
// the last bit of a sum's order.
TEST(Run, BucketingPrefetchAndOverlapChangeNoLoss) {
  test::TempDir dir;
  const std::string common = " --data.paths '" + corpus_file(dir) + "' --training.steps 10 --training.global_batch_size 8 --training.seq_len 32 --nproc 4";
  const std::vector<std::pair<std::string, std::string>> layouts = {
      {"dp4", "--parallelism.data_parallel_shard_degree 1 --parallelism.data_parallel_replicate_degree 4"},
      {"fsdp2xtp2", "--parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 2"},
  };
  for (const auto& [name, flags] : layouts) {
    auto off = spmdx_run("'" SPMDX_SOURCE_DIR "/configs/llama_fsdp.toml' " + flags + common + " --job.dump_folder '" + (dir / (name + "off")).string() +
                         "' --comm.bucket_cap_mb 0 --comm.prefetch false --comm.overlap false");
    ASSERT_EQ(off.exit_code, 0) << off.output;
    auto on = spmdx_run("'" SPMDX_SOURCE_DIR "/configs/llama_fsdp.toml' " + flags + common + " --job.dump_folder '" + (dir / (name + "on")).string() +
                        "' --comm.bucket_cap_mb 0.05 --comm.first_bucket_cap_mb 0.01");
    ASSERT_EQ(on.exit_code, 0) << on.output;
    // Bit for bit but for the order of each sum: a bucket puts a gradient's elements in other
    // blocks of its flat buffer, which other ranks reduce, each starting from its own values
    // (shared memory and the direct algorithm reduce block j from member j on), so a sum of the
    // ranks' terms may round differently in its last bit, as NCCL's does with the message size.
    const auto on_losses = losses(dir / (name + "on") / "metrics.jsonl"), off_losses = losses(dir / (name + "off") / "metrics.jsonl");
    ASSERT_EQ(on_losses.size(), off_losses.size()) << name;
    for (std::size_t i = 0; i < on_losses.size(); ++i) EXPECT_NEAR(on_losses[i], off_losses[i], 3e-7 * off_losses[i]) << name << " step " << i + 1;
    // Fewer backend calls with buckets.
    auto calls = [&](const std::string& run) {
      std::ifstream in(dir / run / "metrics.jsonl");
      std::string line;
      std::getline(in, line);
      return nlohmann::json::parse(line).at("collectives").get<std::int64_t>();
    };
    if (name == "dp4") {
      EXPECT_LT(calls(name + "on"), calls(name + "off"));
    }
  }
}

// Under torchrun, whose agent holds MASTER_PORT with a c10d TCPStore, the ranks join that store
// (LibTorch's c10d client) and train as under spmdx's own launcher.
TEST(Run, UnderTorchrunTheRanksJoinItsC10dStore) {
  const std::string torchrun = SPMDX_SOURCE_DIR "/.venv/bin/torchrun";
  if (!fs::exists(torchrun)) GTEST_SKIP() << torchrun << " is absent (scripts/setup installs it)";
  test::TempDir dir;
  const std::string common = "'" SPMDX_SOURCE_DIR "/configs/mlp_dp.toml' --training.steps 3 --data.paths '" + corpus_file(dir) + "'";
  auto ours = spmdx_run(common + " --nproc 2 --job.dump_folder '" + (dir / "ours").string() + "'");
  ASSERT_EQ(ours.exit_code, 0) << ours.output;
  auto r = test::run_command("'" + torchrun + "' --nproc-per-node 2 --no-python '" SPMDX_EXE "' run " + common + " --job.dump_folder '" +
                             (dir / "torchrun").string() + "'");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("(2 ranks, torchrun)"));
  EXPECT_EQ(losses(dir / "torchrun" / "metrics.jsonl"), losses(dir / "ours" / "metrics.jsonl"));
}

TEST(Run, AutoRefusesACommPluginWithMalformedCapabilitiesBeforeAnyRankStarts) {
  auto r = spmdx_run("'" SPMDX_SOURCE_DIR "/configs/mlp_dp.toml' --nproc 2 --plugins.paths '" TEST_PLUGIN_DIR "/test_comm_typo'");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.output, HasSubstr("comm.backend = \"auto\": comm backend 'test_comm_typo' has malformed capabilities: capability 0 (all_reduse, "
                                  "host) names operation 'all_reduse'"));
  EXPECT_THAT(r.output, HasSubstr("; fix the plugin or remove it from the plugin path"));
  EXPECT_THAT(r.output, ::testing::Not(HasSubstr("[rank")));
}

// Intra-op threads per rank as torchrun users set them: OMP_NUM_THREADS wins; without it, the
// CPUs this process may run on (its affinity mask) shared among the host's ranks; a value that
// is not a count is said to be ignored.
TEST(Run, IntraOpThreadsFollowOmpNumThreadsElseTheCpusShared) {
  test::TempDir dir;
  const std::string job = "'" SPMDX_SOURCE_DIR "/configs/mlp_dp.toml' --nproc 2 --training.steps 1 --job.dump_folder '" + dir.path().string() + "'";
  auto r = test::run_command("OMP_NUM_THREADS=3 '" SPMDX_EXE "' run " + job);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr(", 3 intra-op threads per rank, float32 linears on "));
  cpu_set_t set;
  ASSERT_EQ(sched_getaffinity(0, sizeof set, &set), 0);
  const int shared = std::max(1, CPU_COUNT(&set) / 2);
  const std::string expected = ", " + std::to_string(shared) + " intra-op thread" + (shared == 1 ? "" : "s") + " per rank, float32 linears on ";
  r = test::run_command("env -u OMP_NUM_THREADS '" SPMDX_EXE "' run " + job);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr(expected));
  r = test::run_command("OMP_NUM_THREADS=four '" SPMDX_EXE "' run " + job);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("OMP_NUM_THREADS='four' is not a whole number from 1 to 4096: ignored"));
  EXPECT_THAT(r.output, HasSubstr(expected));
  // The linears' library (training.cpu_matmul) is named on the same line.
  r = test::run_command("OMP_NUM_THREADS=1 '" SPMDX_EXE "' run " + job + " --training.cpu_matmul aten");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr(", 1 intra-op thread per rank, float32 linears on ATen's BLAS\n"));
}

TEST(Run, TheLocalBackendIsRefusedBeforeAnyRankStarts) {
  auto r = spmdx_run("'" SPMDX_SOURCE_DIR "/configs/mlp_dp.toml' --nproc 2 --comm.backend local");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.output, HasSubstr("comm.backend = \"local\": the local plugin runs ranks as threads of one process (its descriptor is flagged "
                                  "in-process only), and spmdx starts a process per rank; use ucx, or \"auto\""));
  EXPECT_THAT(r.output, ::testing::Not(HasSubstr("[rank")));
}

TEST(Run, CudaWithoutAGpuIsRefusedBeforeAnyRankStartsSayingWhatToDo) {
  test::TempDir dir;
  auto r = spmdx_run("'" SPMDX_SOURCE_DIR "/configs/mlp_dp.toml' --nproc 2 --training.device cuda --training.steps 2 --job.dump_folder '" +
                     dir.path().string() + "'");
  // A job that succeeds must have trained on GPUs: the banner names the CPU's linear library
  // (", float32 linears on ...") only for a CPU device, so a silent CPU fallback where no GPU
  // is fails here instead of reading as "skipped".
  if (r.exit_code == 0) {
    EXPECT_THAT(r.output, HasSubstr("spmdx: ")) << r.output;
    EXPECT_THAT(r.output, Not(HasSubstr("float32 linears on"))) << "training.device = \"cuda\" trained on the CPU:\n" << r.output;
    GTEST_SKIP() << "this machine has GPUs for 2 ranks: the job trained on them";
  }
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("command line --training.device cuda: training.device = \"cuda\": "));
  EXPECT_THAT(r.output, testing::AnyOf(HasSubstr("use training.device = \"cpu\""), HasSubstr("takes one GPU per rank (--nproc at most")));
  EXPECT_THAT(r.output, ::testing::Not(HasSubstr("[rank")));
}

TEST(Run, CudaGraphsAreRefusedOnTheCpuAndOnSeveralRanks) {
  auto cpu = spmdx_run("'" SPMDX_SOURCE_DIR "/configs/mlp_dp.toml' --nproc 2 --training.cuda_graphs true");
  EXPECT_EQ(cpu.exit_code, 1);
  EXPECT_THAT(cpu.output, HasSubstr("training.cuda_graphs = true needs training.device = \"cuda\""));
  auto ranks = spmdx_run("'" SPMDX_SOURCE_DIR "/configs/mlp_dp.toml' --nproc 2 --training.device cuda --training.cuda_graphs true");
  EXPECT_EQ(ranks.exit_code, 1);
  EXPECT_THAT(ranks.output, HasSubstr("training.cuda_graphs = true runs one rank only for now (2 ranks here)"));
  EXPECT_THAT(ranks.output, ::testing::Not(HasSubstr("[rank")));
}

TEST(Run, ABadCommBackendOptionFailsBeforeAnyRankStarts) {
  auto r = spmdx_run("'" SPMDX_SOURCE_DIR "/configs/mlp_dp.toml' --nproc 2 --comm.backend 'ucx:chunk_bytes=many'");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.output, HasSubstr("comm.backend = \"ucx:chunk_bytes=many\": ucx: option chunk_bytes='many' must be a size in bytes"));
  EXPECT_THAT(r.output, ::testing::Not(HasSubstr("[rank")));
  r = spmdx_run("'" SPMDX_SOURCE_DIR "/configs/mlp_dp.toml' --nproc 2 --comm.swap_at_step 1 --comm.swap_to 'ucx:chunk=64'");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.output, HasSubstr("comm.swap_to = \"ucx:chunk=64\": ucx: unknown option 'chunk' (known: tls, chunk_bytes, direct_max_bytes, shm, shm_chunk_bytes)"));
  EXPECT_THAT(r.output, ::testing::Not(HasSubstr("[rank")));
  r = spmdx_run("'" SPMDX_SOURCE_DIR "/configs/mlp_dp.toml' --nproc 2 --comm.swap_to 'ucx:shm=off'");  // a swap that would never happen
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.output, HasSubstr("comm.swap_to is set but comm.swap_at_step is 0, so nothing would swap"));
  // A transport that exists everywhere but carries nothing between the rank processes.
  r = spmdx_run("'" SPMDX_SOURCE_DIR "/configs/mlp_dp.toml' --nproc 2 --comm.backend 'ucx:tls=self'");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.output, HasSubstr("comm.backend = \"ucx:tls=self\": ucx: tls=self names no transport between rank processes: add shm"));
  EXPECT_THAT(r.output, ::testing::Not(HasSubstr("[rank")));
}

TEST(Run, TypoInConfigFailsBeforeAnyRankStartsNamingLineAndKey) {
  test::TempDir dir;
  test::write_file(dir / "bad.toml", "[model]\nname = \"llama\"\n[training]\nsteps = 3\nsqe_len = 16\n");
  auto r = spmdx_run("'" + (dir / "bad.toml").string() + "' --nproc 4");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.output, HasSubstr("bad.toml:5:11: unknown key 'training.sqe_len'; did you mean 'training.seq_len'?"));
  EXPECT_THAT(r.output, ::testing::Not(HasSubstr("[rank")));
}

// Everything the config alone shows to be wrong is said before any rank starts, all at once:
// the config's own problems, a comm plugin's options (UCX's transports, checked without
// joining a job), and what only placing the model finds (a vocabulary tensor parallelism
// cannot split), which used to fail on every rank after start.
TEST(Run, EveryCheckThatNeedsNoRankRunsBeforeRanksStartAndAllAreSaidAtOnce) {
  test::TempDir dir;
  // A tokenizer of 27 ids (a-z and the space): output.weight [27, dim] does not split over tp 2.
  nlohmann::json vocab = nlohmann::json::object();
  for (char c = 'a'; c <= 'z'; ++c) vocab[std::string(1, c)] = c - 'a';
  vocab[" "] = 26;
  test::write_file(dir / "tokenizer.json", nlohmann::json{{"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", nlohmann::json::array()}}}}.dump());
  auto r = spmdx_run("'" SPMDX_SOURCE_DIR "/configs/llama_fsdp.toml' --nproc 2 --parallelism.tensor_parallel_degree 2 --data.paths '" + corpus_file(dir) +
                     "' --job.dump_folder '" + (dir / "out").string() + "' --model.tokenizer '" + (dir / "tokenizer.json").string() +
                     "' --comm.swap_at_step 3 --comm.swap_to 'ucx:tls=bogus' --training.dataset c4");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("problems (every one found)"));
  EXPECT_THAT(r.output, HasSubstr("training.dataset = c4 is torchtitan's; spmdx does not support torchtitan's named data sets"));
  EXPECT_THAT(r.output, HasSubstr("comm.swap_to = \"ucx:tls=bogus\": ucx: tls=bogus: UCX here has no transport bogus (it has: self, tcp"));
  EXPECT_THAT(r.output, HasSubstr("tensor_parallel: parameter 'output.weight' dim 0 (27) does not split evenly over tp=2"));
  EXPECT_THAT(r.output, ::testing::Not(HasSubstr("[rank")));
  EXPECT_FALSE(fs::exists(dir / "out" / "metrics.jsonl"));
  // nccl on a machine without a GPU: refused before the ranks, not at the swap step.
  if (!fs::exists("/dev/nvidiactl")) {
    auto n = spmdx_run("'" SPMDX_SOURCE_DIR "/configs/mlp_dp.toml' --nproc 2 --data.paths '" + corpus_file(dir) + "' --comm.swap_at_step 3 --comm.swap_to nccl");
    EXPECT_EQ(n.exit_code, 1) << n.output;
    EXPECT_THAT(n.output, HasSubstr("comm.swap_to = \"nccl\": nccl: no usable CUDA device on this machine"));
    EXPECT_THAT(n.output, ::testing::Not(HasSubstr("[rank")));
  }
}

TEST(Run, MissingDataFailsBeforeAnyRankStarts) {
  auto r = spmdx_run("'" SPMDX_SOURCE_DIR "/configs/llama_fsdp.toml' --nproc 2 --data.paths /nonexistent/corpus.txt");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.output, HasSubstr("data.paths: '/nonexistent/corpus.txt': no such file"));
  EXPECT_THAT(r.output, ::testing::Not(HasSubstr("[rank")));
}

TEST(Run, DataTooShortFailsBeforeAnyRankStarts) {
  test::TempDir dir;
  test::write_file(dir / "short.txt", "too short\n");
  auto r = spmdx_run("'" SPMDX_SOURCE_DIR "/configs/llama_fsdp.toml' --nproc 2 --data.paths '" + (dir / "short.txt").string() + "'");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.output, HasSubstr("short.txt' holds 12 tokens, but a sample needs seq_len + 1 = 65"));
  EXPECT_THAT(r.output, ::testing::Not(HasSubstr("[rank")));
}

// A planned peak over the host's memory and swap: refused before the first step, where the
// kernel's out-of-memory killer would have stopped a rank mid-step ("killed by signal Killed").
TEST(Run, APlannedPeakOverTheHostsMemoryIsRefusedBeforeTheFirstStep) {
  test::TempDir dir;
  auto r = spmdx_run("'" SPMDX_SOURCE_DIR "/configs/llama_debug.toml' --nproc 2 --parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 1 "
                     "--training.steps 1 --training.local_batch_size 1000000 --job.dump_folder '" + dir.path().string() + "'");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.output, HasSubstr("error: the planned peak memory, 15.1 TiB a rank x 2 ranks on this host, is over its "));
  EXPECT_THAT(r.output, HasSubstr("lower training.local_batch_size or training.seq_len"));
  EXPECT_FALSE(std::filesystem::exists(dir / "metrics.jsonl")) << "no step ran";
}

// A tokenizer with an id near 2^24 makes a vocabulary of 16,777,216 ids: the planned peak is
// refused before any of the state is allocated (the banner, printed after it, never comes),
// naming the peak, the host's memory and the vocabulary that makes it large; the tokenizer's
// reader warns of the gap. (The large flavor's dim 2048: over 1 TiB, more than a test machine has.)
TEST(Run, AVocabularyMadeHugeByATokenizerIdIsRefusedBeforeTheStateIsAllocated) {
  test::TempDir dir;
  nlohmann::json vocab = nlohmann::json::object();
  for (int c = 0x20; c < 0x7f; ++c) vocab[std::string(1, static_cast<char>(c))] = c - 0x20;
  vocab["\n"] = 0x7f - 0x20;
  vocab["zz"] = (1 << 24) - 1;
  const nlohmann::json tokenizer = {{"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", nlohmann::json::array()}}}};
  test::write_file(dir / "tokenizer.json", tokenizer.dump());
  auto r = spmdx_run("'" SPMDX_SOURCE_DIR "/configs/llama_debug.toml' --nproc 1 --parallelism.data_parallel_shard_degree 1 --parallelism.tensor_parallel_degree 1 "
                     "--training.steps 1 --model.flavor large --model.n_layers 1 --model.tokenizer '" + (dir / "tokenizer.json").string() + "' --data.paths '" + corpus_file(dir) +
                     "' --job.dump_folder '" + (dir / "out").string() + "'");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("its largest id, 16777215 (\"zz\"), makes a vocabulary of 16777216 ids for the 97 tokens it defines"));
  EXPECT_THAT(r.output, ::testing::ContainsRegex("error: the planned peak memory, [0-9.]+ (GiB|TiB) a rank x 1 rank on this host, is over its [0-9.]+ (GiB|TiB) of memory"));
  EXPECT_THAT(r.output, HasSubstr("the largest buffers at the peak: "));
  EXPECT_THAT(r.output, ::testing::ContainsRegex("the vocabulary of 16777216 ids makes the embedding and output rows [0-9]+% of the model's parameters \\(model.tokenizer '" +
                                                 (dir / "tokenizer.json").string() + "': its largest id \\+ 1"));
  EXPECT_THAT(r.output, Not(HasSubstr("spmdx: llama")));  // the banner, after the state is made
  EXPECT_FALSE(std::filesystem::exists(dir / "out" / "metrics.jsonl")) << "no step ran";
}

// Also with pipeline stages (rank 1 the middle one of 3), whose neighbours wait on its sends.
TEST(Run, ARankKilledStopsTheJobNamingIt) {
  for (const std::string flags : {"", " --parallelism.pipeline_parallel_degree 3 --parallelism.data_parallel_shard_degree 1 --model.n_layers 3"}) {
    SCOPED_TRACE(flags);
    test::TempDir dir;
    const std::string data = corpus_file(dir);
    // Start a long run, kill rank 1 (found by its RANK variable) with SIGKILL, and see the launcher stop the rest.
    const std::string script =
        "'" SPMDX_EXE "' run '" SPMDX_SOURCE_DIR "/configs/llama_fsdp.toml' --nproc 3 --training.steps 1000000 --data.paths '" + data +
        "' --training.seq_len 16" + flags + " --job.dump_folder '" + dir.path().string() + "' > '" + (dir / "log").string() + "' 2>&1 & launcher=$!; "
        "for i in $(seq 1 100); do for p in $(pgrep -P $launcher); do "
        "  if tr '\\0' '\\n' < /proc/$p/environ | grep -qx RANK=1; then kill -9 $p; break 2; fi; done; sleep 0.1; done; "
        "wait $launcher; echo \"launcher exit $?\"; cat '" + (dir / "log").string() + "'";
    auto r = test::run_command("bash -c \"" + [&] {
      std::string escaped;
      for (char c : script) escaped += (c == '"' || c == '$' || c == '`' || c == '\\') ? std::string("\\") + c : std::string(1, c);
      return escaped;
    }() + "\"");
    EXPECT_THAT(r.output, HasSubstr("launcher exit 1"));
    // (the rest of the line names the out-of-memory killer only if the machine's count rose meanwhile)
    EXPECT_THAT(r.output, HasSubstr("spmdx run: rank 1 was killed by signal Killed"));
    EXPECT_THAT(r.output, HasSubstr("; the other ranks were stopped"));
    EXPECT_EQ(test::run_command("pgrep -f 'training[.]steps 1000000' | wc -l").output, "0\n") << "rank processes were left behind";
  }
}

// A rank killed with SIGKILL: the launcher reads the kernel's count of out-of-memory kills at
// launch and when the rank is reaped. It rose: the out-of-memory killer is named with what to
// lower; unchanged: a person or a scheduler did it, nothing more is said; unreadable: it may
// have been either. Other signals are named alone.
TEST(Launcher, ARankSigkilledByTheOutOfMemoryKillerIsSaidToBe) {
  using launch::OomKillCount;
  const OomKillCount three{3, "/proc/vmstat"}, four{4, "/proc/vmstat"};
  const std::string oom = launch::killed_by(SIGKILL, three, four);
  EXPECT_THAT(oom, HasSubstr("was killed by signal Killed, most likely by the kernel's out-of-memory killer (oom_kill in /proc/vmstat rose from 3 to 4 while the job ran)"));
  EXPECT_THAT(oom, HasSubstr("lower training.local_batch_size or training.seq_len"));
  EXPECT_EQ(launch::killed_by(SIGKILL, three, three), "was killed by signal Killed");
  for (const auto& [before, after] : {std::pair<std::optional<OomKillCount>, std::optional<OomKillCount>>{std::nullopt, four}, {three, std::nullopt},
                                      {three, OomKillCount{4, "/sys/fs/cgroup/memory.events"}}}) {
    EXPECT_THAT(launch::killed_by(SIGKILL, before, after), HasSubstr("was killed by signal Killed (SIGKILL: sent by a person, a scheduler, or the kernel's out-of-memory killer"));
  }
  EXPECT_EQ(launch::killed_by(SIGSEGV, three, four), "was killed by signal Segmentation fault");
}

// A failing rank is named, and the rest of the job said to be stopped only when there is one.
TEST(Launcher, AFailingRankIsNamedAndTheOthersStoppedWhenThereAreOthers) {
  for (const int nproc : {1, 2}) {
    launch::LaunchOptions o;
    o.nproc = nproc;
    testing::internal::CaptureStderr();
    testing::internal::CaptureStdout();
    const int rc = launch::launch(o, {"/bin/sh", "-c", "[ \"$RANK\" = 0 ] && exit 3; exec sleep 30"});
    const std::string err = testing::internal::GetCapturedStderr();
    testing::internal::GetCapturedStdout();
    EXPECT_EQ(rc, 1);
    EXPECT_EQ(err, nproc == 1 ? "spmdx run: rank 0 exited with code 3\n" : "spmdx run: rank 0 exited with code 3; the other ranks were stopped\n");
  }
}

// The count's files: cgroup v2's memory.events and /proc/vmstat, one "key value" a line.
TEST(Launcher, TheOutOfMemoryKillCountIsReadFromMemoryEventsOrVmstat) {
  test::TempDir dir;
  std::ofstream(dir / "memory.events") << "low 0\nhigh 0\nmax 12\noom 2\noom_kill 2\noom_group_kill 0\n";
  std::ofstream(dir / "vmstat") << "nr_free_pages 2711\npgfault 99\noom_kill 7\nunevictable_pgs_culled 0\n";
  std::ofstream(dir / "none") << "low 0\nhigh 0\n";
  EXPECT_EQ(launch::read_oom_kill((dir / "memory.events").string()), 2);
  EXPECT_EQ(launch::read_oom_kill((dir / "vmstat").string()), 7);
  EXPECT_EQ(launch::read_oom_kill((dir / "none").string()), std::nullopt);
  EXPECT_EQ(launch::read_oom_kill((dir / "missing").string()), std::nullopt);
  // This machine (Linux 4.13 or later) has one or the other.
  const auto now = launch::oom_kill_count();
  ASSERT_TRUE(now.has_value());
  EXPECT_TRUE(now->file == "/proc/vmstat" || now->file.ends_with("/memory.events")) << now->file;
  EXPECT_GE(now->kills, 0);
}

// Saved on 4 ranks as fsdp x tp 2 x 2 at step 5, resumed on 2 ranks as dp 2: steps 6-10 give
// the losses of an uninterrupted one-rank run.
// Pipeline stages save each rank's stage (metadata.json version 3: every tensor's stage): saved
// at step 3 as pp 2 x fsdp 2, resumed as pp 2 x fsdp 2 (each rank its own file), as pp 4 (other
// stages) and as fsdp 2 without stages, and a checkpoint without stages resumed as pp 2: steps
// 4-6 give the losses of an uninterrupted one-rank run; the export is whole.
TEST(Checkpoint, PipelineStagesSaveAndResumeOnAnyLayout) {
  test::TempDir dir;
  const std::string common = "'" SPMDX_SOURCE_DIR "/configs/llama_fsdp.toml' --data.paths '" + corpus_file(dir) +
                             "' --training.steps 6 --training.global_batch_size 8 --training.seq_len 32 --model.n_layers 4";
  ASSERT_EQ(spmdx_run(common + " --nproc 1 --job.dump_folder '" + (dir / "full").string() + "'").exit_code, 0);
  const auto want = losses(dir / "full" / "metrics.jsonl");
  const std::string pp2 = " --nproc 4 --parallelism.pipeline_parallel_degree 2 --parallelism.data_parallel_shard_degree 2";
  const std::string save_flags = " --checkpoint.enable true --checkpoint.interval 3";
  auto save = spmdx_run(common + pp2 + save_flags + " --job.dump_folder '" + (dir / "pp").string() + "'");
  ASSERT_EQ(save.exit_code, 0) << save.output;
  const fs::path step3 = dir / "pp" / "checkpoint" / "step-3";
  const auto md = nlohmann::json::parse(test::read_file(step3 / "metadata.json"));
  EXPECT_EQ(md.at("version").get<int>(), 3);
  EXPECT_EQ(md.at("pipeline").at("stages").get<int>(), 2);
  EXPECT_EQ(md.at("world_size").get<int>(), 4);
  EXPECT_EQ(md.at("tensors").at("tok_embeddings.weight").at("stage").get<int>(), 0);
  EXPECT_EQ(md.at("tensors").at("exp_avg.layers.3.attention.wq.weight").at("stage").get<int>(), 1);
  auto exported = test::run_command("'" SPMDX_EXE "' export '" + step3.string() + "' '" + (dir / "m.safetensors").string() + "'");
  ASSERT_EQ(exported.exit_code, 0) << exported.output;
  EXPECT_THAT(exported.output, HasSubstr("wrote 41 tensors"));  // 39 parameters of 4 layers + the 2 rope tables
  struct Resume {
    std::string name, flags;
  };
  for (const Resume& r : {Resume{"same", pp2}, Resume{"pp4", " --nproc 4 --parallelism.pipeline_parallel_degree 4 --parallelism.data_parallel_shard_degree 1"},
                          Resume{"fsdp2", " --nproc 2 --parallelism.data_parallel_shard_degree 2"}}) {
    const fs::path folder = dir / r.name;
    fs::create_directories(folder / "checkpoint");
    fs::copy(step3, folder / "checkpoint" / "step-3", fs::copy_options::recursive);
    auto resume = spmdx_run(common + r.flags + " --checkpoint.enable true --job.dump_folder '" + folder.string() + "'");
    ASSERT_EQ(resume.exit_code, 0) << r.name << "\n" << resume.output;
    EXPECT_THAT(resume.output, HasSubstr("resumed from")) << r.name;
    const auto got = losses(folder / "metrics.jsonl");
    ASSERT_EQ(got.size(), 3u) << r.name;
    for (std::size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i + 3], 1e-5 * std::abs(want[i + 3])) << r.name << " step " << i + 4;
  }
  // Saved without stages (fsdp 2), resumed with them (from step 3: the same 6-step schedule).
  ASSERT_EQ(spmdx_run(common + " --nproc 2 --parallelism.data_parallel_shard_degree 2" + save_flags + " --job.dump_folder '" + (dir / "flat").string() + "'").exit_code, 0);
  fs::remove_all(dir / "flat" / "checkpoint" / "step-6");
  auto resume = spmdx_run(common + pp2 + " --checkpoint.enable true --job.dump_folder '" + (dir / "flat").string() + "'");
  ASSERT_EQ(resume.exit_code, 0) << resume.output;
  const auto got = losses(dir / "flat" / "metrics.jsonl");
  ASSERT_EQ(got.size(), 6u);
  for (std::size_t i = 3; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-5 * std::abs(want[i])) << "step " << i + 1;
}

TEST(Checkpoint, ResumesOnAnotherMeshAndStrategyWithTheSameLosses) {
  test::TempDir dir;
  const std::string data = corpus_file(dir);
  const std::string common = "'" SPMDX_SOURCE_DIR "/configs/llama_fsdp.toml' --data.paths '" + data +
                             "' --training.steps 10 --training.global_batch_size 8 --training.seq_len 32";
  ASSERT_EQ(spmdx_run(common + " --nproc 1 --job.dump_folder '" + (dir / "full").string() + "'").exit_code, 0);
  auto save = spmdx_run(common + " --nproc 4 --parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 2"
                                 " --checkpoint.enable true --checkpoint.interval 5 --job.dump_folder '" + (dir / "a").string() + "'");
  ASSERT_EQ(save.exit_code, 0) << save.output;
  EXPECT_THAT(save.output, HasSubstr("saved checkpoint"));
  EXPECT_TRUE(fs::exists(dir / "a" / "checkpoint" / "step-5" / "metadata.json"));
  EXPECT_FALSE(fs::exists(dir / "a" / "checkpoint" / ".step-5.partial"));
  fs::remove_all(dir / "a" / "checkpoint" / "step-10");
  auto resume = spmdx_run(common + " --nproc 2 --parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 1"
                                   " --checkpoint.enable true --job.dump_folder '" + (dir / "a").string() + "'");
  ASSERT_EQ(resume.exit_code, 0) << resume.output;
  EXPECT_THAT(resume.output, HasSubstr("resumed from"));
  const auto want = losses(dir / "full" / "metrics.jsonl");
  const auto got = losses(dir / "a" / "metrics.jsonl");  // steps 1-5 of the first run, 6-10 of the resumed one
  ASSERT_EQ(got.size(), 10u);
  for (std::size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 3e-7 * std::abs(want[i])) << "step " << i + 1;

  // Consolidated weights as safetensors, read back by an independent reader (Python).
  auto exported = test::run_command("'" SPMDX_EXE "' export '" + (dir / "a" / "checkpoint" / "step-10").string() + "' '" +
                                    (dir / "model.safetensors").string() + "'");
  ASSERT_EQ(exported.exit_code, 0) << exported.output;
  auto read = test::run_command(
      "python3 -c \"import json,struct,sys; b=open('" + (dir / "model.safetensors").string() +
      "','rb').read(); n=struct.unpack('<Q',b[:8])[0]; h=json.loads(b[8:8+n]); "
      "w=h['layers.0.attention.wq.weight']; print(w['dtype'], w['shape'], w['data_offsets'][1]-w['data_offsets'][0], "
      "len([k for k in h if k!='__metadata__']), 8+n+max(v['data_offsets'][1] for k,v in h.items() if k!='__metadata__')==len(b))\"");
  EXPECT_EQ(read.output, "F32 [64, 64] 16384 23 True\n") << read.output;  // 21 parameters + the 2 rope tables

  // A corrupted shard is named, not loaded.
  const fs::path shard = dir / "a" / "checkpoint" / "step-10" / "rank1.bin";
  ASSERT_TRUE(fs::exists(shard));
  {
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-8, std::ios::end);
    f.write("garbage!", 8);
  }
  auto bad = spmdx_run(common + " --nproc 2 --parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 1"
                                " --checkpoint.enable true --training.steps 12 --job.dump_folder '" + (dir / "a").string() + "'");
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_THAT(bad.output, HasSubstr("rank1.bin: corrupted: tensor"));
  // A truncated one too.
  fs::resize_file(shard, fs::file_size(shard) / 2);
  bad = spmdx_run(common + " --nproc 2 --parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 1"
                           " --checkpoint.enable true --training.steps 12 --job.dump_folder '" + (dir / "a").string() + "'");
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_THAT(bad.output, HasSubstr("rank1.bin: is "));
  EXPECT_THAT(bad.output, HasSubstr("bytes, metadata.json says"));
}

// A checkpoint keeps what its ids mean: resuming with another tokenizer of the same size is
// refused; and export never writes into the checkpoint it reads.
TEST(Checkpoint, ResumeRefusesAnotherTokenizerAndExportNeverWritesIntoTheCheckpoint) {
  test::TempDir dir;
  auto tokenizer = [&](const std::string& name, bool swapped) {
    nlohmann::json vocab = nlohmann::json::object();
    for (char c = 'a'; c <= 'z'; ++c) vocab[std::string(1, c)] = c - 'a';
    vocab[" "] = 26;
    vocab["."] = 27;
    if (swapped) std::swap(vocab["a"], vocab["e"]);  // the same ids, meaning other letters
    test::write_file(dir / name, nlohmann::json{{"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", nlohmann::json::array()}}}}.dump());
    return (dir / name).string();
  };
  std::string text;
  for (int i = 0; i < 200; ++i) text += "the ranks of a job agree on every number they compute. ";
  test::write_file(dir / "corpus.txt", text);
  const std::string common = "'" SPMDX_SOURCE_DIR "/configs/llama_fsdp.toml' --nproc 1 --data.paths '" + (dir / "corpus.txt").string() +
                             "' --training.global_batch_size 4 --training.seq_len 32 --checkpoint.enable true --checkpoint.interval 2 --job.dump_folder '" +
                             (dir / "job").string() + "'";
  auto first = spmdx_run(common + " --training.steps 2 --model.tokenizer '" + tokenizer("a.json", false) + "'");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  auto other = spmdx_run(common + " --training.steps 4 --model.tokenizer '" + tokenizer("b.json", true) + "'");
  EXPECT_EQ(other.exit_code, 1) << other.output;
  EXPECT_THAT(other.output, HasSubstr("was saved with another tokenizer (tokenizer.json "));
  EXPECT_THAT(other.output, HasSubstr("resume with the tokenizer it was trained with"));
  auto same = spmdx_run(common + " --training.steps 4 --model.tokenizer '" + tokenizer("c.json", false) + "'");  // the same file elsewhere
  EXPECT_EQ(same.exit_code, 0) << same.output;
  EXPECT_THAT(same.output, HasSubstr("resumed from"));

  const fs::path step = dir / "job" / "checkpoint" / "step-4";
  const auto before = fs::file_size(step / "metadata.json");
  for (const fs::path& bad : {step / "metadata.json", step / "rank0.bin", step / "new.safetensors"}) {
    auto e = test::run_command("'" SPMDX_EXE "' export '" + step.string() + "' '" + bad.string() + "'");
    EXPECT_EQ(e.exit_code, 1) << e.output;
    EXPECT_THAT(e.output, HasSubstr("is inside the checkpoint")) << e.output;
  }
  EXPECT_EQ(fs::file_size(step / "metadata.json"), before);
  fs::create_directories(dir / "folder");
  auto d = test::run_command("'" SPMDX_EXE "' export '" + step.string() + "' '" + (dir / "folder").string() + "'");
  EXPECT_EQ(d.exit_code, 1) << d.output;
  EXPECT_THAT(d.output, HasSubstr("is a folder: name the .safetensors file to write"));
  for (const auto& e : fs::directory_iterator(dir.path())) EXPECT_EQ(e.path().filename().string().find(".partial"), std::string::npos) << e.path();
  // Never renamed over what is not a regular file (a link, a FIFO; as root, /dev/null).
  test::write_file(dir / "real", "keep");
  fs::create_symlink(dir / "real", dir / "link");
  ASSERT_EQ(::mkfifo((dir / "fifo").c_str(), 0600), 0);
  for (const char* name : {"link", "fifo"}) {
    auto e = test::run_command("'" SPMDX_EXE "' export '" + step.string() + "' '" + (dir / name).string() + "'");
    EXPECT_EQ(e.exit_code, 1) << e.output;
    EXPECT_THAT(e.output, HasSubstr("exists and is not a regular file")) << e.output;
  }
  EXPECT_TRUE(fs::is_symlink(dir / "link"));
  EXPECT_TRUE(fs::is_fifo(dir / "fifo"));
  auto missing = test::run_command("'" SPMDX_EXE "' export '" + step.string() + "' '" + (dir / "no" / "x.safetensors").string() + "'");
  EXPECT_THAT(missing.output, HasSubstr("the folder " + (dir / "no").string() + " does not exist"));
  auto ok = test::run_command("'" SPMDX_EXE "' export '" + step.string() + "' '" + (dir / "real").string() + "'");  // a regular file is replaced
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_GT(fs::file_size(dir / "real"), 4u);
}

// Resuming in the job's own folder, as after a preemption: every file the run appends to keeps
// the steps up to the checkpoint once and leaves out those past it, the file as it was kept
// whole under the next free name; a finished job changes nothing.
TEST(Checkpoint, ResumingInTheSameFolderKeepsTheHistoryOfEveryFile) {
  test::TempDir dir;
  const fs::path out = dir / "job";
  const std::string common = "'" SPMDX_SOURCE_DIR "/configs/llama_fsdp.toml' --nproc 2 --data.paths '" + corpus_file(dir) +
                             "' --training.global_batch_size 4 --training.seq_len 32 --checkpoint.enable true --checkpoint.interval 3"
                             " --hooks.enable timeline,flight_recorder,consistency --hooks.timeline.steps 20 --hooks.consistency.every 1"
                             " --job.dump_folder '" + out.string() + "'";
  auto steps = [](const fs::path& metrics) {
    std::vector<std::int64_t> s;
    std::ifstream in(metrics);
    std::string line;
    while (std::getline(in, line)) s.push_back(nlohmann::json::parse(line).at("step").get<std::int64_t>());
    return s;
  };
  auto first = spmdx_run(common + " --training.steps 8");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const auto uninterrupted = losses(out / "metrics.jsonl");
  // A crash after step 8 that left no step-8 checkpoint: the job resumes from step 6.
  fs::remove_all(out / "checkpoint" / "step-8");
  auto resumed = spmdx_run(common + " --training.steps 8");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_THAT(resumed.output, HasSubstr("done: 2 steps (7-8, resumed)"));
  EXPECT_EQ(steps(out / "metrics.jsonl"), (std::vector<std::int64_t>{1, 2, 3, 4, 5, 6, 7, 8}));
  EXPECT_EQ(steps(out / "metrics.1.jsonl"), (std::vector<std::int64_t>{1, 2, 3, 4, 5, 6, 7, 8}));  // the first run's, whole
  const auto after = losses(out / "metrics.jsonl");
  for (std::size_t i = 0; i < after.size(); ++i) EXPECT_NEAR(after[i], uninterrupted[i], 1e-6) << "step " << i + 1;
  // The hooks' files: steps 1-6 of the first run and 7-8 of the second, once each.
  const auto summary = nlohmann::json::parse(std::ifstream(out / "hooks" / "timeline" / "summary.json"));
  std::map<int, std::vector<std::int64_t>> timeline_steps;
  for (const auto& row : summary) timeline_steps[row.at("rank").get<int>()].push_back(row.at("step").get<std::int64_t>());
  for (int r : {0, 1}) EXPECT_EQ(timeline_steps[r], (std::vector<std::int64_t>{1, 2, 3, 4, 5, 6, 7, 8})) << "rank " << r;
  std::vector<std::int64_t> checked;
  const auto report = nlohmann::json::parse(std::ifstream(out / "hooks" / "consistency" / "report.json"));
  for (const auto& c : report.at("checks")) {
    checked.push_back(c.at("step").get<std::int64_t>());
  }
  EXPECT_EQ(checked, (std::vector<std::int64_t>{1, 2, 3, 4, 5, 6, 7, 8}));
  // The first run's files, which held steps 7 and 8 too, are kept whole under the next free
  // name, each said; the first run's flight recorder dumps too, and the new ones merge alone.
  const fs::path hooks = out / "hooks";
  for (int r : {0, 1}) {
    const fs::path own = hooks / "timeline" / ("rank" + std::to_string(r) + ".json"), aside = hooks / "timeline" / ("rank" + std::to_string(r) + ".1.json");
    EXPECT_THAT(resumed.output, HasSubstr("timeline: " + own.string() + " holds steps this run trains again (from step 7 on): it is kept whole as " +
                                          aside.string() + ", and the trace goes on from its steps before 7"));
    std::vector<std::int64_t> kept;
    const nlohmann::json aside_trace = nlohmann::json::parse(std::ifstream(aside));  // held: a range-for over a temporary's member dangles
    for (const auto& row : aside_trace.at("otherData").at("summary")) kept.push_back(row.at("step").get<std::int64_t>());
    EXPECT_EQ(kept, (std::vector<std::int64_t>{1, 2, 3, 4, 5, 6, 7, 8})) << r;
    const fs::path dump = hooks / "flight_recorder" / ("rank" + std::to_string(r) + ".json"), dump_aside = hooks / "flight_recorder" / ("rank" + std::to_string(r) + ".1.json");
    EXPECT_THAT(resumed.output, HasSubstr("flight_recorder: " + dump.string() + " holds the dump of an earlier run: it is kept whole as " + dump_aside.string()));
    EXPECT_NE(nlohmann::json::parse(std::ifstream(dump)).at("run"), nlohmann::json::parse(std::ifstream(dump_aside)).at("run")) << r;
  }
  EXPECT_EQ(nlohmann::json::parse(std::ifstream(hooks / "timeline" / "summary.1.json")).size(), 16u);  // 2 ranks x steps 1-8
  EXPECT_THAT(resumed.output, HasSubstr("timeline: the merged trace of an earlier run is kept whole: " + (hooks / "timeline" / "merged.json").string() +
                                        " as merged.1.json, " + (hooks / "timeline" / "summary.json").string() + " as summary.1.json"));
  EXPECT_THAT(resumed.output, HasSubstr("consistency: " + (hooks / "consistency" / "report.json").string() +
                                        " holds checks of steps this run trains again (from step 7 on): it is kept whole as " +
                                        (hooks / "consistency" / "report.1.json").string() + ", and the report goes on from its checks before step 7"));
  EXPECT_EQ(nlohmann::json::parse(std::ifstream(hooks / "consistency" / "report.1.json")).at("checks").size(), 8u);
  auto trace = test::run_command("'" SPMDX_EXE "' fr-trace '" + (out / "hooks" / "flight_recorder").string() + "'");
  EXPECT_THAT(trace.output, HasSubstr("no mismatch"));

  // Finished: said so, nothing written (not even the hooks' files), exit 0.
  const auto before = fs::last_write_time(out / "metrics.jsonl");
  const auto timeline_before = fs::last_write_time(out / "hooks" / "timeline" / "rank0.json");
  for (const char* n : {"8", "4"}) {
    auto again = spmdx_run(common + " --training.steps " + n);
    EXPECT_EQ(again.exit_code, 0) << again.output;
    EXPECT_THAT(again.output, HasSubstr("nothing to do: the job is finished (checkpoint"));
    EXPECT_THAT(again.output, HasSubstr("is at step 8, training.steps is " + std::string(n) + "); nothing was changed"));
    EXPECT_THAT(again.output, Not(HasSubstr("done:")));
  }
  EXPECT_EQ(fs::last_write_time(out / "metrics.jsonl"), before);
  EXPECT_EQ(fs::last_write_time(out / "hooks" / "timeline" / "rank0.json"), timeline_before);
  EXPECT_EQ(steps(out / "metrics.jsonl").size(), 8u);
}

// A tiny job of one rank in `out` (issue 43, "Nothing lost on resume"): seconds a run.
std::string tiny_job(const test::TempDir& dir, const fs::path& out) {
  return "'" SPMDX_SOURCE_DIR "/configs/llama_fsdp.toml' --nproc 1 --data.paths '" + corpus_file(dir) +
         "' --training.global_batch_size 4 --training.seq_len 32 --job.dump_folder '" + out.string() + "'";
}

std::vector<std::int64_t> metric_steps(const fs::path& metrics) {
  std::vector<std::int64_t> s;
  for (const auto& row : rows(metrics)) s.push_back(row.at("step").get<std::int64_t>());
  return s;
}

// A rerun beside checkpoints without checkpoint.enable is refused before any rank starts, saying
// how to resume or start anew; a rerun beside metrics alone, and a resume that leaves rows out
// (past its checkpoint, torn), keep the earlier file whole as metrics.<N>.jsonl. No row is lost.
TEST(Checkpoint, ARerunNeverLosesARowOfMetrics) {
  test::TempDir dir;
  const fs::path out = dir / "job";
  const std::string job = tiny_job(dir, out);
  auto first = spmdx_run(job + " --training.steps 4 --checkpoint.enable true --checkpoint.interval 2");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const std::string history = test::read_file(out / "metrics.jsonl");
  auto rerun = spmdx_run(job + " --training.steps 3");
  EXPECT_EQ(rerun.exit_code, 1) << rerun.output;
  EXPECT_THAT(rerun.output, HasSubstr("job.dump_folder '" + out.string() + "' holds the checkpoints of an earlier run (the newest: " +
                                      (out / "checkpoint" / "step-4").string() + ") and checkpoint.enable is false, so this run would start again at step 1"));
  EXPECT_THAT(rerun.output, HasSubstr("To resume that run, add --checkpoint.enable true; to start a new one, choose another --job.dump_folder (or move the old run away)"));
  EXPECT_THAT(rerun.output, Not(HasSubstr("[rank 0]")));  // no rank started
  EXPECT_EQ(test::read_file(out / "metrics.jsonl"), history);

  // A resume that would leave out rows past its checkpoint and a torn line keeps the file whole aside.
  fs::remove_all(out / "checkpoint" / "step-4");
  { std::ofstream(out / "metrics.jsonl", std::ios::app) << "{\"step\": 5, \"lo"; }  // a crash mid-row
  auto resumed = spmdx_run(job + " --training.steps 4 --checkpoint.enable true --checkpoint.interval 2");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_THAT(resumed.output, HasSubstr((out / "metrics.jsonl").string() + ": resuming at step 3, it keeps the rows of steps 1-2 and leaves out 2 rows of steps "
                                        "past the checkpoint's (a run that went on after it: step 3 on is trained again) and 1 line that is not a step's "
                                        "metrics (not JSON, or no step >= 1: torn by a crash, or edited); the file as it was is kept whole as " +
                                        (out / "metrics.1.jsonl").string()));
  EXPECT_EQ(test::read_file(out / "metrics.1.jsonl"), history + "{\"step\": 5, \"lo");
  EXPECT_EQ(metric_steps(out / "metrics.jsonl"), (std::vector<std::int64_t>{1, 2, 3, 4}));
  // A resume with nothing to leave out appends, and keeps nothing aside.
  auto longer = spmdx_run(job + " --training.steps 5 --checkpoint.enable true --checkpoint.interval 2");
  ASSERT_EQ(longer.exit_code, 0) << longer.output;
  EXPECT_THAT(longer.output, Not(HasSubstr("kept whole")));
  EXPECT_EQ(metric_steps(out / "metrics.jsonl"), (std::vector<std::int64_t>{1, 2, 3, 4, 5}));
  EXPECT_FALSE(fs::exists(out / "metrics.2.jsonl"));

  // Beside metrics alone (no checkpoint): the earlier run's are kept under the next free name.
  const fs::path plain = dir / "plain";
  ASSERT_EQ(spmdx_run(tiny_job(dir, plain) + " --training.steps 2").exit_code, 0);
  const std::string two = test::read_file(plain / "metrics.jsonl");
  test::write_file(plain / "metrics.1.jsonl", "someone else's\n");  // never written over
  auto again = spmdx_run(tiny_job(dir, plain) + " --training.steps 3");
  ASSERT_EQ(again.exit_code, 0) << again.output;
  EXPECT_THAT(again.output, HasSubstr("starting from step 1 in " + plain.string() + ", which holds the metrics of an earlier run: they are kept whole as " +
                                      (plain / "metrics.2.jsonl").string() + ", and metrics.jsonl holds this run's"));
  EXPECT_EQ(test::read_file(plain / "metrics.1.jsonl"), "someone else's\n");
  EXPECT_EQ(test::read_file(plain / "metrics.2.jsonl"), two);
  EXPECT_EQ(metric_steps(plain / "metrics.jsonl"), (std::vector<std::int64_t>{1, 2, 3}));
}

// Only complete checkpoints under the names spmdx writes are resumed from: a newer broken one is
// skipped and named; with none complete, a resume is refused naming each; step-7junk, "step- 9"
// and step-02 are not checkpoints, and checkpoint.load_step 2 looks up step-2 alone.
TEST(Checkpoint, OnlyCompleteCheckpointsUnderSpmdxsNamesAreResumedFrom) {
  test::TempDir dir;
  const fs::path out = dir / "job", ckpt = out / "checkpoint";
  const std::string job = tiny_job(dir, out) + " --checkpoint.enable true --checkpoint.interval 2";
  ASSERT_EQ(spmdx_run(job + " --training.steps 4").exit_code, 0);
  for (const char* name : {"step-7junk", "step- 9", "step-02"}) fs::copy(ckpt / "step-4", ckpt / name, fs::copy_options::recursive);
  fs::remove(ckpt / "step-4" / "metadata.json");
  auto resumed = spmdx_run(job + " --training.steps 4");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_THAT(resumed.output, HasSubstr("checkpoint " + (ckpt / "step-4").string() + " has no metadata.json: damaged after it was saved?: skipped; resuming from " +
                                        (ckpt / "step-2").string() + ", the newest complete one"));
  EXPECT_THAT(resumed.output, HasSubstr("resumed from " + (ckpt / "step-2").string()));
  for (const char* name : {"step-7junk", "step- 9", "step-02"}) {
    EXPECT_THAT(resumed.output, HasSubstr((ckpt / name).string() + " is not a checkpoint: spmdx writes step-<N> (N without sign, leading zero or suffix) and reads only those; ignored"));
  }
  // checkpoint.load_step 2 is step-2, never step-02.
  fs::rename(ckpt / "step-2", dir / "step-2");
  auto load2 = spmdx_run(job + " --training.steps 6 --checkpoint.load_step 2");
  EXPECT_EQ(load2.exit_code, 1) << load2.output;
  EXPECT_THAT(load2.output, HasSubstr("checkpoint.load_step 2: no complete checkpoint " + (ckpt / "step-2").string() + " (no such folder); the complete ones there: steps 4"));

  // None complete: refused, naming each and what to do; nothing written.
  for (const auto& [name, damage, says] : std::vector<std::tuple<std::string, std::function<void(const fs::path&)>, std::string>>{
           {"missing", [](const fs::path& m) { fs::remove(m); }, "has no metadata.json: damaged after it was saved?"},
           {"dangling", [](const fs::path& m) { fs::remove(m), fs::create_symlink("/nowhere/metadata.json", m); },
            "has a metadata.json that is a link to /nowhere/metadata.json, which does not exist"},
           {"device", [](const fs::path& m) { fs::remove(m), fs::create_symlink("/dev/null", m); },
            "has a metadata.json that cannot be read: not a regular file (a folder, FIFO or device)"}}) {
    SCOPED_TRACE(name);
    const fs::path broken = dir / name;
    fs::create_directories(broken / "checkpoint");
    fs::copy(dir / "step-2", broken / "checkpoint" / "step-2", fs::copy_options::recursive);  // the first run's
    fs::copy_file(out / "metrics.jsonl", broken / "metrics.jsonl");
    damage(broken / "checkpoint" / "step-2" / "metadata.json");
    const std::string history = test::read_file(broken / "metrics.jsonl");
    auto refused = spmdx_run(tiny_job(dir, broken) + " --checkpoint.enable true --checkpoint.interval 2 --training.steps 4");
    EXPECT_EQ(refused.exit_code, 1) << refused.output;
    EXPECT_THAT(refused.output, HasSubstr("no checkpoint in " + (broken / "checkpoint").string() + " is complete, so there is nothing to resume: " +
                                          (broken / "checkpoint" / "step-2").string() + " (" + says + "). To start over at step 1, move it away; "
                                          "to resume from a good checkpoint, put it in " + (broken / "checkpoint").string() + " as step-<N> and set checkpoint.load_step <N>"));
    EXPECT_THAT(refused.output, Not(HasSubstr("[rank 0]")));
    EXPECT_EQ(test::read_file(broken / "metrics.jsonl"), history);
  }
}

// checkpoint.keep_latest_k (torchtitan's): after each save the oldest complete checkpoints beyond
// k go, the one resumed from only once a newer one is complete, and never a folder spmdx did not
// write (one whose metadata is not spmdx's, a name it does not write).
TEST(Checkpoint, KeepLatestKDeletesTheOldestAfterANewerOneIsComplete) {
  test::TempDir dir;
  const fs::path out = dir / "job", ckpt = out / "checkpoint";
  const std::string job = tiny_job(dir, out) + " --checkpoint.enable true --checkpoint.interval 2";
  auto first = spmdx_run(job + " --training.steps 4 --checkpoint.keep_latest_k 2");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  EXPECT_THAT(first.output, Not(HasSubstr("deleted checkpoint")));
  fs::create_directories(ckpt / "step-1");
  test::write_file(ckpt / "step-1" / "metadata.json", "{\"someone\": \"else\"}");
  fs::copy(ckpt / "step-2", ckpt / "step-02", fs::copy_options::recursive);
  auto resumed = spmdx_run(job + " --training.steps 8 --checkpoint.keep_latest_k 1");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_THAT(resumed.output, HasSubstr("resumed from " + (ckpt / "step-4").string()));
  const std::string& o = resumed.output;
  const auto saved6 = o.find("saved checkpoint " + (ckpt / "step-6").string()), gone4 = o.find("deleted checkpoint " + (ckpt / "step-4").string() + " (checkpoint.keep_latest_k = 1)");
  ASSERT_NE(saved6, std::string::npos) << o;
  ASSERT_NE(gone4, std::string::npos) << o;
  EXPECT_LT(saved6, gone4);  // the checkpoint resumed from goes only once a newer one is complete
  EXPECT_THAT(o, HasSubstr("deleted checkpoint " + (ckpt / "step-2").string()));
  EXPECT_THAT(o, HasSubstr("deleted checkpoint " + (ckpt / "step-6").string()));
  std::set<std::string> left;
  for (const auto& e : fs::directory_iterator(ckpt)) left.insert(e.path().filename().string());
  EXPECT_EQ(left, (std::set<std::string>{"step-02", "step-1", "step-8"}));
  EXPECT_EQ(test::read_file(ckpt / "step-1" / "metadata.json"), "{\"someone\": \"else\"}");
  // 0 (the default) keeps all.
  auto all = spmdx_run(tiny_job(dir, dir / "all") + " --checkpoint.enable true --checkpoint.interval 2 --training.steps 6");
  ASSERT_EQ(all.exit_code, 0) << all.output;
  for (const char* s : {"step-2", "step-4", "step-6"}) EXPECT_TRUE(fs::exists(dir / "all" / "checkpoint" / s / "metadata.json")) << s;
}

// A resume under another learning-rate schedule than its checkpoint's (recorded in metadata.json)
// is warned of, value by value, with the lr it gives and the flags that keep the old one.
TEST(Checkpoint, AResumeUnderAnotherLrScheduleIsSaid) {
  test::TempDir dir;
  const fs::path out = dir / "job";
  const std::string job = tiny_job(dir, out) + " --checkpoint.enable true --checkpoint.interval 2";
  ASSERT_EQ(spmdx_run(job + " --training.steps 4").exit_code, 0);
  const auto md = nlohmann::json::parse(test::read_file(out / "checkpoint" / "step-2" / "metadata.json"));
  EXPECT_EQ(md.at("lr_schedule"), (nlohmann::json{{"steps", 4}, {"warmup_steps", 2}, {"decay_ratio", -1.0}, {"decay_type", "linear"}, {"min_lr_factor", 0.0}}));
  fs::remove_all(out / "checkpoint" / "step-4");
  auto same = spmdx_run(job + " --training.steps 4");
  ASSERT_EQ(same.exit_code, 0) << same.output;
  EXPECT_THAT(same.output, Not(HasSubstr("learning-rate schedule")));
  fs::remove_all(out / "checkpoint" / "step-4");
  auto longer = spmdx_run(job + " --training.steps 8 --lr_scheduler.warmup_steps 3");
  ASSERT_EQ(longer.exit_code, 0) << longer.output;
  char lr3[32];
  std::snprintf(lr3, sizeof lr3, "%.3e", rows(out / "metrics.jsonl").at(2).at("lr").get<double>());
  EXPECT_THAT(longer.output, HasSubstr((out / "checkpoint" / "step-2").string() + ": the checkpoint was saved under another learning-rate schedule: "
                                       "the span (lr_scheduler.total_steps, else training.steps) 4 -> 8, lr_scheduler.warmup_steps 2 -> 3. The resumed steps "
                                       "follow this run's schedule, not the one the first steps followed (step 3's lr is " + std::string(lr3) +
                                       ", where the checkpoint's schedule gives "));
  EXPECT_THAT(longer.output, HasSubstr("To keep the checkpoint's, set --lr_scheduler.total_steps 4 --lr_scheduler.warmup_steps 2"));
}

// A diverged state is never saved: the save fails naming the tensor, the earlier checkpoints stay.
TEST(Checkpoint, ANonFiniteStateIsNeverSaved) {
  test::TempDir dir;
  const fs::path out = dir / "job", ckpt = out / "checkpoint";
  auto r = test::run_command("SPMDX_FAULT=perturb:rank=0,step=4,tensor=norm.weight,delta=nan '" SPMDX_EXE "' run " + tiny_job(dir, out) +
                             " --checkpoint.enable true --checkpoint.interval 2 --training.steps 4");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("not saving checkpoint " + (ckpt / "step-4").string() + ": rank 0's tensor 'norm.weight' holds 64 NaN or infinite values (of 64): "
                                  "training diverged at or before step 4"));
  EXPECT_THAT(r.output, HasSubstr("The earlier checkpoints in " + ckpt.string() + " are kept"));
  EXPECT_TRUE(fs::exists(ckpt / "step-2" / "metadata.json"));
  EXPECT_FALSE(fs::exists(ckpt / "step-4"));
  EXPECT_FALSE(fs::exists(ckpt / ".step-4.partial"));
}

// checkpoint.load_step N beside newer complete checkpoints, with checkpoint.enable: this run's
// saves would take their place, so it is refused before any step, naming them, and nothing is
// changed; moved away as the message says, the run trains on from step N. Each metrics row says
// when its step ended (`time`, seconds since the epoch), in step order.
TEST(Checkpoint, ALoadStepBeforeNewerCheckpointsIsRefusedNamingThem) {
  test::TempDir dir;
  const fs::path out = dir / "job", ckpt = out / "checkpoint";
  const std::string job = tiny_job(dir, out) + " --training.steps 6 --checkpoint.enable true --checkpoint.interval 2";
  const double before = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  auto first = spmdx_run(job);
  const double after = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  ASSERT_EQ(first.exit_code, 0) << first.output;
  double last = before;
  for (const auto& row : rows(out / "metrics.jsonl")) {
    ASSERT_TRUE(row.contains("time") && row.at("time").is_number_float()) << row.dump();
    const double t = row.at("time").get<double>();
    EXPECT_GE(t, last) << row.dump();
    EXPECT_LE(t, after) << row.dump();
    last = t;
  }
  const std::string history = test::read_file(out / "metrics.jsonl"), newest = test::read_file(ckpt / "step-6" / "metadata.json");
  auto refused = spmdx_run(job + " --checkpoint.load_step 2");
  EXPECT_EQ(refused.exit_code, 1) << refused.output;
  EXPECT_THAT(refused.output, HasSubstr("checkpoint.load_step 2: " + ckpt.string() + " also holds newer complete checkpoints, of steps 4 and 6 (" +
                                        (ckpt / "step-4").string() + ", " + (ckpt / "step-6").string() +
                                        "), and this run, training on from step 2 with checkpoint.enable, would save its own in their place. To train on "
                                        "from step 2, move them away first (out of " + ckpt.string() + "); to resume from the newest, step 6, set "
                                        "checkpoint.load_step -1"));
  EXPECT_THAT(refused.output, Not(HasSubstr("step    3 |")));
  EXPECT_EQ(test::read_file(out / "metrics.jsonl"), history);
  EXPECT_EQ(test::read_file(ckpt / "step-6" / "metadata.json"), newest);
  // Moved away: it trains on from step 2 and saves steps 4 and 6 anew.
  fs::create_directories(dir / "later");
  for (const char* s : {"step-4", "step-6"}) fs::rename(ckpt / s, dir / "later" / s);
  auto on = spmdx_run(job + " --checkpoint.load_step 2");
  ASSERT_EQ(on.exit_code, 0) << on.output;
  EXPECT_THAT(on.output, HasSubstr("done: 4 steps (3-6, resumed)"));
  EXPECT_EQ(metric_steps(out / "metrics.jsonl"), (std::vector<std::int64_t>{1, 2, 3, 4, 5, 6}));
  EXPECT_TRUE(fs::exists(ckpt / "step-6" / "metadata.json"));
}

// Hot-swap: every step the ranks leave one backend and join the other (UCX over shared memory,
// UCX over TCP); the losses are those of a run without swaps, and 100 swaps leak nothing.
TEST(HotSwap, SwappingBackendsEveryStepChangesNoResultAndLeaksNothing) {
  test::TempDir dir;
  const std::string data = corpus_file(dir);
  const std::string common = "'" SPMDX_SOURCE_DIR "/configs/llama_fsdp.toml' --nproc 4 --data.paths '" + data +
                             "' --training.global_batch_size 8 --training.seq_len 16 --training.steps 10";
  ASSERT_EQ(spmdx_run(common + " --job.dump_folder '" + (dir / "plain").string() + "'").exit_code, 0);
  auto swapped = spmdx_run(common + " --comm.swap_at_step 1 --comm.swap_to 'ucx:tls=tcp,self' --job.dump_folder '" + (dir / "swap").string() + "'");
  ASSERT_EQ(swapped.exit_code, 0) << swapped.output;
  EXPECT_THAT(swapped.output, HasSubstr("swapped the comm backend to ucx (UCX_TLS=tcp,self, "));
  EXPECT_THAT(swapped.output, HasSubstr("swapped the comm backend to auto -> ucx (UCX_TLS=shm,self, "));
  EXPECT_EQ(losses(dir / "swap" / "metrics.jsonl"), losses(dir / "plain" / "metrics.jsonl"));

  auto many = spmdx_run("'" SPMDX_SOURCE_DIR "/configs/llama_fsdp.toml' --nproc 2 --data.paths '" + data +
                        "' --training.global_batch_size 4 --training.seq_len 16 --training.steps 111 --metrics.log_freq 1000"
                        " --comm.swap_at_step 1 --comm.swap_to 'ucx:tls=tcp,self' --job.dump_folder '" + (dir / "many").string() + "'");
  ASSERT_EQ(many.exit_code, 0) << many.output;
  std::ifstream in(dir / "many" / "metrics.jsonl");
  std::string line;
  std::map<std::int64_t, std::int64_t> rss;
  while (std::getline(in, line)) {
    const auto row = nlohmann::json::parse(line);
    rss[row.at("step").get<std::int64_t>()] = row.at("rss_bytes").get<std::int64_t>();
  }
  ASSERT_EQ(rss.size(), 111u);
  const double growth_mib = static_cast<double>(rss.at(110) - rss.at(10)) / (1 << 20);
  std::printf("RSS after 10 swaps %.1f MiB, after 110 swaps %.1f MiB\n", static_cast<double>(rss.at(10)) / (1 << 20),
              static_cast<double>(rss.at(110)) / (1 << 20));
#if defined(__SANITIZE_ADDRESS__)
  std::printf("RSS check skipped (grew %.1f MiB): AddressSanitizer keeps freed memory in quarantine\n", growth_mib);
#else
  EXPECT_LT(growth_mib, 8.0) << "100 swaps grew RSS by " << growth_mib << " MiB";
#endif
}

// A swap is recorded on the step it follows: that step's metrics.jsonl row says from what, to
// what and what runs now, and the line saying it comes after that step's line, before the next.
TEST(HotSwap, ASwapIsRecordedOnTheStepItFollows) {
  test::TempDir dir;
  auto r = spmdx_run("'" SPMDX_SOURCE_DIR "/configs/mlp_dp.toml' --nproc 2 --data.paths '" + corpus_file(dir) +
                     "' --training.steps 3 --metrics.log_freq 1 --comm.swap_at_step 1 --comm.swap_to 'ucx:tls=tcp,self' --job.dump_folder '" +
                     (dir / "out").string() + "'");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto got = rows(dir / "out" / "metrics.jsonl");
  ASSERT_EQ(got.size(), 3u);
  ASSERT_TRUE(got[0].contains("comm_swap")) << got[0].dump();
  EXPECT_EQ(got[0].at("comm_swap").at("from"), "auto");
  EXPECT_EQ(got[0].at("comm_swap").at("to"), "ucx:tls=tcp,self");
  EXPECT_EQ(got[0].at("comm_swap").at("generation"), 1);
  EXPECT_THAT(got[0].at("comm_swap").at("backend").get<std::string>(), ::testing::StartsWith("ucx (UCX_TLS=tcp,self, "));
  ASSERT_TRUE(got[1].contains("comm_swap")) << got[1].dump();
  EXPECT_EQ(got[1].at("comm_swap").at("from"), "ucx:tls=tcp,self");
  EXPECT_EQ(got[1].at("comm_swap").at("to"), "auto");
  EXPECT_EQ(got[1].at("comm_swap").at("generation"), 2);
  EXPECT_THAT(got[1].at("comm_swap").at("backend").get<std::string>(), ::testing::StartsWith("auto -> ucx (UCX_TLS=shm,self, "));
  EXPECT_FALSE(got[2].contains("comm_swap")) << "the last step swaps nothing: " << got[2].dump();
  // The lines in the order the steps ran: step 1, its swap, step 2, its swap, step 3.
  std::vector<std::size_t> at;
  for (const char* line : {"step    1 |", "after step 1: swapped the comm backend to ucx (UCX_TLS=tcp,self, ", "step    2 |",
                           "after step 2: swapped the comm backend to auto -> ucx (UCX_TLS=shm,self, ", "step    3 |"}) {
    at.push_back(r.output.find(line));
    ASSERT_NE(at.back(), std::string::npos) << "no '" << line << "' in:\n" << r.output;
  }
  EXPECT_TRUE(std::is_sorted(at.begin(), at.end())) << r.output;
  EXPECT_THAT(r.output, Not(HasSubstr("after step 3:")));
}

TEST(BenchComm, EveryOpSweepsSizesAndChecksEveryResult) {
  for (const char* op : {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"}) {
    auto r = test::run_command("'" SPMDX_EXE "' bench comm --nproc 3 --op " + std::string(op) +
                               " --min-bytes 8 --max-bytes 256K --iters 2 --warmup 1");
    EXPECT_EQ(r.exit_code, 0) << op << "\n" << r.output;
    EXPECT_THAT(r.output, HasSubstr("# spmdx bench comm: " + std::string(op) + ", 3 ranks"));
    EXPECT_THAT(r.output, HasSubstr("# wrong results: 0"));
    EXPECT_THAT(r.output, HasSubstr("busbw"));
  }
  auto bad = test::run_command("'" SPMDX_EXE "' bench comm --min-bytes 1X");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_THAT(bad.output, HasSubstr("'1X': unknown unit 'X'"));
  auto empty = test::run_command("'" SPMDX_EXE "' bench comm --max-bytes 0");  // ran nothing and said nothing
  EXPECT_NE(empty.exit_code, 0);
  EXPECT_THAT(empty.output, HasSubstr("--min-bytes and --max-bytes must be at least 4 (one float32), got 8 and 0"));
  // The backend is checked as spmdx run checks comm.backend, before any rank starts.
  auto local = test::run_command("'" SPMDX_EXE "' bench comm --backend local --nproc 2 --max-bytes 64K");
  EXPECT_EQ(local.exit_code, 1) << local.output;
  EXPECT_THAT(local.output, HasSubstr("--backend \"local\": the local plugin runs ranks as threads of one process"));
  EXPECT_THAT(local.output, ::testing::Not(HasSubstr("[rank")));
  auto auto_options = test::run_command("'" SPMDX_EXE "' bench comm --backend 'auto:shm=off' --nproc 2");
  EXPECT_EQ(auto_options.exit_code, 1) << auto_options.output;
  EXPECT_THAT(auto_options.output, HasSubstr("\"auto\" takes no options (it makes each backend with its defaults); to give options, pin a "
                                             "backend, e.g. \"ucx:shm=off\""));
}

// Unlike ranks on one machine (issue 49): --cpu-affinity pins each local rank to its CPU list
// (taskset's form) and gives it its share of them as intra-op threads; lists that do not fit
// are refused before any rank starts. The CPUs are this process's own first and last.
TEST(Launcher, CpuAffinityPinsEachRankToItsCpus) {
  EXPECT_EQ(launch::parse_cpu_list("3,0-1,1"), (std::vector<int>{0, 1, 3}));
  EXPECT_EQ(launch::parse_cpu_list("0-7:2,9"), (std::vector<int>{0, 2, 4, 6, 9})) << "taskset's stride form";
  EXPECT_EQ(launch::parse_cpu_list("1-8:3"), (std::vector<int>{1, 4, 7}));
  for (const std::string bad : {"", "a", "1-", "3-1", "1,,2", "-2", "0,", "0-7:0", "3:2", "0-7:", "0-7:x"}) EXPECT_THROW(launch::parse_cpu_list(bad), std::invalid_argument) << bad;
  EXPECT_EQ(launch::cpu_shares({"0", "1", "1"}), (std::vector<double>{1, 0.5, 0.5}));
  EXPECT_EQ(launch::cpu_shares({"0-3", "2-5"}), (std::vector<double>{3, 3}));
  cpu_set_t own;
  ASSERT_EQ(sched_getaffinity(0, sizeof own, &own), 0);
  int first = -1, last = -1;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &own)) last = c, first = first < 0 ? c : first;
  }
  const std::string a = std::to_string(first), b = std::to_string(last);
  EXPECT_EQ(launch::cpu_affinity_lists(b + ";" + a, 2), (std::vector<std::string>{b, a}));
  EXPECT_THROW(launch::cpu_affinity_lists(a, 2), std::invalid_argument);
  EXPECT_THROW(launch::cpu_affinity_lists(a + ";" + std::to_string(CPU_SETSIZE - 1), 2), std::invalid_argument);

  test::TempDir dir;
  const std::string data = corpus_file(dir);
  const std::string run = "'" SPMDX_EXE "' run '" SPMDX_SOURCE_DIR "/configs/llama_debug.toml' --nproc 2 --training.steps 2 --data.paths '" + data +
                          "' --training.seq_len 16 --parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 1 --job.dump_folder '" +
                          dir.path().string() + "' --cpu-affinity ";
  auto r = test::run_command(run + "'" + b + ";" + a + "' 2>&1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // The set each rank reads back from the kernel after pinning itself.
  EXPECT_THAT(r.output, HasSubstr("[rank 0] CPUs " + b + " (--cpu-affinity), 1 intra-op thread\n"));
  EXPECT_THAT(r.output, HasSubstr("[rank 1] CPUs " + a + " (--cpu-affinity), 1 intra-op thread\n"));
  for (const auto& [flags, says] : std::vector<std::pair<std::string, std::string>>{
           {"'" + a + "'", "--cpu-affinity '" + a + "' gives 1 CPU lists for 2 ranks (--nproc)"},
           {"'" + a + ";x'", "--cpu-affinity, local rank 1: CPU list 'x': 'x' is not a CPU number"},
           {"''", "--cpu-affinity '' gives 0 CPU lists for 2 ranks"},
           {"'" + a + ";" + std::to_string(CPU_SETSIZE - 1) + "'", "--cpu-affinity, local rank 1: CPU " + std::to_string(CPU_SETSIZE - 1) + " is not among the"}}) {
    r = test::run_command(run + flags + " 2>&1");
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_THAT(r.output, HasSubstr(says));
    EXPECT_THAT(r.output, Not(HasSubstr("[rank")));  // before any rank starts
  }
  // Without the flag, values left in the environment reach no rank (they would undo taskset's,
  // srun's or mpirun's binding).
  r = test::run_command("SPMDX_CPU_AFFINITY=garbage SPMDX_CPU_SHARE=64 " + run.substr(0, run.size() - std::string("--cpu-affinity ").size()) + " 2>&1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, Not(HasSubstr("(--cpu-affinity)")));
  EXPECT_THAT(r.output, Not(HasSubstr("64 intra-op threads")));
}

// SPMDX_FAULT's slow:rank=R,factor=F: that rank's compute ops each take F times as long (a
// slower device on a uniform machine); what it computes is unchanged, so the losses equal an
// unslowed run's bit for bit. Its form is checked before any rank starts.
TEST(Run, ASlowFactorSlowsOneRankWithoutChangingItsNumbers) {
  test::TempDir dir;
  const std::string data = corpus_file(dir);
  auto run = [&](const std::string& fault, const std::string& name) {
    return test::run_command((fault.empty() ? "" : "SPMDX_FAULT='" + fault + "' ") + "'" SPMDX_EXE "' run '" SPMDX_SOURCE_DIR
                             "/configs/llama_debug.toml' --nproc 3 --training.steps 3 --data.paths '" + data +
                             "' --training.seq_len 16 --parallelism.data_parallel_replicate_degree 3 --parallelism.data_parallel_shard_degree 1 "
                             "--parallelism.tensor_parallel_degree 1 --job.dump_folder '" + (dir / name).string() + "' 2>&1");
  };
  auto even = run("", "even");
  ASSERT_EQ(even.exit_code, 0) << even.output;
  auto slowed = run("slow:rank=2,factor=3", "slowed");
  ASSERT_EQ(slowed.exit_code, 0) << slowed.output;
  EXPECT_THAT(slowed.output, HasSubstr("[rank 2] SPMDX_FAULT: rank 2 runs every compute op 3 times as long from step 1\n"));
  EXPECT_EQ(losses((dir / "slowed" / "metrics.jsonl").string()), losses((dir / "even" / "metrics.jsonl").string()));
  for (const auto& [fault, says] : std::vector<std::pair<std::string, std::string>>{
           {"slow:rank=1,factor=1", "factor must be more than 1 and at most 100"},
           {"slow:rank=1,factor=0", "factor must be more than 1 and at most 100"},
           {"slow:rank=1,factor=0x10", "factor='0x10' is not a decimal number"},
           {"slow:rank=1,factor=2,seconds=3", "slow with factor=F takes rank=R and step=S only"},
           {"slow:rank=1,factor=2;slow:rank=1,factor=3,step=2", "rank 1 is given two slow factors"},
           {"slow:rank=7,factor=2", "never happens in this job"},
           {"slow:rank=1,factor=2,step=-1", "step='-1' is not a whole number >= 1"},
           {"slow:rank=1,factor=2,step=0", "step=S (S >= 1)"}}) {
    const auto r = run(fault, "bad");
    EXPECT_NE(r.exit_code, 0) << fault;
    EXPECT_THAT(r.output, HasSubstr(says)) << fault;
  }
}

// training.device = "auto" and training.devices on a machine without a GPU: every rank on the
// CPU, with the numbers of training.device = "cpu"; a list that does not fit the job, or puts
// a rank on a GPU this machine lacks, is refused before any rank starts, naming the key.
TEST(Run, DeviceAutoAndAPerRankListRunOnTheCpuHereWithTheCpusNumbers) {
  test::TempDir dir;
  const std::string data = corpus_file(dir);
  auto run = [&](const std::string& device, const std::string& name) {
    return test::run_command("'" SPMDX_EXE "' run '" SPMDX_SOURCE_DIR "/configs/llama_debug.toml' --nproc 2 --training.steps 3 --data.paths '" + data +
                             "' --training.seq_len 16 --parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 1 "
                             "--parallelism.tensor_parallel_degree 1 " + device + " --job.dump_folder '" + (dir / name).string() + "' 2>&1");
  };
  const auto cpu = run("--training.device cpu", "cpu");
  ASSERT_EQ(cpu.exit_code, 0) << cpu.output;
  EXPECT_THAT(cpu.output, Not(HasSubstr("devices:")));
  const auto automatic = run("--training.device auto", "auto");
  ASSERT_EQ(automatic.exit_code, 0) << automatic.output;
  EXPECT_THAT(automatic.output, HasSubstr("devices: cpu\n"));
  const auto listed = run("--training.devices cpu,auto", "listed");
  ASSERT_EQ(listed.exit_code, 0) << listed.output;
  EXPECT_THAT(listed.output, HasSubstr("devices: cpu\n"));
  const auto want = losses((dir / "cpu" / "metrics.jsonl").string());
  ASSERT_EQ(want.size(), 3u);
  EXPECT_EQ(losses((dir / "auto" / "metrics.jsonl").string()), want);
  EXPECT_EQ(losses((dir / "listed" / "metrics.jsonl").string()), want);
  for (const auto& [device, says] : std::vector<std::pair<std::string, std::string>>{
           {"--training.devices cpu", "training.devices lists 1 device for 2 ranks (--nproc x nodes): give one per rank"},
           {"--training.devices cpu,gpu", "training.devices: 'gpu' is not a device: give each rank \"cpu\", \"cuda\" or \"auto\""},
           {"--training.devices cpu,cuda", "training.devices puts rank 1 on \"cuda\": "},
           {"--training.device auto --fault_tolerance.enable true --fault_tolerance.group_size 2", "fault tolerance runs on training.device = \"cpu\""}}) {
    const auto r = run(device, "bad");
    EXPECT_NE(r.exit_code, 0) << device;
    EXPECT_THAT(r.output, HasSubstr(says)) << device << "\n" << r.output;
    EXPECT_THAT(r.output, Not(HasSubstr("[rank 1]"))) << device << ": refused before any rank starts";
  }
}

}  // namespace
}  // namespace spmdx
