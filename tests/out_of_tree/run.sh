#!/usr/bin/env bash
# Installs spmdx from BUILD_DIR into a temporary prefix, builds the sample strategy plugin in
# a separate folder with find_package(spmdx), and checks that the installed host loads it.
# Usage: run.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build="$1"; src="$2"
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
chmod 0755 "$work"

cmake --install "$build" --prefix "$work/prefix" >/dev/null
launcher=()
if command -v ccache >/dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
cmake -S "$src" -B "$work/build" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" "${launcher[@]}" >/dev/null
cmake --build "$work/build" >/dev/null

out="$(env -u SPMDX_PLUGIN_PATH "$work/prefix/bin/spmdx" plugins --plugin-path "$work/build" --json)"
echo "$out"
python3 - "$out" "$work" <<'PY'
import json, sys
plugins = {p["name"]: p for p in json.loads(sys.argv[1])}
work = sys.argv[2]
s = plugins.get("sample_column")
assert s, "the installed host did not list the out-of-tree plugin"
assert s["kind"] == "strategy" and s["registered"] and s["factories"] == ["sample_column"], s
assert s["path"] == f"{work}/build/libspmdx_sample_column.so", s["path"]
dp = plugins.get("data_parallel")
assert dp and dp["path"] == f"{work}/prefix/lib/spmdx/plugins/libspmdx_data_parallel.so", dp
print("out-of-tree plugin loaded by the installed host: OK")
PY
