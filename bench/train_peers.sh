#!/usr/bin/env bash
# N-rank training, spmdx against PyTorch eager on this machine: Llama debugmodel, global batch
# 16 x 128 on 4 rank processes, spmdx dp 4 vs PyTorch DistributedDataParallel over Gloo, and
# spmdx fsdp 4 vs PyTorch FSDP2 (fully_shard per layer) over Gloo (bench/peers/torch_llama.py:
# the same model, optimizer (AdamW, fused as torchtitan's default), clipping and threads per rank). Each pair runs in turn ROUNDS
# times (default 3); the medians of the per-run median step times are compared.
# Prints "speedup" = PyTorch step time / spmdx step time (the promise: > 1).
# A third row, "no communication", is the floor of the dp row: NPROC one-rank spmdx jobs started
# at once, one intra-op thread each, against NPROC PyTorch processes that each train their own
# copy with a barrier before each step (torch_llama.py local): the same work and sharing of the
# cores as dp / DDP without their gradient all_reduce. Its speedup is the most dp vs DDP can be
# on this machine however fast the communication; the dp row's gap to it is what communication
# (and waiting for the slowest rank) costs each side.
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
spmdx_floor_ms() {  # NPROC one-rank jobs at once -> median step ms of steps 3.. over all of them
  local pids=() k
  for ((k = 0; k < n; k++)); do
    OMP_NUM_THREADS=$(( $(nproc) / n > 0 ? $(nproc) / n : 1 )) "$build/bin/spmdx" run "$repo/configs/llama_debug.toml" --nproc 1 \
      --training.steps "$steps" --metrics.log_freq 1000 --training.local_batch_size $local_batch \
      --parallelism.data_parallel_replicate_degree 1 --parallelism.data_parallel_shard_degree 1 --parallelism.tensor_parallel_degree 1 \
      --job.dump_folder "$out/floor$k" > "$out/floor$k.log" 2>&1 &
    pids+=($!)
  done
  for k in "${!pids[@]}"; do wait "${pids[$k]}" || { cat "$out/floor$k.log" >&2; return 1; }; done
  python3 -c '
import json, statistics, sys
r = [json.loads(l)["step_ms"] for f in sys.argv[1:] for l in list(open(f))[2:]]
print("%.1f" % statistics.median(r))' "$out"/floor*/metrics.jsonl
}
torch_ms() {  # ddp|fsdp|local
  "$repo/.venv/bin/python" "$repo/bench/peers/torch_llama.py" "$1" "$n" "$steps" debugmodel $local_batch 128 2> "$out/torch_$1.log" \
    | awk '{ print $2 }' || { cat "$out/torch_$1.log" >&2; return 1; }
}
source "$repo/bench/lib.sh"  # median, machine

machine
printf "%-26s %-28s %-28s %8s\n" "llama debugmodel, $n ranks" "spmdx step ms (rounds)" "PyTorch step ms" speedup
for pair in "dp ddp DDP" "fsdp fsdp FSDP2" "floor local no-communication"; do
  set -- $pair
  s=(); t=()
  for ((r = 0; r < rounds; r++)); do
    if [ "$1" = floor ]; then s+=("$(spmdx_floor_ms)"); else s+=("$(spmdx_ms "$1")"); fi
    t+=("$(torch_ms "$2" || true)")
  done
  ms=$(echo "${s[*]}" | median 1); mt=$(echo "${t[*]}" | median 1)
  speedup=$(awk -v a="$ms" -v b="$mt" 'BEGIN { if (a + 0 > 0 && b + 0 > 0) printf "%.2fx", b / a; else print "n/a" }')
  label="spmdx $1 $n vs $3"
  [ "$1" = floor ] && label="no communication, $n x 1"
  printf "%-26s %-28s %-28s %8s\n" "$label" "$ms (${s[*]})" "$mt (${t[*]})" "$speedup"
done
echo "medians of $rounds rounds; speedup = PyTorch / spmdx step time (promise: > 1); no communication: the dp row's floor"
