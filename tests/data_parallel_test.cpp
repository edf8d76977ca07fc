// The data_parallel strategy plugin, loaded from the built-in plugin folder as a user's run
// would load it.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "spmdx/core/registry.h"

namespace spmdx {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<Strategy> data_parallel() {
  PluginRegistry registry;
  registry.discover(plugin_search_path({}));
  return registry.make_strategy("data_parallel");
}

TEST(DataParallel, ReplicatesParametersAndShardsTheBatchOnItsMeshDim) {
  StrategyInput in{{{"dp_replicate", 2}, {"dp_shard", 2}, {"tp", 2}},
                   {{"tok_embeddings.weight", {256, 64}}, {"norm.weight", {64}}},
                   {{"tokens", {8, 32}}, {"labels", {8, 32}}}};
  for (int dim : {0, 1, 2}) {  // by the index the host gives, whatever the dim's name
    in.mesh_dim = dim;
    PlacementMap placements = data_parallel()->place(in);
    ASSERT_EQ(placements.size(), 4u);
    const std::string batch = dim == 0 ? "S(0)RR" : dim == 1 ? "RS(0)R" : "RRS(0)";
    EXPECT_EQ(to_string(placements.at("tok_embeddings.weight")), "RRR");
    EXPECT_EQ(to_string(placements.at("norm.weight")), "RRR");
    EXPECT_EQ(to_string(placements.at("tokens")), batch);
    EXPECT_EQ(to_string(placements.at("labels")), batch);
  }
}

TEST(DataParallel, BatchNotAMultipleOfTheDegreeIsRejected) {
  StrategyInput in{{{"dp", 4}}, {}, {{"tokens", {6, 32}}}};
  try {
    data_parallel()->place(in);
    FAIL() << "a batch of 6 over 4 ranks was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("input 'tokens' has batch size 6, not a multiple of the data-parallel degree 4"));
  }
}

TEST(DataParallel, MeshDimOutsideTheMeshIsRejected) {
  StrategyInput in{{{"tp", 2}}, {}, {{"tokens", {8, 32}}}, 1};
  try {
    data_parallel()->place(in);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("data_parallel: mesh_dim 1 is not a dim of the mesh (1 dims)"));
  }
}

}  // namespace
}  // namespace spmdx
