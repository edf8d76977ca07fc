// Test plugin whose descriptor has no registration callback.
#include <spmdx/plugin.h>

namespace {

const spmdx::PluginDescriptor descriptor{SPMDX_ABI_MAJOR, SPMDX_ABI_MINOR, "test_no_callback",
                                         spmdx::PluginKind::hook, "1.0.0", "test: no callback", nullptr, SPMDX_TOOLCHAIN, 0};
const spmdx::PluginDescriptor* entry() { return &descriptor; }

}  // namespace

SPMDX_PLUGIN_ENTRY(entry)
