#!/usr/bin/env bash
# What gradient accumulation buys and costs on the main job's model (Llama debugmodel, FSDP over
# 4 rank processes, a global batch of 16 x 128): the same global batch as 1, 2 and 4
# microbatches (training.local_batch_size 4, 2, 1), each run in this invocation, and for each
# the measured and planned peak memory per rank, the bytes sent per step and the step time,
# as ratios against the one-microbatch run (the peer), and the largest loss difference to it.
# Usage: bench/accumulation.sh [STEPS]   (default 10)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${SPMDX_BUILD_DIR:-$repo/build}"
steps="${1:-10}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
source "$repo/bench/lib.sh"  # machine

machine
for local in 4 2 1; do
  "$build/bin/spmdx" run "$repo/configs/llama_debug.toml" --nproc 4 --parallelism.data_parallel_shard_degree 4 --parallelism.tensor_parallel_degree 1 \
    --training.global_batch_size 16 --training.local_batch_size "$local" --training.steps "$steps" --metrics.log_freq 100000 \
    --job.dump_folder "$out/local$local" > "$out/local$local.log" 2>&1 || { cat "$out/local$local.log"; exit 1; }
done
python3 - "$out" <<'PY'
import json, statistics, sys
out = sys.argv[1]
rows = {l: [json.loads(x) for x in open(f"{out}/local{l}/metrics.jsonl")] for l in (4, 2, 1)}
base = rows[4]
med = lambda rs, k: statistics.median(r[k] for r in rs[1:])  # step 1 warms up
print(f"{'microbatches':>12} {'peak MiB':>9} {'x':>6} {'planned MiB':>12} {'sent MiB':>9} {'x':>6} {'step ms':>8} {'x':>6} {'max |dloss|/loss':>17}")
for l, m in ((4, 1), (2, 2), (1, 4)):
    rs = rows[l]
    peak, planned = rs[-1]["peak_mem_bytes"] / 2**20, rs[-1]["planned_peak_mem_bytes"] / 2**20
    sent, ms = rs[-1]["comm_bytes"] / 2**20, med(rs, "step_ms")
    dloss = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(rs, base))
    print(f"{m:>12} {peak:>9.1f} {peak / (base[-1]['peak_mem_bytes'] / 2**20):>6.2f} {planned:>12.1f} {sent:>9.1f} "
          f"{sent / (base[-1]['comm_bytes'] / 2**20):>6.2f} {ms:>8.1f} {ms / med(base, 'step_ms'):>6.2f} {dloss:>17.1e}")
PY
