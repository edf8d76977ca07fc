// Strategy plugins at the host boundary (sharding::parallelize): what a plugin returns is
// checked before the core uses it, and the errors name the plugin, the tensor and the mesh dim.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "spmdx/config/config.h"
#include "spmdx/core/registry.h"
#include "spmdx/sharding/parallelize.h"
#include "spmdx/job/compile.h"
#include "spmdx/job/spec.h"

namespace spmdx {
namespace {

using ::testing::HasSubstr;

PluginRegistry& bad_placement_registry() {
  static PluginRegistry* registry = [] {
    auto* r = new PluginRegistry();
    r->discover({{BUILTIN_PLUGIN_DIR, PluginSource::Origin::builtin}, {std::string(TEST_PLUGIN_DIR) + "/test_bad_placement", PluginSource::Origin::user}});
    return r;
  }();
  return *registry;
}

// A 2-D weight first (the one test_bad_placement misplaces), a 1-D norm, the batch.
StrategyInput two_d_weight() {
  StrategyInput in;
  in.parameters = {{"w1.weight", {32, 16}}, {"norm.weight", {16}}};
  in.inputs = {{"tokens", {4, 8}}};
  return in;
}

// The message parallelize throws for the plugin answering `placement` on tp (mesh dim 1 of
// dp_shard 2 x tp 2).
std::string refusal(const std::string& placement) {
  try {
    sharding::parallelize(bad_placement_registry(), sharding::make_mesh({1, 2, 2}, 4), two_d_weight(), {{"tp", "test_bad_placement"}},
                          {{"test_bad_placement", {{"placement", placement}}}});
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(StrategyPlugins, AShardOfADimTheTensorLacksNamesPluginTensorAndMeshDim) {
  for (const std::string bad : {"shard5", "shard-1"}) {
    const std::string what = refusal(bad);
    EXPECT_THAT(what, HasSubstr("strategy 'test_bad_placement' (plugin test_bad_placement 1.0.0, ")) << bad;
    EXPECT_THAT(what, HasSubstr("libspmdx_test_bad_placement.so)")) << bad;
    EXPECT_THAT(what, HasSubstr(" placed 'w1.weight' (shape [32, 16]) Shard(dim=" + std::string(bad == "shard5" ? "5" : "-1") +
                                ") on a 2-D tensor on mesh dim 1 'tp' (size 2); allowed there: Replicate() or Shard(dim) with dim in 0..1."))
        << bad;
  }
}

TEST(StrategyPlugins, APartialOrAShortListIsRefusedAtTheBoundary) {
  EXPECT_THAT(refusal("partial"), HasSubstr("placed 'w1.weight' (shape [32, 16]) Partial(sum), a pending reduction"));
  EXPECT_THAT(refusal("partial"), HasSubstr("on mesh dim 1 'tp' (size 2)"));
  EXPECT_THAT(refusal("short"), HasSubstr("(plugin test_bad_placement 1.0.0, "));
  EXPECT_THAT(refusal("short"), HasSubstr("gave 1 placements for 'w1.weight' on the mesh"));
  EXPECT_THAT(refusal("short"), HasSubstr("of 2 dims, deciding mesh dim 1 'tp'"));
}

TEST(StrategyPlugins, AValidAnswerIsKeptOnTheDimTheStrategyDecides) {
  const auto placed = sharding::parallelize(bad_placement_registry(), sharding::make_mesh({1, 1, 2}, 2), two_d_weight(), {{"tp", "test_bad_placement"}},
                                            {{"test_bad_placement", {{"placement", "replicate"}}}});
  EXPECT_EQ(to_string(placed.at("w1.weight")), "R");
  EXPECT_EQ(to_string(placed.at("tokens")), "R");
}

// Llama tiny (configs/llama_debug.toml) placed on dp_shard x tp, with more plugins found.
job::PlacedJob llama(std::int64_t shard, std::int64_t tp, const std::string& dp_shard_strategy = "") {
  config::Config cfg = config::Config::load(SPMDX_SOURCE_DIR "/configs/llama_debug.toml");
  cfg.override_value("model.flavor", "tiny");
  cfg.override_value("parallelism.data_parallel_shard_degree", std::to_string(shard));
  cfg.override_value("parallelism.tensor_parallel_degree", std::to_string(tp));
  if (!dp_shard_strategy.empty()) cfg.override_value("parallelism.strategies.dp_shard", dp_shard_strategy);
  PluginRegistry registry;
  registry.discover({{BUILTIN_PLUGIN_DIR, PluginSource::Origin::builtin},
                     {std::string(TEST_PLUGIN_DIR) + "/fsdp_except_embeddings", PluginSource::Origin::user}});
  return job::place_job(job::job_spec(cfg, shard * tp, 256), registry);
}

// Roles come from the ops that read a parameter, not from its name; with loss parallelism (tp 2)
// the logits go to the vocabulary-parallel loss's ops, and the output projection is still found.
TEST(StrategyPlugins, EachParameterGetsTheRoleOfTheOpsThatReadIt) {
  for (const std::int64_t tp : {1, 2}) {
    const job::PlacedJob job = llama(2, tp);
    const auto roles = sharding::parameter_roles(job.model.graph, job.model.params);
    EXPECT_EQ(roles.at("tok_embeddings.weight"), TensorRole::embedding) << "tp " << tp;
    EXPECT_EQ(roles.at("output.weight"), TensorRole::output) << "tp " << tp;
    EXPECT_EQ(roles.at("norm.weight"), TensorRole::norm) << "tp " << tp;
    EXPECT_EQ(roles.at("layers.0.attention_norm.weight"), TensorRole::norm) << "tp " << tp;
    EXPECT_EQ(roles.at("layers.0.attention.wq.weight"), TensorRole::linear) << "tp " << tp;
    EXPECT_EQ(roles.at("layers.0.feed_forward.w2.weight"), TensorRole::linear) << "tp " << tp;
    int unknown = 0;
    for (const auto& [name, role] : roles) unknown += role == TensorRole::unknown;
    EXPECT_EQ(unknown, 0);
  }
  EXPECT_STREQ(to_string(TensorRole::optimizer_state), "optimizer_state");
}

// "name:key=value" binds a strategy with options; the plugin places by role.
TEST(StrategyPlugins, OptionsInTheBindingReachTheStrategy) {
  const job::PlacedJob fsdp = llama(2, 1);
  const job::PlacedJob same = llama(2, 1, "fsdp_except_embeddings:keep=");
  const job::PlacedJob embedding = llama(2, 1, "fsdp_except_embeddings:keep=embedding");
  const job::PlacedJob both = llama(2, 1, "fsdp_except_embeddings");
  EXPECT_EQ(same.inputs, fsdp.inputs);
  EXPECT_EQ(to_string(fsdp.inputs.at("tok_embeddings.weight")), "S(0)");
  EXPECT_EQ(to_string(embedding.inputs.at("tok_embeddings.weight")), "R");
  EXPECT_EQ(to_string(embedding.inputs.at("output.weight")), "S(0)");
  EXPECT_EQ(to_string(both.inputs.at("tok_embeddings.weight")), "R");
  EXPECT_EQ(to_string(both.inputs.at("output.weight")), "R");
  EXPECT_EQ(to_string(both.inputs.at("layers.0.attention.wq.weight")), "S(0)");
  EXPECT_EQ(to_string(both.inputs.at("tokens")), "S(0)");
  ASSERT_EQ(both.decided_by.size(), 1u);
  EXPECT_THAT(both.decided_by[0], HasSubstr("mesh dim dp_shard (2): strategy 'fsdp_except_embeddings' (plugin fsdp_except_embeddings 0.1.0, "));
}

TEST(StrategyPlugins, APluginSpecSplitsAsCommBackendsDo) {
  const PluginSpec s = parse_plugin_spec("fsdp_except_embeddings:keep=embedding,output;x=1", "strategy");
  EXPECT_EQ(s.name, "fsdp_except_embeddings");
  EXPECT_EQ(s.options, (Options{{"keep", "embedding,output"}, {"x", "1"}}));
  EXPECT_TRUE(parse_plugin_spec("fsdp", "strategy").options.empty());
  try {
    parse_plugin_spec("ucx:tls=tcp;tls=shm", "comm backend");
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "comm backend 'ucx:tls=tcp;tls=shm': option 'tls' is given twice");
  }
}

}  // namespace
}  // namespace spmdx
