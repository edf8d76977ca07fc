#!/usr/bin/env bash
# all_reduce of float32 sums on this machine, spmdx's ucx plugin against Open MPI (mpirun,
# shared memory) and Gloo (PyTorch torch.distributed), measured in the same run; prints each
# one's bus bandwidth and spmdx's ratio to each (issue target: >= Open MPI, >= 2x Gloo at 64 MiB).
# The three peers run in turn, ROUNDS times (default 3), and the medians are compared: on a
# shared machine one run of any of them can be off by 2x.
# Usage: bench/comm_peers.sh [BYTES] [NPROC...]   (default: 64 MiB on 2 and 4 ranks)
#        ROUNDS=5 bench/comm_peers.sh
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${SPMDX_BUILD_DIR:-$repo/build}"
bytes="${1:-67108864}"; shift || true
nprocs=("${@:-2 4}"); nprocs=(${nprocs[@]})
rounds="${ROUNDS:-3}"
if ! [[ "$bytes" =~ ^[0-9]+$ ]] || [ "$bytes" -lt 4 ] || [ $((bytes % 4)) -ne 0 ]; then
  echo "BYTES must be a whole number of float32s (a multiple of 4, at least 4), got '$bytes'" >&2; exit 2
fi
if ! [[ "$rounds" =~ ^[1-9][0-9]*$ ]]; then echo "ROUNDS must be a positive whole number, got '$rounds'" >&2; exit 2; fi
iters=10

spmdx_busbw() {  # in-place busbw
  "$build/bin/spmdx" bench comm --nproc "$1" --op all_reduce --min-bytes "$bytes" --max-bytes "$bytes" --iters $iters --warmup 3 \
    | awk '$1 == "[rank" && $3 ~ /^[0-9]+$/ { print $(NF-1) }' | tail -1
}
mpi_busbw() {
  mpirun --allow-run-as-root --oversubscribe -np "$1" --mca btl self,vader "$build/bin/bench_mpi_allreduce" "$bytes" $iters \
    2>/dev/null | awk '{ print $2 }'
}
gloo_busbw() {
  "$repo/.venv/bin/python" "$repo/bench/peers/gloo_allreduce.py" "$1" "$bytes" $iters 2>/dev/null | awk '{ print $2 }'
}
source "$repo/bench/lib.sh"  # median
met() { awk -v r="${1%x}" -v t="$2" 'BEGIN { if (r == "n/a" || r == "") print "(not measured)"; else if (r + 0 >= t) print "met"; else print "NOT met" }'; }
verdicts=()
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a + 0 > 0 && b + 0 > 0) printf "%.2fx", a / b; else print "n/a" }'; }

echo "all_reduce busbw in GB/s (nccl-tests' bus bandwidth), each round's and the median"
printf "%-6s %10s %-26s %-26s %-26s %8s %8s\n" ranks bytes "spmdx (rounds)" "Open MPI" "Gloo" "vs mpi" "vs gloo"
for n in "${nprocs[@]}"; do
  s=(); m=(); g=()
  for ((r = 0; r < rounds; r++)); do
    s+=("$(spmdx_busbw "$n")"); m+=("$(mpi_busbw "$n" || true)"); g+=("$(gloo_busbw "$n" || true)")
  done
  ms=$(echo "${s[*]}" | median); mm=$(echo "${m[*]}" | median); mg=$(echo "${g[*]}" | median)
  rm_=$(ratio "$ms" "$mm"); rg=$(ratio "$ms" "$mg")
  printf "%-6s %10s %-26s %-26s %-26s %8s %8s\n" "$n" "$bytes" "$ms (${s[*]})" "$mm (${m[*]})" "$mg (${g[*]})" "$rm_" "$rg"
  verdicts+=("$n ranks: >= 1x Open MPI $(met "$rm_" 1), >= 2x Gloo $(met "$rg" 2)")
done
echo "medians of $rounds rounds"
if [ "$bytes" = 67108864 ]; then
  echo "issue 5's targets (64 MiB):"
  printf '  %s\n' "${verdicts[@]}"
else
  echo "(issue 5's targets are set at 64 MiB; run with the default size to check them)"
fi
