#!/usr/bin/env bash
# Context parallelism on a long sequence (Llama debugmodel, 2 layers, one row of SEQ tokens):
# one rank (the peer) against cp 2 and cp 4, each with the sequence load-balanced (2 cp pieces,
# rank r holding r and 2 cp - 1 - r) and in order, attention all-gathering k and v; and cp 4
# with rotate_method "auto" (batch or heads split by all_to_all where that moves fewer bytes).
# For each: rank 0's median step time, its exposed communication (time waiting on the others:
# in order, rank 0 holds the sequence's start, whose causal attention is the cheapest, and
# waits on the last rank), its measured peak memory as a ratio against one rank's, and the
# largest loss difference to one rank.
# Usage: bench/context_parallel.sh [STEPS] [SEQ]   (defaults 6, 2048)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${SPMDX_BUILD_DIR:-$repo/build}"
steps="${1:-6}"
seq="${2:-2048}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
run() {  # name nproc flags...
  local name="$1" nproc="$2"
  shift 2
  "$build/bin/spmdx" run "$repo/configs/llama_debug.toml" --nproc "$nproc" --parallelism.data_parallel_shard_degree 1 --parallelism.tensor_parallel_degree 1 \
    --model.n_layers 2 --training.seq_len "$seq" --training.global_batch_size 1 --training.local_batch_size 1 --training.steps "$steps" \
    --metrics.log_freq 100000 --job.dump_folder "$out/$name" "$@" > "$out/$name.log" 2>&1 || { cat "$out/$name.log"; exit 1; }
}
run one 1
for cp in 2 4; do
  run "cp$cp-balanced" "$cp" --parallelism.context_parallel_degree "$cp"
  run "cp$cp-in-order" "$cp" --parallelism.context_parallel_degree "$cp" --parallelism.context_parallel_load_balance false
done
run cp4-auto 4 --parallelism.context_parallel_degree 4 --parallelism.context_parallel_rotate_method auto
python3 - "$out" "$seq" <<'PY'
import json, statistics, sys
out, seq = sys.argv[1], sys.argv[2]
load = lambda n: [json.loads(x) for x in open(f"{out}/{n}/metrics.jsonl")]
med = lambda rs, f: statistics.median(f(r) for r in rs[1:])  # step 1 warms up
one = load("one")
print(f"{'seq ' + seq + ', one row':>16} {'step ms':>8} {'x one':>6} {'exposed comm':>13} {'peak MiB':>9} {'x one':>6} {'max |dloss|/loss':>17}")
for n in ("one", "cp2-balanced", "cp2-in-order", "cp4-balanced", "cp4-in-order", "cp4-auto"):
    rs = load(n)
    ms = med(rs, lambda r: r["step_ms"])
    exposed = med(rs, lambda r: r["exposed_comm_ms"] / r["step_ms"])
    peak = rs[-1]["peak_mem_bytes"] / 2**20
    dloss = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(rs, one))
    print(f"{n:>16} {ms:>8.1f} {ms / med(one, lambda r: r['step_ms']):>6.2f} {exposed:>12.1%} {peak:>9.1f} {peak / (one[-1]['peak_mem_bytes'] / 2**20):>6.2f} {dloss:>17.1e}")
PY
