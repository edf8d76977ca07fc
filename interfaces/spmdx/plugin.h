// The spmdx plugin ABI: what a plugin shared object exports and how it registers factories.
//
// Every plugin exports exactly one entry point, the alias `spmdx_plugin`, laid out as
// Boost.DLL's BOOST_DLL_ALIAS (an exported `const void*` in section "boostdll" pointing at a
// function), so the host reads it with boost::dll::shared_library::get_alias while this header
// needs no Boost. The function returns a PluginDescriptor. The host reads abi_major and
// abi_minor first and touches nothing else unless
//     plugin.abi_major == SPMDX_ABI_MAJOR  and  plugin.abi_minor <= SPMDX_ABI_MINOR,
// then calls register_plugin with its Registrar (as LLVM's PassPluginLibraryInfo).
//
// Versioning: the minor grows when the host gains something a plugin may use without older
// plugins noticing (a Registrar method appended, a descriptor field appended); the major grows
// when a plugin-implemented interface (Strategy, CommBackend, Hook) or a descriptor field
// before the end changes.
//
// Writing a plugin:
//     #include <spmdx/plugin.h>
//     static void register_me(spmdx::Registrar& r) {
//       r.add_strategy("my_strategy", [](const spmdx::Options&) { return std::make_unique<My>(); });
//     }
//     SPMDX_PLUGIN("my_strategy", strategy, "0.1.0", "Shards every weight on dim 0", register_me)
//
// Plain C++17, no LibTorch, no Boost: a third party compiles against this folder alone
// (plus the core library for logging).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "spmdx/comm.h"
#include "spmdx/hook.h"
#include "spmdx/strategy.h"

#define SPMDX_ABI_MAJOR 2
#define SPMDX_ABI_MINOR 1

namespace spmdx {

enum class PluginKind : std::uint32_t { strategy = 1, comm = 2, hook = 3 };

/// "strategy", "comm", "hook"; "unknown" for a value outside the enum.
inline const char* to_string(PluginKind kind) noexcept {
  switch (kind) {
    case PluginKind::strategy: return "strategy";
    case PluginKind::comm: return "comm";
    case PluginKind::hook: return "hook";
  }
  return "unknown";
}

/// Plugin options: the keys of the plugin's config table, values as written in the config.
using Options = std::map<std::string, std::string>;

using StrategyFactory = std::function<std::unique_ptr<Strategy>(const Options&)>;
using CommBackendFactory = std::function<std::unique_ptr<CommBackend>(const Options&)>;
using HookFactory = std::function<std::unique_ptr<Hook>(const Options&)>;

/// Implemented by the host. A factory name is unique per kind across all loaded plugins;
/// adding a taken name throws std::invalid_argument naming both plugins.
class Registrar {
 public:
  virtual void add_strategy(const std::string& name, StrategyFactory factory) = 0;
  virtual void add_comm_backend(const std::string& name, CommBackendFactory factory) = 0;
  virtual void add_hook(const std::string& name, HookFactory factory) = 0;

 protected:
  ~Registrar() = default;
};

/// What the entry point returns. Static storage: the host keeps the pointer.
/// The first two fields never move, whatever the ABI version.
struct PluginDescriptor {
  std::uint32_t abi_major;
  std::uint32_t abi_minor;
  const char* name;         ///< unique plugin name, [a-z0-9_]+
  PluginKind kind;
  const char* version;      ///< the plugin's own version, e.g. "0.1.0"
  const char* description;  ///< one line
  void (*register_plugin)(Registrar& registrar);  ///< may throw; the host reports it
};

using PluginEntryPoint = const PluginDescriptor* (*)();

}  // namespace spmdx

/// The name of the exported entry point alias.
#define SPMDX_PLUGIN_ENTRY_NAME "spmdx_plugin"

/// Exports `FN` (a `const spmdx::PluginDescriptor* FN()`) as the entry point, with the
/// layout of BOOST_DLL_ALIAS(FN, spmdx_plugin).
#define SPMDX_PLUGIN_ENTRY(FN)                                                            \
  namespace _autoaliases {                                                                \
  extern "C" __attribute__((visibility("default"))) const void* spmdx_plugin;            \
  __attribute__((section("boostdll"))) const void* spmdx_plugin =                         \
      reinterpret_cast<const void*>(reinterpret_cast<std::intptr_t>(&FN));                \
  }

/// Declares the plugin: its descriptor at the current ABI version and the entry point.
#define SPMDX_PLUGIN(NAME, KIND, VERSION, DESCRIPTION, REGISTER_FN)                        \
  namespace {                                                                             \
  const ::spmdx::PluginDescriptor spmdx_plugin_descriptor_{                               \
      SPMDX_ABI_MAJOR, SPMDX_ABI_MINOR, NAME, ::spmdx::PluginKind::KIND,                  \
      VERSION,         DESCRIPTION,     REGISTER_FN};                                     \
  const ::spmdx::PluginDescriptor* spmdx_plugin_entry_() { return &spmdx_plugin_descriptor_; } \
  }                                                                                       \
  SPMDX_PLUGIN_ENTRY(spmdx_plugin_entry_)
