// `spmdx diff` as a user runs it, on `spmdx compile --dump` folders and configs: a dump against
// itself is equivalent, a one-node edit is reported at that node and nowhere else, dp against
// fsdp differs in exactly the expected collectives, bad input exits 2.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <set>

#include "test_util.h"

namespace spmdx {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using nlohmann::json;

test::CommandResult spmdx(const std::string& args) { return test::run_command("env -u SPMDX_PLUGIN_PATH '" SPMDX_EXE "' " + args); }

const std::string kTiny = "'" SPMDX_SOURCE_DIR "/configs/llama_debug.toml' --model.flavor tiny --training.global_batch_size 8 --training.seq_len 64";
const std::string kDp = " --parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 1 --parallelism.tensor_parallel_degree 1";
const std::string kFsdp = " --parallelism.data_parallel_replicate_degree 1 --parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 1";

fs::path dump(const test::TempDir& dir, const std::string& name, const std::string& flags) {
  const fs::path out = dir / name;
  auto r = spmdx("compile " + kTiny + flags + " --dump '" + out.string() + "'");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return out;
}

json read_json(const fs::path& p) {
  std::ifstream in(p);
  return json::parse(in);
}
void write_json(const fs::path& p, const json& j) { test::write_file(p, j.dump(1)); }

json diff_json(const fs::path& a, const fs::path& b, int expected_exit) {
  auto r = spmdx("diff '" + a.string() + "' '" + b.string() + "' --json");
  EXPECT_EQ(r.exit_code, expected_exit) << r.output;
  return json::parse(r.output);
}

TEST(Diff, ADumpAgainstItselfAndAConfigAgainstItsDumpAreEquivalent) {
  test::TempDir dir;
  const fs::path a = dump(dir, "a", kDp);
  ASSERT_TRUE(fs::exists(a / "rank0.plan.json"));
  auto r = spmdx("diff '" + a.string() + "' '" + a.string() + "'");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("all matched; 2 rank graph(s) compared"));
  EXPECT_THAT(r.output, HasSubstr("equivalent: no difference in the graphs, placements, collectives or buckets"));
  EXPECT_THAT(r.output, HasSubstr("all_reduce over dp_replicate: "));
  // The same job as a config (the effective one, as --print-config writes it), compiled in
  // memory: equivalent to its dump.
  auto cfg = spmdx("compile " + kTiny + kDp + " --print-config");
  ASSERT_EQ(cfg.exit_code, 0) << cfg.output;
  test::write_file(dir / "dp.toml", cfg.output);
  r = spmdx("diff '" + (dir / "dp.toml").string() + "' '" + a.string() + "'");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("equivalent"));
}

// One parameter's placement in the plan, one collective's bytes in rank 0's graph and one
// bucket's bytes in its runtime plan, edited by hand: each reported at that node, and only there.
TEST(Diff, AOneNodeChangeIsReportedAtThatNode) {
  test::TempDir dir;
  const fs::path a = dump(dir, "a", kFsdp);
  fs::copy(a, dir / "b", fs::copy_options::recursive);
  const fs::path b = dir / "b";
  json plan = read_json(b / "plan.json");
  ASSERT_EQ(plan["inputs"]["layers.1.attention.wo.weight"], "S(0)");
  plan["inputs"]["layers.1.attention.wo.weight"] = "S(1)";
  write_json(b / "plan.json", plan);
  json d = diff_json(a, b, 1);
  ASSERT_EQ(d["differences"].size(), 1u) << d.dump(1);
  EXPECT_EQ(d["differences"][0]["level"], "plan");
  EXPECT_EQ(d["differences"][0]["where"], "layers.1.attention.wo");
  EXPECT_EQ(d["differences"][0]["what"], "input placement S(0) in A, S(1) in B");
  write_json(b / "plan.json", read_json(a / "plan.json"));

  // rank 0: the gradient reduce_scatter of layers.0.feed_forward.w2 reads twice the bytes.
  json g = read_json(b / "rank0.json");
  std::map<int, json*> producer;
  for (auto& n : g["nodes"]) {
    for (const auto& o : n["outputs"]) producer[o["id"].get<int>()] = &n;
  }
  bool edited = false;
  for (auto& n : g["nodes"]) {
    if (n["op"] != "reduce_scatter") continue;
    auto it = producer.find(n["inputs"][0].get<int>());
    if (it == producer.end() || (*it->second)["op"] != "matmul") continue;
    json* p = it->second;
    auto& shape = (*p)["outputs"][0]["meta"]["shape"];
    shape[0] = shape[0].get<long long>() * 2;
    edited = true;
    break;
  }
  ASSERT_TRUE(edited);
  write_json(b / "rank0.json", g);
  json runtime = read_json(b / "rank0.plan.json");
  ASSERT_FALSE(runtime["buckets"].empty());
  runtime["buckets"][0]["bytes"] = runtime["buckets"][0]["bytes"].get<long long>() + 1024;
  write_json(b / "rank0.plan.json", runtime);
  d = diff_json(a, b, 1);
  std::vector<json> rank, plans;
  for (const auto& x : d["differences"]) {
    if (x["level"] == "rank 0") rank.push_back(x);
    else if (x["level"] == "runtime plan 0") plans.push_back(x);
    else ADD_FAILURE() << "unexpected: " << x.dump();
  }
  ASSERT_EQ(rank.size(), 1u) << d.dump(1);
  std::printf("%s: %s\n", rank[0]["where"].get<std::string>().c_str(), rank[0]["what"].get<std::string>().c_str());
  EXPECT_THAT(rank[0]["where"].get<std::string>(), HasSubstr("(gradient)"));
  EXPECT_THAT(rank[0]["what"].get<std::string>(), ::testing::MatchesRegex("collectives reduce_scatter over dp_shard \\((.*)\\) in A, reduce_scatter over dp_shard \\((.*)\\) in B"));
  ASSERT_EQ(plans.size(), 1u) << d.dump(1);
  EXPECT_EQ(plans[0]["where"], "bucket 0");
}

// dp 2 against fsdp 2 of one model: the logical graphs match node for node; every gradient's
// all_reduce over dp_replicate in A is a reduce_scatter over dp_shard in B, every parameter
// gains its all_gathers, and nothing else moves (the scalar loss and norm all_reduces only
// change their mesh dim).
TEST(Diff, DpAgainstFsdpDiffersInExactlyTheExpectedCollectives) {
  test::TempDir dir;
  const fs::path a = dump(dir, "dp", kDp), b = dump(dir, "fsdp", kFsdp);
  const json d = diff_json(a, b, 1);
  EXPECT_EQ(d["unmatched_logical_nodes"], 0);
  std::set<std::string> a_ops, b_ops;
  for (const auto& c : d["summary"]) {
    const std::string key = c["op"].get<std::string>() + " over " + c["mesh_dim"].get<std::string>();
    if (c["count"][0].get<int>() > 0) a_ops.insert(key);
    if (c["count"][1].get<int>() > 0) b_ops.insert(key);
  }
  EXPECT_EQ(a_ops, (std::set<std::string>{"all_reduce over dp_replicate"}));
  EXPECT_EQ(b_ops, (std::set<std::string>{"all_gather over dp_shard", "reduce_scatter over dp_shard", "all_reduce over dp_shard"}));
  const json params = read_json(a / "plan.json")["inputs"];
  std::set<std::string> gradients, gathered;
  for (const auto& x : d["differences"]) {
    if (x["level"] != "rank 0") continue;
    const std::string where = x["where"], what = x["what"];
    if (what.rfind("collectives ", 0) != 0) continue;
    if (where.size() > 11 && where.compare(where.size() - 11, 11, " (gradient)") == 0) {
      EXPECT_THAT(what, ::testing::MatchesRegex("collectives all_reduce over dp_replicate \\(.*\\) in A, reduce_scatter over dp_shard \\(.*\\) in B")) << where;
      gradients.insert(where.substr(0, where.size() - 11));
    } else if (what.find(" in A, all_gather over dp_shard") != std::string::npos) {
      gathered.insert(where);
    }
  }
  std::size_t n_params = 0;
  for (const auto& [name, placement] : params.items()) {
    if (name.rfind("exp_avg", 0) == 0 || name == "tokens" || name == "labels" || name.rfind("rope.", 0) == 0 || name == "lr" || name == "step") continue;
    ++n_params;
    const std::string p = name.substr(0, name.size() - 7);  // ".weight"
    EXPECT_TRUE(gradients.count(p)) << p << " has no gradient collective difference";
    EXPECT_TRUE(gathered.count(p)) << p << " has no all_gather difference";
  }
  EXPECT_EQ(gradients.size(), n_params);
  auto r = spmdx("diff '" + a.string() + "' '" + b.string() + "'");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.output, HasSubstr("[plan] mesh: dp_replicate=2 in A, dp_shard=2 in B"));
  EXPECT_THAT(r.output, HasSubstr("(its AdamW state alike)"));
  EXPECT_THAT(r.output, HasSubstr("[runtime plan 0] bucket 0: all_reduce(sum) over dp_replicate"));
  bool collapsed = false;
  for (const auto& x : d["differences"]) collapsed = collapsed || (x["level"] == "rank 1" && x["where"] == "all");
  EXPECT_TRUE(collapsed) << "rank 1's differences are rank 0's, said in one line";
}

// The step's output placements and the gradients each bucket carries are compared too (a
// changed one was reported as equivalent).
TEST(Diff, OutputPlacementsAndBucketMembersAreCompared) {
  test::TempDir dir;
  const fs::path a = dump(dir, "a", kDp);
  fs::copy(a, dir / "b", fs::copy_options::recursive);
  json plan = read_json(a / "plan.json");
  ASSERT_EQ(plan["outputs"]["loss"], "R");
  plan["outputs"]["loss"] = "S(0)";
  write_json(dir / "b" / "plan.json", plan);
  json runtime = read_json(a / "rank0.plan.json");
  ASSERT_GE(runtime["buckets"][0]["members"].size(), 2u);
  std::swap(runtime["buckets"][0]["members"][0], runtime["buckets"][0]["members"][1]);
  write_json(dir / "b" / "rank0.plan.json", runtime);
  auto r = spmdx("diff '" + a.string() + "' '" + (dir / "b").string() + "'");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("[plan] output loss: placement R in A, S(0) in B"));
  EXPECT_THAT(r.output, ::testing::ContainsRegex("\\[runtime plan 0\\] bucket 0: member 0 is [^ ]+ \\(gradient\\) in A, [^ ]+ \\(gradient\\) in B"));
}

TEST(Diff, BadInputExitsTwoNamingTheFile) {
  test::TempDir dir;
  const fs::path a = dump(dir, "a", kDp);
  auto r = spmdx("diff '" + a.string() + "' '" + (dir / "nowhere").string() + "'");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.output, HasSubstr((dir / "nowhere").string() + ": not a folder (give a spmdx compile --dump folder or a config .toml)"));
  fs::create_directories(dir / "empty");
  r = spmdx("diff '" + a.string() + "' '" + (dir / "empty").string() + "'");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.output, HasSubstr((dir / "empty" / "logical.json").string() + ": missing"));
  fs::copy(a, dir / "broken", fs::copy_options::recursive);
  test::write_file(dir / "broken" / "rank1.json", "{\"format\": \"spmdx.graph\", \"inputs\": [");
  r = spmdx("diff '" + a.string() + "' '" + (dir / "broken").string() + "'");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.output, HasSubstr((dir / "broken" / "rank1.json").string() + ": not JSON"));
  test::write_file(dir / "broken" / "rank1.json", "{\"format\": \"something else\"}");
  r = spmdx("diff '" + a.string() + "' '" + (dir / "broken").string() + "'");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.output, HasSubstr("rank1.json: not a graph document"));
  test::write_file(dir / "broken" / "rank1.json",
                   "{\"format\": \"spmdx.graph\", \"inputs\": [{\"name\": \"x\", \"meta\": {\"dtype\": \"f32\", \"shape\": [2]}, \"id\": 1e30}]}");
  r = spmdx("diff '" + a.string() + "' '" + (dir / "broken").string() + "'");  // a float id: get<int> made it -2147483648
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.output, HasSubstr("rank1.json: malformed graph document (the id 1e+30 is not a whole number that spmdx writes)"));
  test::write_file(dir / "broken" / "rank1.json", "{\"format\": null}");  // was nlohmann's type error, naming no file
  r = spmdx("diff '" + a.string() + "' '" + (dir / "broken").string() + "'");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.output, HasSubstr("rank1.json: not a graph document"));
  fs::remove(dir / "broken" / "rank1.json");
  fs::copy(a / "rank1.json", dir / "broken" / "rank1.json");
  fs::remove(dir / "broken" / "rank0.json");
  r = spmdx("diff '" + a.string() + "' '" + (dir / "broken").string() + "'");  // was "0 rank graphs in B", a difference
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.output, HasSubstr((dir / "broken" / "rank0.json").string() + ": missing, but rank1.json is there"));
  fs::copy(a / "rank0.json", dir / "broken" / "rank0.json");
  fs::remove(dir / "broken" / "rank0.plan.json");
  r = spmdx("diff '" + a.string() + "' '" + (dir / "broken").string() + "'");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.output, HasSubstr((dir / "broken" / "rank0.plan.json").string() + ": missing beside rank0.json"));
  fs::copy(a / "rank0.plan.json", dir / "broken" / "rank0.plan.json");
  test::write_file(dir / "broken" / "plan.json", "{}");
  r = spmdx("diff '" + a.string() + "' '" + (dir / "broken").string() + "'");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.output, HasSubstr("plan.json: not a sharding plan"));
  // A field of the wrong type names the file (A's here: which of the two) and the field, before
  // any comparison reads it (it was "A/plan.json or B/plan.json: malformed", the library's words).
  auto edited = [&](const std::string& file, auto&& edit) {
    json j = read_json(a / file);
    edit(j);
    write_json(dir / "broken" / file, j);
    const auto out = spmdx("diff '" + (dir / "broken").string() + "' '" + a.string() + "'");
    EXPECT_EQ(out.exit_code, 2) << out.output;
    fs::copy(a / file, dir / "broken" / file, fs::copy_options::overwrite_existing);
    return out.output;
  };
  const std::string placements = "not placements (as \"S(0)R\" or \"P(sum)\"); write it again with spmdx compile --dump";
  EXPECT_THAT(edited("plan.json", [](json& j) { j["nodes"][1]["outputs"][0] = 5; }),
              HasSubstr((dir / "broken" / "plan.json").string() + ": /nodes/1/outputs/0 is 5, " + placements));
  EXPECT_THAT(edited("plan.json", [](json& j) { j["inputs"]["tokens"] = "Q(1)"; }), HasSubstr("plan.json: /inputs/tokens is \"Q(1)\", " + placements));
  EXPECT_THAT(edited("plan.json", [](json& j) { j["outputs"]["loss"] = "S(99999999)"; }), HasSubstr("plan.json: /outputs/loss is \"S(99999999)\", not placements"));
  EXPECT_THAT(edited("plan.json", [](json& j) { j["mesh"][0]["size"] = -1; }), HasSubstr("plan.json: /mesh/0/size is -1, not a whole number from 0 to 2^63 - 1"));
  EXPECT_THAT(edited("plan.json", [](json& j) { j["mesh"][0]["size"] = 9223372036854775808ull; }),  // read as 0, once
              HasSubstr("plan.json: /mesh/0/size is 9223372036854775808, not a whole number"));
  EXPECT_THAT(edited("plan.json", [](json& j) { j["redistributions"][0]["steps"][0]["bytes"] = 1e30; }),
              HasSubstr("plan.json: /redistributions/0/steps/0/bytes is 1e+30, not a byte count from 0 to 1e18"));
  EXPECT_THAT(edited("rank0.plan.json", [](json& j) { j["issues"] = "many"; }), HasSubstr("rank0.plan.json: /issues is \"many\", not a whole number"));
  EXPECT_THAT(edited("rank0.plan.json", [](json& j) { j["format"] = nullptr; }), HasSubstr("rank0.plan.json: not a runtime plan"));
  EXPECT_THAT(edited("rank0.plan.json", [](json& j) { j["buckets"][0]["members"][0] = 999999; }),
              HasSubstr("rank0.plan.json: /buckets/0/members/0 is 999999, not a node of its rank graph"));
  EXPECT_THAT(edited("rank1.json", [](json& j) { j["nodes"][0]["outputs"][0]["meta"]["shape"] = "big"; }),
              HasSubstr("rank1.json: /nodes/0/outputs/0/meta/shape is \"big\", not an array"));
  EXPECT_THAT(edited("rank1.json", [](json& j) { j["inputs"][0]["meta"]["shape"][0] = 9223372036854775808ull; }),  // wrapped to a negative size, once
              HasSubstr("rank1.json: /inputs/0/meta/shape/0 is 9223372036854775808, not a whole number"));
  EXPECT_THAT(edited("rank1.json", [](json& j) { j["inputs"][0]["meta"]["dtype"] = "a/b"; }), HasSubstr("rank1.json: /inputs/0/meta/dtype is \"a/b\", not a dtype"));
  EXPECT_THAT(edited("rank1.json", [](json& j) { j["inputs"][0]["meta"]["requires_grad"] = 1; }),
              HasSubstr("rank1.json: /inputs/0/meta/requires_grad is 1, not a boolean"));
  // A structure the checks do not cover: the JSON library's error, with the value's place.
  EXPECT_THAT(edited("logical.json", [](json& j) { j["inputs"][0]["name"] = 5; }),
              HasSubstr("logical.json: malformed graph document ([json.exception.type_error.302] (/inputs/0/name) type must be string, but is number)"));
  // A rank's runtime plan without its graph.
  fs::remove(dir / "broken" / "rank1.json");
  r = spmdx("diff '" + a.string() + "' '" + (dir / "broken").string() + "'");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.output, HasSubstr((dir / "broken" / "rank1.json").string() + ": missing, but rank1.plan.json is there"));
  fs::copy(a / "rank1.json", dir / "broken" / "rank1.json");
  test::write_file(dir / "bad.toml", "[training]\nstepz = 3\n");
  r = spmdx("diff '" + a.string() + "' '" + (dir / "bad.toml").string() + "'");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.output, HasSubstr("stepz"));
}

}  // namespace
}  // namespace spmdx
