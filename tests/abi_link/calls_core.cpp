// Compiles (the core's headers are visible) but must not link: builtin_plugin_dir() is defined
// in libspmdx_core.so, which a plugin does not link, and libspmdx_host.so does not export it.
#include <spmdx/core/log.h>
#include <spmdx/core/registry.h>
#include <spmdx/plugin.h>

namespace {

void register_me(spmdx::Registrar&) {
  SPMDX_INFO("the built-in plugins are in " << spmdx::builtin_plugin_dir().string());  // not a host service
}

}  // namespace

SPMDX_PLUGIN("abi_violation", strategy, "0.1.0", "test: calls a core symbol that is no host service", register_me)
