#!/usr/bin/env bash
# Mixture-of-Experts training, spmdx against PyTorch eager on this machine (issue 46): Qwen3-MoE
# tiny_moe (dim 64, 2 layers, 8 experts of hidden 32, top 2) and torchtitan's debugmodel_moe cut to
# DEBUG_LAYERS layers (default 2; dim 256, 16 heads of 128, 64 experts of hidden 768, top 8).
# bench/peers/torch_moe.py is the peer: the same model (torchtitan's MoE layer: float32 router,
# top-k, argsort dispatch, torch._grouped_mm experts where they run on this CPU, else its for-loop;
# the line "peer:" says which), AdamW, clipping and DeepSeek-V3 load balancing, the same global
# batch, sequence and intra-op threads per rank (cores / ranks). Rows, each at the same global batch:
#   1 rank       spmdx on 1 rank               vs PyTorch in 1 process
#   fsdp N       spmdx fsdp over N ranks       vs PyTorch FSDP2 (fully_shard per layer) over Gloo, N processes
#   ep N         spmdx expert parallel N (ep = dp_shard = N: experts sharded, tokens by all_to_all_v)
#                vs spmdx fsdp N (the row above's runs): what keeping the experts in place buys
# Each round runs every job once, in turn; the medians over ROUNDS of each job's median step time
# (steps 3.. of metrics.jsonl / the peer's) are compared. ratio = peer ms / spmdx ms.
# Goal: ratio >= 1.3x on every row (spmdx at least 1.3x the peer's speed). Not a test: the table
# says where it is met.
# Under each model's rows: spmdx's exposed communication and its compute, per step (the last
# round's metrics.jsonl, median of steps 3..), for where its time goes.
# Usage: bench/moe.sh [STEPS] [NPROC]   (default 8 steps for tiny_moe, 4 ranks; steps 1-2 are warm-up)
#        ROUNDS=3 (tiny_moe's rounds)  DEBUG_ROUNDS=1 DEBUG_STEPS=5 DEBUG_LAYERS=2 (debugmodel_moe's:
#        seconds a step on 2 cores)  MODELS="tiny_moe debugmodel_moe"
#        TINY_BATCH=16 TINY_SEQ=64  DEBUG_BATCH=8 DEBUG_SEQ=64 (global batch rows and tokens a row)
#        THREADS=1: the 1-rank rows' intra-op threads, both sides (default: every core); on a loaded
#        machine 2 threads that wait on each other at every op can cost more than they gain
#        MOE_EXPERTS=for_loop: the peer's experts as torchtitan's for-loop even where grouped_mm runs
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${SPMDX_BUILD_DIR:-$repo/build}"
steps="${1:-8}"
n="${2:-4}"
rounds="${ROUNDS:-3}"
debug_steps="${DEBUG_STEPS:-5}"
debug_rounds="${DEBUG_ROUNDS:-1}"
threads="${THREADS:-$(nproc)}"
debug_layers="${DEBUG_LAYERS:-2}"
models="${MODELS:-tiny_moe debugmodel_moe}"
goal=1.3
for v in "$steps" "$debug_steps"; do
  if ! [[ "$v" =~ ^[0-9]+$ ]] || [ "$v" -lt 3 ]; then echo "STEPS and DEBUG_STEPS must be at least 3 (steps 1-2 are warm-up, not timed), got '$v'" >&2; exit 2; fi
done
if ! [[ "$n" =~ ^[1-9][0-9]*$ ]]; then echo "NPROC must be a positive whole number, got '$n'" >&2; exit 2; fi
if ! [[ "$threads" =~ ^[1-9][0-9]*$ ]]; then echo "THREADS must be a positive whole number, got '$threads'" >&2; exit 2; fi
for v in "$rounds" "$debug_rounds"; do
  if ! [[ "$v" =~ ^[1-9][0-9]*$ ]]; then echo "ROUNDS and DEBUG_ROUNDS must be positive whole numbers, got '$v'" >&2; exit 2; fi
done
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
source "$repo/bench/lib.sh"  # median, machine
py="$repo/.venv/bin/python"

step_ms() {  # metrics.jsonl [KEY] -> median KEY (step_ms) of steps 3.. ("n/a" without the file)
  [ -f "$1" ] || { echo n/a; return 0; }
  python3 -c '
import json, statistics, sys
r = [json.loads(l)[sys.argv[2]] for l in open(sys.argv[1])]
print("%.1f" % statistics.median(r[2:]))' "$1" "${2:-step_ms}"
}
# spmdx_ms NAME FLAVOR LAYERS STEPS GLOBAL_BATCH SEQ RANKS EP -> median step ms. A run that fails
# (the binary being rebuilt under the bench, a library missing for a moment) is tried twice more,
# 30 s apart; then "n/a".
spmdx_ms() {
  local name=$1 flavor=$2 layers=$3 st=$4 batch=$5 seq=$6 ranks=$7 ep=$8 try
  local env=()
  if [ "$ranks" = 1 ]; then env=(OMP_NUM_THREADS="$threads"); fi
  for try in 1 2 3; do
    rm -rf "$out/$name"
    if env "${env[@]}" "$build/bin/spmdx" run "$repo/configs/qwen3_moe.toml" --model.flavor "$flavor" --model.n_layers "$layers" --nproc "$ranks" \
      --training.steps "$st" --metrics.log_freq 1000 --training.local_batch_size $((batch / ranks)) --training.seq_len "$seq" \
      --parallelism.data_parallel_shard_degree "$ranks" --parallelism.expert_parallel_degree "$ep" \
      --job.dump_folder "$out/$name" > "$out/$name.log" 2>&1; then
      step_ms "$out/$name/metrics.jsonl"
      return 0
    fi
    echo "spmdx $name failed (try $try of 3):" >&2
    tail -5 "$out/$name.log" >&2
    if [ "$try" -lt 3 ]; then sleep 30; fi
  done
  echo n/a
}
# torch_ms NAME one|fsdp FLAVOR LAYERS STEPS GLOBAL_BATCH SEQ RANKS -> median step ms; its line in $out/NAME.line
torch_ms() {
  local name=$1 mode=$2 flavor=$3 layers=$4 st=$5 batch=$6 seq=$7 ranks=$8
  OMP_NUM_THREADS="$threads" "$py" "$repo/bench/peers/torch_moe.py" "$mode" "$ranks" "$st" "$flavor" $((batch / ranks)) "$seq" "$layers" \
    > "$out/$name.line" 2> "$out/$name.log" || { tail -5 "$out/$name.log" >&2; echo n/a; return 0; }
  awk '{ print $2 }' "$out/$name.line"
}
med() { tr ' ' '\n' | grep -v '^n/a$' | median 1; }  # the median of the numbers among "n/a"s
ratio() {  # PEER_MS SPMDX_MS -> "1.23x" and whether it meets the goal
  awk -v a="$2" -v b="$1" -v goal="$goal" 'BEGIN { if (a + 0 > 0 && b + 0 > 0) printf "%.2fx | %s", b / a, (b / a >= goal ? "yes" : "no"); else print "n/a | n/a" }'
}

machine
echo "spmdx: $("$build/bin/spmdx" --version 2>/dev/null | head -1 || true); peer: $("$py" -c 'import torch; print("torch", torch.__version__, "(MKL" if torch.backends.mkl.is_available() else "(no MKL", "oneDNN)" if torch.backends.mkldnn.is_available() else "no oneDNN)")'), Gloo; intra-op threads per rank: $threads on 1 rank, $(( $(nproc) / n > 0 ? $(nproc) / n : 1 )) on $n ranks (both sides)"
echo "goal: peer / spmdx >= ${goal}x on every row; each job's median step (steps 3..), the median over rounds (each round's value in brackets)"
rows=()
for model in $models; do
  case "$model" in
    tiny_moe) layers=-1 st=$steps rn=$rounds batch=${TINY_BATCH:-16} seq=${TINY_SEQ:-64} label="tiny_moe" ;;
    debugmodel_moe) layers=$debug_layers st=$debug_steps rn=$debug_rounds batch=${DEBUG_BATCH:-8} seq=${DEBUG_SEQ:-64} label="debugmodel_moe, $debug_layers layers" ;;
    *) echo "MODELS: tiny_moe or debugmodel_moe, got '$model'" >&2; exit 2 ;;
  esac
  if [ $((batch % n)) -ne 0 ]; then echo "$model: global batch $batch is not a multiple of $n ranks" >&2; exit 2; fi
  one=(); tone=(); fsdp=(); tfsdp=(); ep=()
  for ((r = 0; r < rn; r++)); do
    one+=("$(spmdx_ms "${model}_one" "$model" "$layers" "$st" "$batch" "$seq" 1 1)")
    tone+=("$(torch_ms "${model}_tone" one "$model" "$layers" "$st" "$batch" "$seq" 1)")
    fsdp+=("$(spmdx_ms "${model}_fsdp" "$model" "$layers" "$st" "$batch" "$seq" "$n" 1)")
    tfsdp+=("$(torch_ms "${model}_tfsdp" fsdp "$model" "$layers" "$st" "$batch" "$seq" "$n")")
    ep+=("$(spmdx_ms "${model}_ep" "$model" "$layers" "$st" "$batch" "$seq" "$n" "$n")")
    echo "  $model round $((r + 1)): 1 rank ${one[-1]} / ${tone[-1]}, fsdp $n ${fsdp[-1]} / ${tfsdp[-1]}, ep $n ${ep[-1]} ms (spmdx / peer)" >&2
  done
  echo "$model: global batch $batch x $seq, $st steps, $rn rounds; spmdx: $(sed -n 's/.*intra-op thread[s]* per rank, //p' "$out/${model}_one.log" | head -1); peer: $(awk '{ print $4 }' "$out/${model}_tone.line" 2>/dev/null)"
  for j in one fsdp ep; do
    echo "  spmdx $j: step $(step_ms "$out/${model}_$j/metrics.jsonl") ms = compute $(step_ms "$out/${model}_$j/metrics.jsonl" compute_ms) + exposed comm $(step_ms "$out/${model}_$j/metrics.jsonl" exposed_comm_ms) (all comm $(step_ms "$out/${model}_$j/metrics.jsonl" comm_ms)) ms (last round, medians)"
  done
  m1=$(echo "${one[*]}" | med); t1=$(echo "${tone[*]}" | med)
  mf=$(echo "${fsdp[*]}" | med); tf=$(echo "${tfsdp[*]}" | med)
  me=$(echo "${ep[*]}" | med)
  rows+=("| $label, 1 rank vs PyTorch 1 process | $m1 (${one[*]}) | $t1 (${tone[*]}) | $(ratio "$t1" "$m1") |")
  rows+=("| $label, fsdp $n vs PyTorch FSDP2 $n (Gloo) | $mf (${fsdp[*]}) | $tf (${tfsdp[*]}) | $(ratio "$tf" "$mf") |")
  rows+=("| $label, spmdx ep $n vs spmdx fsdp $n (peer column) | $me (${ep[*]}) | $mf (${fsdp[*]}) | $(ratio "$mf" "$me") |")
done
echo
echo "| config | spmdx ms | peer ms | ratio peer/spmdx | >= ${goal}x |"
echo "| --- | ---: | ---: | ---: | :---: |"
printf '%s\n' "${rows[@]}"
