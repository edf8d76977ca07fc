// The plugin registry against real plugin .so files built by tests/CMakeLists.txt, one folder
// per test plugin under TEST_PLUGIN_DIR.
#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "spmdx/comm/all_to_all_v.h"
#include "spmdx/core/registry.h"
#include "test_util.h"

namespace spmdx {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using Code = PluginError::Code;
using test::TempDir;

fs::path plugin_dir(const std::string& target) { return fs::path(TEST_PLUGIN_DIR) / target; }
fs::path plugin_file(const std::string& target) { return plugin_dir(target) / ("libspmdx_" + target + ".so"); }

std::vector<PluginSource> user(std::initializer_list<fs::path> paths) {
  std::vector<PluginSource> out;
  for (const auto& p : paths) out.push_back({p, PluginSource::Origin::user});
  return out;
}

// The single error a registry collected, or a failure.
PluginError only_error(const PluginRegistry& registry) {
  EXPECT_EQ(registry.errors().size(), 1u);
  if (registry.errors().empty()) return PluginError(Code::unknown_plugin, {}, "no error collected");
  return registry.errors().front();
}

TEST(Registry, DiscoversAPluginAndLoadsItOnDemand) {
  PluginRegistry registry;
  registry.discover(user({plugin_dir("test_strategy")}));
  ASSERT_TRUE(registry.errors().empty()) << registry.errors().front().what();
  ASSERT_EQ(registry.plugins().size(), 1u);
  const PluginInfo& info = registry.plugins().front();
  EXPECT_EQ(info.name, "test_strategy");
  EXPECT_EQ(info.kind, PluginKind::strategy);
  EXPECT_EQ(info.version, "1.0.0");
  EXPECT_EQ(info.abi_major, static_cast<std::uint32_t>(SPMDX_ABI_MAJOR));
  EXPECT_EQ(info.abi_minor, static_cast<std::uint32_t>(SPMDX_ABI_MINOR));
  EXPECT_EQ(info.path, plugin_file("test_strategy"));
  EXPECT_FALSE(info.registered);

  auto strategy = registry.make_strategy("test_strategy");
  EXPECT_TRUE(registry.find("test_strategy")->registered);
  EXPECT_EQ(registry.find("test_strategy")->factories, std::vector<std::string>{"test_strategy"});
  StrategyInput in{{{"dp_shard", 2}, {"tp", 2}}, {{"w", {8, 4}}, {"b", {8}}}, {}};
  PlacementMap placements = strategy->place(in);
  ASSERT_EQ(placements.size(), 2u);
  EXPECT_EQ(to_string(placements.at("w")), "S(0)R");
  EXPECT_EQ(to_string(placements.at("b")), "S(0)R");
}

TEST(Registry, SameFileTwiceIsOnePluginWithoutWarning) {
  PluginRegistry registry;
  registry.discover(user({plugin_dir("test_strategy"), plugin_file("test_strategy")}));
  EXPECT_EQ(registry.plugins().size(), 1u);
  EXPECT_TRUE(registry.warnings().empty());
  EXPECT_TRUE(registry.errors().empty());
}

TEST(Registry, MissingFileOrFolderNamesItAndTheSetting) {
  PluginRegistry registry;
  registry.discover(user({"/nonexistent/libspmdx_gone.so"}));
  PluginError e = only_error(registry);
  EXPECT_EQ(e.code(), Code::file_missing);
  EXPECT_EQ(e.path(), "/nonexistent/libspmdx_gone.so");
  EXPECT_THAT(e.what(), HasSubstr("'/nonexistent/libspmdx_gone.so' (from plugins.paths or --plugin-path) does not exist"));

  try {
    read_plugin("/nonexistent/libspmdx_gone.so");
    FAIL() << "read_plugin of a missing file returned";
  } catch (const PluginError& err) {
    EXPECT_EQ(err.code(), Code::file_missing);
    EXPECT_THAT(err.what(), HasSubstr("plugin file '/nonexistent/libspmdx_gone.so' does not exist"));
  }
}

TEST(Registry, MissingBuiltinFolderIsNotAnError) {
  PluginRegistry registry;
  registry.discover({{"/nonexistent/builtin", PluginSource::Origin::builtin}});
  EXPECT_TRUE(registry.errors().empty());
}

TEST(Registry, NotASharedObject) {
  TempDir dir;
  const fs::path file = dir / "libspmdx_text.so";
  test::write_file(file, "this is a text file, not ELF\n");
  PluginRegistry registry;
  registry.discover(user({dir.path()}));
  PluginError e = only_error(registry);
  EXPECT_EQ(e.code(), Code::not_shared_object);
  EXPECT_EQ(e.path(), file);
  EXPECT_THAT(e.what(), HasSubstr("cannot load plugin '" + file.string() + "': not a shared object"));
  EXPECT_TRUE(registry.plugins().empty());
}

TEST(Registry, EntryPointMissing) {
  PluginRegistry registry;
  registry.discover(user({plugin_dir("test_no_entry")}));
  PluginError e = only_error(registry);
  EXPECT_EQ(e.code(), Code::entry_missing);
  EXPECT_THAT(e.what(), HasSubstr(plugin_file("test_no_entry").string() + "' has no 'spmdx_plugin' entry point"));
}

TEST(Registry, AbiMajorMismatchSaysBothVersions) {
  PluginRegistry registry;
  registry.discover(user({plugin_dir("test_abi_major")}));
  PluginError e = only_error(registry);
  EXPECT_EQ(e.code(), Code::abi_mismatch);
  EXPECT_THAT(e.what(), HasSubstr("was built for ABI " + std::to_string(SPMDX_ABI_MAJOR + 1) + ", this host supports " +
                                   std::to_string(SPMDX_ABI_MAJOR)));
  EXPECT_THAT(e.what(), HasSubstr(plugin_file("test_abi_major").string()));
}

TEST(Registry, PluginBuiltAgainstAbi2IsRefusedSayingRebuild) {
  PluginRegistry registry;
  registry.discover(user({plugin_dir("test_abi_2")}));
  PluginError e = only_error(registry);
  EXPECT_EQ(e.code(), Code::abi_mismatch);
  EXPECT_EQ(std::string(e.what()), "plugin '" + plugin_file("test_abi_2").string() +
                                       "' was built for ABI 2, this host supports 4 (ABI 4.1): rebuild the plugin against this spmdx. "
                                       "(ABI 3 moved the collectives into the host: a comm plugin built on the P2P backend now registers "
                                       "a Transport, see spmdx/transport.h.)");
  EXPECT_TRUE(registry.plugins().empty());
}

TEST(Registry, PluginCallingHostServicesUnderTheOldStringAbiIsRefusedSayingRebuild) {
  PluginRegistry registry;
  registry.discover(user({plugin_dir("test_old_string_abi")}));
  PluginError e = only_error(registry);
  EXPECT_EQ(e.code(), Code::toolchain_mismatch);
  EXPECT_THAT(e.what(), HasSubstr("undefined symbol: _ZN5spmdx12OptionReader"));
  EXPECT_THAT(e.what(), HasSubstr("built against another spmdx, or with another C++ standard library ABI than this host's '" SPMDX_TOOLCHAIN
                                  "' (e.g. -D_GLIBCXX_USE_CXX11_ABI=0); rebuild it against this spmdx"));
}

TEST(Registry, PluginBuiltWithAnotherStandardLibraryIsRefused) {
  PluginRegistry registry;
  registry.discover(user({plugin_dir("test_toolchain")}));
  PluginError e = only_error(registry);
  EXPECT_EQ(e.code(), Code::toolchain_mismatch);
  EXPECT_THAT(e.what(), HasSubstr("was built with toolchain 'libc++ cxx11-abi exceptions', this host with '" SPMDX_TOOLCHAIN "'"));
  EXPECT_THAT(e.what(), HasSubstr("rebuild the plugin with the toolchain spmdx was built with"));
  EXPECT_EQ(std::string(SPMDX_TOOLCHAIN), "libstdc++ cxx11-abi exceptions");  // this tree's build
}

TEST(Registry, AbiMinorNewerThanHostIsRefused) {
  PluginRegistry registry;
  registry.discover(user({plugin_dir("test_abi_minor")}));
  PluginError e = only_error(registry);
  EXPECT_EQ(e.code(), Code::abi_mismatch);
  EXPECT_THAT(e.what(), HasSubstr("was built for ABI " + std::to_string(SPMDX_ABI_MAJOR) + ".99, this host supports up to " +
                                   std::to_string(SPMDX_ABI_MAJOR) + "." + std::to_string(SPMDX_ABI_MINOR)));
}

// ABI 4.1 added VariableAllToAll as an interface of its own (a minor): a comm plugin of 4.0
// still loads and runs the other collectives; all_to_all_v on it names it and says to rebuild.
TEST(Registry, CommPluginOfAbi40LoadsAndItsAllToAllVIsRefusedNamingIt) {
  PluginRegistry registry;
  registry.discover(user({plugin_dir("test_comm_abi_4_0")}));
  EXPECT_TRUE(registry.errors().empty());
  auto backend = registry.make_comm_backend("test_comm_abi_4_0");
  ASSERT_NE(backend, nullptr);
  EXPECT_EQ(registry.find("test_comm_abi_4_0")->abi_minor, 0u);
  std::vector<float> in(2), out(2);
  std::vector<std::size_t> recv(1);
  try {
    comm::all_to_all_v(*backend, 0, {in.data(), 2}, {out.data(), 2}, {2}, recv.data());
    FAIL() << "all_to_all_v ran on a backend without it";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("comm backend test_comm_abi_4_0 "));
    EXPECT_THAT(e.what(), HasSubstr("has no all_to_all_v (VariableAllToAll, plugin ABI 4.1): its plugin was built for ABI 4.0 or does not "
                                    "implement it; rebuild the plugin against this spmdx, or use ucx or nccl"));
  }
}

TEST(Registry, DescriptorWithoutCallbackIsRefused) {
  PluginRegistry registry;
  registry.discover(user({plugin_dir("test_no_callback")}));
  PluginError e = only_error(registry);
  EXPECT_EQ(e.code(), Code::bad_descriptor);
  EXPECT_THAT(e.what(), HasSubstr("no registration callback"));
}

TEST(Registry, DuplicateNameFirstInSearchOrderWinsWithWarning) {
  for (bool dup_first : {false, true}) {
    PluginRegistry registry;
    auto first = plugin_dir(dup_first ? "test_strategy_dup" : "test_strategy");
    auto second = plugin_dir(dup_first ? "test_strategy" : "test_strategy_dup");
    registry.discover(user({first, second}));
    ASSERT_EQ(registry.plugins().size(), 1u);
    EXPECT_EQ(registry.plugins().front().version, dup_first ? "0.2.0" : "1.0.0");
    EXPECT_TRUE(registry.errors().empty());
    ASSERT_EQ(registry.warnings().size(), 1u);
    const std::string& w = registry.warnings().front();
    EXPECT_THAT(w, HasSubstr("plugin 'test_strategy' found twice"));
    EXPECT_THAT(w, HasSubstr("using " + first.string()));
    EXPECT_THAT(w, HasSubstr("ignoring " + second.string()));
  }
}

TEST(Registry, RegistrationThatThrowsIsReportedAndRegistersNothing) {
  PluginRegistry registry;
  registry.discover(user({plugin_dir("test_throws"), plugin_dir("test_strategy")}));
  ASSERT_EQ(registry.plugins().size(), 2u);
  try {
    registry.load("test_throws");
    FAIL() << "load of a throwing plugin returned";
  } catch (const PluginError& e) {
    EXPECT_EQ(e.code(), Code::register_failed);
    EXPECT_THAT(e.what(), HasSubstr("plugin 'test_throws' (" + plugin_file("test_throws").string() +
                                    ") failed to register: cannot find libfoo settings"));
  }
  EXPECT_FALSE(registry.find("test_throws")->registered);
  // All or nothing: the hook it added before throwing is not there.
  EXPECT_THROW(registry.make_hook("test_throws"), PluginError);
  // The host goes on with the other plugins.
  EXPECT_NE(registry.make_strategy("test_strategy"), nullptr);

  registry.load_all();
  ASSERT_EQ(registry.errors().size(), 1u);
  EXPECT_EQ(registry.errors().front().code(), Code::register_failed);
}

TEST(Registry, UnknownNameListsWhatWasFound) {
  PluginRegistry registry;
  registry.discover(user({plugin_dir("test_strategy"), plugin_dir("test_comm_a")}));
  try {
    registry.make_strategy("test_strategyy");
    FAIL();
  } catch (const PluginError& e) {
    EXPECT_EQ(e.code(), Code::unknown_plugin);
    EXPECT_THAT(e.what(), HasSubstr("no strategy plugin named 'test_strategyy'; found: test_strategy"));
  }
  // A plugin of another kind does not answer for a strategy.
  EXPECT_THROW(registry.make_strategy("test_comm_a"), PluginError);
  EXPECT_THROW(registry.load("nope"), PluginError);
}

TEST(Registry, RefusesAPluginWritableByOthers) {
  TempDir dir;
  const fs::path file = dir / "libspmdx_test_strategy.so";
  fs::copy_file(plugin_file("test_strategy"), file);
  fs::permissions(file, fs::perms::others_write, fs::perm_options::add);
  PluginRegistry registry;
  registry.discover(user({dir.path()}));
  PluginError e = only_error(registry);
  EXPECT_EQ(e.code(), Code::untrusted);
  EXPECT_THAT(e.what(), HasSubstr("refusing to load plugin '"));
  EXPECT_THAT(e.what(), HasSubstr("the file is writable by others (mode 0757)"));
}

TEST(Registry, RefusesAPluginInAFolderWritableByOthers) {
  TempDir dir;
  const fs::path file = dir / "libspmdx_test_strategy.so";
  fs::copy_file(plugin_file("test_strategy"), file);
  fs::permissions(dir.path(), fs::perms::all);
  PluginRegistry registry;
  registry.discover(user({file}));
  PluginError e = only_error(registry);
  EXPECT_EQ(e.code(), Code::untrusted);
  EXPECT_THAT(e.what(), HasSubstr("its folder '" + fs::canonical(dir.path()).string() +
                                  "' is writable by others (mode 0777)"));
}

TEST(Registry, RefusesAPluginOwnedByAnotherUser) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give a file to another user (uid 65534)";
  TempDir dir;
  const fs::path file = dir / "libspmdx_test_strategy.so";
  fs::copy_file(plugin_file("test_strategy"), file);
  ASSERT_EQ(::chown(file.c_str(), 65534, 65534), 0);
  PluginRegistry registry;
  registry.discover(user({file}));
  PluginError e = only_error(registry);
  EXPECT_EQ(e.code(), Code::untrusted);
  EXPECT_THAT(e.what(), HasSubstr("the file is owned by uid 65534, not by root or you (uid 0)"));
}

TEST(Registry, TruncatedLibraryIsRejectedWithoutCrashing) {
  // dlopen of a truncated library would die of SIGBUS; the ELF check must catch it first.
  const fs::path real = plugin_file("test_strategy");
  const auto size = fs::file_size(real);
  for (std::uintmax_t keep : {std::uintmax_t{1000}, std::uintmax_t{8192}, size / 2, size - 1}) {
    TempDir dir;
    const fs::path file = dir / "libspmdx_cut.so";
    std::ifstream in(real, std::ios::binary);
    std::string bytes(keep, '\0');
    in.read(bytes.data(), static_cast<std::streamsize>(keep));
    test::write_file(file, bytes);
    PluginRegistry registry;
    registry.discover(user({file}));
    PluginError e = only_error(registry);
    EXPECT_EQ(e.code(), Code::not_shared_object) << keep;
    EXPECT_THAT(e.what(), HasSubstr("not a shared object (truncated: ")) << keep;
  }
}

TEST(Registry, FifoOrFolderNamedLikeAPluginIsRejectedWithoutHanging) {
  TempDir dir;
  ASSERT_EQ(::mkfifo((dir / "libspmdx_fifo.so").c_str(), 0600), 0);
  fs::create_directory(dir / "libspmdx_dir.so");
  PluginRegistry registry;
  registry.discover(user({dir.path()}));
  ASSERT_EQ(registry.errors().size(), 2u);
  for (const auto& e : registry.errors()) {
    EXPECT_EQ(e.code(), Code::not_shared_object);
    EXPECT_THAT(e.what(), HasSubstr("not a regular file"));
  }
}

TEST(Registry, DanglingLinkSaysSo) {
  TempDir dir;
  fs::create_symlink(dir / "gone.so", dir / "libspmdx_dangling.so");
  PluginRegistry registry;
  registry.discover(user({dir.path()}));
  EXPECT_THAT(only_error(registry).what(), HasSubstr("cannot be resolved"));
}

TEST(Registry, LinkInAFolderWritableByOthersIsRefused) {
  TempDir dir;
  fs::create_directory(dir / "open");
  fs::permissions(dir / "open", fs::perms::all);  // 0777, no sticky bit
  fs::create_symlink(plugin_file("test_strategy"), dir / "open" / "libspmdx_evil.so");
  PluginRegistry registry;
  registry.discover(user({dir / "open"}));
  PluginError e = only_error(registry);
  EXPECT_EQ(e.code(), Code::untrusted);
  EXPECT_THAT(e.what(), HasSubstr("(a link to '" + plugin_file("test_strategy").string() + "')"));
  EXPECT_THAT(e.what(), HasSubstr("its folder '" + (dir / "open").string() + "' is writable by others (mode 0777)"));
}

TEST(Registry, FolderAboveWritableByOthersWithoutStickyBitIsRefused) {
  TempDir dir;
  fs::create_directories(dir / "open" / "sub");
  fs::permissions(dir / "open", fs::perms::all);
  fs::copy_file(plugin_file("test_strategy"), dir / "open" / "sub" / "libspmdx_test_strategy.so");
  PluginRegistry registry;
  registry.discover(user({dir / "open" / "sub"}));
  EXPECT_THAT(only_error(registry).what(), HasSubstr("the folder '" + fs::canonical(dir / "open").string() +
                                                     "' above it is writable by others (mode 0777)"));
  // With the sticky bit (as /tmp) the folder above is fine.
  fs::permissions(dir / "open", fs::perms::all | fs::perms::sticky_bit);
  PluginRegistry sticky;
  sticky.discover(user({dir / "open" / "sub"}));
  EXPECT_TRUE(sticky.errors().empty()) << sticky.errors().front().what();
}

TEST(Registry, GroupWritableByAnotherGroupIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give a file to another group (gid 65534)";
  TempDir dir;
  const fs::path file = dir / "libspmdx_test_strategy.so";
  fs::copy_file(plugin_file("test_strategy"), file);
  ASSERT_EQ(::chown(file.c_str(), 0, 65534), 0);
  fs::permissions(file, fs::perms::group_write, fs::perm_options::add);
  PluginRegistry registry;
  registry.discover(user({file}));
  EXPECT_THAT(only_error(registry).what(), HasSubstr("the file is writable by group 65534 (mode 0775)"));
}

TEST(Registry, APluginCannotTakeAnotherPluginsName) {
  PluginRegistry registry;
  registry.discover(user({plugin_dir("test_hijack"), plugin_dir("test_strategy")}));
  registry.load_all();
  PluginError e = only_error(registry);
  EXPECT_EQ(e.code(), Code::register_failed);
  EXPECT_THAT(e.what(), HasSubstr("plugin 'test_hijack'"));
  EXPECT_THAT(e.what(), HasSubstr("strategy name 'test_strategy' is the name of another plugin"));
  EXPECT_TRUE(registry.find("test_strategy")->registered);
}

TEST(Registry, APluginRegistersOnlyItsOwnKind) {
  PluginRegistry registry;
  registry.discover(user({plugin_dir("test_wrong_kind")}));
  EXPECT_THROW(registry.load("test_wrong_kind"), PluginError);
  registry.load_all();
  EXPECT_THAT(only_error(registry).what(),
              HasSubstr("it is a comm plugin and may register only comm factories, not strategy 'test_wrong_kind'"));
}

TEST(Registry, PluginNameMustBeAnIdentifier) {
  PluginRegistry registry;
  registry.discover(user({plugin_dir("test_bad_name")}));
  PluginError e = only_error(registry);
  EXPECT_EQ(e.code(), Code::bad_descriptor);
  EXPECT_THAT(e.what(), HasSubstr("name is empty or not [a-z0-9_]+"));
}

// Unload policy "never unload": backend A lives on while B is loaded and after the registry
// that made it is gone, and its destructor (code in A's library) runs safely afterwards.
TEST(Registry, SecondBackendWhileFirstIsAliveAndFirstDroppedAfterRegistry) {
  std::unique_ptr<CommBackend> a;
  std::unique_ptr<CommBackend> b;
  {
    PluginRegistry registry;
    registry.discover(user({plugin_dir("test_comm_a"), plugin_dir("test_comm_b")}));
    ASSERT_TRUE(registry.errors().empty());
    a = registry.make_comm_backend("test_comm_a", {{"tls", "shm,self"}});
    a->init({0, 1, 0});
    b = registry.make_comm_backend("test_comm_b", {{"tls", "tcp"}});
    b->init({0, 1, 1});
    a->finalize();
    EXPECT_EQ(a->describe(), "test_comm_a tls=shm,self rank 0/1 generation 0 live 1 finalized");
    EXPECT_EQ(b->describe(), "test_comm_b tls=tcp rank 0/1 generation 1 live 1");
  }
  a.reset();  // runs code of library A after its registry is destroyed
  EXPECT_NE(::dlopen(plugin_file("test_comm_a").c_str(), RTLD_NOW | RTLD_NOLOAD), nullptr)
      << "library A was unmapped";
  EXPECT_EQ(b->describe(), "test_comm_b tls=tcp rank 0/1 generation 1 live 1");

  // Loading B again in a new registry reuses the same mapping: its instance count is shared.
  PluginRegistry again;
  again.discover(user({plugin_dir("test_comm_b")}));
  auto b2 = again.make_comm_backend("test_comm_b");
  EXPECT_EQ(b2->describe(), "test_comm_b tls=default rank 0/1 generation 0 live 2");
}

TEST(Registry, SearchPathOrderIsUserThenEnvironmentThenBuiltin) {
  ::setenv("SPMDX_PLUGIN_PATH", "/env/one::/env/two", 1);
  auto path = plugin_search_path({"/user/a"});
  ::unsetenv("SPMDX_PLUGIN_PATH");
  ASSERT_EQ(path.size(), 4u);
  EXPECT_EQ(path[0].path, "/user/a");
  EXPECT_EQ(path[0].origin, PluginSource::Origin::user);
  EXPECT_EQ(path[1].path, "/env/one");
  EXPECT_EQ(path[2].path, "/env/two");
  EXPECT_EQ(path[2].origin, PluginSource::Origin::environment);
  EXPECT_EQ(path[3].origin, PluginSource::Origin::builtin);
  EXPECT_EQ(path[3].path, fs::canonical(BUILTIN_PLUGIN_DIR));
}

TEST(Registry, EnvironmentPathThatDoesNotExistNamesTheVariable) {
  PluginRegistry registry;
  registry.discover({{"/nonexistent/env", PluginSource::Origin::environment}});
  PluginError e = only_error(registry);
  EXPECT_THAT(e.what(), HasSubstr("'/nonexistent/env' (from SPMDX_PLUGIN_PATH) does not exist"));
}

}  // namespace
}  // namespace spmdx
