// Test plugin with a chosen ABI version (TEST_ABI_MAJOR.TEST_ABI_MINOR): what an old or new
// plugin looks like to this host.
#include <spmdx/plugin.h>

namespace {

void register_nothing(spmdx::Registrar&) {}

const spmdx::PluginDescriptor descriptor{TEST_ABI_MAJOR, TEST_ABI_MINOR, "test_abi", spmdx::PluginKind::hook,
                                         "1.0.0", "test: built for another ABI", register_nothing};
const spmdx::PluginDescriptor* entry() { return &descriptor; }

}  // namespace

SPMDX_PLUGIN_ENTRY(entry)
