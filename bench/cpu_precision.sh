#!/usr/bin/env bash
# One rank on one CPU thread, spmdx in float32 and in bfloat16 (training.mixed_precision_param)
# against PyTorch on the same core: eager float32, eager under torch.autocast("cpu", bfloat16)
# (float32 parameters and fused AdamW, torchtitan's mixed precision on one device) and
# torch.compile (inductor) in float32 (bench/peers/torch_llama.py cpu, cpu_bf16, cpu_compile: the
# same model, optimizer, clipping and loss). Two models: FLAVOR (default debugmodel, batch 4 x seq
# 128, STEPS steps) and a GEMM-heavy one, HEAVY_FLAVOR (default large: dim 2048, 8 layers, FFN
# 5632; HEAVY_BATCH 1 x HEAVY_SEQ 512, HEAVY_STEPS steps, default 6: a step takes seconds, and the
# median of steps 3-6 is the steady step, past the first steps' page faults and kernel set-up); set
# either to none to skip it. Each process gets one intra-op thread (OMP_NUM_THREADS=1, THREADS=1)
# and is pinned with taskset to CPU PIN_CPU (default 1; unpinned, and said so, when taskset is
# missing or this process may use one CPU only). The five runs go in turn ROUNDS times (default
# 3); each run's median step time (steps 3..) is taken and the medians of those compared.
# Prints the machine line first; per model each run's step time, tokens/s and spmdx's mfu (its
# metrics.jsonl's "mfu", percent; n/a when absent), then three ratios against issue 47's goals:
#   spmdx bf16 / spmdx f32 step time          <= 0.65 (on a CPU with bfloat16 instructions)
#   PyTorch autocast bf16 / spmdx bf16        >= 1.3
#   torch.compile f32 / spmdx f32             >= 1.3
# MULTI=1 adds a section with NPROC ranks (default 4, unpinned, threads per rank as
# bench/train_peers.sh: cores / ranks) on FLAVOR, global batch NPROC x 4 x 128: spmdx dp and fsdp
# in float32 and bfloat16 against PyTorch DDP / FSDP2 over Gloo and their bfloat16 forms
# (torch_llama.py ddp_bf16: autocast; fsdp_bf16: MixedPrecisionPolicy(bfloat16, float32)).
# Usage: bench/cpu_precision.sh [STEPS]   (default 8 steps; steps 1-2 are warm-up, not timed)
#        ROUNDS=1 HEAVY_FLAVOR=debugmodel HEAVY_SEQ=128 bench/cpu_precision.sh 4   (a quick check)
#        MULTI=1 bench/cpu_precision.sh
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${SPMDX_BUILD_DIR:-$repo/build}"
python="$repo/.venv/bin/python"
steps="${1:-8}"
rounds="${ROUNDS:-3}"
flavor="${FLAVOR:-debugmodel}"
heavy_flavor="${HEAVY_FLAVOR:-large}"
heavy_batch="${HEAVY_BATCH:-1}"
heavy_seq="${HEAVY_SEQ:-512}"
heavy_steps="${HEAVY_STEPS:-6}"
pin_cpu="${PIN_CPU:-1}"
multi="${MULTI:-0}"
n="${NPROC:-4}"
whole() { [[ "$1" =~ ^[1-9][0-9]*$ ]]; }
if ! whole "$steps" || [ "$steps" -lt 4 ]; then echo "STEPS must be at least 4 (steps 1-2 are warm-up, not timed), got '$steps'" >&2; exit 2; fi
if ! whole "$rounds"; then echo "ROUNDS must be a positive whole number, got '$rounds'" >&2; exit 2; fi
if ! whole "$heavy_steps" || [ "$heavy_steps" -lt 3 ]; then echo "HEAVY_STEPS must be at least 3 (steps 1-2 are warm-up, not timed), got '$heavy_steps'" >&2; exit 2; fi
if ! whole "$heavy_batch"; then echo "HEAVY_BATCH must be a positive whole number, got '$heavy_batch'" >&2; exit 2; fi
if ! whole "$heavy_seq"; then echo "HEAVY_SEQ must be a positive whole number, got '$heavy_seq'" >&2; exit 2; fi
if ! whole "$n"; then echo "NPROC must be a positive whole number, got '$n'" >&2; exit 2; fi
if ! [[ "$pin_cpu" =~ ^[0-9]+$ ]]; then echo "PIN_CPU must be a CPU number, got '$pin_cpu'" >&2; exit 2; fi
if [ "$multi" != 0 ] && [ "$multi" != 1 ]; then echo "MULTI must be 0 or 1, got '$multi'" >&2; exit 2; fi
for f in "$flavor" "$heavy_flavor"; do  # the flavors both sides know (torch_llama.py's FLAVORS)
  case "$f" in tiny|debugmodel|large|none) ;; *) echo "FLAVOR and HEAVY_FLAVOR must be tiny, debugmodel, large or none, got '$f'" >&2; exit 2 ;; esac
done
if [ ! -x "$build/bin/spmdx" ]; then echo "no $build/bin/spmdx: build it first (scripts/build) or set SPMDX_BUILD_DIR" >&2; exit 2; fi
if [ ! -x "$python" ]; then echo "no $python: run scripts/setup first" >&2; exit 2; fi
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
source "$repo/bench/lib.sh"  # median, machine

pin=()
if command -v taskset > /dev/null && [ "$(nproc)" -ge 2 ] && taskset -c "$pin_cpu" true 2> /dev/null; then
  pin=(taskset -c "$pin_cpu"); where="pinned to CPU $pin_cpu (taskset -c $pin_cpu)"
elif ! command -v taskset > /dev/null; then
  where="unpinned (no taskset on this machine)"
else
  where="unpinned (CPU $pin_cpu is not among the $(nproc) this process may use, or there is only one)"
fi
bf16_isa=0
grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo && bf16_isa=1

# spmdx_run TAG NPROC REPLICATE SHARD DTYPE FLAVOR BATCH SEQ STEPS [launcher...] ->
# "median step ms of steps 3.., median mfu (n/a when metrics.jsonl has none)"
spmdx_run() {
  local tag=$1 np=$2 rep=$3 shard=$4 dtype=$5 fl=$6 batch=$7 seq=$8 st=$9
  shift 9
  "$@" "$build/bin/spmdx" run "$repo/configs/llama_debug.toml" --nproc "$np" --training.steps "$st" --metrics.log_freq 1000 \
    --model.flavor "$fl" --training.local_batch_size "$batch" --training.seq_len "$seq" \
    --parallelism.data_parallel_replicate_degree "$rep" --parallelism.data_parallel_shard_degree "$shard" \
    --parallelism.tensor_parallel_degree 1 --training.mixed_precision_param "$dtype" \
    --job.dump_folder "$out/$tag" > "$out/$tag.log" 2>&1 || { echo "spmdx $tag failed:" >&2; cat "$out/$tag.log" >&2; return 1; }
  python3 -c '
import json, statistics, sys
r = [json.loads(l) for l in open(sys.argv[1])][2:]
mfu = [x["mfu"] for x in r if x.get("mfu") is not None]
print("%.1f %s" % (statistics.median(x["step_ms"] for x in r), "%.2f" % statistics.median(mfu) if mfu else "n/a"))' "$out/$tag/metrics.jsonl"
  rm -rf "${out:?}/$tag"
}
# torch_run MODE NPROC FLAVOR BATCH SEQ STEPS [launcher...] -> median step ms of steps 3.. (empty
# when the peer failed: its log goes to stderr and the run counts as missing)
torch_run() {
  local mode=$1 np=$2 fl=$3 batch=$4 seq=$5 st=$6
  shift 6
  if "$@" "$python" "$repo/bench/peers/torch_llama.py" "$mode" "$np" "$st" "$fl" "$batch" "$seq" > "$out/torch_$mode.out" 2> "$out/torch_$mode.log"; then
    awk '{ print $2 }' "$out/torch_$mode.out"
  else
    echo "PyTorch $mode failed (counted as missing):" >&2; tail -20 "$out/torch_$mode.log" >&2
  fi
}
ratio() { awk -v a="$1" -v b="$2" -v unit="${3:-}" 'BEGIN { if (a + 0 > 0 && b + 0 > 0) printf "%.2f%s\n", a / b, unit; else print "n/a" }'; }
# verdict RATIO le|ge GOAL -> "met", "not met", or "n/a" (a run missing)
verdict() { awk -v r="$1" -v op="$2" -v g="$3" 'BEGIN { if (r == "n/a") { print "n/a"; exit } ok = op == "le" ? r <= g : r >= g; print (ok ? "met" : "not met") }'; }

machine
echo "one rank, one intra-op thread (OMP_NUM_THREADS=1, torch.set_num_threads(1)), $where; medians of $rounds rounds of each run's median step (steps 3..)"

one_rank() {  # FLAVOR BATCH SEQ STEPS
  local fl=$1 batch=$2 seq=$3 st=$4 r k v ms mfu tokens
  local -a names=("spmdx float32" "spmdx bfloat16" "PyTorch eager float32" "PyTorch autocast bfloat16" "torch.compile float32")
  local -a t0=() t1=() t2=() t3=() t4=() m0=() m1=() med=()
  for ((r = 0; r < rounds; r++)); do
    v=$(OMP_NUM_THREADS=1 spmdx_run "f32_$fl" 1 1 1 float32 "$fl" "$batch" "$seq" "$st" ${pin[@]+"${pin[@]}"}) || exit 1
    read -r ms mfu <<< "$v"; t0+=("$ms"); [ "$mfu" = n/a ] || m0+=("$mfu")
    v=$(OMP_NUM_THREADS=1 spmdx_run "bf16_$fl" 1 1 1 bfloat16 "$fl" "$batch" "$seq" "$st" ${pin[@]+"${pin[@]}"}) || exit 1
    read -r ms mfu <<< "$v"; t1+=("$ms"); [ "$mfu" = n/a ] || m1+=("$mfu")
    t2+=("$(OMP_NUM_THREADS=1 THREADS=1 torch_run cpu 1 "$fl" "$batch" "$seq" "$st" ${pin[@]+"${pin[@]}"})")
    t3+=("$(OMP_NUM_THREADS=1 THREADS=1 torch_run cpu_bf16 1 "$fl" "$batch" "$seq" "$st" ${pin[@]+"${pin[@]}"})")
    t4+=("$(OMP_NUM_THREADS=1 THREADS=1 torch_run cpu_compile 1 "$fl" "$batch" "$seq" "$st" ${pin[@]+"${pin[@]}"})")
  done
  echo
  echo "llama $fl, batch $batch x seq $seq, $st steps, 1 rank"
  printf "%-28s %-36s %10s %7s\n" run "step ms (rounds)" tokens/s "mfu %"
  for k in 0 1 2 3 4; do
    local -n times="t$k"
    med[k]=$(echo "${times[*]}" | median 1)
    tokens=$(awk -v ms="${med[k]}" -v t=$((batch * seq)) 'BEGIN { if (ms + 0 > 0) printf "%.0f", t / ms * 1e3; else print "n/a" }')
    mfu="n/a"
    if [ "$k" = 0 ] && [ ${#m0[@]} -gt 0 ]; then mfu=$(echo "${m0[*]}" | median 2); fi
    if [ "$k" = 1 ] && [ ${#m1[@]} -gt 0 ]; then mfu=$(echo "${m1[*]}" | median 2); fi
    [ "$k" -ge 2 ] && mfu=""
    printf "%-28s %-36s %10s %7s\n" "${names[k]}" "${med[k]} (${times[*]})" "$tokens" "$mfu"
    unset -n times
  done
  local a b c
  a=$(ratio "${med[1]}" "${med[0]}"); b=$(ratio "${med[3]}" "${med[1]}"); c=$(ratio "${med[4]}" "${med[0]}")
  if [ "$bf16_isa" = 1 ]; then
    echo "spmdx bf16 / spmdx f32 step:        $a (goal <= 0.65 on a CPU with bfloat16 instructions: $(verdict "$a" le 0.65))"
  else
    echo "spmdx bf16 / spmdx f32 step:        $a (goal <= 0.65 applies to CPUs with bfloat16 instructions; this one has neither avx512_bf16 nor amx_bf16)"
  fi
  echo "PyTorch autocast bf16 / spmdx bf16: $b (goal >= 1.3: $(verdict "$b" ge 1.3))"
  echo "torch.compile f32 / spmdx f32:      $c (goal >= 1.3: $(verdict "$c" ge 1.3))"
}

[ "$flavor" = none ] || one_rank "$flavor" 4 128 "$steps"
[ "$heavy_flavor" = none ] || one_rank "$heavy_flavor" "$heavy_batch" "$heavy_seq" "$heavy_steps"

if [ "$multi" = 1 ] && [ "$flavor" != none ]; then
  echo
  echo "llama $flavor, $n ranks, global batch $((n * 4)) x 128, $steps steps, unpinned (threads per rank: cores / ranks)"
  printf "%-36s %-28s %-28s %8s\n" "spmdx vs PyTorch (Gloo)" "spmdx step ms (rounds)" "PyTorch step ms" speedup
  for row in "dp float32 ddp DDP" "dp bfloat16 ddp_bf16 DDP-autocast-bf16" "fsdp float32 fsdp FSDP2" "fsdp bfloat16 fsdp_bf16 FSDP2-bf16-policy"; do
    read -r layout dtype mode peer <<< "$row"
    s=(); t=()
    rep=1 shard=1
    if [ "$layout" = dp ]; then rep=$n; else shard=$n; fi
    for ((r = 0; r < rounds; r++)); do
      v=$(spmdx_run "${layout}_$dtype" "$n" "$rep" "$shard" "$dtype" "$flavor" 4 128 "$steps") || exit 1
      s+=("${v%% *}")
      t+=("$(torch_run "$mode" "$n" "$flavor" 4 128 "$steps")")
    done
    ms=$(echo "${s[*]}" | median 1); mt=$(echo "${t[*]}" | median 1)
    printf "%-36s %-28s %-28s %8s\n" "$layout $n $dtype vs ${peer//-/ }" "$ms (${s[*]})" "$mt (${t[*]})" "$(ratio "$mt" "$ms" x)"
  done
  echo "speedup = PyTorch / spmdx step time (> 1: spmdx faster)"
fi
