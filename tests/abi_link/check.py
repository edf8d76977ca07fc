#!/usr/bin/env python3
"""The plugin ABI held by the linker (issue 44, item 4). CTest `abi_link`.

Usage: check.py BUILD_DIR SOURCE_DIR

1. A plugin that calls a core symbol which is no host service (calls_core.cpp: the core's
   builtin_plugin_dir()), built as a third party would, with find_package(spmdx) against the
   build tree, must fail to LINK, with the linker naming that symbol: it compiles, and its link
   fails on `spmdx::builtin_plugin_dir()` and on nothing else.
2. libspmdx_host.so, the one spmdx library a plugin links, exports (defines, dynamically) only
   spmdx functions that interfaces/spmdx/ or the logging facade declare.
3. No plugin built in the tree needs libspmdx_core.so (or libspmdx_exec.so).
Prints each problem on a line and exits 1 when there is any.
"""
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

build, source = (os.path.abspath(p) for p in sys.argv[1:3])
here = os.path.join(source, "tests", "abi_link")
problems = []


def run(cmd):
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


# 1. The plugin that calls the core: configured and compiled fine, refused by the linker.
work = tempfile.mkdtemp(prefix="spmdx-abi-link-")
try:
    launcher = ["-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"] if shutil.which("ccache") else []
    conf = run(["cmake", "-S", here, "-B", work, "-G", "Ninja", f"-Dspmdx_DIR={build}"] + launcher)
    if conf.returncode != 0:
        problems.append("configuring tests/abi_link against the build tree failed:\n" + conf.stdout)
    else:
        obj = run(["cmake", "--build", work, "--target", "CMakeFiles/abi_violation.dir/calls_core.cpp.o"])
        if obj.returncode != 0:
            problems.append("calls_core.cpp did not compile (the test wants a link error, not a compile error):\n" + obj.stdout)
        else:
            link = run(["cmake", "--build", work])
            # spmdx::builtin_plugin_dir[abi:cxx11]() as GNU ld demangles it: the tag dropped
            undefined = [re.sub(r"\[abi:\w+\]", "", u) for u in re.findall(r"undefined (?:reference to|symbol:) [`']?([^'\n]+)'?", link.stdout)]
            if link.returncode == 0:
                problems.append("the plugin calling spmdx::builtin_plugin_dir() linked: the core's symbols reach plugins")
            elif not undefined:
                problems.append("the plugin failed to build, but not with an undefined symbol:\n" + link.stdout)
            elif set(undefined) != {"spmdx::builtin_plugin_dir()"}:
                problems.append(f"the link failed on {sorted(set(undefined))}, not on spmdx::builtin_plugin_dir() alone:\n" + link.stdout)
            else:
                print("a plugin calling spmdx::builtin_plugin_dir() fails to link:",
                      next(l for l in link.stdout.splitlines() if "undefined" in l).strip())
finally:
    shutil.rmtree(work, ignore_errors=True)

# 2. What libspmdx_host.so exports.
host = os.path.join(build, "lib", "libspmdx_host.so")
nm = run(["nm", "-D", "--defined-only", "-C", host])
if nm.returncode != 0:
    problems.append(f"nm {host} failed:\n" + nm.stdout)
declared = ""
for header in glob.glob(os.path.join(source, "interfaces", "spmdx", "*.h")) + [
        os.path.join(source, "core", "include", "spmdx", "core", "log.h")]:
    with open(header, encoding="utf-8") as f:
        declared += f.read()
exported = []
for line in nm.stdout.splitlines():
    parts = line.split(" ", 2)
    if len(parts) < 3 or parts[1] in ("A",):  # the version node's absolute symbol, if any
        continue
    name = parts[2]
    exported.append(name)
    if not name.startswith("spmdx::"):
        problems.append(f"libspmdx_host.so exports {name!r}, which is no spmdx host service")
        continue
    # spmdx::log::ThreadLevel::~ThreadLevel() -> ~ThreadLevel; spmdx::edit_distance(...) -> edit_distance
    function = re.sub(r"\[abi:\w+\]", "", re.sub(r"\(.*$", "", name)).split("::")[-1]
    if not re.search(r"(?<![\w~])" + re.escape(function.lstrip("~")) + r"\s*\(", declared):
        problems.append(f"libspmdx_host.so exports {name!r}, which neither interfaces/spmdx/ nor spmdx/core/log.h declares")
if not any(n.startswith("spmdx::log::write(") for n in exported):
    problems.append("libspmdx_host.so does not export spmdx::log::write: the logging facade is missing")
print(f"libspmdx_host.so exports {len(exported)} symbols, all host services")

# 3. The plugins of the tree link the host services, not the core.
plugins = sorted(glob.glob(os.path.join(build, "lib", "spmdx", "plugins", "libspmdx_*.so")))
if not plugins:
    problems.append("no plugin in " + os.path.join(build, "lib", "spmdx", "plugins"))
for plugin in plugins:
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", run(["readelf", "-d", plugin]).stdout)
    if any(n.startswith(("libspmdx_core", "libspmdx_exec")) for n in needed):
        problems.append(f"{os.path.basename(plugin)} needs {needed}: a plugin links libspmdx_host.so, not the core")
print(f"{len(plugins)} plugins of the tree need no spmdx library but libspmdx_host.so")

for p in problems:
    print(p)
sys.exit(1 if problems else 0)
