#!/usr/bin/env bash
# What run-time failover (comm.fallback) costs the main job when nothing fails: each step then
# starts from a copy of the rank's state and ends with a store vote of every rank. Runs the
# main job (Llama debugmodel, fsdp x tp 2 x 2 on 4 rank processes) without and with
# `--comm.fallback ucx`, alternating, PAIRS times (the machine's drift falls on both), and
# prints each run's wall time (the `done:` line, which the vote is inside of), the ratio of the
# sums, the planned and measured peak memory, and `spmdx bench compare` of the last pair.
# Usage: bench/fallback.sh [PAIRS] [STEPS]   (default 3 pairs of 30 steps)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${SPMDX_BUILD_DIR:-$repo/build}"
pairs="${1:-3}"
steps="${2:-30}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
source "$repo/bench/lib.sh"  # machine
run() {  # name, flags...
  local name="$1"; shift
  "$build/bin/spmdx" run "$repo/configs/llama_debug.toml" --nproc 4 --training.steps "$steps" --metrics.log_freq 100000 \
    --job.dump_folder "$out/$name" "$@" > "$out/$name.log" 2>&1 || { cat "$out/$name.log"; exit 1; }
  sed -n 's/.*done: [0-9]* steps in \([0-9.]*\) s.*/\1/p' "$out/$name.log"
}

machine
plain=0; with=0
printf '%-6s %14s %14s\n' pair "without (s)" "with (s)"
for i in $(seq 1 "$pairs"); do
  a=$(run "plain$i"); b=$(run "fallback$i" --comm.fallback ucx)
  printf '%-6s %14s %14s\n' "$i" "$a" "$b"
  plain=$(python3 -c "print($plain + $a)"); with=$(python3 -c "print($with + $b)")
done
python3 - "$out" "$pairs" "$plain" "$with" <<'PY'
import json, sys
out, pairs, plain, with_ = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
last = lambda name: json.loads(open(f"{out}/{name}/metrics.jsonl").readlines()[-1])
a, b = last(f"plain{pairs}"), last(f"fallback{pairs}")
print(f"wall time with / without comm.fallback: {with_ / plain:.3f}x ({with_:.1f} s / {plain:.1f} s over {pairs} pairs)")
for label, r in (("without", a), ("with", b)):
    print(f"peak memory {label:7}: measured {r['peak_mem_bytes'] / 2**20:.1f} MiB, planned {r['planned_peak_mem_bytes'] / 2**20:.1f} MiB")
PY
"$build/bin/spmdx" bench compare "$out/plain$pairs" "$out/fallback$pairs" | tail -n +3
