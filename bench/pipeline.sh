#!/usr/bin/env bash
# Pipeline schedules on the main job's model (Llama debugmodel with 8 layers, 4 stages of one
# rank process each, microbatches of one row, a global batch of M x SEQ tokens): GPipe (the peer),
# 1F1B and Interleaved1F1B (2 chunks a stage), run in this invocation for M = 8 and 16. For each:
# the measured bubble (rank 0, stage 0: the share of the step it waited on its neighbour's
# sends, exposed_comm_ms / step_ms) against the schedule's theoretical (stages - 1) / (chunks x M
# + stages - 1); rank 0's measured and planned peak memory as a ratio against GPipe's (1F1B keeps
# at most `stages` microbatches' activations alive on stage 0, GPipe all M); the step time; and
# the largest loss difference to GPipe.
# Usage: bench/pipeline.sh [STEPS] [SEQ]   (defaults 6, 128)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${SPMDX_BUILD_DIR:-$repo/build}"
steps="${1:-6}"
seq="${2:-128}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
source "$repo/bench/lib.sh"  # machine

machine
for m in 8 16; do
  for schedule in GPipe 1F1B Interleaved1F1B; do
    "$build/bin/spmdx" run "$repo/configs/llama_debug.toml" --nproc 4 --parallelism.data_parallel_shard_degree 1 --parallelism.tensor_parallel_degree 1 \
      --parallelism.pipeline_parallel_degree 4 --model.n_layers 8 \
      --parallelism.pipeline_parallel_schedule "$schedule" --training.seq_len "$seq" --training.global_batch_size "$m" --training.steps "$steps" \
      --metrics.log_freq 100000 --job.dump_folder "$out/$m-$schedule" > "$out/$m-$schedule.log" 2>&1 || { cat "$out/$m-$schedule.log"; exit 1; }
  done
done
python3 - "$out" <<'PY'
import json, statistics, sys
out = sys.argv[1]
med = lambda rs, f: statistics.median(f(r) for r in rs[1:])  # step 1 warms up
print(f"{'pp 4':>21} {'bubble':>7} {'theory':>7} {'peak MiB':>9} {'x':>6} {'planned MiB':>12} {'x':>6} {'step ms':>8} {'x':>6} {'max |dloss|/loss':>17}")
for m in (8, 16):
    rows = {s: [json.loads(x) for x in open(f"{out}/{m}-{s}/metrics.jsonl")] for s in ("GPipe", "1F1B", "Interleaved1F1B")}
    base = rows["GPipe"]
    for s in ("GPipe", "1F1B", "Interleaved1F1B"):
        rs = rows[s]
        bubble = med(rs, lambda r: r["exposed_comm_ms"] / r["step_ms"])
        peak, planned = rs[-1]["peak_mem_bytes"] / 2**20, rs[-1]["planned_peak_mem_bytes"] / 2**20
        ms = med(rs, lambda r: r["step_ms"])
        dloss = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(rs, base))
        chunks = 2 if s == "Interleaved1F1B" else 1
        print(f"{s + ', M ' + str(m):>21} {bubble:>7.3f} {3 / (chunks * m + 3):>7.3f} {peak:>9.1f} {peak / (base[-1]['peak_mem_bytes'] / 2**20):>6.2f} "
              f"{planned:>12.1f} {planned / (base[-1]['planned_peak_mem_bytes'] / 2**20):>6.2f} {ms:>8.1f} {ms / med(base, lambda r: r['step_ms']):>6.2f} {dloss:>17.1e}")
PY
