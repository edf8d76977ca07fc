#!/usr/bin/env bash
# Importing torch.export programs: what `spmdx import` costs and what an imported model's step
# costs, each against a peer measured in the same run.
#
#   bench/import.sh [--layers 32] [--dim 1024] [--ffn 2816] [--heads 16] [--kv-heads 4]
#
# 1. `spmdx import` of a torchtitan-style Llama export with zero weights (the given size):
#    wall time and peak RSS, as a ratio to the weights' bytes; the same for a tiny export (the
#    process's own footprint, LibTorch included) is printed beside it.
# 2. One-rank step of the imported torchtitan-style Llama vs the built-in `llama debugmodel` of
#    the same shape (bench_import_step): ratio built-in / imported (goal >= 0.95).
# 3. The same for transformers' own LlamaForCausalLM (the pinned `transformers` package) as its
#    users export it: default attention (sdpa, under the boolean mask transformers builds),
#    config defaults, wrapped to return the logits (examples/export/transformers_qwen3.py's
#    LogitsOnly), exported by examples/export/common.py, in the shape of llama debugmodel.
# 4. Sliding-window attention at seq 2048, window 256 (the tiled kernel) vs full causal
#    attention (ATen's fused kernel), forward and backward (bench_attention): ratio window /
#    causal (goal <= 0.25).
# 5. One-rank step of the built-in llama debugmodel on the main job's documents
#    (configs/llama_debug.toml's data) with model.attn_mask_type = "block_causal" vs "causal":
#    median step_ms of each, runs alternated, ratio block_causal / causal.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=bench/lib.sh
source "$repo/bench/lib.sh"
machine
py="${SPMDX_VENV:-$repo/.venv}/bin/python"
spmdx="$repo/build/bin/spmdx"
layers=32 dim=1024 ffn=2816 heads=16 kv=4
while [ $# -gt 0 ]; do
  case "$1" in
    --layers) layers=$2; shift 2 ;; --dim) dim=$2; shift 2 ;; --ffn) ffn=$2; shift 2 ;;
    --heads) heads=$2; shift 2 ;; --kv-heads) kv=$2; shift 2 ;;
    *) echo "usage: $0 [--layers N] [--dim N] [--ffn N] [--heads N] [--kv-heads N]" >&2; exit 2 ;;
  esac
done
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export_llama() {  # folder, then size flags
  local out=$1; shift
  "$py" "$repo/examples/export/torchtitan_llama.py" --out "$out" "$@" >/dev/null
}
export_transformers_llama() {  # folder: LlamaForCausalLM in llama debugmodel's shape, batch 2 x 256
  "$py" - "$1" "$repo/examples/export" <<'EOF' >/dev/null
import sys
out, examples = sys.argv[1], sys.argv[2]
sys.path.insert(0, examples)
import transformers
from common import main
from transformers_qwen3 import LogitsOnly

config = transformers.LlamaConfig(vocab_size=264, hidden_size=256, num_hidden_layers=6, num_attention_heads=16, num_key_value_heads=16,
                                  intermediate_size=768, bos_token_id=256, eos_token_id=257)
sys.argv = [sys.argv[0], "--out", out]
main("transformers_llama", lambda: LogitsOnly(transformers.LlamaForCausalLM(config)).eval(), False, 2, 256, 264)
EOF
}
peak() {  # wall seconds and max RSS KiB of a command
  /usr/bin/time -f "%e %M" "$@" 2>&1 >/dev/null | tail -1
}

echo "== spmdx import: $layers layers, dim $dim, ffn $ffn, $heads heads ($kv KV), zero weights"
export_llama "$work/big" --layers "$layers" --dim "$dim" --ffn "$ffn" --heads "$heads" --kv-heads "$kv" --batch 1 --seq 64 --zeros
export_llama "$work/tiny"
weights=$("$spmdx" import --json "$work/big/torchtitan_llama.pt2" | "$py" -c 'import json,sys; print(json.load(sys.stdin)["parameter_bytes"])')
read -r t_big rss_big < <(peak "$spmdx" import "$work/big/torchtitan_llama.pt2")
read -r t_tiny rss_tiny < <(peak "$spmdx" import "$work/tiny/torchtitan_llama.pt2")
awk -v w="$weights" -v t="$t_big" -v r="$rss_big" -v rt="$rss_tiny" -v tt="$t_tiny" 'BEGIN {
  printf "weights %.1f MiB: import %.2f s, peak RSS %.1f MiB = %.2fx the weights (goal <= 1.2x); over a tiny export'"'"'s %.1f MiB (%.2f s): %.2fx\n",
    w / 1048576, t, r / 1024, r * 1024 / w, rt / 1024, tt, (r - rt) * 1024 / w }'

echo "== one-rank step: imported torchtitan-style Llama vs built-in llama debugmodel (same shape)"
export_llama "$work/debug" --layers 6 --dim 256 --ffn 768 --heads 16 --kv-heads 16 --batch 2 --seq 256
"$repo/build/bin/bench_import_step" "$work/debug/torchtitan_llama.pt2" --flavor debugmodel --steps 20

echo "== one-rank step: imported transformers LlamaForCausalLM (sdpa export) vs built-in llama debugmodel (same shape)"
export_transformers_llama "$work/hf"
"$repo/build/bin/bench_import_step" "$work/hf/transformers_llama.pt2" --flavor debugmodel --steps 20
echo "== sliding-window attention (seq 2048, window 256) vs full causal attention"
"$repo/build/bin/bench_attention" --seq 2048 --window 256

echo "== one-rank step of llama debugmodel on configs/llama_debug.toml's documents: block_causal vs causal"
step_ms() {  # mask, round: the median step_ms after the first 2 steps
  local out="$work/mask-$1-$2"
  "$spmdx" run "$repo/configs/llama_debug.toml" --nproc 1 --parallelism.data_parallel_shard_degree 1 --parallelism.tensor_parallel_degree 1 \
    --training.steps 12 --model.attn_mask_type "$1" --job.dump_folder "$out" >/dev/null
  "$py" -c 'import json, statistics, sys; r = [json.loads(l) for l in open(sys.argv[1]) if "step_ms" in l]; print(statistics.median(x["step_ms"] for x in r[2:]))' "$out/metrics.jsonl"
}
causal_ms=() block_ms=()
for round in 1 2; do
  causal_ms+=("$(step_ms causal "$round")")
  block_ms+=("$(step_ms block_causal "$round")")
done
c=$(echo "${causal_ms[*]}" | median 1) b=$(echo "${block_ms[*]}" | median 1)
awk -v c="$c" -v b="$b" 'BEGIN { printf "step: causal %.1f ms, block_causal %.1f ms: block_causal / causal = %.3f\n", c, b, b / c }'
