#!/usr/bin/env bash
# all_reduce of float32 sums on this machine, spmdx's ucx plugin against Open MPI (mpirun,
# shared memory) and Gloo (PyTorch torch.distributed), measured in the same run; prints each
# one's bus bandwidth and spmdx's ratio to each (issue target: >= Open MPI, >= 2x Gloo at 64 MiB).
# Usage: bench/comm_peers.sh [BYTES] [NPROC...]   (default: 64 MiB on 2 and 4 ranks)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${SPMDX_BUILD_DIR:-$repo/build}"
bytes="${1:-67108864}"; shift || true
nprocs=("${@:-2 4}"); nprocs=(${nprocs[@]})
iters=10
printf "%-6s %12s %12s %12s %12s %10s %10s\n" ranks bytes "spmdx GB/s" "mpi GB/s" "gloo GB/s" "vs mpi" "vs gloo"
for n in "${nprocs[@]}"; do
  spmdx=$("$build/bin/spmdx" bench comm --nproc "$n" --op all_reduce --min-bytes "$bytes" --max-bytes "$bytes" --iters $iters --warmup 3 \
          | awk '$1 == "[rank" && $3 ~ /^[0-9]+$/ { print $(NF-1) }' | tail -1)   # in-place busbw
  mpi=$(mpirun --allow-run-as-root --oversubscribe -np "$n" --mca btl self,vader "$build/bin/bench_mpi_allreduce" "$bytes" $iters \
        2>/dev/null | awk '{ print $2 }')
  gloo=$("$repo/.venv/bin/python" "$repo/bench/peers/gloo_allreduce.py" "$n" "$bytes" $iters 2>/dev/null | awk '{ print $2 }')
  ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2fx", a / b; else print "n/a" }'; }
  printf "%-6s %12s %12s %12s %12s %10s %10s\n" "$n" "$bytes" "$spmdx" "${mpi:-n/a}" "${gloo:-n/a}" "$(ratio "$spmdx" "${mpi:-0}")" "$(ratio "$spmdx" "${gloo:-0}")"
done
