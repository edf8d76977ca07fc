// Test plugins that break the registration rules, chosen by MISBEHAVE:
//   1 "test_hijack"     (strategy) registers a strategy under another plugin's name
//   2 "test_wrong_kind" (comm)     registers a strategy
//   3 "Bad-Name!"       (hook)     has a name outside [a-z0-9_]+
//   4 "test_typo"       (strategy) places "w1.weigth", a parameter that does not exist
#include <spmdx/plugin.h>

namespace {

class Nothing final : public spmdx::Strategy {
 public:
  spmdx::PlacementMap place(const spmdx::StrategyInput& in) const override {
    if (MISBEHAVE != 4) return {};
    return {{"w1.weigth", std::vector<spmdx::Placement>(in.mesh.size(), spmdx::Placement::shard(0))}};
  }
};

void register_misbehaving(spmdx::Registrar& r) {
  r.add_strategy(MISBEHAVE == 1 ? "test_strategy" : MISBEHAVE == 4 ? "test_typo" : "test_wrong_kind",
                 [](const spmdx::Options&) { return std::make_unique<Nothing>(); });
}

}  // namespace

#if MISBEHAVE == 1
SPMDX_PLUGIN("test_hijack", strategy, "1.0.0", "test: takes another plugin's name", register_misbehaving)
#elif MISBEHAVE == 2
SPMDX_PLUGIN("test_wrong_kind", comm, "1.0.0", "test: registers another kind", register_misbehaving)
#elif MISBEHAVE == 4
SPMDX_PLUGIN("test_typo", strategy, "1.0.0", "test: names a parameter that does not exist", register_misbehaving)
#else
SPMDX_PLUGIN("Bad-Name!", hook, "1.0.0", "test: bad name", register_misbehaving)
#endif
