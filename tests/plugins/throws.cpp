// Test plugin whose registration adds a factory and then throws: the host must survive, name
// the plugin, and keep nothing of what it registered.
#include <spmdx/plugin.h>

#include <stdexcept>

namespace {

class Quiet final : public spmdx::Hook {
 public:
  void on_step_end(const spmdx::StepInfo&) override {}
};

void register_then_throw(spmdx::Registrar& r) {
  r.add_hook("test_throws", [](const spmdx::Options&) { return std::make_unique<Quiet>(); });
  throw std::runtime_error("cannot find libfoo settings");
}

}  // namespace

SPMDX_PLUGIN("test_throws", hook, "1.0.0", "test: registration throws", register_then_throw)
