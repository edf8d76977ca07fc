// Test plugin built with -D_GLIBCXX_USE_CXX11_ABI=0 that calls a host service (OptionReader):
// its references to the core library name std::string the old way, so it cannot load here.
#include <spmdx/options.h>
#include <spmdx/plugin.h>

namespace {

class Nothing final : public spmdx::Strategy {
 public:
  explicit Nothing(const spmdx::Options& options) {
    spmdx::OptionReader reader("[parallelism.old_string_abi]", options);
    reader.get_string("mode", "none");
    reader.done();
  }
  spmdx::PlacementMap place(const spmdx::StrategyInput&) const override { return {}; }
};

void register_old(spmdx::Registrar& r) {
  r.add_strategy("test_old_string_abi", [](const spmdx::Options& o) { return std::make_unique<Nothing>(o); });
}

}  // namespace

SPMDX_PLUGIN("test_old_string_abi", strategy, "1.0.0", "test: built with the pre-C++11 std::string ABI", register_old)
