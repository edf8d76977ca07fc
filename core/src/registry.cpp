#include "spmdx/core/registry.h"
#include "spmdx/text.h"

#include <dlfcn.h>
#include <elf.h>
#include <sys/stat.h>
#include <unistd.h>

#define BOOST_DLL_USE_STD_FS
#include <boost/dll/shared_library.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
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

TransportWrapper& transport_wrapper() {
  static TransportWrapper wrap;
  return wrap;
}

std::string octal_mode(mode_t mode) {
  std::ostringstream s;
  s << '0' << std::oct << (mode & 07777);
  return s.str();
}

// Why `path` could have been written by someone other than root or us, or nullopt. A file and
// the folder holding it must not be writable by others, nor by a group other than root's or
// ours; a folder further up may be writable by others only with the sticky bit (as /tmp), which
// stops them from renaming what is inside. Every level must be owned by root or by us.
std::optional<std::string> trust_problem(const fs::path& path, bool ancestor) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return std::nullopt;  // reported elsewhere as missing
  const bool sticky = S_ISDIR(st.st_mode) && (st.st_mode & S_ISVTX);
  if ((st.st_mode & S_IWOTH) && !(ancestor && sticky)) {
    return "is writable by others (mode " + octal_mode(st.st_mode) + ")";
  }
  if ((st.st_mode & S_IWGRP) && st.st_gid != 0 && st.st_gid != ::getegid() && !(ancestor && sticky)) {
    return "is writable by group " + std::to_string(st.st_gid) + " (mode " + octal_mode(st.st_mode) + ")";
  }
  if (st.st_uid != 0 && st.st_uid != ::geteuid()) {
    return "is owned by uid " + std::to_string(st.st_uid) + ", not by root or you (uid " + std::to_string(::geteuid()) + ")";
  }
  return std::nullopt;
}

// `file` is the path as searched (absolute), `target` where its links lead.
void check_trusted(const fs::path& file, const fs::path& target) {
  const std::string shown = "'" + file.string() + "'" + (file == target ? "" : " (a link to '" + target.string() + "')");
  auto refuse = [&](const std::string& what, const std::string& why) {
    throw PluginError(Code::untrusted, file,
                      "refusing to load plugin " + shown + ": " + what + " " + why +
                          ". A plugin is code: keep it and the folders above it writable by their owner only "
                          "(chmod go-w) and owned by root or by you.");
  };
  if (auto why = trust_problem(target, false)) refuse("the file", *why);
  // The folder the link sits in matters as much as the folder of its target.
  for (const fs::path& dir : {file.parent_path(), target.parent_path()}) {
    if (auto why = trust_problem(dir, false)) refuse("its folder '" + dir.string() + "'", *why);
  }
  for (fs::path dir = target.parent_path(); dir.has_relative_path(); ) {
    dir = dir.parent_path();
    if (auto why = trust_problem(dir, true)) refuse("the folder '" + dir.string() + "' above it", *why);
  }
}

// dlopen maps a file's segments without checking that the file holds them: a truncated
// library kills the process with SIGBUS when a page past its end is touched. So the ELF
// header and the program and section header tables are checked against the file size first.
void check_elf(const fs::path& file, const fs::path& target) {
  auto not_so = [&](const std::string& why) {
    throw PluginError(Code::not_shared_object, file,
                      "cannot load plugin '" + file.string() + "': not a shared object (" + why +
                          "). Rebuild it with spmdx_add_plugin(), or remove it from the plugin path.");
  };
  std::ifstream in(target, std::ios::binary);
  if (!in) {
    throw PluginError(Code::unreadable, file,
                      "cannot read plugin '" + file.string() + "': " + std::strerror(errno) +
                          ". Make it readable by this user, or remove it from the plugin path.");
  }
  std::error_code ec;
  const std::uint64_t size = fs::file_size(target, ec);
  Elf64_Ehdr eh{};
  if (!in.read(reinterpret_cast<char*>(&eh), sizeof eh) || std::memcmp(eh.e_ident, ELFMAG, SELFMAG) != 0) {
    not_so("no ELF header");
  }
#if defined(__aarch64__)
  constexpr auto kMachine = EM_AARCH64;
#else
  constexpr auto kMachine = EM_X86_64;
#endif
  if (eh.e_ident[EI_CLASS] != ELFCLASS64 || eh.e_type != ET_DYN || eh.e_machine != kMachine) {
    not_so("ELF class " + std::to_string(eh.e_ident[EI_CLASS]) + ", type " + std::to_string(eh.e_type) + ", machine " +
           std::to_string(eh.e_machine) + " is not a 64-bit shared object for this machine");
  }
  auto fits = [&](std::uint64_t offset, std::uint64_t length) { return offset <= size && length <= size - offset; };
  auto truncated = [&](const std::string& what, std::uint64_t end) {
    not_so("truncated: " + what + " ends at byte " + std::to_string(end) + ", the file has " + std::to_string(size));
  };
  if (eh.e_phentsize != sizeof(Elf64_Phdr)) not_so("unexpected program header size");
  const std::uint64_t ph_bytes = std::uint64_t{eh.e_phnum} * eh.e_phentsize;
  if (!fits(eh.e_phoff, ph_bytes)) truncated("the program header table", eh.e_phoff + ph_bytes);
  const std::uint64_t sh_bytes = std::uint64_t{eh.e_shnum} * eh.e_shentsize;
  if (eh.e_shoff != 0 && !fits(eh.e_shoff, sh_bytes)) truncated("the section header table", eh.e_shoff + sh_bytes);
  std::vector<Elf64_Phdr> phdrs(eh.e_phnum);
  in.seekg(static_cast<std::streamoff>(eh.e_phoff));
  if (!in.read(reinterpret_cast<char*>(phdrs.data()), static_cast<std::streamsize>(ph_bytes))) {
    truncated("the program header table", eh.e_phoff + ph_bytes);
  }
  for (std::size_t i = 0; i < phdrs.size(); ++i) {
    if (phdrs[i].p_type != PT_LOAD && phdrs[i].p_type != PT_DYNAMIC) continue;
    if (!fits(phdrs[i].p_offset, phdrs[i].p_filesz)) {
      truncated("segment " + std::to_string(i), phdrs[i].p_offset + phdrs[i].p_filesz);
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

bool is_identifier(const char* text, bool allow_dot) {
  if (text == nullptr || *text == '\0') return false;
  for (const char* c = text; *c; ++c) {
    const bool ok = (*c >= 'a' && *c <= 'z') || (*c >= '0' && *c <= '9') || *c == '_' || (allow_dot && *c == '.');
    if (!ok) return false;
  }
  return true;
}

bool is_printable(const char* text) {
  if (text == nullptr) return true;
  for (const unsigned char* c = reinterpret_cast<const unsigned char*>(text); *c; ++c) {
    if (*c < 0x20 || *c == 0x7f) return false;
  }
  return true;
}

const PluginDescriptor* open_descriptor(const fs::path& given) {
  // Messages name the file as an absolute path: the user may have run from another folder.
  const fs::path file = fs::absolute(given).lexically_normal();
  std::error_code ec;
  const auto link_status = fs::symlink_status(file, ec);
  if (!fs::exists(link_status)) {
    throw PluginError(Code::file_missing, file,
                      "plugin file '" + file.string() + "' does not exist: fix the path, or remove it from the "
                      "config's [plugins] paths, --plugin-path or SPMDX_PLUGIN_PATH.");
  }
  const auto status = fs::status(file, ec);
  const fs::path canonical = fs::canonical(file, ec);
  if (!fs::exists(status) || ec) {
    throw PluginError(Code::file_missing, file,
                      "plugin file '" + file.string() + "' cannot be resolved (" +
                          (ec ? ec.message() : std::string("a link that leads nowhere")) +
                          "): fix the link or the path, or remove it from the plugin path.");
  }
  if (!fs::is_regular_file(status)) {
    throw PluginError(Code::not_shared_object, file,
                      "cannot load plugin '" + file.string() +
                          "': not a regular file (a folder, FIFO, socket or device); remove it from the plugin path.");
  }
  check_trusted(file, canonical);
  check_elf(file, canonical);

  auto& cache = library_cache();
  std::lock_guard lock(cache.mutex);
  auto it = cache.by_path.find(canonical.string());
  if (it == cache.by_path.end()) {
    boost::dll::shared_library lib;
    try {
      lib.load(canonical, boost::dll::load_mode::rtld_now | boost::dll::load_mode::rtld_local);
    } catch (const std::exception& e) {
      const std::string reason = dlopen_reason(e.what());
      // A host service (OptionReader, logging, text helpers) the plugin calls under another
      // name than this spmdx exports: another spmdx, or another C++ library ABI (e.g.
      // -D_GLIBCXX_USE_CXX11_ABI=0 mangles std::string differently). The toolchain tag would
      // say so, but the loader never gets that far.
      if (reason.find("undefined symbol: _ZN5spmdx") != std::string::npos || reason.find("undefined symbol: _ZNK5spmdx") != std::string::npos) {
        throw PluginError(Code::toolchain_mismatch, file,
                          "cannot load plugin '" + file.string() + "': " + reason +
                              ". It calls a function of spmdx's core library that this spmdx does not have under that name: it was "
                              "built against another spmdx, or with another C++ standard library ABI than this host's '" SPMDX_TOOLCHAIN
                              "' (e.g. -D_GLIBCXX_USE_CXX11_ABI=0); rebuild it against this spmdx with the toolchain spmdx was built with.");
      }
      throw PluginError(Code::not_shared_object, file,
                        "cannot load plugin '" + file.string() + "': " + reason +
                            ". A library it needs may be missing (check with ldd), or its static initialisation "
                            "failed; rebuild it, or remove it from the plugin path.");
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
                          "): rebuild the plugin against this spmdx." +
                          (d->abi_major == 2 ? " (ABI 3 moved the collectives into the host: a comm plugin built on the P2P backend "
                                               "now registers a Transport, see spmdx/transport.h.)"
                           : d->abi_major == 3 ? " (ABI 4 gave TensorInfo a role: a plugin's ABI 3 source builds unchanged, only rebuild it.)"
                                               : ""));
  }
  if (d->abi_minor > SPMDX_ABI_MINOR) {
    throw PluginError(Code::abi_mismatch, file,
                      "plugin '" + file.string() + "' was built for ABI " + std::to_string(d->abi_major) + "." +
                          std::to_string(d->abi_minor) + ", this host supports up to " +
                          std::to_string(SPMDX_ABI_MAJOR) + "." + std::to_string(SPMDX_ABI_MINOR) +
                          ": upgrade spmdx, or rebuild the plugin against this one.");
  }
  if (d->toolchain == nullptr || std::string_view(d->toolchain) != SPMDX_TOOLCHAIN) {
    throw PluginError(Code::toolchain_mismatch, file,
                      "plugin '" + file.string() + "' was built with toolchain '" +
                          (d->toolchain && is_printable(d->toolchain) ? std::string(d->toolchain) : std::string("(none)")) +
                          "', this host with '" SPMDX_TOOLCHAIN
                          "': standard-library types and exceptions cross the plugin boundary, so both must use the same "
                          "C++ standard library and ABI; rebuild the plugin with the toolchain spmdx was built with.");
  }
  auto bad = [&](const std::string& what) {
    throw PluginError(Code::bad_descriptor, file, "plugin '" + file.string() + "': " + what + "; fix the plugin.");
  };
  if (!is_identifier(d->name, false)) bad("its descriptor's name is empty or not [a-z0-9_]+");
  if (!is_printable(d->version) || !is_printable(d->description)) bad("its version or description holds control characters");
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
    case PluginSource::Origin::user: return "plugins.paths or --plugin-path";
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
  info.toolchain = d.toolchain;
  info.flags = d.flags;
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

void set_transport_wrapper(TransportWrapper wrap) { transport_wrapper() = std::move(wrap); }

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
  std::map<std::string, Entry<PlannerFactory>, std::less<>> planners;
  std::map<std::string, const PluginDescriptor*, std::less<>> descriptors;
  std::map<std::string, std::vector<std::string>, std::less<>> transport_options;  // backend -> the keys it takes
};

// What one plugin's callback registers, committed only when the callback returns.
class PluginRegistry::Staging final : public Registrar {
 public:
  Staging(Factories& target, const PluginInfo& plugin, const std::vector<PluginInfo>& all)
      : target_(target), plugin_(plugin.name), kind_(plugin.kind), all_(all) {}

  void add_strategy(const std::string& name, StrategyFactory f) override {
    add(target_.strategies, strategies_, PluginKind::strategy, name, std::move(f));
  }
  void add_comm_backend(const std::string& name, CommBackendFactory f) override {
    add(target_.comm_backends, comm_backends_, PluginKind::comm, name, std::move(f));
  }
  void add_transport(const std::string& name, TransportInfo info) override {
    if (!info.factory) throw std::invalid_argument("empty transport factory '" + name + "'");
    if (!transport_wrapper()) throw std::logic_error("transport '" + name + "': no collective engine to run it over (set_transport_wrapper was never called)");
    TransportBackend backend = transport_wrapper()(name, std::move(info));
    add(target_.comm_backends, comm_backends_, PluginKind::comm, name, std::move(backend.factory));
    transport_options_[name] = std::move(backend.options);
  }
  void add_hook(const std::string& name, HookFactory f) override {
    add(target_.hooks, hooks_, PluginKind::hook, name, std::move(f));
  }
  void add_planner(const std::string& name, PlannerFactory f) override {
    add(target_.planners, planners_, PluginKind::strategy, name, std::move(f), "planner");
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
    move_all(planners_, target_.planners);
    for (auto& [name, keys] : transport_options_) target_.transport_options[name] = std::move(keys);
    return names;
  }

 private:
  template <class F>
  void add(const std::map<std::string, Factories::Entry<F>, std::less<>>& existing,
           std::map<std::string, Factories::Entry<F>, std::less<>>& staged, PluginKind factory_kind,
           const std::string& name, F factory, const char* label = nullptr) {
    const std::string kind = label != nullptr ? label : factory_kind == PluginKind::comm ? "comm backend" : to_string(factory_kind);
    if (factory_kind != kind_) {
      throw std::invalid_argument("it is a " + std::string(to_string(kind_)) + " plugin and may register only " +
                                  to_string(kind_) + " factories, not " + kind + " '" + name + "'");
    }
    if (!is_identifier(name.c_str(), true)) {
      throw std::invalid_argument(kind + " name '" + name + "' is empty or not [a-z0-9_.]+");
    }
    for (const auto& other : all_) {
      if (other.name == name && other.name != plugin_) {
        throw std::invalid_argument(kind + " name '" + name + "' is the name of another plugin (" + other.path.string() +
                                    "); register factories under your plugin's own name");
      }
    }
    if (!factory) throw std::invalid_argument("empty " + kind + " factory '" + name + "'");
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
  PluginKind kind_;
  const std::vector<PluginInfo>& all_;
  std::map<std::string, Factories::Entry<StrategyFactory>, std::less<>> strategies_;
  std::map<std::string, Factories::Entry<CommBackendFactory>, std::less<>> comm_backends_;
  std::map<std::string, Factories::Entry<HookFactory>, std::less<>> hooks_;
  std::map<std::string, Factories::Entry<PlannerFactory>, std::less<>> planners_;
  std::map<std::string, std::vector<std::string>> transport_options_;
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
      errors_.push_back(e);
    } catch (const std::exception& e) {
      const fs::path shown = fs::absolute(file).lexically_normal();
      errors_.emplace_back(Code::unreadable, shown,
                           "cannot load plugin '" + shown.string() + "': " + e.what() + "; remove it from the plugin path.");
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
    fs::directory_iterator it(source.path, ec);
    for (; !ec && it != fs::directory_iterator(); it.increment(ec)) {
      if (is_plugin_file_name(it->path())) files.push_back(it->path());
    }
    if (ec) {
      errors_.emplace_back(Code::unreadable, source.path,
                           "cannot list plugin folder '" + source.path.string() + "' (from " +
                               origin_text(source.origin) + "): " + ec.message() +
                               ". Make it readable by this user, or remove it from " + origin_text(source.origin) + ".");
      continue;
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
    std::vector<std::string> names;
    for (const auto& p : plugins_) names.push_back(p.name);
    const std::string known = join(names);
    throw PluginError(Code::unknown_plugin, {},
                      "no plugin named '" + std::string(plugin_name) + "'; found: " +
                          (known.empty() ? "none" : known) +
                          ". Check the name, or add its folder to plugins.paths (the config), --plugin-path (spmdx plugins, compile) or SPMDX_PLUGIN_PATH.");
  }
  if (info->registered) return;
  const PluginDescriptor* d = factories_->descriptors.at(info->name);
  Staging staging(*factories_, *info, plugins_);
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
  std::vector<std::string> names;
  for (const auto& p : plugins_) {
    if (p.kind == kind) names.push_back(p.name);
  }
  const std::string known = join(names);
  throw PluginError(Code::unknown_plugin, {},
                    std::string("no ") + to_string(kind) + " plugin named '" + std::string(name) + "'; found: " +
                        (known.empty() ? "none" : known) +
                        ". Check the name, or add its folder to plugins.paths (the config), --plugin-path (spmdx plugins, compile) or SPMDX_PLUGIN_PATH.");
}

std::unique_ptr<Strategy> PluginRegistry::make_strategy(std::string_view name, const Options& options) {
  ensure_factory(PluginKind::strategy, name);
  return factories_->strategies.find(name)->second.factory(options);
}

const PluginInfo& PluginRegistry::strategy_plugin(std::string_view name) {
  ensure_factory(PluginKind::strategy, name);
  return *find(factories_->strategies.find(name)->second.plugin);
}

PluginSpec parse_plugin_spec(const std::string& spec, const std::string& what) {
  const auto colon = spec.find(':');
  PluginSpec out{spec.substr(0, colon), {}};
  if (colon != std::string::npos) {
    std::stringstream list(spec.substr(colon + 1));
    std::string item;
    while (std::getline(list, item, ';')) {
      const auto eq = item.find('=');
      if (eq == std::string::npos) throw std::invalid_argument(what + " '" + spec + "': option '" + item + "' is not key=value");
      if (!out.options.emplace(item.substr(0, eq), item.substr(eq + 1)).second) {
        throw std::invalid_argument(what + " '" + spec + "': option '" + item.substr(0, eq) + "' is given twice");
      }
    }
  }
  return out;
}

std::unique_ptr<CommBackend> PluginRegistry::make_comm_backend_from_spec(const std::string& spec) {
  const PluginSpec parsed = parse_plugin_spec(spec, "comm backend");
  return make_comm_backend(parsed.name, parsed.options);
}

std::unique_ptr<CommBackend> PluginRegistry::make_comm_backend(std::string_view name, const Options& options) {
  ensure_factory(PluginKind::comm, name);
  return factories_->comm_backends.find(name)->second.factory(options);
}

std::vector<std::string> PluginRegistry::comm_backend_options(std::string_view name) const {
  const auto it = factories_->transport_options.find(name);
  return it == factories_->transport_options.end() ? std::vector<std::string>{} : it->second;
}

const PluginInfo& PluginRegistry::comm_backend_plugin(std::string_view name) {
  ensure_factory(PluginKind::comm, name);
  return *find(factories_->comm_backends.find(name)->second.plugin);
}

std::unique_ptr<Hook> PluginRegistry::make_hook(std::string_view name, const Options& options) {
  ensure_factory(PluginKind::hook, name);
  return factories_->hooks.find(name)->second.factory(options);
}

std::unique_ptr<Planner> PluginRegistry::make_planner(std::string_view name, const Options& options) {
  if (factories_->planners.count(name) == 0) {
    if (const PluginInfo* p = find(name); p != nullptr && p->kind == PluginKind::strategy) load(name);
  }
  if (auto it = factories_->planners.find(name); it != factories_->planners.end()) return it->second.factory(options);
  std::vector<std::string> names;
  for (const auto& [known, entry] : factories_->planners) names.push_back(known);
  const std::string known = join(names);
  throw PluginError(Code::unknown_plugin, {},
                    "no planner named '" + std::string(name) + "' (parallelism.planner); loaded planners: " + (known.empty() ? "none" : known) +
                        ". The built-in one is 'auto' (the auto plugin, built where COIN-OR CBC is installed: scripts/setup installs "
                        "coinor-libcbc-dev); a third party's goes in plugins.paths, --plugin-path or SPMDX_PLUGIN_PATH.");
}

}  // namespace spmdx
