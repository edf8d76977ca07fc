// Test plugin with a chosen ABI version (TEST_ABI_MAJOR.TEST_ABI_MINOR) and toolchain tag
// (TEST_TOOLCHAIN): what an old or new plugin, or one built with another C++ library, looks
// like to this host.
#include <spmdx/plugin.h>

#ifndef TEST_TOOLCHAIN
#define TEST_TOOLCHAIN SPMDX_TOOLCHAIN
#endif

namespace {

void register_nothing(spmdx::Registrar&) {}

const spmdx::PluginDescriptor descriptor{TEST_ABI_MAJOR, TEST_ABI_MINOR, "test_abi", spmdx::PluginKind::hook,
                                         "1.0.0", "test: built for another ABI", register_nothing, TEST_TOOLCHAIN, 0};
const spmdx::PluginDescriptor* entry() { return &descriptor; }

}  // namespace

SPMDX_PLUGIN_ENTRY(entry)
