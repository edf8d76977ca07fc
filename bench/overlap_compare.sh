#!/usr/bin/env bash
# Is the main job slower with overlap, bucketing and prefetch off? The timing claim the test
# suite does not make (tests/overlap_test.cpp counts what these options change: calls, bytes,
# where each wait falls; tests/compare_test.cpp checks the verdict's statistics on known series).
# Runs the main job (Llama debugmodel, fsdp x tp 2 x 2 on 4 rank processes) with the comm
# defaults (A: overlap on, 25 MiB buckets, prefetch) and with
# `--comm.overlap false --comm.bucket_cap_mb 0 --comm.prefetch false` (B), in turn PAIRS times,
# the order swapped every other pair (the machine's drift falls on both), and prints the machine
# it ran on, each pair's `spmdx bench compare A B --max-slowdown 0%` verdict (B's step time over
# A's, measured in the same run, with its 95% interval), B's exposed communication and backend
# calls over A's, and how many pairs found B slower beyond the noise. Other work on the cores
# during one run of a pair and not the other can hide the difference or invert it: read the
# load average it prints, and run it on an otherwise idle machine.
# Usage: bench/overlap_compare.sh [STEPS] [PAIRS]   (default 40 steps, 2 pairs; steps 1-2 are warm-up)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${SPMDX_BUILD_DIR:-$repo/build}"
steps="${1:-40}"
pairs="${2:-2}"
if ! [[ "$steps" =~ ^[0-9]+$ ]] || [ "$steps" -lt 4 ]; then echo "STEPS must be at least 4 (steps 1-2 are warm-up, not timed), got '$steps'" >&2; exit 2; fi
if ! [[ "$pairs" =~ ^[1-9][0-9]*$ ]]; then echo "PAIRS must be a positive whole number, got '$pairs'" >&2; exit 2; fi
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
source "$repo/bench/lib.sh"  # machine
off=(--comm.overlap false --comm.bucket_cap_mb 0 --comm.prefetch false)

run() {  # name, flags...
  local name="$1"; shift
  "$build/bin/spmdx" run "$repo/configs/llama_debug.toml" --nproc 4 --training.steps "$steps" --metrics.log_freq 100000 \
    --job.dump_folder "$out/$name" "$@" > "$out/$name.log" 2>&1 || { cat "$out/$name.log" >&2; exit 1; }
}

machine
echo "main job, $steps steps a run; A: overlap, bucketing and prefetch on (the defaults); B: ${off[*]}"
printf '%-5s %-9s %-22s %-14s %-12s %s\n' pair "B/A step" "interval" "exposed comm" "calls B/A" "verdict"
slower=0
for ((p = 1; p <= pairs; p++)); do
  if ((p % 2)); then run "on$p"; run "off$p" "${off[@]}"; else run "off$p" "${off[@]}"; run "on$p"; fi
  set +e
  "$build/bin/spmdx" bench compare "$out/on$p" "$out/off$p" --max-slowdown 0% > "$out/compare$p.txt"
  rc=$?
  "$build/bin/spmdx" bench compare "$out/on$p" "$out/off$p" --json > "$out/compare$p.json"
  set -e
  if [ "$rc" -eq 1 ]; then slower=$((slower + 1)); elif [ "$rc" -ne 0 ]; then cat "$out/compare$p.txt" >&2; exit 1; fi
  python3 - "$out" "$p" <<'PY'
import json, sys
out, p = sys.argv[1], sys.argv[2]
m = {x["name"]: x for x in json.load(open(f"{out}/compare{p}.json"))["measures"]}
step, exposed = m["step_ms"], m.get("exposed_comm_ms", {})
calls = lambda name: json.loads(open(f"{out}/{name}{p}/metrics.jsonl").readline())["collectives"]
verdict = next(l for l in open(f"{out}/compare{p}.txt") if l.startswith("step_ms:")).split(": ", 1)[1].split(" (")[0]
lo, hi = step["interval"]
ex = f"{exposed['ratio']:.2f}x" if exposed.get("available") else "n/a"
print(f"{p:<5} {step['ratio']:<9.3f} {f'[{lo:.3f}, {hi:.3f}]':<22} {ex:<14} {calls('off')}/{calls('on'):<9} {verdict}")
PY
done
echo "B slower than A beyond the noise (bench compare exit 1) in $slower of $pairs pairs"
echo "last pair, as bench compare prints it:"
tail -n +3 "$out/compare$pairs.txt"
