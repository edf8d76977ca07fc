#!/usr/bin/env bash
# Planning at scale (issue 23): `spmdx compile --fake --json` of torchtitan's Llama 3 shapes,
# its wall time and peak RSS (getrusage, in the JSON), in two tables:
#  1. against depth: the 8B width (dim 4096, FFN 14336, 32 heads, 8 KV heads, vocab 128256)
#     with 8, 16, 32, 80 and 126 layers, then 70B and 405B, on dp_replicate 16 x dp_shard 128
#     x tp 8 = 16,384 fake ranks; seconds per layer against the 8-layer row (GSPMD's property:
#     planning grows no worse than linearly in layers, so the ratio stays near 1);
#  2. against world size: 8B on 64 .. 16,384 fake ranks; the ratio of each row's seconds to
#     the 64-rank row (flat in world size: near 1 where the mesh shape is the same);
#  3. with gradient accumulation (8 microbatches: one graph holds all 8 forwards and
#     backwards), 8B and 405B on 16,384 fake ranks.
# One microbatch per rank (global batch = the data-parallel degree, local batch 1) so that every
# row plans the same train-step graph; sequence 8192 as torchtitan's Llama 3 configs.
# Targets (issue 23): 8B at 1,024 and at 16,384 ranks <= 5 s each, 405B <= 30 s, RSS < 1 GiB.
# The times depend on the machine's load; compare the rows of one run.
# Usage: bench/plan_scale.sh [SEQ_LEN]   (default 8192)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${SPMDX_BUILD_DIR:-$repo/build}"
seq="${1:-8192}"
if ! [[ "$seq" =~ ^[1-9][0-9]*$ ]]; then echo "SEQ_LEN must be a positive whole number, got '$seq'" >&2; exit 2; fi
py="${SPMDX_VENV:-$repo/.venv}/bin/python"
[ -x "$py" ] || py=python3
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
source "$repo/bench/lib.sh"  # machine

plan() {  # name flavor layers dp_replicate dp_shard tp [microbatches] -> $out/name.json
  local name="$1" flavor="$2" layers="$3" rep="$4" shard="$5" tp="$6" mb="${7:-1}"
  "$build/bin/spmdx" compile "$repo/configs/llama_debug.toml" --fake --json --model.flavor "$flavor" --model.n_layers "$layers" \
    --model.vocab_size 128256 --training.seq_len "$seq" --training.local_batch_size 1 --training.global_batch_size $((rep * shard * mb)) \
    --parallelism.data_parallel_replicate_degree "$rep" --parallelism.data_parallel_shard_degree "$shard" --parallelism.tensor_parallel_degree "$tp" \
    > "$out/$name.json" 2> "$out/$name.err" || { cat "$out/$name.err" >&2; exit 1; }
}

machine
echo "1. depth: 16,384 fake ranks (dp_replicate 16 x dp_shard 128 x tp 8), sequence $seq"
for layers in 8 16 32 80 126; do plan "8B-$layers" 8B "$layers" 16 128 8; done
plan 70B 70B -1 16 128 8
plan 405B 405B -1 16 128 8
"$py" - "$out" <<'EOF'
import json, sys
out = sys.argv[1]
rows = [f"8B-{n}" for n in (8, 16, 32, 80, 126)] + ["70B", "405B"]
print(f"{'model':<24}{'layers':>7}{'parameters':>18}{'nodes':>9}{'seconds':>9}{'s/layer':>9}{'vs 8 layers':>12}{'peak RSS':>11}")
base = None
for r in rows:
    j = json.load(open(f"{out}/{r}.json"))
    label = j["model"]["label"]
    layers = int(label.split("(")[1].split()[0]) if "(" in label else {"70B": 80, "405B": 126}.get(r, 32)
    s = j["planner_seconds"]
    per = s / layers
    if base is None: base = per
    print(f"{label:<24}{layers:>7}{j['model']['parameters']:>18,}{j['model']['graph_nodes']:>9}{s:>9.2f}{per:>9.3f}{per / base:>11.2f}x{j['planner_peak_rss_bytes'] / 2**20:>8.0f} MiB")
EOF

echo
echo "2. world size: Llama 3 8B, sequence $seq"
plan w64 8B -1 1 64 1
plan w256 8B -1 1 256 1
plan w1024 8B -1 1 128 8
plan w4096 8B -1 4 128 8
plan w16384 8B -1 16 128 8
"$py" - "$out" <<'EOF'
import json, sys
out = sys.argv[1]
print(f"{'mesh':<44}{'ranks':>7}{'seconds':>9}{'vs 64':>8}{'peak RSS':>11}{'params/rank':>13}{'sent/rank/step':>16}")
base = None
for r in ("w64", "w256", "w1024", "w4096", "w16384"):
    j = json.load(open(f"{out}/{r}.json"))
    mesh = " x ".join(f"{d['name']}={d['size']}" for d in j["mesh"])
    s = j["planner_seconds"]
    if base is None: base = s
    print(f"{mesh:<44}{j['world_size']:>7}{s:>9.2f}{s / base:>7.2f}x{j['planner_peak_rss_bytes'] / 2**20:>8.0f} MiB"
          f"{j['rank0']['parameter_bytes'] / 2**20:>9.1f} MiB{j['rank0']['comm_bytes_per_step'] / 2**30:>12.1f} GiB")
EOF

echo
echo "3. gradient accumulation: 8 microbatches of one row per rank, 16,384 fake ranks, sequence $seq"
plan acc8B 8B -1 16 128 8 8
plan acc405B 405B -1 16 128 8 8
"$py" - "$out" <<'EOF'
import json, sys
out = sys.argv[1]
print(f"{'model':<14}{'microbatches':>13}{'nodes':>9}{'seconds':>9}{'peak RSS':>11}{'planned peak/rank':>19}{'sent/rank/step':>16}")
for r in ("acc8B", "acc405B"):
    j = json.load(open(f"{out}/{r}.json"))
    print(f"{j['model']['label']:<14}{j['microbatches']:>13}{j['model']['graph_nodes']:>9}{j['planner_seconds']:>9.2f}{j['planner_peak_rss_bytes'] / 2**20:>8.0f} MiB"
          f"{j['planned_peak']['bytes'] / 2**30:>15.1f} GiB{j['rank0']['comm_bytes_per_step'] / 2**30:>12.1f} GiB")
EOF
