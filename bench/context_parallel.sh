#!/usr/bin/env bash
# Context parallelism on a long sequence (Llama debugmodel, 2 layers, one row of SEQ tokens):
# one rank (the peer) against cp 2 and cp 4, each with the sequence load-balanced (2 cp pieces,
# rank r holding r and 2 cp - 1 - r) and in order, attention all-gathering k and v; and cp 4
# with rotate_method "auto" (batch or heads split by all_to_all where that moves fewer bytes).
# For each: rank 0's median step time, its exposed communication (time waiting on the others:
# in order, rank 0 holds the sequence's start, whose causal attention is the cheapest, and
# waits on the last rank), its measured peak memory as a ratio against one rank's, and the
# largest loss difference to one rank.
# Each layout runs ROUNDS times (default 3), interleaved, and the step time is the median of the
# rounds' medians (the machine is noisy: another job's threads double a round's times).
# Usage: [ROUNDS=3] bench/context_parallel.sh [STEPS] [SEQ]   (defaults 6, 2048)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${SPMDX_BUILD_DIR:-$repo/build}"
steps="${1:-6}"
seq="${2:-2048}"
rounds="${ROUNDS:-3}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
source "$repo/bench/lib.sh"  # machine
run() {  # name nproc flags...
  local name="$1" nproc="$2"
  shift 2
  "$build/bin/spmdx" run "$repo/configs/llama_debug.toml" --nproc "$nproc" --parallelism.data_parallel_shard_degree 1 --parallelism.tensor_parallel_degree 1 \
    --model.n_layers 2 --training.seq_len "$seq" --training.global_batch_size 1 --training.local_batch_size 1 --training.steps "$steps" \
    --metrics.log_freq 100000 --job.dump_folder "$out/$name" "$@" > "$out/$name.log" 2>&1 || { cat "$out/$name.log"; exit 1; }
}

machine
for round in $(seq 1 "$rounds"); do
  run "one.$round" 1
  for cp in 2 4; do
    run "cp$cp-balanced.$round" "$cp" --parallelism.context_parallel_degree "$cp"
    run "cp$cp-in-order.$round" "$cp" --parallelism.context_parallel_degree "$cp" --parallelism.context_parallel_load_balance false
  done
  run "cp4-auto.$round" 4 --parallelism.context_parallel_degree 4 --parallelism.context_parallel_rotate_method auto
done
python3 - "$out" "$seq" "$rounds" <<'PY'
import json, statistics, sys
out, seq, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
load = lambda n, r: [json.loads(x) for x in open(f"{out}/{n}.{r}/metrics.jsonl")]
med = lambda rs, f: statistics.median(f(r) for r in rs[1:])  # step 1 warms up
over = lambda n, f: statistics.median(med(load(n, r), f) for r in range(1, rounds + 1))  # the rounds' median
one_ms, one_peak = over("one", lambda r: r["step_ms"]), load("one", 1)[-1]["peak_mem_bytes"] / 2**20
print(f"{'seq ' + seq + ', one row':>16} {'step ms':>8} {'x one':>6} {'exposed comm':>13} {'peak MiB':>9} {'x one':>6} {'max |dloss|/loss':>17}   ({rounds} rounds)")
for n in ("one", "cp2-balanced", "cp2-in-order", "cp4-balanced", "cp4-in-order", "cp4-auto"):
    ms = over(n, lambda r: r["step_ms"])
    exposed = over(n, lambda r: r["exposed_comm_ms"] / r["step_ms"])
    peak = load(n, 1)[-1]["peak_mem_bytes"] / 2**20
    dloss = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(load(n, 1), load("one", 1)))
    print(f"{n:>16} {ms:>8.1f} {ms / one_ms:>6.2f} {exposed:>12.1%} {peak:>9.1f} {peak / one_peak:>6.2f} {dloss:>17.1e}")
PY
