#!/usr/bin/env bash
# Unequal ranks (issue 49): parallelism.balance = "speed" against "even" on the same unequal ranks.
# The main job's model (Llama debugmodel), 3 data-parallel ranks (LAYOUT=dp: DDP over
# dp_replicate; LAYOUT=fsdp: dp_shard), global batch GLOBAL rows (default 24) of SEQ tokens
# (default 128), STEPS steps (default 24). The ranks are made unequal on one machine by
# `spmdx run --cpu-affinity` and SPMDX_FAULT's slow factor (docs/running.md):
#   affinity         --cpu-affinity "0;1;1": rank 0 alone on CPU 0, ranks 1 and 2 sharing CPU 1
#   affinity+slow2   the same, and rank SLOW_RANK (default 2)'s compute 2x as long
#   affinity+slow3   the same at 3x
#   shared+slow3     --cpu-affinity "0,1;0,1;0,1" (all three on both CPUs), rank SLOW_RANK 3x:
#                    one rank 3x slower than two equal ones
# Each scenario runs even and speed in turn, ROUNDS times (default 1). Per run: the median
# step_ms of the steps from TIMED_FROM (default 13: balance_interval 4 has re-planned by then)
# to STEPS, and the speed run's last split (metrics.jsonl's balance_rows). Prints the machine
# line first, then per scenario even ms, speed ms, speed / even and the split. Goal (issue 49):
# speed / even <= 0.75 with one rank 3x slower. Not a test: times depend on the machine and its
# load. Needs 2 CPUs (the affinity lists name CPUs 0 and 1).
# Usage: bench/hetero.sh [ROUNDS]   (env LAYOUT GLOBAL SEQ STEPS TIMED_FROM SLOW_RANK KEEP; about 4.5
# minutes a round here)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${SPMDX_BUILD_DIR:-$repo/build}"
rounds="${1:-1}"
layout="${LAYOUT:-dp}"; global="${GLOBAL:-24}"; seq="${SEQ:-128}"; steps="${STEPS:-24}"; timed_from="${TIMED_FROM:-13}"; slow_rank="${SLOW_RANK:-2}"
whole() { [[ "$1" =~ ^[1-9][0-9]*$ ]]; }
for v in rounds global seq steps timed_from; do
  whole "${!v}" || { echo "$v must be a positive whole number, got '${!v}'" >&2; exit 2; }
done
[ "$timed_from" -le "$steps" ] || { echo "TIMED_FROM ($timed_from) must be at most STEPS ($steps)" >&2; exit 2; }
[ $((global % 3)) -eq 0 ] || { echo "GLOBAL must be a multiple of 3 (the even split runs it), got $global" >&2; exit 2; }
[[ "$slow_rank" =~ ^[0-2]$ ]] || { echo "SLOW_RANK must be 0, 1 or 2, got '$slow_rank'" >&2; exit 2; }
case "$layout" in
  dp) degrees="--parallelism.data_parallel_replicate_degree 3 --parallelism.data_parallel_shard_degree 1" ;;
  fsdp) degrees="--parallelism.data_parallel_replicate_degree 1 --parallelism.data_parallel_shard_degree 3" ;;
  *) echo "LAYOUT must be dp or fsdp, got '$layout'" >&2; exit 2 ;;
esac
if [ ! -x "$build/bin/spmdx" ]; then echo "no $build/bin/spmdx: build it first (scripts/build) or set SPMDX_BUILD_DIR" >&2; exit 2; fi
if ! taskset -c 0,1 true 2> /dev/null; then echo "bench/hetero.sh pins ranks to CPUs 0 and 1, which this process may not use" >&2; exit 2; fi
out="$(mktemp -d)"
[ -n "${KEEP:-}" ] && echo "keeping $out" || trap 'rm -rf "$out"' EXIT
source "$repo/bench/lib.sh"  # median, machine

# run NAME BALANCE AFFINITY FAULT: one job into $out/NAME; prints its median step_ms over the timed steps.
run() {
  local name="$1" balance="$2" affinity="$3" fault="$4"
  rm -rf "$out/$name"
  if ! env ${fault:+SPMDX_FAULT="$fault"} "$build/bin/spmdx" run "$repo/configs/llama_debug.toml" --nproc 3 --cpu-affinity "$affinity" $degrees \
      --parallelism.tensor_parallel_degree 1 --training.steps "$steps" --training.global_batch_size "$global" --training.local_batch_size $((global / 3)) \
      --training.seq_len "$seq" \
      --parallelism.balance "$balance" --parallelism.balance_interval 4 --job.dump_folder "$out/$name" > "$out/$name.log" 2>&1; then
    echo "bench/hetero.sh: $name failed; its log:" >&2; tail -20 "$out/$name.log" >&2; exit 1
  fi
  python3 - "$out/$name/metrics.jsonl" "$timed_from" <<'EOF'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
timed = [r["step_ms"] for r in rows if r["step"] >= int(sys.argv[2])]
print("%.1f %s" % (statistics.median(timed), ":".join(map(str, rows[-1].get("balance_rows", [])))))
EOF
}

machine
echo "bench/hetero.sh: llama debugmodel, 3 ranks $layout, global batch $global x $seq, $steps steps, median step_ms of steps $timed_from-$steps, balance_interval 4, $rounds round(s)"
printf "%-16s %10s %10s %12s  %s\n" scenario "even ms" "speed ms" "speed/even" "split (speed)"
for scenario in affinity affinity+slow2 affinity+slow3 shared+slow3; do
  case "$scenario" in
    affinity) affinity="0;1;1"; fault="" ;;
    affinity+slow2) affinity="0;1;1"; fault="slow:rank=$slow_rank,factor=2" ;;
    affinity+slow3) affinity="0;1;1"; fault="slow:rank=$slow_rank,factor=3" ;;
    shared+slow3) affinity="0,1;0,1;0,1"; fault="slow:rank=$slow_rank,factor=3" ;;
  esac
  evens=(); speeds=(); split=""
  for ((r = 1; r <= rounds; r++)); do
    read -r e _ < <(run "$scenario-even-$r" even "$affinity" "$fault")
    read -r s split < <(run "$scenario-speed-$r" speed "$affinity" "$fault")
    evens+=("$e"); speeds+=("$s")
  done
  e=$(echo "${evens[*]}" | median 1); s=$(echo "${speeds[*]}" | median 1)
  printf "%-16s %10s %10s %12s  %s\n" "$scenario" "$e" "$s" "$(awk -v a="$s" -v b="$e" 'BEGIN { printf "%.2f", a / b }')" "$split"
done
