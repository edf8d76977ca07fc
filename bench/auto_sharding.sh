#!/usr/bin/env bash
# strategy = "auto" against the hand strategies, on 4 ranks of this machine: for each model
# (mlp tiny, llama tiny, llama debugmodel with 2 layers), the cost model's predicted step time of
# each hand layout (dp 4, fsdp 4, tp 4, fsdp 2 x tp 2, hsdp 2 x 2, and for the llamas pp 2 x dp 2,
# pp 2 x fsdp 2, pp 2 x tp 2: `spmdx compile --estimate`)
# against its measured median step time (`spmdx run`), the prediction's error, the Spearman
# rank correlation of the two rankings, and the plan auto chose, measured the same way.
# The calibration is this machine's: compute rates measured once by compile, alpha and beta of
# the shared-memory link fitted by `spmdx bench comm --calibrate` (all_reduce, 4 ranks), and the
# per-collective cost fitted by `spmdx bench fit` to one profiling run of each model (fsdp 4).
# Then the solver's time against model size, and the planning time of auto for a 32-layer
# debugmodel on 1024 fake ranks.
# Each layout runs ROUNDS times (default 2), interleaved; a step time is the median of the
# rounds' medians (the machine is noisy).
# Usage: [ROUNDS=2] bench/auto_sharding.sh [STEPS]   (default 8)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${SPMDX_BUILD_DIR:-$repo/build}"
steps="${1:-8}"
rounds="${ROUNDS:-2}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
source "$repo/bench/lib.sh"  # machine
spmdx="$build/bin/spmdx"

machine
"$spmdx" bench comm --nproc 4 --max-bytes 16M --iters 10 --calibrate "$out/calibration.json" > "$out/comm.log" 2>&1 || { cat "$out/comm.log"; exit 1; }
declare -A layouts=(
  [dp4]="--parallelism.data_parallel_replicate_degree 4 --parallelism.data_parallel_shard_degree 1 --parallelism.tensor_parallel_degree 1"
  [fsdp4]="--parallelism.data_parallel_replicate_degree 1 --parallelism.data_parallel_shard_degree 4 --parallelism.tensor_parallel_degree 1"
  [tp4]="--parallelism.data_parallel_replicate_degree 1 --parallelism.data_parallel_shard_degree 1 --parallelism.tensor_parallel_degree 4"
  [fsdp2xtp2]="--parallelism.data_parallel_replicate_degree 1 --parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 2"
  [hsdp2x2]="--parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 1"
  [pp2xdp2]="--parallelism.pipeline_parallel_degree 2 --parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 1 --parallelism.tensor_parallel_degree 1"
  [pp2xfsdp2]="--parallelism.pipeline_parallel_degree 2 --parallelism.data_parallel_replicate_degree 1 --parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 1"
  [pp2xtp2]="--parallelism.pipeline_parallel_degree 2 --parallelism.data_parallel_replicate_degree 1 --parallelism.data_parallel_shard_degree 1 --parallelism.tensor_parallel_degree 2"
)
# The layouts a model runs: pipeline stages need layers (mlp has none).
names_of() { if [ "$1" = mlp ]; then echo dp4 fsdp4 tp4 fsdp2xtp2 hsdp2x2; else echo dp4 fsdp4 tp4 fsdp2xtp2 hsdp2x2 pp2xdp2 pp2xfsdp2 pp2xtp2; fi; }
declare -A models=(
  [mlp]="$repo/configs/mlp_dp.toml --training.global_batch_size 32 --training.seq_len 64"
  [llama_tiny]="$repo/configs/llama_fsdp.toml --training.global_batch_size 8 --training.seq_len 64"
  [debugmodel]="$repo/configs/llama_debug.toml --model.n_layers 2 --training.global_batch_size 8 --training.seq_len 128"
)
for model in mlp llama_tiny debugmodel; do
  dump="$out/$model"
  mkdir -p "$dump"
  cp "$out/calibration.json" "$dump/calibration.json"
  # The per-collective cost, fitted to one profiling run of the model (fsdp 4), as Alpa profiles
  # on the mesh: the ranks' time slices on shared cores, which no microbenchmark sees.
  # shellcheck disable=SC2086
  "$spmdx" run ${models[$model]} ${layouts[fsdp4]} --nproc 4 --training.steps "$steps" --metrics.log_freq 100000 --job.dump_folder "$dump/profile" > "$out/$model.profile.log" 2>&1
  "$spmdx" bench fit "$dump/profile" --calibrate "$dump/calibration.json" >> "$out/fit.log"
  for name in $(names_of "$model"); do
    # shellcheck disable=SC2086
    "$spmdx" compile ${models[$model]} ${layouts[$name]} --world-size 4 --estimate --json --job.dump_folder "$dump" > "$out/$model.$name.estimate.json" 2> "$out/$model.$name.estimate.err" ||
      echo "{}" > "$out/$model.$name.estimate.json"
  done
  # shellcheck disable=SC2086
  "$spmdx" compile ${models[$model]} --world-size 4 --strategy auto --json --job.dump_folder "$dump" > "$out/$model.auto.json" 2> "$out/$model.auto.err" || cat "$out/$model.auto.err"
  for round in $(seq 1 "$rounds"); do
    for name in $(names_of "$model") auto; do
      flags="${layouts[$name]:-}"
      [ "$name" = auto ] && flags="--parallelism.strategy auto"
      # shellcheck disable=SC2086
      "$spmdx" run ${models[$model]} $flags --nproc 4 --training.steps "$steps" --metrics.log_freq 100000 --job.dump_folder "$dump" \
        --metrics.enable_tensorboard false > "$out/$model.$name.$round.log" 2>&1 && mv "$dump/metrics.jsonl" "$out/$model.$name.$round.jsonl" ||
        echo "$model $name: $(grep -m1 -i error "$out/$model.$name.$round.log")" >> "$out/failed.txt"
      rm -f "$dump/metrics.jsonl"
    done
  done
done
python3 - "$out" "$rounds" <<'PY'
import json, os, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
print(open(f"{out}/comm.log").read().strip().splitlines()[-1].replace("[rank 0] ", ""))
print(open(f"{out}/fit.log").read().strip())
def measured(model, name):
    meds = []
    for r in range(1, rounds + 1):
        f = f"{out}/{model}.{name}.{r}.jsonl"
        if os.path.exists(f):
            rows = [json.loads(x) for x in open(f)]
            meds.append(statistics.median(x["step_ms"] for x in rows[1:]))
    return statistics.median(meds) if meds else None
def ranks(xs):
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    r = [0] * len(xs)
    for k, i in enumerate(order): r[i] = k + 1
    return r
def spearman(a, b):
    n = len(a)
    ra, rb = ranks(a), ranks(b)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1)) if n > 1 else float("nan")
for model in ("mlp", "llama_tiny", "debugmodel"):
    auto = json.load(open(f"{out}/{model}.auto.json")) if os.path.getsize(f"{out}/{model}.auto.json") else {}
    chosen = auto.get("auto", {}).get("chosen", "?")
    print(f"\n{model}: auto chose {chosen} (planned {auto.get('auto', {}).get('seconds', 0):.1f} s)")
    print(f"{'layout':>12} {'predicted ms':>13} {'measured ms':>12} {'error':>8}")
    pred, meas = [], []
    names = ["dp4", "fsdp4", "tp4", "fsdp2xtp2", "hsdp2x2"] + ([] if model == "mlp" else ["pp2xdp2", "pp2xfsdp2", "pp2xtp2"])
    for name in names + ["auto"]:
        if name == "auto":
            plans = auto.get("auto", {}).get("plans", [])
            p = plans[0]["step_seconds"] * 1e3 if plans else None
        else:
            e = json.load(open(f"{out}/{model}.{name}.estimate.json")).get("estimate")
            p = e["step_seconds"] * 1e3 if e else None
        m = measured(model, name)
        if p is None or m is None:
            print(f"{name:>12} {'-':>13} {'-' if m is None else f'{m:.2f}':>12}")
            continue
        print(f"{name:>12} {p:>13.2f} {m:>12.2f} {(p - m) / m:>+8.0%}")
        if name != "auto": pred.append(p), meas.append(m)
    best = min(meas) if meas else None
    a = measured(model, "auto")
    print(f"Spearman (hand layouts, predicted vs measured): {spearman(pred, meas):.2f}; auto's step / the best hand layout's: " +
          (f"{a / best:.2f}" if a and best else "-"))
if os.path.exists(f"{out}/failed.txt"): print("\nfailed:\n" + open(f"{out}/failed.txt").read())
PY
# Solver time against model size: the planner's seconds per mesh dim (CBC) and the problem's
# columns, for debugmodel with 2 to 16 layers on 4 ranks (no time limit reached: 600 s).
echo
echo "solver time vs model size (debugmodel, 4 ranks; the best layout's mesh dims):"
for layers in 2 4 8 16; do
  "$spmdx" compile "$repo/configs/llama_debug.toml" --world-size 4 --model.n_layers "$layers" --strategy auto --parallelism.planner_time_limit_seconds 600 \
    --json --job.dump_folder "$out/size$layers" > "$out/size$layers.json" 2> /dev/null || { echo "layers $layers: failed"; continue; }
  python3 - "$out/size$layers.json" "$layers" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))["auto"]
for p in j["plans"]:
    if p.get("planner"):
        dims = "; ".join(f"{d['mesh_dim']} {d['solve_seconds']:.2f} s ({d['solver'].split('), ')[-1]}, {'optimal' if d['optimal'] else 'time limit'})" for d in p["planner"])
        print(f"  {sys.argv[2]:>2} layers, {p['layout']}: {dims}")
        break
PY
done
# Planning time at scale: 1024 fake ranks, debugmodel widths with 32 layers, one row a rank.
start=$(date +%s.%N)
"$spmdx" compile "$repo/configs/llama_debug.toml" --world-size 1024 --fake --model.n_layers 32 --training.local_batch_size 1 --strategy auto \
  --job.dump_folder "$out/big" > "$out/big.log" 2>&1 || { tail -5 "$out/big.log"; exit 1; }
end=$(date +%s.%N)
echo
grep -m1 "^auto-sharding" "$out/big.log"
grep -m1 "^auto: chose" "$out/big.log"
echo "1024 fake ranks, 32 layers: spmdx compile --strategy auto took $(python3 -c "print(f'{$end - $start:.1f}')") s"
