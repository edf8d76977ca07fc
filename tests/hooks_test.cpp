// Debug hooks (interfaces/spmdx/hook.h): the GraphViews the host builds, HookSet's isolation of
// a failing hook, the flight recorder analysis, and every hook plugin on real multi-process
// runs, with planted faults: a rank that skips a collective, a rank whose replicated weight
// is perturbed, a plan over its memory budget.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <functional>
#include <map>
#include <regex>
#include <set>

#include "spmdx/config/config.h"
#include "spmdx/options.h"
#include "spmdx/core/registry.h"
#include "spmdx/hooks/fr_trace.h"
#include "spmdx/hooks/hook_set.h"
#include "spmdx/models/model.h"
#include "spmdx/job/compile.h"
#include "spmdx/job/preflight.h"
#include "spmdx/job/spec.h"
#include "run_util.h"

namespace spmdx {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using ::testing::HasSubstr;
using ::testing::Not;

std::string read(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::map<std::string, long> counts(const fs::path& p) {
  std::map<std::string, long> out;
  std::ifstream in(p);
  std::string k;
  long v = 0;
  while (in >> k >> v) out[k] = v;
  return out;
}

// llama tiny on fsdp 2 x tp 2, planned as `spmdx compile` does.
struct Planned {
  config::Config cfg;
  PluginRegistry registry;
  std::unique_ptr<job::PlacedJob> job;
  std::unique_ptr<sharding::DistributedPlan> plan_;
  const sharding::DistributedPlan& plan() const { return *plan_; }
  Planned() {
    cfg = config::Config::load(SPMDX_SOURCE_DIR "/configs/llama_fsdp.toml");
    cfg.override_value("parallelism.data_parallel_shard_degree", "2");
    cfg.override_value("parallelism.tensor_parallel_degree", "2");
    registry.discover({{BUILTIN_PLUGIN_DIR, PluginSource::Origin::builtin}});
    job = std::make_unique<job::PlacedJob>(job::place_job(job::job_spec(cfg, 4, 256), registry));
    plan_ = std::make_unique<sharding::DistributedPlan>(
        job::propagate_job(*job));
  }
};

TEST(GraphView, StagesCarryPlacementsCollectivesAndWaits) {
  Planned p;
  const GraphView captured = hooks::captured_view(p.job->model.graph, p.job->mesh);
  EXPECT_EQ(captured.stage, CompileStage::captured);
  EXPECT_EQ(captured.nodes.size(), p.job->model.graph.num_nodes());
  for (const auto& v : captured.values) EXPECT_TRUE(v.placements.empty());

  const GraphView propagated = hooks::propagated_view(p.plan());
  const auto edges = hooks::edges_of(propagated);
  std::size_t uses = 0, redistributed = 0;
  for (const auto& n : propagated.nodes) uses += n.inputs.size();
  for (const auto& e : edges) redistributed += e.from != e.to;
  EXPECT_EQ(edges.size(), uses);
  EXPECT_GT(redistributed, 0u);  // FSDP's all_gathers at least
  const auto wq = std::find_if(propagated.values.begin(), propagated.values.end(), [](const GraphValue& v) { return v.name == "layers.0.attention.wq.weight"; });
  ASSERT_NE(wq, propagated.values.end());
  // Column-parallel on tp (dim 0); FSDP moved to dim 1 so that the two shards do not nest.
  EXPECT_EQ(to_string(wq->placements), "S(1)S(0)");

  const ir::Graph g = sharding::rank_graph(p.plan(), 3);
  const plan::RuntimePlan runtime = plan::make_runtime_plan(g, p.job->mesh);
  const GraphView planned = hooks::rank_view(p.plan(), g, 3, &runtime);
  EXPECT_EQ(planned.stage, CompileStage::planned);
  EXPECT_EQ(planned.rank, 3);
  for (std::size_t i = 0; i < planned.nodes.size(); ++i) {  // the plan's execution order
    EXPECT_EQ(planned.nodes[i].op, std::next(g.nodes().begin(), runtime.order[i])->get()->op()) << i;
  }
  std::size_t collectives = 0;
  for (std::size_t i = 0; i < planned.nodes.size(); ++i) {
    const GraphNode& n = planned.nodes[i];
    if (!n.collective) continue;
    ++collectives;
    ASSERT_GE(n.mesh_dim, 0);
    const double k = 2, in = static_cast<double>(planned.values[static_cast<std::size_t>(n.inputs[0])].bytes);
    const double want = n.op == "all_reduce" ? 2 * (k - 1) / k * in : n.op == "all_gather" ? (k - 1) * in : (k - 1) / k * in;
    EXPECT_EQ(n.comm_bytes, static_cast<std::int64_t>(want)) << n.op;
    EXPECT_TRUE(n.wait_before == -1 || n.wait_before > static_cast<int>(i)) << "a collective is waited for after it is issued";
    EXPECT_FALSE(planned.values[static_cast<std::size_t>(n.outputs[0])].placements.empty()) << n.op << " output has placements";
  }
  EXPECT_GT(collectives, 10u);
  // Matmuls reading a block's weight belong to that block.
  for (const auto& n : planned.nodes) {
    for (int v : n.inputs) {
      if (planned.values[static_cast<std::size_t>(v)].name == "layers.1.feed_forward.w2.weight" && n.op == "matmul") {
        EXPECT_EQ(n.layer, "layers.1");
      }
    }
  }
  EXPECT_EQ(models::layer_of("exp_avg_sq.layers.12.attention.wo.weight"), "layers.12");
  EXPECT_EQ(models::layer_of("tok_embeddings.weight"), "tok_embeddings");
  EXPECT_EQ(models::layer_of("tokens"), "");
  EXPECT_EQ(models::layer_of("model.layers.7.self_attn.q_proj.weight"), "model.layers.7");
  EXPECT_EQ(models::layer_of("exp_avg.transformer.h.0.attn.c_attn.bias"), "transformer.h.0");
  EXPECT_EQ(models::layer_of("const.rope.cos"), "const");
}

TEST(HookSet, CallsEveryStageAndValidatorOnEveryNodeAndEdge) {
  Planned p;
  test::TempDir dir;
  PluginRegistry registry;
  registry.discover({{fs::path(TEST_PLUGIN_DIR) / "test_hook", PluginSource::Origin::user}});
  HookContext base;
  base.world_size = 4;
  base.compile_only = true;
  hooks::HookSet set(registry, {"test_hook"}, {}, base, dir.path().string());
  set.compile(p.plan(), {0, 1, 2, 3});
  const auto c = counts(dir / "hooks" / "test_hook" / "rank0.txt");
  EXPECT_EQ(c.at("stage.captured"), 1);
  EXPECT_EQ(c.at("stage.propagated"), 1);
  EXPECT_EQ(c.at("stage.rewritten"), 4);
  EXPECT_EQ(c.at("stage.planned"), 4);
  EXPECT_EQ(c.at("vertex.propagated"), static_cast<long>(p.job->model.graph.num_nodes()));
  EXPECT_EQ(c.at("vertex.rewritten"), c.at("nodes.rewritten"));
  EXPECT_GT(c.at("edge.propagated"), c.at("vertex.propagated"));
  EXPECT_GT(c.at("edge.redistributed"), 0);
}

TEST(HookSet, AThrowingHookIsReportedAndTheRunGoesOnButAValidationErrorStops) {
  Planned p;
  test::TempDir dir;
  PluginRegistry registry;
  registry.discover({{fs::path(TEST_PLUGIN_DIR) / "test_hook", PluginSource::Origin::user}});
  HookContext base;
  base.compile_only = true;
  hooks::HookSet throwing(registry, {"test_hook"}, {{"test_hook", {{"throw_in", "vertex"}}}}, base, dir.path().string());
  EXPECT_NO_THROW(throwing.compile(p.plan(), {0}));
  hooks::HookSet validating(registry, {"test_hook"}, {{"test_hook", {{"validate", "compile"}}}}, base, dir.path().string());
  try {
    validating.compile(p.plan(), {0});
    FAIL() << "a ValidationError must stop the job";
  } catch (const ValidationError& e) {
    EXPECT_THAT(e.what(), HasSubstr("hook test_hook: the plan is not acceptable"));
  }
}

TEST(HookSet, UnknownHookListsTheAvailableOnesAndBadOptionsNameTheHook) {
  test::TempDir dir;
  PluginRegistry registry;
  registry.discover({{BUILTIN_PLUGIN_DIR, PluginSource::Origin::builtin}});
  HookContext base;
  try {
    hooks::HookSet(registry, {"timelime"}, {}, base, dir.path().string());
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("hooks.enable: no hook plugin named 'timelime'"));
    EXPECT_THAT(e.what(), HasSubstr("timeline"));
  }
  try {
    hooks::HookSet(registry, {"timeline"}, {{"timeline", {{"stpes", "3"}}}}, base, dir.path().string());
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("[hooks.timeline] stpes: unknown option; did you mean 'steps'?"));
  }
  try {
    hooks::HookSet(registry, {"partition_validator"}, {{"partition_validator", {{"memory_budget", "lots"}}}}, base, dir.path().string());
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("[hooks.partition_validator] memory_budget = \"lots\": expected a size such as 4GiB"));
  }
}

TEST(OptionReader, ParsesSizesNumbersAndBooleans) {
  OptionReader o("[hooks.x]", {{"budget", "1.5GiB"}, {"n", "7"}, {"on", "true"}, {"f", "0.25"}});
  EXPECT_DOUBLE_EQ(o.get_bytes("budget", 0), 1.5 * 1024 * 1024 * 1024);
  EXPECT_EQ(o.get_int("n", 0, 0, 10), 7);
  EXPECT_TRUE(o.get_bool("on", false));
  EXPECT_DOUBLE_EQ(o.get_double("f", 0, 0, 1), 0.25);
  EXPECT_EQ(o.get_int("absent", 3, 0, 10), 3);
  EXPECT_NO_THROW(o.done());
  // Every problem at once, in done(): bad values (the getter returns its fallback) and unknown keys.
  OptionReader bad("[hooks.x]", {{"n", "11"}, {"on", "yes"}, {"bogus", "1"}});
  EXPECT_EQ(bad.get_int("n", 5, 0, 10), 5);
  EXPECT_FALSE(bad.get_bool("on", false));
  try {
    bad.done();
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), "[hooks.x] n = \"11\": expected an integer from 0 to 10\n[hooks.x] on = \"yes\": expected true or false\n"
                                     "[hooks.x] bogus: unknown option (known: n, on)");
  }
}

TEST(Config, HookOptionTablesAndOverrides) {
  config::Config cfg = config::Config::parse("[hooks]\nenable = [\"timeline\"]\n[hooks.timeline]\nsteps = 3\nstart_step = \"2\"\n", "x.toml");
  EXPECT_EQ(cfg.plugin_options("hooks.timeline").at("steps"), "3");
  EXPECT_EQ(cfg.plugin_options("hooks.timeline").at("start_step"), "2");
  cfg.override_value("hooks.timeline.steps", "4");
  EXPECT_EQ(cfg.plugin_options("hooks.timeline").at("steps"), "4");
  EXPECT_THAT(cfg.to_toml(), HasSubstr("[hooks.timeline]\nstart_step = \"2\"\nsteps = \"4\"\n"));
  EXPECT_TRUE(cfg.plugin_options("hooks.graphviz").empty());
}

// Flight recorder dumps written by hand: which rank is missing from which collective. With
// `index`, entry i carries plan index index[i] (as dumps since ABI 2.1 do); without, none.
void dump(const fs::path& dir, int rank, const std::vector<std::tuple<std::uint64_t, std::string, std::int64_t, std::string>>& entries,
          const std::vector<std::int64_t>& index = {}) {
  json e = json::array();
  for (const auto& [seq, value, bytes, state] : entries) {
    e.push_back({{"op", "all_reduce"}, {"mesh_dim", 0}, {"group_name", "dp"}, {"group_ranks", {0, 1, 2}}, {"seq", seq}, {"step", 4},
                 {"bytes", bytes}, {"dtype", "f32"}, {"shape", {bytes / 4}}, {"value", value}, {"state", state}, {"error", ""}});
    if (!index.empty()) e.back()["index"] = index.at(e.size() - 1);
  }
  test::write_file(dir / ("rank" + std::to_string(rank) + ".json"),
                   json{{"format", "spmdx-flight-recorder-1"}, {"rank", rank}, {"world_size", 3}, {"reason", "timeout"}, {"entries", e}}.dump());
}

TEST(FrTrace, NamesTheRankMissingFromACollective) {
  test::TempDir dir;
  dump(dir.path(), 0, {{7, "%10", 64, "completed"}, {8, "%12", 128, "issued"}});
  dump(dir.path(), 1, {{7, "%10", 64, "completed"}});
  dump(dir.path(), 2, {{7, "%10", 64, "completed"}, {8, "%12", 128, "issued"}});
  const auto a = hooks::analyze_flight_recorder(dir.path());
  ASSERT_EQ(a.findings.size(), 1u) << a.text;
  EXPECT_EQ(a.findings[0].ranks, std::vector<int>{1});
  EXPECT_EQ(a.findings[0].seq, 8u);
  EXPECT_THAT(a.text, HasSubstr("group dp [0, 1, 2], collective #8: rank 1 never issued it; ranks 0, 2 issued all_reduce f32[32] (128.0 B) producing %12 in step 4 (state issued)"));
  EXPECT_THAT(a.text, HasSubstr("Rank 1's last collective on this group is #7"));
}

TEST(FrTrace, NamesTheRankThatIssuedADifferentCollectiveAndAStall) {
  test::TempDir dir;
  dump(dir.path(), 0, {{3, "%10", 64, "issued"}});
  dump(dir.path(), 1, {{3, "%14", 256, "issued"}});
  dump(dir.path(), 2, {{3, "%10", 64, "issued"}});
  auto a = hooks::analyze_flight_recorder(dir.path());
  ASSERT_EQ(a.findings.size(), 1u) << a.text;
  EXPECT_EQ(a.findings[0].ranks, std::vector<int>{1});
  // Nothing tells which comes first in the plan: the minority is named, not called a skipper.
  EXPECT_EQ(a.findings[0].kind, hooks::FrFinding::Kind::different);
  EXPECT_THAT(a.text, HasSubstr("the ranks disagree on what it is: ranks 0, 2 issued all_reduce f32[16] (64.0 B) producing %10 in step 4; rank 1 issued"));

  // One place in the plan, two ops: nobody skipped it, the ranks disagree on it (rank 1's op
  // sorted first by name once made ranks 0 and 2 the ones said to skip it).
  for (const std::string op : {"all_gather", "reduce_scatter"}) {
    test::TempDir other;
    for (int r = 0; r < 3; ++r) dump(other.path(), r, {{3, "%10", 64, "issued"}}, {7});
    json one = json::parse(test::read_file(other.path() / "rank1.json"));
    one["entries"][0]["op"] = op;
    test::write_file(other.path() / "rank1.json", one.dump());
    a = hooks::analyze_flight_recorder(other.path());
    ASSERT_EQ(a.findings.size(), 1u) << a.text;
    EXPECT_EQ(a.findings[0].kind, hooks::FrFinding::Kind::different) << op;
    EXPECT_EQ(a.findings[0].ranks, std::vector<int>{1}) << op;
    EXPECT_THAT(a.text, HasSubstr("the ranks disagree on what it is: ranks 0, 2 issued all_reduce f32[16] (64.0 B) producing %10 in step 4, plan index 7; rank 1 issued " + op));
  }

  // Each rank its own op: no majority, every rank is named.
  test::TempDir three;
  for (int r = 0; r < 3; ++r) dump(three.path(), r, {{3, "%10", 64, "issued"}}, {7});
  for (const auto& [r, op] : std::map<int, std::string>{{1, "all_gather"}, {2, "reduce_scatter"}}) {
    json d = json::parse(test::read_file(three.path() / ("rank" + std::to_string(r) + ".json")));
    d["entries"][0]["op"] = op;
    test::write_file(three.path() / ("rank" + std::to_string(r) + ".json"), d.dump());
  }
  a = hooks::analyze_flight_recorder(three.path());
  ASSERT_EQ(a.findings.size(), 1u) << a.text;
  EXPECT_EQ(a.findings[0].ranks, (std::vector<int>{0, 1, 2}));
  EXPECT_THAT(a.text, HasSubstr("the ranks disagree on what it is (no majority tells which is wrong)"));

  test::TempDir stall;
  for (int r = 0; r < 3; ++r) dump(stall.path(), r, {{5, "%10", 64, r == 2 ? "issued" : "completed"}});
  a = hooks::analyze_flight_recorder(stall.path());
  ASSERT_EQ(a.findings.size(), 1u) << a.text;
  EXPECT_THAT(a.text, HasSubstr("every rank issued it, it did not complete on rank 2"));
}

// The case that blamed the wrong rank: rank 1 skipped %126 and issued the next collective, of
// the same op and size, as the same sequence number. Two ranks: no majority to go by.
TEST(FrTrace, ASkippedCollectiveFollowedByOneOfTheSameSizeBlamesTheRankThatSkipped) {
  for (bool with_index : {true, false}) {
    test::TempDir dir;
    dump(dir.path(), 0, {{4, "%126", 4, "completed"}, {5, "%128", 4, "failed"}}, with_index ? std::vector<std::int64_t>{0, 1} : std::vector<std::int64_t>{});
    dump(dir.path(), 1, {{4, "%128", 4, "completed"}, {5, "bucket 0 (20 tensors, last %273)", 492800, "failed"}},
         with_index ? std::vector<std::int64_t>{1, 21} : std::vector<std::int64_t>{});
    dump(dir.path(), 2, {{4, "%126", 4, "completed"}, {5, "%128", 4, "failed"}}, with_index ? std::vector<std::int64_t>{0, 1} : std::vector<std::int64_t>{});
    const auto a = hooks::analyze_flight_recorder(dir.path());
    ASSERT_FALSE(a.findings.empty()) << a.text;
    const auto& f = a.findings.front();
    EXPECT_EQ(f.kind, hooks::FrFinding::Kind::skipped) << a.text;
    EXPECT_EQ(f.ranks, std::vector<int>{1}) << a.text;
    EXPECT_EQ(f.value, "%126");
    EXPECT_EQ(f.seq, 4u);
    EXPECT_EQ(f.index, with_index ? 0 : -1);
    EXPECT_THAT(f.message, HasSubstr("rank 1 skipped the collective producing %126 in step 4"));
    EXPECT_THAT(f.message, HasSubstr("ranks 0, 2 issued it as #4, rank 1 issued all_reduce f32[1] (4.0 B) producing %128"));
  }
  // Two ranks, by plan index alone (rank 1's dump ends where it failed): still rank 1.
  test::TempDir two;
  for (int r : {0, 1}) {
    json e = json::array();
    auto add = [&](std::uint64_t seq, const std::string& value, std::int64_t index) {
      e.push_back({{"op", "all_reduce"}, {"mesh_dim", 0}, {"group_name", "dp_replicate"}, {"group_ranks", {0, 1}}, {"seq", seq}, {"step", 2},
                   {"index", index}, {"bytes", 4}, {"dtype", "f32"}, {"shape", json::array()}, {"value", value}, {"state", "failed"}});
    };
    if (r == 0) add(4, "%126", 0);
    else add(4, "%128", 1);
    test::write_file(two / ("rank" + std::to_string(r) + ".json"),
                     json{{"format", "spmdx-flight-recorder-1"}, {"rank", r}, {"world_size", 2}, {"reason", "x"}, {"entries", e}}.dump());
  }
  const auto b = hooks::analyze_flight_recorder(two.path());
  ASSERT_FALSE(b.findings.empty()) << b.text;
  EXPECT_EQ(b.findings.front().ranks, std::vector<int>{1}) << b.text;
  EXPECT_EQ(b.findings.front().value, "%126");
}

// A collective not yet seen complete (the rank had not waited for it) before a divergence is
// not reported as a stall that hides it.
TEST(FrTrace, AnUnwaitedCollectiveBeforeADivergenceIsNotCalledAStall) {
  test::TempDir dir;
  dump(dir.path(), 0, {{6, "bucket 0", 400, "completed"}, {7, "%272", 4, "failed"}}, {21, 23});
  dump(dir.path(), 1, {{6, "bucket 0", 400, "issued"}, {7, "%270", 4, "failed"}}, {21, 22});
  dump(dir.path(), 2, {{6, "bucket 0", 400, "completed"}, {7, "%270", 4, "failed"}}, {21, 22});
  const auto a = hooks::analyze_flight_recorder(dir.path());
  ASSERT_EQ(a.findings.size(), 1u) << a.text;
  EXPECT_EQ(a.findings[0].kind, hooks::FrFinding::Kind::skipped);
  EXPECT_EQ(a.findings[0].ranks, std::vector<int>{0}) << a.text;
  EXPECT_EQ(a.findings[0].value, "%270");
}

TEST(FrTrace, AGroupMemberWithoutADumpIsNamedAsTheLikelyOneMissing) {
  test::TempDir dir;
  dump(dir.path(), 0, {{4, "%8", 64, "completed"}, {5, "%10", 64, "failed"}});
  dump(dir.path(), 2, {{4, "%8", 64, "completed"}, {5, "%10", 64, "failed"}});
  const auto a = hooks::analyze_flight_recorder(dir.path());
  ASSERT_EQ(a.findings.size(), 1u) << a.text;
  EXPECT_EQ(a.findings[0].ranks, std::vector<int>{1});
  EXPECT_THAT(a.text, HasSubstr("ranks 0, 2 issued it, it did not complete on ranks 0, 2"));
  EXPECT_THAT(a.text, HasSubstr("rank 1 of this group left no dump"));
  EXPECT_THAT(a.text, Not(HasSubstr("every rank issued it")));
}

TEST(FrTrace, DumpsOfAnotherRunOrHugeSequenceNumbersAreHandled) {
  test::TempDir dir;
  dump(dir.path(), 0, {{std::uint64_t{1} << 62, "%8", 64, "issued"}});
  dump(dir.path(), 1, {{0, "%8", 64, "issued"}});
  // However odd the numbers, the analysis returns and reads them whole: rank 1 is behind, at
  // #0, and never issued #2^62 (no overflow into a small or negative number).
  const auto odd = hooks::analyze_flight_recorder(dir.path());
  ASSERT_EQ(odd.findings.size(), 1u) << odd.text;
  EXPECT_EQ(odd.findings[0].ranks, std::vector<int>{1}) << odd.text;
  EXPECT_THAT(odd.text, HasSubstr("collective #4611686018427387904: rank 1 never issued it"));
  EXPECT_THAT(odd.text, HasSubstr("Rank 1's last collective on this group is #0"));
  test::write_file(dir / "rank2.json", json{{"format", "spmdx-flight-recorder-1"}, {"rank", 2}, {"world_size", 8}, {"entries", json::array()}}.dump());
  try {
    hooks::analyze_flight_recorder(dir.path());
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("the dumps come from different runs"));
  }
}

// A dump edited by hand, or of another run, is refused naming the file, the entry and the key,
// rather than analysed into blaming the wrong rank.
TEST(FrTrace, EditedOrMixedDumpsAreRefusedNamingTheEntryAndKey) {
  auto error_with = [](const std::function<void(json&)>& edit, const std::string& file = "rank1.json") {
    test::TempDir dir;
    for (int r = 0; r < 3; ++r) dump(dir.path(), r, {{7, "%10", 64, "completed"}, {8, "%12", 128, "issued"}}, {3, 4});
    json d = json::parse(read(dir / "rank1.json"));
    edit(d);
    fs::remove(dir / "rank1.json");
    test::write_file(dir / file, d.dump());
    try {
      hooks::analyze_flight_recorder(dir.path());
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string("(analysed)");
  };
  EXPECT_THAT(error_with([](json& d) { d["entries"][1]["index"] = 1.5; }), HasSubstr("rank1.json: not a valid flight recorder dump (entry #1: 'index' must be a whole number"));
  EXPECT_THAT(error_with([](json& d) { d["entries"][1]["seq"] = -1; }), HasSubstr("entry #1: 'seq' must be a whole number from 0"));
  EXPECT_THAT(error_with([](json& d) { d["entries"][0]["seq"] = "7"; }), HasSubstr("entry #0: 'seq' must be a whole number"));
  EXPECT_THAT(error_with([](json& d) { d["entries"][0].erase("step"); }), HasSubstr("entry #0: 'step' is missing"));
  EXPECT_THAT(error_with([](json& d) { d["entries"][0]["group_ranks"] = {1, 7}; }), HasSubstr("'group_ranks' must hold ascending ranks below world_size 3"));
  EXPECT_THAT(error_with([](json& d) { d["entries"][0]["group_ranks"] = {0, 2}; }), HasSubstr("does not hold the rank that dumped it (1)"));
  const std::string many = error_with([](json& d) {
    d["entries"][0]["group_ranks"] = json::array();
    for (int r = 100'000; r > 0; --r) d["entries"][0]["group_ranks"].push_back(r);
  });
  EXPECT_THAT(many, HasSubstr("'group_ranks' must hold ascending ranks below world_size 3, is [100000,99999,"));
  EXPECT_THAT(many, HasSubstr("... (588896 characters)"));  // not the 100,000 ranks
  EXPECT_LT(many.size(), 1000u);
  EXPECT_THAT(error_with([](json&) {}, "rank9.json"), HasSubstr("rank9.json: not a valid flight recorder dump (it holds rank 1's dump under another rank's name"));
  EXPECT_THAT(error_with([](json& d) { d["run"] = "another"; }), HasSubstr("the dumps come from different runs"));
  EXPECT_EQ(error_with([](json&) {}), "(analysed)");
}

TEST(FrTrace, NoDumpsOrABadDumpIsAClearError) {
  test::TempDir dir;
  EXPECT_THAT([&] { try { hooks::analyze_flight_recorder(dir.path()); } catch (const std::exception& e) { return std::string(e.what()); } return std::string(); }(),
              HasSubstr("no rank*.json dumps"));
  test::write_file(dir / "rank0.json", "{\"format\": \"spmdx-flight-recorder-1\", \"rank\": 0");
  EXPECT_THAT([&] { try { hooks::analyze_flight_recorder(dir.path()); } catch (const std::exception& e) { return std::string(e.what()); } return std::string(); }(),
              HasSubstr((dir / "rank0.json").string()));
}

// Real runs: `spmdx run` with real rank processes over the ucx plugin.
test::CommandResult spmdx(const std::string& args, const std::string& env = "") {
  return test::run_command(env + " '" SPMDX_EXE "' " + args);
}

TEST(Hooks, EveryHookOnAFourRankRunWritesItsOutputAndChangesNoLoss) {
  test::TempDir dir;
  const std::string common = "run '" SPMDX_SOURCE_DIR "/configs/llama_fsdp.toml' --nproc 4 --parallelism.data_parallel_shard_degree 2 "
                             "--parallelism.tensor_parallel_degree 2 --training.steps 3 --training.seq_len 32 --data.paths '" + test::corpus_file(dir) + "'";
  auto plain = spmdx(common + " --job.dump_folder '" + (dir / "plain").string() + "'");
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  const fs::path out = dir / "hooked";
  auto r = spmdx(common + " --job.dump_folder '" + out.string() +
                 "' --hooks.enable graphviz,partition_validator,timeline,consistency,flight_recorder --hooks.consistency.every 2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(test::losses(out / "metrics.jsonl"), test::losses(dir / "plain" / "metrics.jsonl"));
  const fs::path h = out / "hooks";

  // graphviz: an SVG per graph, and Graphviz accepts the full DOT.
  for (const char* stem : {"logical", "rank0", "rank3"}) {
    EXPECT_NE(read(h / "graphviz" / (std::string(stem) + ".svg")).find("<svg"), std::string::npos) << stem;
    EXPECT_NE(read(h / "graphviz" / (std::string(stem) + ".dot")).find("label=\"adamw"), std::string::npos) << stem;
  }
  EXPECT_NE(read(h / "graphviz" / "rank0.dot").find("all_gather (dp_shard)"), std::string::npos);
  // Graphviz parses the full DOT (gc reads a graph without laying it out, which takes ~30 s).
  if (test::run_command("command -v gc").exit_code == 0) {
    auto gc = test::run_command("gc '" + (h / "graphviz" / "rank0.dot").string() + "'");
    EXPECT_THAT(gc.output, HasSubstr("rank0.dot)"));
    EXPECT_THAT(gc.output, Not(HasSubstr("rror")));
  } else {
    std::cout << "Graphviz is not installed: the DOT syntax check is skipped\n";
  }

  // partition_validator: every rank, same load (even shards), a cut ratio strictly inside (0, 1).
  const json pv = json::parse(read(h / "partition_validator" / "report.json"));
  ASSERT_EQ(pv.at("ranks").size(), 4u);
  EXPECT_GT(pv.at("edge_cut_ratio").get<double>(), 0.0);
  EXPECT_LT(pv.at("edge_cut_ratio").get<double>(), 1.0);
  EXPECT_NEAR(pv.at("flops_std_over_mean").get<double>(), 0.0, 1e-12);
  EXPECT_GT(pv.at("ranks")[0].at("comm_bytes").get<double>(), 0.0);
  EXPECT_TRUE(pv.at("failures").empty());

  // timeline: every rank's compute and comm spans in the merged trace, and the overlap ratio.
  const json merged = json::parse(read(h / "timeline" / "merged.json"));
  std::set<std::pair<int, std::string>> seen;
  for (const auto& e : merged.at("traceEvents")) {
    if (e.at("ph") == "X" && e.contains("cat")) seen.insert({e.at("pid").get<int>(), e.at("cat").get<std::string>()});
  }
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_TRUE(seen.count({rank, "compute"})) << rank;
    EXPECT_TRUE(seen.count({rank, "comm"})) << rank;
    EXPECT_TRUE(seen.count({rank, "step"})) << rank;
  }
  const json summary = json::parse(read(h / "timeline" / "summary.json"));
  ASSERT_EQ(summary.size(), 12u);  // 4 ranks x 3 steps
  for (const auto& s : summary) {
    EXPECT_GT(s.at("comm_ms").get<double>(), 0.0);
    EXPECT_GE(s.at("overlap_ratio").get<double>(), 0.0);
    EXPECT_LE(s.at("overlap_ratio").get<double>(), 1.0);
  }
  const json row = json::parse(read(out / "metrics.jsonl").substr(0, read(out / "metrics.jsonl").find('\n')));
  EXPECT_GT(row.at("comm_ms").get<double>(), 0.0);
  EXPECT_TRUE(row.contains("overlap_ratio"));

  // consistency (every 2 steps of 3): step 2 and the last step, nothing diverged.
  // flight_recorder: dumps at the end, all agree.
  const json cons = json::parse(read(h / "consistency" / "report.json"));
  ASSERT_EQ(cons.at("checks").size(), 2u) << cons.dump();
  EXPECT_EQ(cons.at("checks")[0].at("step"), 2);
  EXPECT_EQ(cons.at("checks")[1].at("step"), 3);
  EXPECT_TRUE(cons.at("divergence").is_null());
  EXPECT_EQ(json::parse(read(h / "flight_recorder" / "rank3.json")).at("reason"), "end of run");
  auto trace = spmdx("fr-trace '" + (h / "flight_recorder").string() + "'");
  EXPECT_THAT(trace.output, HasSubstr("no mismatch"));
}

// The by-layer pictures (collapse_layers) of the logical graph and of rank 0's: one box per
// layer, in the order a step runs them (the embedding, the blocks by number: layers.2 before
// layers.10, the final norm, the output with the loss, the optimizer), none "(no layer)", and
// the same boxes in both. Read from the DOT text: the boxes in the order written, the invisible
// chain that stacks them, and every edge going back up (the backward's) left out of the ranking.
TEST(Hooks, GraphvizByLayerPicturesStackTheLayersInOrderWithTheSameBoxes) {
  test::TempDir dir;
  auto r = spmdx("compile '" SPMDX_SOURCE_DIR "/configs/llama_debug.toml' --model.n_layers 12 --hooks.enable graphviz --hooks.graphviz.collapse_layers true "
                 "--hooks.graphviz.format dot --job.dump_folder '" + dir.path().string() + "'");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::vector<std::string> want = {"tok_embeddings"};
  for (int l = 0; l < 12; ++l) want.push_back("layers." + std::to_string(l));
  for (const char* b : {"norm", "output + loss", "optimizer"}) want.push_back(b);
  for (const char* stem : {"logical", "rank0"}) {
    SCOPED_TRACE(stem);
    const std::string dot = read(dir / "hooks" / "graphviz" / (std::string(stem) + ".layers.dot"));
    std::vector<std::string> boxes;
    const std::regex box_re("\n  g([0-9]+) \\[[^\n]*label=\"([^\"\\\\]*)\\\\n");
    for (auto it = std::sregex_iterator(dot.begin(), dot.end(), box_re); it != std::sregex_iterator(); ++it) {
      EXPECT_EQ(std::stoul((*it)[1]), boxes.size());
      boxes.push_back((*it)[2]);
    }
    EXPECT_EQ(boxes, want);
    for (std::size_t i = 0; i + 1 < boxes.size(); ++i) {
      EXPECT_THAT(dot, HasSubstr("  g" + std::to_string(i) + " -> g" + std::to_string(i + 1) + " [style=invis, weight=100];"));
    }
    const std::regex edge_re("\n  g([0-9]+) -> g([0-9]+) \\[label=[^\n]*");
    int up = 0;
    for (auto it = std::sregex_iterator(dot.begin(), dot.end(), edge_re); it != std::sregex_iterator(); ++it) {
      const bool goes_up = std::stoi((*it)[1]) > std::stoi((*it)[2]);
      up += goes_up;
      EXPECT_EQ(it->str().find("constraint=false") != std::string::npos, goes_up) << it->str();
    }
    EXPECT_GE(up, 12) << "the backward goes from each block to the one before";
  }
}

// A rerun in the same folder (from step 1, on fewer ranks) never loses what the hooks wrote
// before: each file it replaces is kept whole under the next free name, and said; the flight
// recorder's dumps of ranks the new run lacks too, and fr-trace merges the new run's alone.
TEST(Hooks, ARerunKeepsEveryHookFileOfTheEarlierRunWhole) {
  test::TempDir dir;
  const fs::path out = dir / "out", h = out / "hooks";
  const std::string corpus = test::corpus_file(dir);
  auto run = [&](int nproc, int steps) {
    return spmdx("run '" SPMDX_SOURCE_DIR "/configs/mlp_dp.toml' --nproc " + std::to_string(nproc) + " --parallelism.data_parallel_replicate_degree " +
                 std::to_string(nproc) + " --training.steps " + std::to_string(steps) + " --data.paths '" + corpus + "' --job.dump_folder '" + out.string() +
                 "' --hooks.enable timeline,consistency,flight_recorder --hooks.consistency.every 1");
  };
  auto first = run(4, 2);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  std::map<fs::path, std::string> earlier;  // every file the hooks wrote
  for (const auto& e : fs::recursive_directory_iterator(h)) {
    if (e.is_regular_file()) earlier[e.path()] = read(e.path());
  }
  ASSERT_EQ(earlier.size(), 11u);  // timeline: 4 ranks, merged, summary; consistency: report; flight_recorder: 4 ranks
  auto second = run(2, 3);
  ASSERT_EQ(second.exit_code, 0) << second.output;
  for (const auto& [path, bytes] : earlier) {
    const fs::path aside = path.parent_path() / (path.stem().string() + ".1.json");
    if (path.parent_path().filename() == "timeline" && (path.filename() == "rank2.json" || path.filename() == "rank3.json")) {
      EXPECT_EQ(read(path), bytes) << path;  // no rank of this run writes it: left as it is
      EXPECT_FALSE(fs::exists(aside)) << aside;
      continue;
    }
    EXPECT_EQ(read(aside), bytes) << path;
    const std::string said = path.filename() == "merged.json" || path.filename() == "summary.json"
                                 ? "timeline: the merged trace of an earlier run is kept whole: " + (h / "timeline" / "merged.json").string() +
                                       " as merged.1.json, " + (h / "timeline" / "summary.json").string() + " as summary.1.json"
                             : path.parent_path().filename() == "timeline" ? "timeline: " + path.string() + " holds the trace of an earlier run: it is kept whole as " + aside.string()
                             : path.parent_path().filename() == "consistency"
                                 ? "consistency: " + path.string() + " holds the report of an earlier run: it is kept whole as " + aside.string()
                                 : "flight_recorder: " + path.string() + " holds the dump of an earlier run: it is kept whole as " + aside.string();
    EXPECT_THAT(second.output, HasSubstr(said));
  }
  EXPECT_EQ(json::parse(read(h / "timeline" / "summary.json")).size(), 6u);  // this run's: 2 ranks x 3 steps
  EXPECT_EQ(json::parse(read(h / "consistency" / "report.json")).at("checks").size(), 3u);
  EXPECT_FALSE(fs::exists(h / "flight_recorder" / "rank2.json"));
  auto trace = spmdx("fr-trace '" + (h / "flight_recorder").string() + "'");
  EXPECT_EQ(trace.exit_code, 0) << trace.output;
  EXPECT_THAT(trace.output, HasSubstr("no mismatch"));
}

TEST(Hooks, FlightRecorderNamesTheRankThatSkippedACollective) {
  test::TempDir dir;
  const fs::path out = dir / "out";
  auto r = spmdx("run '" SPMDX_SOURCE_DIR "/configs/mlp_dp.toml' --nproc 4 --parallelism.data_parallel_replicate_degree 4 --training.steps 4 "
                 "--comm.timeout_seconds 10 --data.paths '" + test::corpus_file(dir) + "' --job.dump_folder '" + out.string() + "' --hooks.enable flight_recorder",
                 "SPMDX_FAULT=skip_collective:rank=1,step=2,index=1");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("flight_recorder: rank 0 dumped"));
  for (int rank = 0; rank < 4; ++rank) EXPECT_TRUE(fs::exists(out / "hooks" / "flight_recorder" / ("rank" + std::to_string(rank) + ".json"))) << rank;
  auto trace = spmdx("fr-trace '" + (out / "hooks" / "flight_recorder").string() + "'");
  ASSERT_EQ(trace.exit_code, 0) << trace.output;
  EXPECT_THAT(trace.output, HasSubstr("ranks 0, 2, 3 issued it as #"));
  // Four members: the comm layer itself tells the odd one out, and the launcher says what it
  // skipped, from the dumps.
  EXPECT_THAT(r.output, HasSubstr("(rank 1 differs from the other members)"));
  EXPECT_THAT(r.output, HasSubstr("spmdx run: rank 1 diverged, as the flight recorder's dumps show"));
  EXPECT_THAT(trace.output, HasSubstr("rank 1 skipped the collective producing"));
  EXPECT_THAT(trace.output, HasSubstr("in step 2"));
}

// The issue's grid: for each layout, each rank skips in turn the first, a middle and the last
// collective of step 2; the launcher and fr-trace must name that rank and what it skipped. What
// was skipped is read from a clean run's dump (same plan, no fault), not from the faulty run.
// One test per layout and pick (each a clean run and a faulty run per rank), so that each stays
// well inside CTest's limit on a loaded 2-core machine.
struct SkipCase {
  std::string layout;
  int nproc;
  std::string args;
  int pick;  // 0: the first collective of step 2, 1: a middle one, 2: the last
};

// How CTest lists a case: "fsdp_x_tp_2x2, middle" (not its bytes).
void PrintTo(const SkipCase& c, std::ostream* os) { *os << c.layout << ", " << (c.pick == 0 ? "first" : c.pick == 1 ? "middle" : "last"); }

class FlightRecorderGrid : public ::testing::TestWithParam<SkipCase> {};

TEST_P(FlightRecorderGrid, NamesTheRankAndValueSkipped) {
  const SkipCase& c = GetParam();
  test::TempDir dir;
  const std::string corpus = test::corpus_file(dir);
  const std::string base = "run '" SPMDX_SOURCE_DIR "/configs/llama_fsdp.toml' --model.flavor tiny --training.steps 3 --training.global_batch_size 4 "
                           "--training.seq_len 32 --nproc " + std::to_string(c.nproc) + " " + c.args +
                           " --comm.timeout_seconds 6 --hooks.enable flight_recorder --data.paths '" + corpus + "'";
  const fs::path clean = dir / "clean";
  auto run = spmdx(base + " --job.dump_folder '" + clean.string() + "'");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  std::map<std::int64_t, std::string> value_at;  // plan index of step 2 -> what that call produces (every rank runs the same plan)
  for (int r = 0; r < c.nproc; ++r) {
    const json d = json::parse(read(clean / "hooks" / "flight_recorder" / ("rank" + std::to_string(r) + ".json")));
    for (const auto& e : d.at("entries")) {
      if (e.at("step") == 2) value_at[e.at("index").get<std::int64_t>()] = e.at("value").get<std::string>();
    }
  }
  ASSERT_GE(value_at.size(), 3u) << run.output;
  const std::int64_t index = c.pick == 0   ? value_at.begin()->first
                             : c.pick == 1 ? std::next(value_at.begin(), static_cast<long>(value_at.size() / 2))->first
                                           : value_at.rbegin()->first;
  for (int rank = 0; rank < c.nproc; ++rank) {
    SCOPED_TRACE(c.layout + ", rank " + std::to_string(rank) + " skips index " + std::to_string(index) + " (" + value_at[index] + ")");
    const fs::path out = dir / ("fault" + std::to_string(rank));
    auto r = spmdx(base + " --job.dump_folder '" + out.string() + "'",
                   "SPMDX_FAULT=skip_collective:rank=" + std::to_string(rank) + ",step=2,index=" + std::to_string(index));
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_THAT(r.output, HasSubstr("spmdx run: rank " + std::to_string(rank) + " diverged, as the flight recorder's dumps show")) << r.output;
    const auto a = hooks::analyze_flight_recorder(out / "hooks" / "flight_recorder");
    ASSERT_FALSE(a.findings.empty()) << a.text;
    EXPECT_EQ(a.findings.front().ranks, std::vector<int>{rank}) << a.text;
    EXPECT_EQ(a.findings.front().value, value_at[index]) << a.text;
    EXPECT_EQ(a.findings.front().step, 2) << a.text;
    EXPECT_EQ(a.findings.front().index, index) << a.text;
  }
}

std::vector<SkipCase> skip_cases() {
  std::vector<SkipCase> cases;
  for (int pick = 0; pick < 3; ++pick) {
    cases.push_back({"ddp_2", 2, "--parallelism.data_parallel_replicate_degree 2", pick});
    cases.push_back({"fsdp_x_tp_2x2", 4, "--parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 2", pick});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(EveryIndexRankAndLayout, FlightRecorderGrid, ::testing::ValuesIn(skip_cases()), [](const ::testing::TestParamInfo<SkipCase>& info) {
  return info.param.layout + (info.param.pick == 0 ? "_first" : info.param.pick == 1 ? "_middle" : "_last");
});

// Without the flight recorder, two members that called different collectives cannot tell which
// one skipped: the launcher says so instead of blaming the lowest rank.
TEST(Hooks, WithoutTheFlightRecorderTheLauncherDoesNotGuessWhichOfTwoRanksSkipped) {
  test::TempDir dir;
  auto r = spmdx("run '" SPMDX_SOURCE_DIR "/configs/llama_fsdp.toml' --model.flavor tiny --training.steps 3 --training.global_batch_size 4 "
                 "--training.seq_len 32 --nproc 2 --parallelism.data_parallel_replicate_degree 2 --comm.timeout_seconds 6 --data.paths '" +
                     test::corpus_file(dir) + "' --job.dump_folder '" + (dir / "out").string() + "'",
                 "SPMDX_FAULT=skip_collective:rank=1,step=2,index=0");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("spmdx run: the ranks called different collectives (all_reduce"));
  EXPECT_THAT(r.output, HasSubstr("run with --hooks.enable flight_recorder and the launcher names it"));
  EXPECT_THAT(r.output, Not(HasSubstr("was named by the other ranks")));
}

TEST(Hooks, ConsistencyNamesTheRankWhoseReplicatedWeightWasPerturbed) {
  test::TempDir dir;
  const fs::path out = dir / "out";
  auto r = spmdx("run '" SPMDX_SOURCE_DIR "/configs/mlp_dp.toml' --nproc 4 --parallelism.data_parallel_replicate_degree 4 --training.steps 6 "
                 "--data.paths '" + test::corpus_file(dir) + "' --job.dump_folder '" + out.string() + "' --hooks.enable consistency --hooks.consistency.every 1",
                 "SPMDX_FAULT=perturb:rank=2,step=3,tensor=w1.weight");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("consistency: step 3: tensor w1.weight differs on rank 2 from ranks 0, 1, 3"));
  EXPECT_THAT(r.output, Not(HasSubstr("step    4 |")));
  const json report = json::parse(read(out / "hooks" / "consistency" / "report.json"));
  EXPECT_EQ(report.at("divergence").at("tensor"), "w1.weight");
  EXPECT_EQ(report.at("divergence").at("ranks"), json::array({2}));
  EXPECT_EQ(report.at("divergence").at("step"), 3);
}

TEST(Hooks, PartitionValidatorStopsBeforeTheFirstStepNamingRankAndTensors) {
  test::TempDir dir;
  auto r = spmdx("run '" SPMDX_SOURCE_DIR "/configs/llama_fsdp.toml' --nproc 4 --training.steps 2 --data.paths '" + test::corpus_file(dir) +
                 "' --job.dump_folder '" + (dir / "out").string() + "' --hooks.enable partition_validator --hooks.partition_validator.memory_budget 1MiB");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("hook partition_validator: rank 0 needs about"));
  EXPECT_THAT(r.output, HasSubstr("over memory_budget 1.0 MiB; largest tensors: "));
  EXPECT_THAT(r.output, Not(HasSubstr("step    1 |")));
  // The same check from `spmdx compile`, without starting ranks.
  auto c = spmdx("compile '" SPMDX_SOURCE_DIR "/configs/llama_fsdp.toml' --world-size 4 --job.dump_folder '" + (dir / "c").string() +
                 "' --hooks.enable partition_validator --hooks.partition_validator.memory_budget 1MiB");
  EXPECT_EQ(c.exit_code, 1) << c.output;
  EXPECT_THAT(c.output, HasSubstr("rank 0 needs about"));
}

TEST(Hooks, AHookThatThrowsIsNamedAndTheRunFinishes) {
  test::TempDir dir;
  auto r = spmdx("run '" SPMDX_SOURCE_DIR "/configs/mlp_dp.toml' --nproc 2 --training.steps 3 --data.paths '" + test::corpus_file(dir) + "' --job.dump_folder '" +
                 (dir / "out").string() + "' --plugins.paths '" TEST_PLUGIN_DIR "/test_hook' --hooks.enable test_hook --hooks.test_hook.throw_in step");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("hook test_hook failed in on_step_end: step trouble at step 1 (the run goes on)"));
  EXPECT_THAT(r.output, HasSubstr("[rank 0] done: 3 steps"));
  const auto c = counts(dir / "out" / "hooks" / "test_hook" / "rank1.txt");
  EXPECT_EQ(c.at("step"), 3);
  EXPECT_EQ(c.at("collective.issued"), c.at("collective.completed"));
  EXPECT_GT(c.at("spans"), 0);
}

TEST(Hooks, BadHookConfigFailsBeforeAnyRankStarts) {
  test::TempDir dir;
  const std::string base = "run '" SPMDX_SOURCE_DIR "/configs/mlp_dp.toml' --nproc 2 --data.paths '" + test::corpus_file(dir) + "' --job.dump_folder '" + (dir / "o").string() + "'";
  auto unknown = spmdx(base + " --hooks.enable timelime");
  EXPECT_EQ(unknown.exit_code, 1);
  EXPECT_THAT(unknown.output, HasSubstr("no hook plugin named 'timelime'"));
  EXPECT_THAT(unknown.output, Not(HasSubstr("[rank")));
  auto option = spmdx(base + " --hooks.enable timeline --hooks.timeline.steps many");
  EXPECT_EQ(option.exit_code, 1);
  EXPECT_THAT(option.output, HasSubstr("[hooks.timeline] steps = \"many\": expected an integer"));
  auto orphan = spmdx(base + " --training.steps 1 --hooks.timeline.steps 3");
  EXPECT_EQ(orphan.exit_code, 0) << orphan.output;
  EXPECT_THAT(orphan.output, HasSubstr("[hooks.timeline] sets options of hook 'timeline', which hooks.enable does not list: ignored"));
}

TEST(Hooks, AnEmptyHookTableNoHookUsesIsNamedWithItsLine) {
  test::TempDir dir;
  const fs::path cfg = dir / "c.toml";
  std::ofstream(cfg) << "[model]\nname = \"mlp\"\n\n[hooks.unused]\n\n[hooks.timelin]\n";
  auto c = spmdx("compile '" + cfg.string() + "' --job.dump_folder '" + (dir / "o").string() + "' --hooks.enable timeline");
  EXPECT_EQ(c.exit_code, 1) << c.output;
  EXPECT_THAT(c.output, HasSubstr("[hooks.timelin] sets options of hook 'timelin', which hooks.enable does not list; did you mean [hooks.timeline]?"));
  std::ofstream(cfg) << "[model]\nname = \"mlp\"\n\n[hooks.unused]\n";
  c = spmdx("compile '" + cfg.string() + "' --job.dump_folder '" + (dir / "o").string() + "' --hooks.enable timeline");
  EXPECT_EQ(c.exit_code, 0) << c.output;
  EXPECT_THAT(c.output, HasSubstr(cfg.string() + ":4:1: [hooks.unused] sets options of hook 'unused', which hooks.enable does not list: ignored"));
}

}  // namespace
}  // namespace spmdx
