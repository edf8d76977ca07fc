#!/usr/bin/env bash
# What a dead rank costs, with and without fault tolerance (issue 48). The main job's model
# (Llama debugmodel) on REPLICAS replica groups of PER_GROUP ranks (FSDP inside a group when
# PER_GROUP > 1; default 2 x 2, the main job's 4 ranks), STEPS steps, rank KILL_RANK killed
# (SIGKILL, SPMDX_FAULT) at the start of step KILL_STEP, four runs, ROUNDS times in turn:
#   ft clean      [fault_tolerance] on, nothing killed                  (the baseline)
#   ft killed     [fault_tolerance] on, --max-restarts 1: the other groups train on, the lost
#                 group is restarted and given their state
#   plain clean   the same mesh without fault tolerance, checkpoints every INTERVAL steps
#   plain killed  the same, killed: every rank stops; then run again, resuming from the newest
#                 checkpoint (torchrun's --max-restarts and the launcher's way)
# From metrics.jsonl (`time`: when a step ended; `step_ms`) and the runs' wall times it prints,
# per round and as medians:
#   recovery (s)   from the kill (the end of step KILL_STEP-1) to the lost ranks training again:
#                  fault tolerance, the start of the first step with the restarted group in
#                  `replicas`; stop-and-restart, the start of the resumed run's first step
#   start-up (s)   a clean run's launch to the start of its first step (process start, plugin
#                  loading, compile, rendezvous): what a restarted process pays at least
#   redone         steps the survivors computed twice: fault tolerance, the steps dropped
#                  (the one in flight when a group is lost); stop-and-restart, the steps since
#                  the checkpoint, on every rank
#   lost (steps)   (killed wall time - clean wall time) / the clean run's median step time
# Goals (issue 48): no committed step lost by the survivors, recovery <= 3 step times plus
# start-up. Not a test: times depend on the machine and its load (printed first).
# Usage: bench/fault_tolerance.sh [ROUNDS]   (default 1; env REPLICAS PER_GROUP STEPS KILL_STEP
# KILL_RANK INTERVAL, defaults 2 2 30 15 <last rank> 10; about 2 minutes a round here)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${SPMDX_BUILD_DIR:-$repo/build}"
rounds="${1:-1}"
groups="${REPLICAS:-2}"; per_group="${PER_GROUP:-2}"; steps="${STEPS:-30}"; kill_step="${KILL_STEP:-15}"; interval="${INTERVAL:-10}"
nproc=$((groups * per_group))
kill_rank="${KILL_RANK:-$((nproc - 1))}"
out="$(mktemp -d)"
[ -n "${KEEP:-}" ] && echo "keeping $out" || trap 'rm -rf "$out"' EXIT
source "$repo/bench/lib.sh"  # machine

# run NAME [flags...]: one launch into $out/NAME (appending its log); prints "LAUNCH_TIME WALL_S EXIT".
run() {
  local name="$1"; shift
  local t0 t1 rc=0
  t0=$(date +%s.%N)
  "$build/bin/spmdx" run "$repo/configs/llama_debug.toml" --nproc "$nproc" --training.steps "$steps" \
    --parallelism.data_parallel_replicate_degree "$groups" --parallelism.data_parallel_shard_degree "$per_group" \
    --parallelism.tensor_parallel_degree 1 --checkpoint.enable true --checkpoint.interval "$interval" \
    --job.dump_folder "$out/$name" "$@" >> "$out/$name.log" 2>&1 || rc=$?
  t1=$(date +%s.%N)
  echo "$t0 $(python3 -c "print(f'{$t1 - $t0:.3f}')") $rc"
}
fail() { echo "bench/fault_tolerance.sh: $1; its log:" >&2; cat "$2" >&2; exit 1; }

machine
echo "job: llama debugmodel, $groups replica groups x $per_group ranks ($nproc ranks), $steps steps; rank $kill_rank killed at the start of step $kill_step; checkpoints every $interval steps"
for r in $(seq 1 "$rounds"); do
  read -r l wall rc < <(run "ft_clean$r" --fault_tolerance.enable true)
  [ "$rc" = 0 ] || fail "the clean fault-tolerant run exited $rc" "$out/ft_clean$r.log"
  echo "$l $wall" > "$out/ft_clean$r.t"
  read -r l wall rc < <(SPMDX_FAULT="kill:rank=$kill_rank,step=$kill_step" run "ft_killed$r" --fault_tolerance.enable true --max-restarts 1)
  [ "$rc" = 0 ] || fail "the fault-tolerant run with a kill exited $rc" "$out/ft_killed$r.log"
  echo "$l $wall" > "$out/ft_killed$r.t"
  read -r l wall rc < <(run "plain_clean$r")
  [ "$rc" = 0 ] || fail "the clean run exited $rc" "$out/plain_clean$r.log"
  echo "$l $wall" > "$out/plain_clean$r.t"
  read -r l wall rc < <(SPMDX_FAULT="kill:rank=$kill_rank,step=$kill_step" run "plain_killed$r")
  [ "$rc" != 0 ] || fail "the run without fault tolerance went on after a kill" "$out/plain_killed$r.log"
  read -r l2 wall2 rc < <(run "plain_killed$r")
  [ "$rc" = 0 ] || fail "the resumed run exited $rc" "$out/plain_killed$r.log"
  echo "$l $(python3 -c "print($wall + $wall2)") $l2" > "$out/plain_killed$r.t"
done

python3 - "$out" "$rounds" "$kill_step" "$kill_rank" "$per_group" <<'PY'
import json, statistics, sys
out, rounds, kill_step, kill_rank, per_group = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
lost_group = kill_rank // per_group

def rows(name):
    return [json.loads(line) for line in open(f"{out}/{name}/metrics.jsonl") if line.strip()]

def times(name):
    return open(f"{out}/{name}.t").read().split()

def start(row):  # when a step began
    return row["time"] - row["step_ms"] / 1000

table = {k: [] for k in ("ft", "plain")}
for r in range(1, rounds + 1):
    clean = {k: rows(f"{k}_clean{r}") for k in ("ft", "plain")}
    step_s = {k: statistics.median(x["step_ms"] for x in clean[k][1:]) / 1000 for k in clean}
    startup = {k: start(clean[k][0]) - float(times(f"{k}_clean{r}")[0]) for k in clean}
    wall_clean = {k: float(times(f"{k}_clean{r}")[1]) for k in clean}

    ft = rows(f"ft_killed{r}")
    assert [x["step"] for x in ft] == list(range(1, len(ft) + 1)), "fault tolerance: metrics.jsonl must hold every step once"
    killed_at = next(x["time"] for x in ft if x["step"] == kill_step - 1)
    back = next(x for x in ft if x["step"] >= kill_step and lost_group in x["replicas"])
    log = open(f"{out}/ft_killed{r}.log").read()
    dropped = log.count("dropped by every replica group")
    table["ft"].append(dict(recovery=start(back) - killed_at, startup=startup["ft"], step=step_s["ft"], redone=dropped,
                            lost=(float(times(f"ft_killed{r}")[1]) - wall_clean["ft"]) / step_s["ft"], back_at=back["step"],
                            away=sum(1 for x in ft if len(x["replicas"]) < max(len(y["replicas"]) for y in ft))))

    # The resumed run keeps the killed run's metrics.jsonl as metrics.1.jsonl and starts its own
    # with the rows up to the checkpoint it resumed from.
    first = [json.loads(line) for line in open(f"{out}/plain_killed{r}/metrics.1.jsonl") if line.strip()]
    second = [x for x in rows(f"plain_killed{r}") if x["time"] > first[-1]["time"]]
    killed_at = next(x["time"] for x in first if x["step"] == kill_step - 1)
    table["plain"].append(dict(recovery=start(second[0]) - killed_at, startup=startup["plain"], step=step_s["plain"],
                               redone=first[-1]["step"] - (second[0]["step"] - 1),
                               lost=(float(times(f"plain_killed{r}")[1]) - wall_clean["plain"]) / step_s["plain"], back_at=second[0]["step"], away=0))

print(f"{'round':>5} {'':<22} {'recovery (s)':>12} {'start-up (s)':>12} {'step (s)':>9} {'= steps':>8} {'redone':>7} {'lost (steps)':>12}")
for k, label in (("ft", "fault tolerance"), ("plain", "stop, resume at ckpt")):
    for r, x in enumerate(table[k], 1):
        over = (x["recovery"] - x["startup"]) / x["step"]
        print(f"{r:>5} {label:<22} {x['recovery']:12.2f} {x['startup']:12.2f} {x['step']:9.3f} {over:+8.1f} {x['redone']:7d} {x['lost']:12.1f}")
med = lambda k, f: statistics.median(x[f] for x in table[k])
for k, label in (("ft", "fault tolerance"), ("plain", "stop, resume at ckpt")):
    over = (med(k, "recovery") - med(k, "startup")) / med(k, "step")
    print(f"median {label:<21} recovery {med(k, 'recovery'):.2f} s = start-up {med(k, 'startup'):.2f} s {over:+.1f} step times; "
          f"steps redone by the survivors {med(k, 'redone'):g}; wall time lost {med(k, 'lost'):.1f} step times")
x = table["ft"][-1]
print(f"fault tolerance, last round: the survivors never stopped; group {lost_group} was away for {x['away']} committed step(s) and trained again from step {x['back_at']}")
PY
