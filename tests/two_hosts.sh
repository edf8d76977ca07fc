#!/usr/bin/env bash
# A two-host job on one machine: two network namespaces joined by a veth pair, 2 ranks in each
# (spmdx run --nnodes 2 --node-rank K, as torchrun), UCX over TCP between them. The losses must
# equal those of 4 ranks on one host. Needs root and `ip netns`; exits 77 (skipped) otherwise.
# Usage: two_hosts.sh SPMDX_EXE CONFIG
set -euo pipefail
spmdx="$1"; cfg="$2"
if [ "$(id -u)" != 0 ] || ! ip netns add "spmdx_probe_$$" 2>/dev/null; then
  echo "SKIP: needs root and network namespaces (ip netns)"; exit 77
fi
ip netns del "spmdx_probe_$$"
a="spmdx_a_$$"; b="spmdx_b_$$"; work="$(mktemp -d)"
cleanup() { ip netns del "$a" 2>/dev/null || true; ip netns del "$b" 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
ip netns add "$a"; ip netns add "$b"
ip link add "va$$" type veth peer name "vb$$"
ip link set "va$$" netns "$a"; ip link set "vb$$" netns "$b"
ip -n "$a" addr add 10.231.7.1/24 dev "va$$"; ip -n "$b" addr add 10.231.7.2/24 dev "vb$$"
for ns in "$a" "$b"; do ip -n "$ns" link set lo up; done
ip -n "$a" link set "va$$" up; ip -n "$b" link set "vb$$" up

for i in $(seq 1 200); do echo "Two hosts train as one when every rank agrees on every number, line $i."; done > "$work/corpus.txt"
common=(--data.paths "$work/corpus.txt" --training.steps 5 --training.global_batch_size 8 --training.seq_len 32
        --parallelism.data_parallel_shard_degree -1 --comm.timeout_seconds 60)

"$spmdx" run "$cfg" --nproc 4 "${common[@]}" --job.dump_folder "$work/local" > "$work/local.log" 2>&1 \
  || { cat "$work/local.log"; exit 1; }

export SPMDX_JOB_TOKEN="two-hosts-$$" UCX_TLS=tcp,self
ip netns exec "$b" "$spmdx" run "$cfg" --nnodes 2 --node-rank 1 --nproc 2 --master-addr 10.231.7.1 --master-port 29555 \
  "${common[@]}" --job.dump_folder "$work/b" > "$work/b.log" 2>&1 &
other=$!
status=0
ip netns exec "$a" timeout 120 "$spmdx" run "$cfg" --nnodes 2 --node-rank 0 --nproc 2 --master-addr 10.231.7.1 --master-port 29555 \
  "${common[@]}" --job.dump_folder "$work/a" > "$work/a.log" 2>&1 || status=$?
wait "$other" || status=$?
if [ "$status" != 0 ]; then echo "--- node 0"; cat "$work/a.log"; echo "--- node 1"; cat "$work/b.log"; exit 1; fi
cat "$work/a.log"
python3 - "$work/local/metrics.jsonl" "$work/a/metrics.jsonl" <<'PY'
import json, sys
local = [json.loads(l)["loss"] for l in open(sys.argv[1])]
hosts = [json.loads(l)["loss"] for l in open(sys.argv[2])]
assert len(local) == len(hosts) == 5, (local, hosts)
worst = max(abs(a - b) / abs(a) for a, b in zip(local, hosts))
assert worst <= 1e-5, (local, hosts)
print(f"two hosts (2+2 ranks, UCX over TCP) vs 4 local ranks: max relative loss difference {worst:.2e}")
PY
