// The plugin registry: finds plugin shared objects, checks them, and makes their factories
// available by name (docs/DESIGN.md, "Comm primitive registry"; the plugin ABI is
// interfaces/spmdx/plugin.h).
//
// Search order (first match of a plugin name wins; a later one is ignored with a warning
// naming both paths):
//   1. paths given by the user (config `[plugins] paths`, `spmdx plugins --plugin-path`),
//   2. the entries of SPMDX_PLUGIN_PATH (':'-separated),
//   3. the built-in folder `<dir of libspmdx_core.so>/spmdx/plugins` (build/lib/spmdx/plugins
//      in a build tree, <prefix>/lib/spmdx/plugins when installed).
// A path is a folder (its files named libspmdx_*.so are plugins; not recursive) or a file
// (any name). A path given by the user or the environment that does not exist is an error;
// a missing built-in folder is not.
//
// Unload policy: never unload (as UCC, Triton and LLVM do). A loaded library stays mapped
// until the process exits, even after every registry is destroyed, so an object a plugin made
// (a comm backend being hot-swapped out, a factory captured somewhere) can always run its
// destructor, and a second backend can be loaded while the first is alive. Loading the same
// file again reuses the mapping.
//
// Trust: a plugin is code. Before a file is opened, it, the folder it is found in, the folder
// its links lead to and every folder above must be owned by root or the current user; the file
// and its folders must not be writable by others (nor by a group other than root's or the
// user's); folders further up may be only with the sticky bit (/tmp).
// A file is checked to be a complete ELF shared object before dlopen maps it.
//
// Factory names: a plugin registers factories of its own kind only, under names of
// [a-z0-9_.]+ that are not the name of another discovered plugin (so a plugin cannot take over
// another's name).
// Plugin code runs in this process: a plugin whose static initialiser calls exit() or abort()
// ends the process. A duplicate is opened (to read its name) before it is ignored.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "spmdx/plugin.h"

namespace spmdx {

class PluginError : public std::runtime_error {
 public:
  enum class Code {
    file_missing,       ///< a configured file or folder does not exist
    untrusted,          ///< writable by others, or owned by another non-root user
    unreadable,         ///< a file or folder this user cannot read
    not_shared_object,  ///< not a regular, complete ELF shared object, or dlopen refused it
    entry_missing,      ///< no `spmdx_plugin` entry point
    abi_mismatch,       ///< major differs, or minor newer than the host's
    toolchain_mismatch, ///< built with another C++ standard library or ABI (SPMDX_TOOLCHAIN)
    bad_descriptor,     ///< null descriptor, empty name, unknown kind, no callback
    register_failed,    ///< the registration callback threw
    unknown_plugin,     ///< no plugin or factory of that name
  };
  PluginError(Code code, std::filesystem::path path, const std::string& message)
      : std::runtime_error(message), code_(code), path_(std::move(path)) {}
  Code code() const noexcept { return code_; }
  /// The plugin file or folder concerned; empty for unknown_plugin.
  const std::filesystem::path& path() const noexcept { return path_; }

 private:
  Code code_;
  std::filesystem::path path_;
};

/// What a transport that a comm plugin registers (Registrar::add_transport) becomes: a comm
/// backend that runs the collective engine over it (comm/p2p.h), and the option keys that
/// backend takes (the transport's, then the engine's).
struct TransportBackend {
  CommBackendFactory factory;
  std::vector<std::string> options;
};
/// Makes a TransportBackend of the transport registered as `name`; throws
/// std::invalid_argument for a transport that claims one of the engine's option keys.
using TransportWrapper = std::function<TransportBackend(const std::string& name, TransportInfo info)>;
/// Set by the collective engine (core/src/comm/p2p.cpp) when the core library loads, so that
/// the registry depends on nothing of comm/.
void set_transport_wrapper(TransportWrapper wrap);

struct PluginSource {
  enum class Origin { user, environment, builtin };
  std::filesystem::path path;
  Origin origin = Origin::user;
};

/// The search path in the order above. `user_paths` come from the config or command line.
std::vector<PluginSource> plugin_search_path(const std::vector<std::filesystem::path>& user_paths);

/// The built-in plugin folder next to the core library (may not exist).
std::filesystem::path builtin_plugin_dir();

struct PluginInfo {
  std::string name;
  PluginKind kind = PluginKind::strategy;
  std::string version;
  std::string description;
  std::uint32_t abi_major = 0;
  std::uint32_t abi_minor = 0;
  std::string toolchain;             ///< SPMDX_TOOLCHAIN it was built with
  std::uint32_t flags = 0;           ///< PluginFlag bits (plugin.h)
  std::filesystem::path path;        ///< absolute, as found
  bool registered = false;           ///< its registration callback ran and succeeded
  std::vector<std::string> factories;  ///< names it registered, once registered
};

class PluginRegistry {
 public:
  PluginRegistry();
  ~PluginRegistry();
  PluginRegistry(const PluginRegistry&) = delete;
  PluginRegistry& operator=(const PluginRegistry&) = delete;

  /// Scans `sources` in order and reads each plugin's descriptor (the library is opened; its
  /// registration callback is not run). Never throws for a bad plugin: each problem goes to
  /// errors(), each ignored duplicate to warnings() (and the log).
  void discover(const std::vector<PluginSource>& sources);

  const std::vector<PluginInfo>& plugins() const noexcept { return plugins_; }
  const std::vector<PluginError>& errors() const noexcept { return errors_; }
  const std::vector<std::string>& warnings() const noexcept { return warnings_; }
  /// nullptr when no discovered plugin has that name.
  const PluginInfo* find(std::string_view name) const;

  /// Runs the plugin's registration callback once (later calls return at once).
  /// All-or-nothing: a callback that throws registers nothing.
  /// Throws PluginError: unknown_plugin (message lists the known names), register_failed
  /// (names the plugin and its file).
  void load(std::string_view plugin_name);
  /// load() for every discovered plugin; failures go to errors() instead of throwing.
  void load_all();

  /// A new object from the factory of that name, loading the plugin of the same name on
  /// demand. Throws PluginError(unknown_plugin) naming the kind and the known factories, and
  /// whatever the factory throws.
  std::unique_ptr<Strategy> make_strategy(std::string_view name, const Options& options = {});
  std::unique_ptr<CommBackend> make_comm_backend(std::string_view name, const Options& options = {});
  std::unique_ptr<Hook> make_hook(std::string_view name, const Options& options = {});
  /// A planner (planner.h) registered by a strategy plugin, loading the plugin of the same
  /// name on demand. Throws PluginError(unknown_plugin) naming the planners loaded.
  std::unique_ptr<Planner> make_planner(std::string_view name, const Options& options = {});
  /// make_comm_backend from a spec "name" or "name:key=value;key=value" (e.g.
  /// "ucx:tls=tcp,self", the form of the config's comm.backend). Throws
  /// std::invalid_argument for an item that is not key=value, and what make_comm_backend throws.
  std::unique_ptr<CommBackend> make_comm_backend_from_spec(const std::string& spec);
  /// The plugin that registered strategy `name` (loading plugins on demand as make_strategy
  /// does); throws PluginError(unknown_plugin) as make_strategy.
  const PluginInfo& strategy_plugin(std::string_view name);
  /// The plugin that registered comm backend `name` (loading plugins on demand as
  /// make_comm_backend does); throws PluginError(unknown_plugin) as make_comm_backend.
  const PluginInfo& comm_backend_plugin(std::string_view name);
  /// The option keys of a loaded comm backend that runs over a registered transport: the
  /// transport's, then the collective engine's; empty for a whole backend (nccl), whose
  /// options only its factory knows, and for a name not loaded.
  std::vector<std::string> comm_backend_options(std::string_view name) const;

 private:
  struct Factories;
  class Staging;
  PluginInfo* find_mutable(std::string_view name);
  void ensure_factory(PluginKind kind, std::string_view name);

  std::vector<PluginInfo> plugins_;
  std::vector<PluginError> errors_;
  std::vector<std::string> warnings_;
  std::unique_ptr<Factories> factories_;
};

/// A plugin named with its options: "ucx", or "ucx:tls=tcp,self;rndv_thresh=8192".
struct PluginSpec {
  std::string name;
  Options options;
};

/// Splits "name" or "name:key=value;key=value" (comm.backend, [parallelism.strategies]).
/// `what` names the setting in messages ("comm backend", "strategy"). Throws
/// std::invalid_argument for an item that is not key=value or a key given twice.
PluginSpec parse_plugin_spec(const std::string& spec, const std::string& what);

/// Opens one plugin file and returns its descriptor's fields (registered = false), after the
/// trust check and the ABI check. Throws PluginError with a message that names the file and
/// says what to do.
PluginInfo read_plugin(const std::filesystem::path& file);

}  // namespace spmdx
