#!/usr/bin/env bash
# Builds the sample strategy plugin with find_package(spmdx) against the BUILD tree
# (-Dspmdx_DIR=BUILD_DIR) and checks that the built host loads it; installs spmdx from BUILD_DIR
# into a temporary prefix, builds the sample transport plugin against that (-DCMAKE_PREFIX_PATH),
# checks that the installed host loads both, and trains 2 ranks over the sample transport: the
# losses must be ucx's, bit for bit.
# Usage: run.sh BUILD_DIR OUT_OF_TREE_DIR CONFIG
set -euo pipefail
build="$1"; oot="$2"; config="$3"; src="$oot/sample_strategy"
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
chmod 0755 "$work"

launcher=()
if command -v ccache >/dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
# The strategy against the build tree: no install step between editing spmdx and a plugin.
cmake -S "$src" -B "$work/build" -G Ninja -Dspmdx_DIR="$build" "${launcher[@]}" >/dev/null
cmake --build "$work/build" >/dev/null
cmake --install "$build" --prefix "$work/prefix" >/dev/null
cmake -S "$oot/sample_transport" -B "$work/transport" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" "${launcher[@]}" >/dev/null
cmake --build "$work/transport" >/dev/null

# The strategy, loaded by the host of the build tree and by the installed one.
for host in "$build" "$work/prefix"; do
  out="$(env -u SPMDX_PLUGIN_PATH "$host/bin/spmdx" plugins --plugin-path "$work/build" --json)"
  echo "$out"
  python3 - "$out" "$work" "$host" <<'PY'
import json, sys
plugins = {p["name"]: p for p in json.loads(sys.argv[1])}
work, host = sys.argv[2:4]
s = plugins.get("sample_column")
assert s, f"the host in {host} did not list the out-of-tree plugin"
assert s["kind"] == "strategy" and s["registered"] and s["factories"] == ["sample_column"], s
assert s["path"] == f"{work}/build/libspmdx_sample_column.so", s["path"]
dp = plugins.get("data_parallel")
assert dp and dp["path"] == f"{host}/lib/spmdx/plugins/libspmdx_data_parallel.so", dp
print(f"out-of-tree plugin built against the build tree, loaded by the host in {host}: OK")
PY
done

# The transport: listed with its capability, then 2 ranks train over it (shm=off, so every
# byte goes through it) and over ucx; the same engine runs on both, so the losses are equal.
listing="$(env -u SPMDX_PLUGIN_PATH "$work/prefix/bin/spmdx" plugins --plugin-path "$work/transport")"
grep -q "capabilities of store_transport: \* host any size score 0" <<<"$listing" || { echo "$listing"; echo "store_transport not listed"; exit 1; }
python3 -c "print('the quick brown fox jumps over the lazy dog. ' * 400)" > "$work/corpus.txt"
for backend in "store_transport:shm=off" "ucx:shm=off"; do
  out="$work/run-${backend%%:*}"
  env -u SPMDX_PLUGIN_PATH "$work/prefix/bin/spmdx" run "$config" --nproc 2 --training.steps 3 --training.local_batch_size 2 \
    --training.seq_len 16 --data.paths "$work/corpus.txt" --plugins.paths "$work/transport" --comm.backend "$backend" \
    --job.dump_folder "$out" >"$out.log" 2>&1 || { cat "$out.log"; exit 1; }
done
python3 - "$work" <<'PY'
import json, sys
work = sys.argv[1]
def losses(name):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in map(json.loads, open(f"{work}/run-{name}/metrics.jsonl")) if "loss" in r]
ours, ucx = losses("store_transport"), losses("ucx")
assert len(ours) == 3 and ours == ucx, (ours, ucx)
log = open(f"{work}/run-store_transport.log").read()
assert "comm store_transport (messages through the job's store" in log, log
print("out-of-tree transport trains as ucx does:", ours[-1])
PY
