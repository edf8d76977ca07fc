#!/usr/bin/env bash
# Memory and precision, measured in one run on Llama debugmodel as FSDP over 4 rank processes:
#  1. rank 0's peak per step (metrics.jsonl peak_mem_bytes: the CPU allocator's count, as
#     torch.cuda.max_memory_allocated on a GPU) with activation checkpointing none, selective
#     (op) and full, beside the memory plan's prediction (planned_peak_mem_bytes); issue 19's
#     target: full <= 0.6x none;
#  2. step time in bfloat16 and float16 (dynamic loss scaling) against float32: these CPUs have
#     no bf16/fp16 matmul units, so expect no gain here (on an H200, >= 1.5x).
# Steps 1-2 are warm-up; the medians of the rest are printed. The memory numbers do not depend on
# the machine's load; the step times do (compare the rows of one run, not runs).
# Usage: bench/memory.sh [STEPS] [SEQ_LEN]   (default 8 steps, sequence 256)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${SPMDX_BUILD_DIR:-$repo/build}"
steps="${1:-8}"
seq="${2:-256}"
if ! [[ "$steps" =~ ^[0-9]+$ ]] || [ "$steps" -lt 4 ]; then echo "STEPS must be at least 4 (steps 1-2 are warm-up, not timed), got '$steps'" >&2; exit 2; fi
if ! [[ "$seq" =~ ^[1-9][0-9]*$ ]]; then echo "SEQ_LEN must be a positive whole number, got '$seq'" >&2; exit 2; fi
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
source "$repo/bench/lib.sh"  # machine
fsdp="--parallelism.data_parallel_replicate_degree 1 --parallelism.data_parallel_shard_degree 4 --parallelism.tensor_parallel_degree 1"
run() {  # name, flags...
  local name="$1"; shift
  "$build/bin/spmdx" run "$repo/configs/llama_debug.toml" --nproc 4 --training.steps "$steps" --training.seq_len "$seq" --metrics.log_freq 1000 \
    $fsdp --job.dump_folder "$out/$name" "$@" > "$out/$name.log" 2>&1 || { cat "$out/$name.log"; exit 1; }
}

machine
run none --activation_checkpoint.mode none
run selective --activation_checkpoint.mode selective
run full --activation_checkpoint.mode full
run bfloat16 --training.mixed_precision_param bfloat16
run float16 --training.mixed_precision_param float16
python3 - "$out" "$seq" <<'PY'
import json, statistics, sys
out, seq = sys.argv[1], sys.argv[2]
def rows(name):
    r = [json.loads(l) for l in open(f"{out}/{name}/metrics.jsonl")]
    return r[2:] if len(r) > 3 else r
def med(name, key):
    return statistics.median(x[key] for x in rows(name))
mib = 1024.0 * 1024
print(f"llama debugmodel, fsdp 4 ranks, sequence {seq}, rank 0")
print(f"{'run':<22} {'planned MiB':>12} {'measured MiB':>13} {'measured/planned':>17} {'step ms':>9}")
for name in ["none", "selective", "full", "bfloat16", "float16"]:
    p, m = med(name, "planned_peak_mem_bytes"), med(name, "peak_mem_bytes")
    label = f"checkpointing {name}" if name in ("none", "selective", "full") else f"{name} (no checkpointing)"
    print(f"{label:<22} {p / mib:>12.1f} {m / mib:>13.1f} {m / p:>17.4f} {med(name, 'step_ms'):>9.1f}")
full = med("full", "peak_mem_bytes") / med("none", "peak_mem_bytes")
sel = med("selective", "peak_mem_bytes") / med("none", "peak_mem_bytes")
print(f"peak, full / none checkpointing: {full:.2f}x (target <= 0.6x: {'met' if full <= 0.6 else 'not met'}); selective / none: {sel:.2f}x")
for name in ["bfloat16", "float16"]:
    print(f"step time, {name} / float32: {med(name, 'step_ms') / med('none', 'step_ms'):.2f}x; peak {med(name, 'peak_mem_bytes') / med('none', 'peak_mem_bytes'):.2f}x")
PY
