// RuntimePlan: the order it runs a rank's graph in, its buckets and its prefetches, checked on
// the plans of real jobs (llama tiny as DDP, FSDP and FSDP x TP).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "spmdx/config/config.h"
#include "spmdx/core/registry.h"
#include "spmdx/plan/memory_plan.h"
#include "spmdx/plan/runtime_plan.h"
#include "spmdx/sharding/rewriter.h"
#include "spmdx/job/compile.h"
#include "spmdx/job/preflight.h"
#include "spmdx/job/spec.h"
#include "spmdx/sharding/redistribute.h"

namespace spmdx {
namespace {

using ::testing::HasSubstr;

struct Job {
  std::unique_ptr<job::PlacedJob> job;
  std::unique_ptr<sharding::DistributedPlan> plan;
  std::unique_ptr<ir::Graph> graph;  // rank 0's
  Job(std::int64_t replicate, std::int64_t shard, std::int64_t tp) {
    config::Config cfg = config::Config::load(SPMDX_SOURCE_DIR "/configs/llama_fsdp.toml");
    cfg.override_value("parallelism.data_parallel_replicate_degree", std::to_string(replicate));
    cfg.override_value("parallelism.data_parallel_shard_degree", std::to_string(shard));
    cfg.override_value("parallelism.tensor_parallel_degree", std::to_string(tp));
    PluginRegistry registry;
    registry.discover({{BUILTIN_PLUGIN_DIR, PluginSource::Origin::builtin}});
    job = std::make_unique<job::PlacedJob>(job::place_job(job::job_spec(cfg, replicate * shard * tp, 256), registry));
    plan = std::make_unique<sharding::DistributedPlan>(
        job::propagate_job(*job));
    graph = std::make_unique<ir::Graph>(sharding::rank_graph(*plan, 0));
  }
};

std::vector<const ir::Node*> nodes_of(const ir::Graph& g) {
  std::vector<const ir::Node*> out;
  for (const auto& n : g.nodes()) out.push_back(n.get());
  return out;
}

// Every node once, every input produced before it is read.
void expect_valid_order(const ir::Graph& g, const plan::RuntimePlan& p) {
  const auto nodes = nodes_of(g);
  ASSERT_EQ(p.order.size(), nodes.size());
  std::set<const ir::Value*> ready(g.inputs().begin(), g.inputs().end());
  std::set<int> seen;
  for (int i : p.order) {
    EXPECT_TRUE(seen.insert(i).second) << "node " << i << " twice";
    for (const ir::Value* v : nodes[static_cast<std::size_t>(i)]->inputs()) EXPECT_TRUE(ready.count(v)) << v->ref() << " read before it exists";
    for (const ir::Value* v : nodes[static_cast<std::size_t>(i)]->outputs()) ready.insert(v);
  }
}

TEST(RuntimePlan, DdpBucketsGradientsFirstBucketSmallAndIssuesEachAfterItsLastGradient) {
  Job j(4, 1, 1);
  plan::PlanOptions o;
  o.bucket_bytes = 4.0 * 1024 * 1024;
  o.first_bucket_bytes = 128.0 * 1024;  // the output weight's gradient (64 KiB) and the next ones
  const auto p = plan::make_runtime_plan(*j.graph, j.job->mesh, o);
  expect_valid_order(*j.graph, p);
  const auto nodes = nodes_of(*j.graph);
  ASSERT_GE(p.buckets.size(), 2u);
  std::int64_t members = 0;
  for (std::size_t b = 0; b < p.buckets.size(); ++b) {
    const auto& bucket = p.buckets[b];
    std::int64_t bytes = 0;
    for (int m : bucket.members) {
      EXPECT_EQ(nodes[static_cast<std::size_t>(m)]->op(), "all_reduce");
      EXPECT_EQ(p.bucket_of[static_cast<std::size_t>(m)], static_cast<int>(b));
      bytes += nodes[static_cast<std::size_t>(m)]->input(0)->meta().nbytes();
    }
    members += static_cast<std::int64_t>(bucket.members.size());
    EXPECT_EQ(bucket.bytes, bytes);
    EXPECT_LE(static_cast<double>(bucket.bytes), bucket.cap) << "bucket " << b;
    EXPECT_EQ(bucket.cap, b == 0 ? o.first_bucket_bytes : o.bucket_bytes) << "bucket " << b;
    EXPECT_GT(bucket.first_use, bucket.issue_after) << "every member is read after the bucket is issued";
  }
  EXPECT_EQ(p.issues, p.collectives - members + static_cast<std::int64_t>(p.buckets.size()));
  // Issued early: each gradient's all_reduce right after the node that computes the gradient.
  std::vector<int> pos(nodes.size());
  for (std::size_t i = 0; i < p.order.size(); ++i) pos[static_cast<std::size_t>(p.order[i])] = static_cast<int>(i);
  for (const auto& b : p.buckets) {
    for (int m : b.members) {
      const ir::Node* producer = nodes[static_cast<std::size_t>(m)]->input(0)->producer();
      const int pp = pos[static_cast<std::size_t>(std::find(nodes.begin(), nodes.end(), producer) - nodes.begin())];
      EXPECT_LE(pos[static_cast<std::size_t>(m)] - pp, 3) << "a gradient's all_reduce follows its producer";
    }
  }
  EXPECT_THAT(p.str(*j.graph, j.job->mesh), HasSubstr("bucket 0: all_reduce(sum) on dp_replicate"));
}

TEST(RuntimePlan, NoBucketsWhenOffAndForwardAllReducesAreNeverBucketed) {
  Job j(1, 1, 2);
  plan::PlanOptions off;
  off.bucket_bytes = 0;
  const auto p = plan::make_runtime_plan(*j.graph, j.job->mesh, off);
  EXPECT_TRUE(p.buckets.empty());
  EXPECT_EQ(p.issues, p.collectives);
  const auto on = plan::make_runtime_plan(*j.graph, j.job->mesh);
  expect_valid_order(*j.graph, on);
  for (const auto& b : on.buckets) EXPECT_GT(b.first_use, b.issue_after);
}

TEST(RuntimePlan, FsdpPrefetchesTheNextLayersAllGathersWhileTheCurrentLayerRuns) {
  Job j(1, 4, 1);
  const auto p = plan::make_runtime_plan(*j.graph, j.job->mesh);
  expect_valid_order(*j.graph, p);
  ASSERT_FALSE(p.prefetched.empty());
  const auto nodes = nodes_of(*j.graph);
  std::vector<int> pos(nodes.size());
  for (std::size_t i = 0; i < p.order.size(); ++i) pos[static_cast<std::size_t>(p.order[i])] = static_cast<int>(i);
  // layers.1's first all_gather is issued before layers.0's parameters are first used.
  auto first_read = [&](const std::string& layer) {
    int best = static_cast<int>(nodes.size());
    for (std::size_t i = 0; i < nodes.size(); ++i) {
      if (nodes[i]->op() == "all_gather") continue;
      for (const ir::Value* v : nodes[i]->inputs()) {
        const ir::Node* prod = v->producer();
        if (prod != nullptr && prod->op() == "all_gather" && prod->input(0)->name().rfind(layer + ".", 0) == 0) best = std::min(best, pos[i]);
      }
    }
    return best;
  };
  int layer1_gather = static_cast<int>(nodes.size());
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    if (nodes[i]->op() == "all_gather" && nodes[i]->input(0)->name().rfind("layers.1.", 0) == 0) layer1_gather = std::min(layer1_gather, pos[i]);
  }
  EXPECT_LT(layer1_gather, first_read("layers.0"));
  EXPECT_GT(layer1_gather, 0) << "not everything at the start: one layer ahead";
  plan::PlanOptions none;
  none.prefetch = false;
  EXPECT_TRUE(plan::make_runtime_plan(*j.graph, j.job->mesh, none).prefetched.empty());
  // FSDP's gradients are reduce-scattered in buckets, one backend call per bucket.
  std::size_t rs_buckets = 0;
  for (const auto& b : p.buckets) {
    if (b.op != "reduce_scatter") continue;
    ++rs_buckets;
    for (int m : b.members) EXPECT_EQ(nodes[static_cast<std::size_t>(m)]->op(), "reduce_scatter");
    EXPECT_LE(static_cast<double>(b.bytes), b.cap);
  }
  EXPECT_GT(rs_buckets, 0u);
  EXPECT_LT(p.issues, p.collectives);
}

// FSDP2 keeps one reduce_scatter in flight: each gradient reduce_scatter call (bucket or
// single) is waited for by the time the next one of its mesh dim is issued, so its input, the
// layer's whole gradients, is freed then and not when AdamW reads the shards at the end. The
// memory plan, which simulates the executor, holds fewer gradient bytes at its peak for it.
TEST(RuntimePlan, AtMostOneReduceScatterCallIsInFlightPerMeshDimAndTheGradientsHeldFall) {
  for (const auto& [shard, tp] : std::vector<std::pair<std::int64_t, std::int64_t>>{{4, 1}, {2, 2}}) {
    Job j(1, shard, tp);
    plan::PlanOptions o;
    o.bucket_bytes = 64.0 * 1024;  // several buckets per mesh dim
    o.first_bucket_bytes = 16.0 * 1024;
    const auto p = plan::make_runtime_plan(*j.graph, j.job->mesh, o);
    expect_valid_order(*j.graph, p);
    const auto nodes = nodes_of(*j.graph);
    std::vector<int> pos(nodes.size());
    for (std::size_t i = 0; i < p.order.size(); ++i) pos[static_cast<std::size_t>(p.order[i])] = static_cast<int>(i);
    // Per mesh dim, the reduce_scatter calls as (issued at, waited at).
    std::map<std::int64_t, std::vector<std::pair<int, int>>> calls;
    std::set<int> bucket_seen;
    for (std::size_t i = 0; i < nodes.size(); ++i) {
      if (nodes[i]->op() != "reduce_scatter") continue;
      const int b = p.bucket_of[i];
      if (b >= 0 && !bucket_seen.insert(b).second) continue;
      const int issued = b >= 0 ? p.buckets[static_cast<std::size_t>(b)].issue_after : pos[i];
      calls[nodes[i]->attr_int("mesh_dim")].emplace_back(issued, p.waited_at(static_cast<int>(i)));
    }
    ASSERT_FALSE(calls.empty());
    int bounded = 0;
    for (auto& [dim, list] : calls) {
      std::sort(list.begin(), list.end());
      ASSERT_GE(list.size(), 3u) << "mesh dim " << dim;
      for (std::size_t k = 1; k < list.size(); ++k) {
        EXPECT_LE(list[k - 1].second, list[k].first) << "mesh dim " << dim << ": call " << k - 1 << " is still in flight when call " << k << " is issued";
        EXPECT_GT(list[k - 1].second, list[k - 1].first) << "waited before it is issued";
      }
    }
    for (const auto& waits : p.wait_before) bounded += static_cast<int>(!waits.empty());
    EXPECT_GT(bounded, 0) << "FSDP's gradients are read only by the optimizer at the end: some waits must move";
    EXPECT_THAT(p.str(*j.graph, j.job->mesh), HasSubstr("(bound: one reduce_scatter in flight)"));
    // Unbounded (overlap off waits at once; so compare against the plan with the waits removed).
    plan::RuntimePlan unbounded = p;
    for (auto& waits : unbounded.wait_before) waits.clear();
    // The step's peak of this small model is in the forward. Where the backward ends (before
    // the gradient norm's first square), the unbounded plan still holds every layer's whole
    // gradients as reduce_scatter inputs; the bounded one only the last call's (at least a
    // quarter of them less: under tp, part of it is tp's own traffic, waited for at once).
    const auto m = plan::plan_memory(*j.graph, p), u = plan::plan_memory(*j.graph, unbounded);
    EXPECT_LE(m.peak_bytes, u.peak_bytes);
    int last = 0;
    for (const auto& [dim, list] : calls) last = std::max(last, list.back().first);
    std::int64_t gradient_bytes = 0;  // the rank's whole (unsharded over dp_shard) gradients
    for (std::size_t i = 0; i < nodes.size(); ++i) {
      if (nodes[i]->op() == "reduce_scatter") gradient_bytes += nodes[i]->input(0)->meta().nbytes();
    }
    EXPECT_LT(m.held.at(static_cast<std::size_t>(last)) + gradient_bytes / 4, u.held.at(static_cast<std::size_t>(last)))
        << "fsdp " << shard << " x tp " << tp << ": held after the last reduce_scatter is issued";
  }
}

// FSDP x TP: a norm weight's gradient is all-reduced over tp (in a bucket), then
// reduce-scattered over dp_shard. Those second collectives are moved to where the tp bucket is
// waited for and bucketed together, instead of each being issued and read at once.
TEST(RuntimePlan, CollectivesFedByABucketAreBucketedTogetherWhereItIsWaitedFor) {
  Job j(1, 2, 2);
  const auto p = plan::make_runtime_plan(*j.graph, j.job->mesh);
  expect_valid_order(*j.graph, p);
  const auto nodes = nodes_of(*j.graph);
  std::vector<int> pos(nodes.size());
  for (std::size_t i = 0; i < p.order.size(); ++i) pos[static_cast<std::size_t>(p.order[i])] = static_cast<int>(i);
  std::size_t fed = 0, fed_bucketed = 0;
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    const ir::Node* n = nodes[i];
    if (n->op() != "reduce_scatter" || n->input(0)->producer() == nullptr) continue;
    const ir::Node* prod = n->input(0)->producer();
    if (prod->op() != "all_reduce") continue;
    const int b = p.bucket_of[static_cast<std::size_t>(std::find(nodes.begin(), nodes.end(), prod) - nodes.begin())];
    if (b < 0) continue;  // fed by a plain collective
    ++fed;
    if (p.bucket_of[i] >= 0) {
      ++fed_bucketed;
      const auto& mine = p.buckets[static_cast<std::size_t>(p.bucket_of[i])];
      for (int m : mine.members) {  // a bucket of such collectives only
        const ir::Node* mp = nodes[static_cast<std::size_t>(m)]->input(0)->producer();
        EXPECT_TRUE(mp != nullptr && mp->op() == "all_reduce") << nodes[static_cast<std::size_t>(m)]->output()->ref();
      }
      EXPECT_GE(mine.issue_after, p.buckets[static_cast<std::size_t>(b)].first_use - static_cast<int>(mine.members.size()));
    }
  }
  EXPECT_GT(fed, 2u);
  EXPECT_EQ(fed_bucketed, fed) << "every reduce_scatter fed by the tp bucket is in a bucket";
  // Without overlap the order is the graph's and nothing moves.
  plan::PlanOptions off;
  off.overlap = false;
  const auto q = plan::make_runtime_plan(*j.graph, j.job->mesh, off);
  expect_valid_order(*j.graph, q);
  EXPECT_LT(p.issues, q.issues);
}

// The collectives plan.txt (DistributedPlan::str) lists: one per redistribution step it prints.
int printed_collectives(const std::string& plan_text) {
  int n = 0;
  std::istringstream lines(plan_text);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("  redistribute ", 0) != 0) continue;
    for (const char* op : {" all_reduce (", " all_gather (", " reduce_scatter (", " all_to_all ("}) {
      for (auto at = line.find(op); at != std::string::npos; at = line.find(op, at + 1)) ++n;
    }
  }
  return n;
}

int rank_collectives(const ir::Graph& g) {
  int n = 0;
  for (const auto& node : g.nodes()) n += sharding::is_collective(node->op());
  return n;
}

// mul(%c, %c) with %c Partial: both operands read it as one Shard, the rank runs one
// reduce_scatter, and plan.txt says so (it used to list one redistribution per operand).
TEST(PlanText, AnOperandReadTwiceIsRedistributedOnceAsTheRankRunsIt) {
  ir::Graph g;
  ir::Value* a = g.add_input("a", {{4, 8}, ir::DType::f32, "cpu", false});
  ir::Value* b = g.add_input("b", {{8, 4}, ir::DType::f32, "cpu", false});
  ir::Value* c = g.add("matmul", {a, b});
  g.add_output("d", g.add("mul", {c, c}));
  const sharding::DeviceMesh mesh({{"tp", 2}});
  const auto plan = sharding::propagate(g, mesh, {{"a", {Placement::shard(1)}}, {"b", {Placement::shard(0)}}});
  ASSERT_EQ(to_string(plan.placement.at(c)), "P(sum)") << plan.str();
  const std::string text = plan.str();
  EXPECT_EQ(printed_collectives(text), 1) << text;
  EXPECT_THAT(text, HasSubstr("  redistribute " + c->ref() + " P(sum) -> S(0): mesh dim 0: P(sum) -> S(0) reduce_scatter")) << text;
  EXPECT_THAT(text, HasSubstr(" = mul(" + c->ref() + ": S(0), " + c->ref() + ": S(0))")) << text;
  EXPECT_EQ(rank_collectives(sharding::rank_graph(plan, 0)), 1);
  // plan.json keeps one entry per operand read in other placements; the second does not run.
  const auto j = nlohmann::json::parse(plan.to_json());
  ASSERT_EQ(j.at("redistributions").size(), 2u) << j.dump(1);
  EXPECT_TRUE(j["redistributions"][0].at("runs").get<bool>());
  EXPECT_FALSE(j["redistributions"][1].at("runs").get<bool>());
}

// On a real job (llama tiny, FSDP x TP, with FSDP's reshard after forward): plan.txt lists
// exactly the collectives rank 0 runs.
TEST(PlanText, ListsTheCollectivesTheRankGraphRuns) {
  const Job j(1, 2, 2);
  const int printed = printed_collectives(j.plan->str());
  EXPECT_GT(printed, 10);
  EXPECT_EQ(printed, rank_collectives(*j.graph));
}

}  // namespace
}  // namespace spmdx
