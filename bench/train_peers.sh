#!/usr/bin/env bash
# N-rank training, spmdx against PyTorch eager on this machine: Llama debugmodel, global batch
# 16 x 128 on 4 rank processes, spmdx dp 4 vs PyTorch DistributedDataParallel over Gloo, and
# spmdx fsdp 4 vs PyTorch FSDP2 (fully_shard per layer) over Gloo (bench/peers/torch_llama.py:
# the same model, optimizer (AdamW, fused as torchtitan's default), clipping and threads per rank). Each pair runs in turn ROUNDS
# times (default 3); the medians of the per-run median step times are compared.
# Prints "speedup" = PyTorch step time / spmdx step time (the promise: > 1).
# Usage: bench/train_peers.sh [STEPS] [NPROC]   (default 8 steps, 4 ranks; steps 1-2 are warm-up)
#        ROUNDS=5 bench/train_peers.sh
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${SPMDX_BUILD_DIR:-$repo/build}"
steps="${1:-8}"
n="${2:-4}"
rounds="${ROUNDS:-3}"
if ! [[ "$steps" =~ ^[0-9]+$ ]] || [ "$steps" -lt 4 ]; then echo "STEPS must be at least 4 (steps 1-2 are warm-up, not timed), got '$steps'" >&2; exit 2; fi
if ! [[ "$n" =~ ^[1-9][0-9]*$ ]]; then echo "NPROC must be a positive whole number, got '$n'" >&2; exit 2; fi
if ! [[ "$rounds" =~ ^[1-9][0-9]*$ ]]; then echo "ROUNDS must be a positive whole number, got '$rounds'" >&2; exit 2; fi
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
local_batch=4

spmdx_ms() {  # dp|fsdp -> median step ms of steps 3..
  local rep=1 shard=1
  if [ "$1" = dp ]; then rep=$n; else shard=$n; fi
  "$build/bin/spmdx" run "$repo/configs/llama_debug.toml" --nproc "$n" --training.steps "$steps" --metrics.log_freq 1000 \
    --training.local_batch_size $local_batch --parallelism.data_parallel_replicate_degree $rep \
    --parallelism.data_parallel_shard_degree $shard --parallelism.tensor_parallel_degree 1 \
    --job.dump_folder "$out/$1" > "$out/$1.log" 2>&1 || { cat "$out/$1.log" >&2; return 1; }
  python3 -c '
import json, statistics, sys
r = [json.loads(l)["step_ms"] for l in open(sys.argv[1])]
print("%.1f" % statistics.median(r[2:]))' "$out/$1/metrics.jsonl"
}
torch_ms() {  # ddp|fsdp
  "$repo/.venv/bin/python" "$repo/bench/peers/torch_llama.py" "$1" "$n" "$steps" debugmodel $local_batch 128 2> "$out/torch_$1.log" \
    | awk '{ print $2 }' || { cat "$out/torch_$1.log" >&2; return 1; }
}
source "$repo/bench/lib.sh"  # median

printf "%-26s %-28s %-28s %8s\n" "llama debugmodel, $n ranks" "spmdx step ms (rounds)" "PyTorch step ms" speedup
for pair in "dp ddp DDP" "fsdp fsdp FSDP2"; do
  set -- $pair
  s=(); t=()
  for ((r = 0; r < rounds; r++)); do
    s+=("$(spmdx_ms "$1")"); t+=("$(torch_ms "$2" || true)")
  done
  ms=$(echo "${s[*]}" | median 1); mt=$(echo "${t[*]}" | median 1)
  speedup=$(awk -v a="$ms" -v b="$mt" 'BEGIN { if (a + 0 > 0 && b + 0 > 0) printf "%.2fx", b / a; else print "n/a" }')
  printf "%-26s %-28s %-28s %8s\n" "spmdx $1 $n vs $3" "$ms (${s[*]})" "$mt (${t[*]})" "$speedup"
done
echo "medians of $rounds rounds; speedup = PyTorch / spmdx step time (promise: > 1)"
