// Test plugin "test_bad_placement": a strategy whose answer for the first parameter on its mesh
// dim is the option `placement`, so the host boundary's checks can be tried one by one:
//   "shard5" Shard(5), "shard-1" Shard(-1), "partial" Partial(sum), "short" one placement too
//   few; anything else: Replicate. Every other tensor is left out (Replicate).
#include <spmdx/plugin.h>

namespace {

class BadPlacement final : public spmdx::Strategy {
 public:
  explicit BadPlacement(std::string what) : what_(std::move(what)) {}

  spmdx::PlacementMap place(const spmdx::StrategyInput& in) const override {
    if (in.parameters.empty()) return {};
    std::vector<spmdx::Placement> pl(in.mesh.size(), spmdx::Placement::replicate());
    auto& mine = pl.at(static_cast<std::size_t>(in.mesh_dim));
    if (what_ == "shard5") mine = spmdx::Placement::shard(5);
    if (what_ == "shard-1") mine = spmdx::Placement::shard(-1);
    if (what_ == "partial") mine = spmdx::Placement::partial();
    if (what_ == "short") pl.pop_back();
    return {{in.parameters.front().name, pl}};
  }

 private:
  std::string what_;
};

void register_bad_placement(spmdx::Registrar& r) {
  r.add_strategy("test_bad_placement", [](const spmdx::Options& o) {
    const auto it = o.find("placement");
    return std::make_unique<BadPlacement>(it == o.end() ? "" : it->second);
  });
}

}  // namespace

SPMDX_PLUGIN("test_bad_placement", strategy, "1.0.0", "test: places the first parameter as its option `placement` says",
             register_bad_placement)
