// Test plugin "test_strategy": every parameter S(0) on mesh dim 0, Replicate on the others.
// Built twice (test_strategy, test_strategy_dup) with different versions for the duplicate-name
// case.
#include <spmdx/plugin.h>

#ifndef TEST_PLUGIN_VERSION
#define TEST_PLUGIN_VERSION "1.0.0"
#endif

namespace {

class ShardDim0 final : public spmdx::Strategy {
 public:
  spmdx::PlacementMap place(const spmdx::StrategyInput& in) const override {
    spmdx::PlacementMap out;
    for (const auto& p : in.parameters) {
      std::vector<spmdx::Placement> placements(in.mesh.size(), spmdx::Placement::replicate());
      if (!placements.empty()) placements[0] = spmdx::Placement::shard(0);
      out[p.name] = placements;
    }
    return out;
  }
};

void register_test_strategy(spmdx::Registrar& r) {
  r.add_strategy("test_strategy", [](const spmdx::Options&) { return std::make_unique<ShardDim0>(); });
}

}  // namespace

SPMDX_PLUGIN("test_strategy", strategy, TEST_PLUGIN_VERSION, "test: shard every parameter on mesh dim 0",
             register_test_strategy)
