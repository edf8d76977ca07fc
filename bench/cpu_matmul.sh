#!/usr/bin/env bash
# training.cpu_matmul measured in one run: Llama debugmodel as dp 4 (global batch 16 x 128, 4
# rank processes) with float32 linears on ATen's BLAS (MKL in the x86 wheels) and on oneDNN,
# in turn ROUNDS times (default 3); the medians of the per-run median step times (steps 3..)
# are compared, and the last step's losses of both printed (they differ in the last bits).
# Prints "speedup" = aten step time / onednn step time (> 1: oneDNN is faster).
# Usage: bench/cpu_matmul.sh [STEPS]   (default 12 steps; steps 1-2 are warm-up)
#        ROUNDS=5 bench/cpu_matmul.sh
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${SPMDX_BUILD_DIR:-$repo/build}"
steps="${1:-12}"
rounds="${ROUNDS:-3}"
if ! [[ "$steps" =~ ^[0-9]+$ ]] || [ "$steps" -lt 4 ]; then echo "STEPS must be at least 4 (steps 1-2 are warm-up, not timed), got '$steps'" >&2; exit 2; fi
if ! [[ "$rounds" =~ ^[1-9][0-9]*$ ]]; then echo "ROUNDS must be a positive whole number, got '$rounds'" >&2; exit 2; fi
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
source "$repo/bench/lib.sh"  # median, machine

run() {  # aten|onednn -> "median step ms of steps 3.., last loss"
  "$build/bin/spmdx" run "$repo/configs/llama_debug.toml" --nproc 4 --training.steps "$steps" --metrics.log_freq 1000 \
    --training.local_batch_size 4 --parallelism.data_parallel_replicate_degree 4 --parallelism.data_parallel_shard_degree 1 \
    --parallelism.tensor_parallel_degree 1 --training.cpu_matmul "$1" --job.dump_folder "$out/$1" > "$out/$1.log" 2>&1 ||
    { cat "$out/$1.log" >&2; return 1; }
  python3 -c '
import json, statistics, sys
r = [json.loads(l) for l in open(sys.argv[1])]
print("%.1f %.9f" % (statistics.median(x["step_ms"] for x in r[2:]), r[-1]["loss"]))' "$out/$1/metrics.jsonl"
  rm -rf "${out:?}/$1"
}

machine
a=(); o=()
for ((r = 0; r < rounds; r++)); do
  read -r ms loss_a <<< "$(run aten)"; a+=("$ms")
  read -r ms loss_o <<< "$(run onednn)"; o+=("$ms")
done
ma=$(echo "${a[*]}" | median 1); mo=$(echo "${o[*]}" | median 1)
printf "%-40s %s ms (%s)\n" "dp 4, float32 linears on ATen's BLAS" "$ma" "${a[*]}"
printf "%-40s %s ms (%s)\n" "dp 4, float32 linears on oneDNN" "$mo" "${o[*]}"
awk -v a="$ma" -v o="$mo" 'BEGIN { printf "speedup (aten / onednn step time): %.2fx\n", a / o }'
echo "last-step loss: aten $loss_a, onednn $loss_o (medians of $rounds rounds)"
