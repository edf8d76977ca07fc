// The spmdx plugin ABI: what a plugin shared object exports and how it registers factories.
// (LLVM's PassPlugin.h is the model: one entry point, a versioned descriptor, a stated contract.)
//
// Entry point. Every plugin exports exactly one, the alias `spmdx_plugin`, laid out as
// Boost.DLL's BOOST_DLL_ALIAS (an exported `const void*` in section "boostdll" pointing at a
// function), so the host reads it with boost::dll::shared_library::get_alias while this header
// needs no Boost. The function returns a PluginDescriptor. The host reads abi_major and
// abi_minor first and touches nothing else unless
//     plugin.abi_major == SPMDX_ABI_MAJOR  and  plugin.abi_minor <= SPMDX_ABI_MINOR,
// then checks the toolchain tag, then calls register_plugin with its Registrar.
//
// What crosses the boundary. C++ standard library types (std::string, std::vector, std::map,
// std::function, std::unique_ptr) in every interface and struct, and exceptions: plugins throw
// std::invalid_argument, CommError and ValidationError, and the host catches them by type. Both
// are sound only when the plugin and the host use the same C++ standard library with the same
// ABI and exceptions on, which the descriptor's toolchain tag (SPMDX_TOOLCHAIN) records and the
// loader checks: build plugins with the compiler family and standard library spmdx was built
// with (GCC or Clang on libstdc++ here). Objects made by a plugin are destroyed by the host
// through their virtual destructors; the host never unloads a plugin (see registry.h).
//
// Versioning. The major grows with any change to something a built plugin has compiled in:
// a plugin-implemented interface (Strategy, CommBackend, Transport, Hook), a struct either
// side reads (StrategyInput, TensorInfo, CommInit, CommBuffer, CommCapability, GraphView,
// HookContext, ...; a field added anywhere is a major change), an enum's values, the
// descriptor before its end. The minor grows when the host gains something a plugin may use
// without older plugins noticing: a Registrar method appended, a descriptor field appended.
// A plugin built for another major is refused with a message saying to rebuild it.
// 3.0: transports (transport.h) with the collective engine in the host; StrategyInput's
// mesh_dim; descriptor flags and toolchain tag.
// 3.1: StreamOrdered (comm.h), an interface a comm backend may also implement.
// 3.2: Planner (planner.h) and Registrar::add_planner: a strategy plugin may register a
// solver for the per-mesh-dim choice problems of `strategy = "auto"`.
// 3.3: host services check_json_nesting (text.h: JSON too deep to copy or print safely),
// unreadable_file and read_file_bytes (files.h: a FIFO or folder where a file should be).
// 3.4: host service move_aside (files.h: an earlier run's file kept whole under the next free
// name before it is replaced).
// 4.0: TensorInfo::role (strategy.h: TensorRole), a field added to a struct plugins read, so a
// major. Strategies take options ("name:key=value" in [parallelism.strategies]) through the
// factory's Options, which needed no ABI change.
// 4.1: VariableAllToAll (comm.h: all_to_all_v, split sizes known only at run time), an
// interface a comm backend may also implement, as StreamOrdered in 3.1: a new interface, not a
// method added to CommBackend (which would be a major), so 4.0 plugins still load; the host's
// all_to_all_v on a backend without it is a std::invalid_argument naming the backend and
// saying to rebuild its plugin.
//
// Host services. A plugin may call, besides this folder's inline code, only the core
// library's logging facade (spmdx/core/log.h) and the helpers declared in this folder
// (options.h: OptionReader; files.h: write_file_atomic, unreadable_file, read_file_bytes, move_aside; text.h: sizes, rank lists, JSON nesting), which
// are versioned with this ABI. The linker holds a plugin to this: they are defined in
// libspmdx_host.so, which exports nothing else (core/host_services.map) and is the one spmdx
// library a plugin links (spmdx_add_plugin, with -z defs), so a call to any other spmdx symbol
// fails to link, naming it.
//
// C++ standard. C++20, on both sides: these headers, every plugin (spmdx_add_plugin sets it) and
// the host are compiled as C++20, so the inline code and the standard library types of this
// folder compile the same in a plugin as in the host. A plugin compiled otherwise stops at the
// check below.
//
// Writing a plugin:
//     #include <spmdx/plugin.h>
//     static void register_me(spmdx::Registrar& r) {
//       r.add_strategy("my_strategy", [](const spmdx::Options&) { return std::make_unique<My>(); });
//     }
//     SPMDX_PLUGIN("my_strategy", strategy, "0.1.0", "Shards every weight on dim 0", register_me)
//
// Plain C++20, no LibTorch, no Boost: a third party compiles against this folder alone
// (plus libspmdx_host for the host services).
#pragma once

#if __cplusplus < 202002L
#error "spmdx plugins are C++20 (interfaces/spmdx/plugin.h): compile with -std=c++20, as spmdx_add_plugin does"
#endif

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "spmdx/comm.h"
#include "spmdx/hook.h"
#include "spmdx/planner.h"
#include "spmdx/strategy.h"
#include "spmdx/transport.h"

#define SPMDX_ABI_MAJOR 4
#define SPMDX_ABI_MINOR 1

// The toolchain tag: the C++ standard library, its string/list ABI and whether exceptions are
// on. The loader refuses a plugin whose tag differs from the host's.
#if defined(_LIBCPP_VERSION)
#define SPMDX_TOOLCHAIN_STDLIB "libc++"
#elif defined(__GLIBCXX__)
#define SPMDX_TOOLCHAIN_STDLIB "libstdc++"
#else
#define SPMDX_TOOLCHAIN_STDLIB "unknown-stdlib"
#endif
#if defined(_GLIBCXX_USE_CXX11_ABI) && _GLIBCXX_USE_CXX11_ABI == 0
#define SPMDX_TOOLCHAIN_ABI "pre-cxx11-abi"
#else
#define SPMDX_TOOLCHAIN_ABI "cxx11-abi"
#endif
#if defined(__cpp_exceptions) || defined(__EXCEPTIONS)
#define SPMDX_TOOLCHAIN_EXCEPTIONS "exceptions"
#else
#define SPMDX_TOOLCHAIN_EXCEPTIONS "no-exceptions"
#endif
/// e.g. "libstdc++ cxx11-abi exceptions".
#define SPMDX_TOOLCHAIN SPMDX_TOOLCHAIN_STDLIB " " SPMDX_TOOLCHAIN_ABI " " SPMDX_TOOLCHAIN_EXCEPTIONS

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

/// Plugin options: the keys of the plugin's config table, values as written in the config
/// (declared in transport.h too).
using Options = std::map<std::string, std::string>;

/// PluginDescriptor::flags.
enum PluginFlag : std::uint32_t {
  /// Its comm backends serve only ranks that are threads of one process (`local`): `spmdx run`
  /// and the launchers refuse them for ranks in processes, naming the flag.
  kPluginInProcessOnly = 1u << 0,
};

using StrategyFactory = std::function<std::unique_ptr<Strategy>(const Options&)>;
using CommBackendFactory = std::function<std::unique_ptr<CommBackend>(const Options&)>;
using HookFactory = std::function<std::unique_ptr<Hook>(const Options&)>;
using PlannerFactory = std::function<std::unique_ptr<Planner>(const Options&)>;

/// Implemented by the host. A factory name is unique per kind across all loaded plugins;
/// adding a taken name throws std::invalid_argument naming both plugins.
class Registrar {
 public:
  virtual void add_strategy(const std::string& name, StrategyFactory factory) = 0;
  /// A whole backend: the plugin implements every collective (nccl).
  virtual void add_comm_backend(const std::string& name, CommBackendFactory factory) = 0;
  /// A point-to-point transport: the host offers a comm backend `name` that runs its
  /// collective engine over it (transport.h).
  virtual void add_transport(const std::string& name, TransportInfo info) = 0;
  virtual void add_hook(const std::string& name, HookFactory factory) = 0;
  /// A planner (planner.h), registered by a strategy plugin: `[parallelism] strategy = "auto"`
  /// uses the one named by parallelism.planner ("auto" by default). ABI 3.2.
  virtual void add_planner(const std::string& name, PlannerFactory factory) = 0;

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
  const char* toolchain;    ///< SPMDX_TOOLCHAIN where the plugin was built; must equal the host's
  std::uint32_t flags;      ///< PluginFlag bits
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
#define SPMDX_PLUGIN(NAME, KIND, VERSION, DESCRIPTION, REGISTER_FN) \
  SPMDX_PLUGIN_WITH_FLAGS(NAME, KIND, VERSION, DESCRIPTION, REGISTER_FN, 0)

/// SPMDX_PLUGIN with PluginFlag bits, e.g. ::spmdx::kPluginInProcessOnly.
#define SPMDX_PLUGIN_WITH_FLAGS(NAME, KIND, VERSION, DESCRIPTION, REGISTER_FN, FLAGS)       \
  namespace {                                                                             \
  const ::spmdx::PluginDescriptor spmdx_plugin_descriptor_{                               \
      SPMDX_ABI_MAJOR, SPMDX_ABI_MINOR, NAME,            ::spmdx::PluginKind::KIND,       \
      VERSION,         DESCRIPTION,     REGISTER_FN,     SPMDX_TOOLCHAIN,                 \
      FLAGS};                                                                             \
  const ::spmdx::PluginDescriptor* spmdx_plugin_entry_() { return &spmdx_plugin_descriptor_; } \
  }                                                                                       \
  SPMDX_PLUGIN_ENTRY(spmdx_plugin_entry_)
