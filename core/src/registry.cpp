#include "spmdx/core/registry.h"

#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#define BOOST_DLL_USE_STD_FS
#include <boost/dll/shared_library.hpp>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <sstream>

#include "spmdx/core/log.h"

namespace spmdx {
namespace fs = std::filesystem;

namespace {

using Code = PluginError::Code;

// Libraries are never unloaded (see registry.h): the cache is deliberately leaked so that no
// dlclose runs, not even at exit, while plugin-made objects may still be alive.
struct LibraryCache {
  std::mutex mutex;
  std::map<std::string, boost::dll::shared_library> by_path;
};
LibraryCache& library_cache() {
  static auto* cache = new LibraryCache();
  return *cache;
}

std::string octal_mode(mode_t mode) {
  std::ostringstream s;
  s << '0' << std::oct << (mode & 07777);
  return s.str();
}

// Refuses files a user other than root or us could have written (see registry.h).
void check_trusted(const fs::path& file) {
  auto refuse = [&](const std::string& why) {
    throw PluginError(Code::untrusted, file,
                      "refusing to load plugin '" + file.string() + "': " + why +
                          ". A plugin is code: keep it and its folder writable by the owner only "
                          "(chmod go-w) and owned by root or by you.");
  };
  const uid_t me = ::geteuid();
  for (const auto& [what, path] : {std::pair{"the file", file}, std::pair{"its folder", file.parent_path()}}) {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) continue;  // the caller reports a missing file itself
    const std::string name = std::string(what) + (path == file ? "" : " '" + path.string() + "'");
    if (st.st_mode & S_IWOTH) refuse(name + " is writable by others (mode " + octal_mode(st.st_mode) + ")");
    if (st.st_uid != 0 && st.st_uid != me) {
      refuse(name + " is owned by uid " + std::to_string(st.st_uid) + ", not by root or you (uid " +
             std::to_string(me) + ")");
    }
  }
}

std::string dlopen_reason(const std::string& boost_message) {
  static const std::string marker = "dlerror system message: ";
  auto at = boost_message.find(marker);
  if (at == std::string::npos) return boost_message;
  std::string reason = boost_message.substr(at + marker.size());
  if (auto close = reason.rfind(')'); close != std::string::npos) reason.resize(close);
  return reason;
}

const PluginDescriptor* open_descriptor(const fs::path& given) {
  // Messages name the file as an absolute path: the user may have run from another folder.
  const fs::path file = fs::absolute(given).lexically_normal();
  std::error_code ec;
  if (!fs::exists(file, ec)) {
    throw PluginError(Code::file_missing, file,
                      "plugin file '" + file.string() + "' does not exist: fix the path, or remove it from the "
                      "config's [plugins] paths, --plugin-path or SPMDX_PLUGIN_PATH.");
  }
  const fs::path canonical = fs::canonical(file);
  check_trusted(canonical);

  auto& cache = library_cache();
  std::lock_guard lock(cache.mutex);
  auto it = cache.by_path.find(canonical.string());
  if (it == cache.by_path.end()) {
    boost::dll::shared_library lib;
    try {
      lib.load(canonical, boost::dll::load_mode::rtld_now | boost::dll::load_mode::rtld_local);
    } catch (const std::exception& e) {
      const std::string reason = dlopen_reason(e.what());
      const bool not_elf = reason.find("invalid ELF header") != std::string::npos ||
                           reason.find("file too short") != std::string::npos;
      throw PluginError(Code::not_shared_object, file,
                        "cannot load plugin '" + file.string() + "': " +
                            (not_elf ? "not a shared object (" + reason + ")" : reason) +
                            ". Rebuild it with spmdx_add_plugin(), or remove it from the plugin path.");
    }
    it = cache.by_path.emplace(canonical.string(), std::move(lib)).first;
  }
  boost::dll::shared_library& lib = it->second;
  if (!lib.has(SPMDX_PLUGIN_ENTRY_NAME)) {
    throw PluginError(Code::entry_missing, file,
                      "'" + file.string() + "' has no '" SPMDX_PLUGIN_ENTRY_NAME
                      "' entry point, so it is not an spmdx plugin: build it with SPMDX_PLUGIN(...) from "
                      "<spmdx/plugin.h>, or remove it from the plugin path.");
  }
  auto& entry = lib.get_alias<const PluginDescriptor*()>(SPMDX_PLUGIN_ENTRY_NAME);
  const PluginDescriptor* d = entry();
  if (d == nullptr) {
    throw PluginError(Code::bad_descriptor, file,
                      "plugin '" + file.string() + "': its entry point returned no descriptor; fix the plugin.");
  }
  // The ABI fields first, before anything else of the descriptor is read.
  if (d->abi_major != SPMDX_ABI_MAJOR) {
    throw PluginError(Code::abi_mismatch, file,
                      "plugin '" + file.string() + "' was built for ABI " + std::to_string(d->abi_major) +
                          ", this host supports " + std::to_string(SPMDX_ABI_MAJOR) + " (ABI " +
                          std::to_string(SPMDX_ABI_MAJOR) + "." + std::to_string(SPMDX_ABI_MINOR) +
                          "): rebuild the plugin against this spmdx.");
  }
  if (d->abi_minor > SPMDX_ABI_MINOR) {
    throw PluginError(Code::abi_mismatch, file,
                      "plugin '" + file.string() + "' was built for ABI " + std::to_string(d->abi_major) + "." +
                          std::to_string(d->abi_minor) + ", this host supports up to " +
                          std::to_string(SPMDX_ABI_MAJOR) + "." + std::to_string(SPMDX_ABI_MINOR) +
                          ": upgrade spmdx, or rebuild the plugin against this one.");
  }
  auto bad = [&](const std::string& what) {
    throw PluginError(Code::bad_descriptor, file, "plugin '" + file.string() + "': " + what + "; fix the plugin.");
  };
  if (d->name == nullptr || *d->name == '\0') bad("its descriptor has an empty name");
  const auto kind = static_cast<std::uint32_t>(d->kind);
  if (kind < 1 || kind > 3) bad("its descriptor has an unknown kind " + std::to_string(kind));
  if (d->register_plugin == nullptr) bad("its descriptor has no registration callback");
  return d;
}

bool is_plugin_file_name(const fs::path& p) {
  const std::string name = p.filename().string();
  return name.rfind("libspmdx_", 0) == 0 && p.extension() == ".so";
}

std::string origin_text(PluginSource::Origin origin) {
  switch (origin) {
    case PluginSource::Origin::user: return "the config or --plugin-path";
    case PluginSource::Origin::environment: return "SPMDX_PLUGIN_PATH";
    case PluginSource::Origin::builtin: return "the built-in plugin folder";
  }
  return "?";
}

PluginInfo info_from(const PluginDescriptor& d, const fs::path& file) {
  PluginInfo info;
  info.name = d.name;
  info.kind = d.kind;
  info.version = d.version ? d.version : "";
  info.description = d.description ? d.description : "";
  info.abi_major = d.abi_major;
  info.abi_minor = d.abi_minor;
  info.path = fs::absolute(file).lexically_normal();
  return info;
}

}  // namespace

fs::path builtin_plugin_dir() {
  Dl_info info{};
  if (::dladdr(reinterpret_cast<void*>(&builtin_plugin_dir), &info) == 0 || info.dli_fname == nullptr) return {};
  std::error_code ec;
  fs::path lib = fs::canonical(info.dli_fname, ec);
  if (ec) return {};
  return lib.parent_path() / "spmdx" / "plugins";
}

std::vector<PluginSource> plugin_search_path(const std::vector<fs::path>& user_paths) {
  std::vector<PluginSource> out;
  for (const auto& p : user_paths) out.push_back({p, PluginSource::Origin::user});
  if (const char* env = std::getenv("SPMDX_PLUGIN_PATH")) {
    std::stringstream s(env);
    std::string entry;
    while (std::getline(s, entry, ':')) {
      if (!entry.empty()) out.push_back({entry, PluginSource::Origin::environment});
    }
  }
  if (auto dir = builtin_plugin_dir(); !dir.empty()) out.push_back({dir, PluginSource::Origin::builtin});
  return out;
}

PluginInfo read_plugin(const fs::path& file) { return info_from(*open_descriptor(file), file); }

// Factories by kind and name, plus the plugin that registered each.
struct PluginRegistry::Factories {
  template <class F>
  struct Entry {
    F factory;
    std::string plugin;
  };
  std::map<std::string, Entry<StrategyFactory>, std::less<>> strategies;
  std::map<std::string, Entry<CommBackendFactory>, std::less<>> comm_backends;
  std::map<std::string, Entry<HookFactory>, std::less<>> hooks;
  std::map<std::string, const PluginDescriptor*, std::less<>> descriptors;
};

// What one plugin's callback registers, committed only when the callback returns.
class PluginRegistry::Staging final : public Registrar {
 public:
  Staging(Factories& target, std::string plugin) : target_(target), plugin_(std::move(plugin)) {}

  void add_strategy(const std::string& name, StrategyFactory f) override {
    add(target_.strategies, strategies_, "strategy", name, std::move(f));
  }
  void add_comm_backend(const std::string& name, CommBackendFactory f) override {
    add(target_.comm_backends, comm_backends_, "comm backend", name, std::move(f));
  }
  void add_hook(const std::string& name, HookFactory f) override {
    add(target_.hooks, hooks_, "hook", name, std::move(f));
  }

  std::vector<std::string> commit() {
    std::vector<std::string> names;
    auto move_all = [&](auto& from, auto& to) {
      for (auto& [name, entry] : from) {
        names.push_back(name);
        to.emplace(name, std::move(entry));
      }
    };
    move_all(strategies_, target_.strategies);
    move_all(comm_backends_, target_.comm_backends);
    move_all(hooks_, target_.hooks);
    return names;
  }

 private:
  template <class F>
  void add(const std::map<std::string, Factories::Entry<F>, std::less<>>& existing,
           std::map<std::string, Factories::Entry<F>, std::less<>>& staged, const char* kind,
           const std::string& name, F factory) {
    if (!factory) throw std::invalid_argument(std::string("empty ") + kind + " factory '" + name + "'");
    if (auto it = existing.find(name); it != existing.end()) {
      throw std::invalid_argument(std::string(kind) + " '" + name + "' is already registered by plugin '" +
                                  it->second.plugin + "'");
    }
    if (!staged.emplace(name, Factories::Entry<F>{std::move(factory), plugin_}).second) {
      throw std::invalid_argument(std::string(kind) + " '" + name + "' registered twice");
    }
  }

  Factories& target_;
  std::string plugin_;
  std::map<std::string, Factories::Entry<StrategyFactory>, std::less<>> strategies_;
  std::map<std::string, Factories::Entry<CommBackendFactory>, std::less<>> comm_backends_;
  std::map<std::string, Factories::Entry<HookFactory>, std::less<>> hooks_;
};

PluginRegistry::PluginRegistry() : factories_(std::make_unique<Factories>()) {}
PluginRegistry::~PluginRegistry() = default;

void PluginRegistry::discover(const std::vector<PluginSource>& sources) {
  std::map<std::string, bool> seen_files;  // canonical paths already scanned
  auto consider = [&](const fs::path& file) {
    std::error_code ec;
    const fs::path canonical = fs::canonical(file, ec);
    if (!ec && !seen_files.emplace(canonical.string(), true).second) return;
    try {
      const PluginDescriptor* d = open_descriptor(file);
      if (const PluginInfo* first = find(d->name)) {
        warnings_.push_back("plugin '" + std::string(d->name) + "' found twice: using " + first->path.string() +
                            ", ignoring " + fs::absolute(file).lexically_normal().string() +
                            " (the first in search order wins)");
        SPMDX_WARN(warnings_.back());
        return;
      }
      plugins_.push_back(info_from(*d, file));
      factories_->descriptors.emplace(d->name, d);
    } catch (const PluginError& e) {
      SPMDX_DEBUG(e.what());
      errors_.push_back(e);
    }
  };

  for (const auto& source : sources) {
    std::error_code ec;
    const auto status = fs::status(source.path, ec);
    if (!fs::exists(status)) {
      if (source.origin != PluginSource::Origin::builtin) {
        errors_.emplace_back(Code::file_missing, source.path,
                             "plugin path '" + source.path.string() + "' (from " + origin_text(source.origin) +
                                 ") does not exist: fix the path, or remove it from " + origin_text(source.origin) +
                                 ".");
      }
      continue;
    }
    if (!fs::is_directory(status)) {
      consider(source.path);
      continue;
    }
    std::vector<fs::path> files;
    for (const auto& entry : fs::directory_iterator(source.path, ec)) {
      if (is_plugin_file_name(entry.path())) files.push_back(entry.path());
    }
    std::sort(files.begin(), files.end());  // directory order is arbitrary; keep runs repeatable
    for (const auto& f : files) consider(f);
  }
}

const PluginInfo* PluginRegistry::find(std::string_view name) const {
  for (const auto& p : plugins_) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

PluginInfo* PluginRegistry::find_mutable(std::string_view name) {
  return const_cast<PluginInfo*>(std::as_const(*this).find(name));
}

void PluginRegistry::load(std::string_view plugin_name) {
  PluginInfo* info = find_mutable(plugin_name);
  if (info == nullptr) {
    std::string known;
    for (const auto& p : plugins_) known += (known.empty() ? "" : ", ") + p.name;
    throw PluginError(Code::unknown_plugin, {},
                      "no plugin named '" + std::string(plugin_name) + "'; found: " +
                          (known.empty() ? "none" : known) +
                          ". Check the name, or add its folder to SPMDX_PLUGIN_PATH or --plugin-path.");
  }
  if (info->registered) return;
  const PluginDescriptor* d = factories_->descriptors.at(info->name);
  Staging staging(*factories_, info->name);
  try {
    d->register_plugin(staging);
  } catch (const std::exception& e) {
    throw PluginError(Code::register_failed, info->path,
                      "plugin '" + info->name + "' (" + info->path.string() + ") failed to register: " + e.what() +
                          ". The host continues without it; fix the plugin or remove it from the plugin path.");
  } catch (...) {
    throw PluginError(Code::register_failed, info->path,
                      "plugin '" + info->name + "' (" + info->path.string() +
                          ") failed to register: it threw a non-standard exception. The host continues without "
                          "it; fix the plugin or remove it from the plugin path.");
  }
  info->factories = staging.commit();
  info->registered = true;
  SPMDX_DEBUG("registered plugin '" << info->name << "' from " << info->path.string());
}

void PluginRegistry::load_all() {
  for (const auto& p : plugins_) {
    try {
      load(p.name);
    } catch (const PluginError& e) {
      SPMDX_DEBUG(e.what());
      errors_.push_back(e);
    }
  }
}

void PluginRegistry::ensure_factory(PluginKind kind, std::string_view name) {
  auto has = [&] {
    switch (kind) {
      case PluginKind::strategy: return factories_->strategies.count(name) > 0;
      case PluginKind::comm: return factories_->comm_backends.count(name) > 0;
      case PluginKind::hook: return factories_->hooks.count(name) > 0;
    }
    return false;
  };
  if (has()) return;
  if (const PluginInfo* p = find(name); p != nullptr && p->kind == kind) load(name);
  if (has()) return;
  std::string known;
  for (const auto& p : plugins_) {
    if (p.kind == kind) known += (known.empty() ? "" : ", ") + p.name;
  }
  throw PluginError(Code::unknown_plugin, {},
                    std::string("no ") + to_string(kind) + " plugin named '" + std::string(name) + "'; found: " +
                        (known.empty() ? "none" : known) +
                        ". Check the name, or add its folder to SPMDX_PLUGIN_PATH or --plugin-path.");
}

std::unique_ptr<Strategy> PluginRegistry::make_strategy(std::string_view name, const Options& options) {
  ensure_factory(PluginKind::strategy, name);
  return factories_->strategies.find(name)->second.factory(options);
}

std::unique_ptr<CommBackend> PluginRegistry::make_comm_backend(std::string_view name, const Options& options) {
  ensure_factory(PluginKind::comm, name);
  return factories_->comm_backends.find(name)->second.factory(options);
}

std::unique_ptr<Hook> PluginRegistry::make_hook(std::string_view name, const Options& options) {
  ensure_factory(PluginKind::hook, name);
  return factories_->hooks.find(name)->second.factory(options);
}

}  // namespace spmdx
