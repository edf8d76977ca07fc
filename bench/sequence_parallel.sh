#!/usr/bin/env bash
# What sequence parallelism changes on the main job's model (Llama debugmodel, TP over 4 rank
# processes, a global batch of 4 x SEQ): spmdx's TP as its propagation plans it (the peer) and
# the same job with parallelism.enable_sequence_parallel, both run in this invocation, and for
# each the measured and planned peak memory per rank, the bytes sent per step and the step
# time, as ratios against the peer, and the largest loss difference to it.
# Usage: bench/sequence_parallel.sh [STEPS] [SEQ]   (defaults 10, 128)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${SPMDX_BUILD_DIR:-$repo/build}"
steps="${1:-10}"
seq="${2:-128}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
source "$repo/bench/lib.sh"  # machine

machine
for sp in false true; do
  "$build/bin/spmdx" run "$repo/configs/llama_debug.toml" --nproc 4 --parallelism.data_parallel_shard_degree 1 --parallelism.tensor_parallel_degree 4 \
    --parallelism.enable_sequence_parallel "$sp" --training.seq_len "$seq" --training.global_batch_size 4 --training.steps "$steps" \
    --metrics.log_freq 100000 --job.dump_folder "$out/$sp" > "$out/$sp.log" 2>&1 || { cat "$out/$sp.log"; exit 1; }
done
python3 - "$out" <<'PY'
import json, statistics, sys
out = sys.argv[1]
rows = {sp: [json.loads(x) for x in open(f"{out}/{sp}/metrics.jsonl")] for sp in ("false", "true")}
base = rows["false"]
med = lambda rs, k: statistics.median(r[k] for r in rs[1:])  # step 1 warms up
print(f"{'tp 4':>20} {'peak MiB':>9} {'x':>6} {'planned MiB':>12} {'sent MiB':>9} {'x':>6} {'step ms':>8} {'x':>6} {'max |dloss|/loss':>17}")
for sp, name in (("false", "spmdx TP"), ("true", "sequence parallel")):
    rs = rows[sp]
    peak, planned = rs[-1]["peak_mem_bytes"] / 2**20, rs[-1]["planned_peak_mem_bytes"] / 2**20
    sent, ms = rs[-1]["comm_bytes"] / 2**20, med(rs, "step_ms")
    dloss = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(rs, base))
    print(f"{name:>20} {peak:>9.1f} {peak / (base[-1]['peak_mem_bytes'] / 2**20):>6.2f} {planned:>12.1f} {sent:>9.1f} "
          f"{sent / (base[-1]['comm_bytes'] / 2**20):>6.2f} {ms:>8.1f} {ms / med(base, 'step_ms'):>6.2f} {dloss:>17.1e}")
PY
