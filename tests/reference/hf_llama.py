#!/usr/bin/env python3
"""Weights in and out of spmdx through Hugging Face's Llama layout, checked by a plain PyTorch
Llama (no transformers) written as Hugging Face's modeling_llama.py computes it: half-split
rotary embedding (rotate_half) with the "llama3" frequency scaling, RMSNorm, SwiGLU, tied to
nothing.

1. spmdx trains the job for --steps steps (its own mesh, e.g. fsdp x tp on 4 ranks) and saves
   a checkpoint; `spmdx export --names hf` writes it with Hugging Face's names and rotary rows.
2. That file goes back into spmdx as checkpoint.initial_load_path on another mesh (--load-nproc
   ranks) for one step, which reports the loss of those weights on its first batch
   (debug.dump_batches keeps the batch).
3. PyTorch loads the file with the safetensors package into the model below and computes the
   loss of that batch in float64.

Exits 1 when spmdx's loss and PyTorch's differ by more than --tolerance relative, or when the
file lacks a Hugging Face name. A wrong permutation of the query and key rows changes the loss
by 3.8e-4 on llama_debug after 3 steps (--perturb no_permute checks that the comparison catches it);
measured agreement: 1.9e-9.

    hf_llama.py --spmdx build/bin/spmdx --config configs/llama_debug.toml [-- spmdx run options]
"""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

# Each spmdx llama flavor as a Hugging Face LlamaConfig would give it (heads; the rest is read
# off the weights' shapes). rope_scaling is Llama 3.1's, as spmdx's and torchtitan's default.
HEADS = {"debugmodel": 16, "tiny": 4, "large": 16}
ROPE = dict(rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
RMS_NORM_EPS = 1e-5


def llama3_inv_freq(head_dim, r):
    # transformers' _compute_llama3_parameters.
    inv_freq = 1.0 / (r["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    low_freq_wavelen = r["original_max_position_embeddings"] / r["low_freq_factor"]
    high_freq_wavelen = r["original_max_position_embeddings"] / r["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / r["factor"], inv_freq)
    smooth = (r["original_max_position_embeddings"] / wavelen - r["low_freq_factor"]) / (r["high_freq_factor"] - r["low_freq_factor"])
    smoothed = (1 - smooth) * inv_freq_llama / r["factor"] + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rms_norm(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_NORM_EPS))


def hf_llama_loss(w, n_heads, tokens, labels):
    """Hugging Face LlamaForCausalLM's forward on `w` (its state dict), mean cross entropy."""
    bs, seq = tokens.shape
    dim = w["model.embed_tokens.weight"].shape[1]
    hd = dim // n_heads
    n_layers = 1 + max(int(k.split(".")[2]) for k in w if k.startswith("model.layers."))
    freqs = torch.outer(torch.arange(seq, dtype=torch.float64), llama3_inv_freq(hd, ROPE))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[None, None], emb.sin()[None, None]
    h = w["model.embed_tokens.weight"][tokens]
    for l in range(n_layers):
        p = f"model.layers.{l}."
        x = rms_norm(h, w[p + "input_layernorm.weight"])
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(bs, seq, n_heads, hd).transpose(1, 2)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).view(bs, seq, n_heads, hd).transpose(1, 2)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(bs, seq, n_heads, hd).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(bs, seq, dim)
        h = h + o @ w[p + "self_attn.o_proj.weight"].T
        y = rms_norm(h, w[p + "post_attention_layernorm.weight"])
        h = h + (F.silu(y @ w[p + "mlp.gate_proj.weight"].T) * (y @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    logits = rms_norm(h, w["model.norm.weight"]) @ w["lm_head.weight"].T
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"failed ({' '.join(cmd)}):\n{r.stdout}{r.stderr}")
    return r.stdout


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spmdx", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--steps", type=int, default=3, help="steps spmdx trains before exporting (so the weights are not the seeded ones)")
    ap.add_argument("--load-nproc", type=int, default=2, help="ranks of the run that loads the file back (data-parallel shards)")
    ap.add_argument("--tolerance", type=float, default=1e-5)
    ap.add_argument("--perturb", choices=["none", "no_permute"], default="none",
                    help="no_permute: undo the export's rotary row permutation before PyTorch reads the file, as an export without it "
                    "would write: the comparison must fail")
    ap.add_argument("run", nargs="*", help="more `spmdx run` options for the training run (after --), e.g. --nproc 4")
    args = ap.parse_args()

    dump = tempfile.mkdtemp(prefix="spmdx-hf-")
    try:
        train = [args.spmdx, "run", args.config, "--training.steps", str(args.steps), "--job.dump_folder", os.path.join(dump, "train"),
                 "--checkpoint.enable", "true", "--checkpoint.interval", str(args.steps)] + args.run
        cfg = tomllib.loads(run(train + ["--print-config"]))
        assert cfg["model"]["name"] == "llama", "Hugging Face's layout is Llama's"
        run(train)
        hf = os.path.join(dump, "hf.safetensors")
        print(run([args.spmdx, "export", os.path.join(dump, "train", "checkpoint", f"step-{args.steps}"), hf, "--names", "hf"]).strip())

        load = os.path.join(dump, "load")
        out = run([args.spmdx, "run", args.config, "--nproc", str(args.load_nproc), "--parallelism.data_parallel_shard_degree", str(args.load_nproc),
                   "--parallelism.tensor_parallel_degree", "1", "--parallelism.data_parallel_replicate_degree", "1", "--training.steps", "1",
                   "--job.dump_folder", load, "--debug.dump_batches", "true", "--checkpoint.initial_load_path", hf])
        print(next(line for line in out.splitlines() if "initial weights" in line))
        spmdx_loss = json.loads(open(os.path.join(load, "metrics.jsonl")).readline())["loss"]

        w = {k: t.double() for k, t in load_file(hf).items()}
        n_heads = HEADS[cfg["model"]["flavor"]]
        if args.perturb == "no_permute":
            for k in w:
                if k.endswith(("q_proj.weight", "k_proj.weight")):
                    rows, cols = w[k].shape
                    w[k] = w[k].view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)
        tokens = torch.from_numpy(np.load(os.path.join(load, "debug", "batches", "step-1.tokens.npy")))
        labels = torch.from_numpy(np.load(os.path.join(load, "debug", "batches", "step-1.labels.npy")))
        with torch.no_grad():
            torch_loss = hf_llama_loss(w, n_heads, tokens, labels).item()
    finally:
        shutil.rmtree(dump, ignore_errors=True)
    rel = abs(spmdx_loss - torch_loss) / abs(torch_loss)
    print(f"loss of the exported weights on one batch: spmdx {spmdx_loss:.7f} (loaded on {args.load_nproc} ranks), "
          f"PyTorch Hugging Face layout {torch_loss:.7f} (float64); relative difference {rel:.1e} (tolerance {args.tolerance:.0e})")
    if rel > args.tolerance:
        sys.exit(f"spmdx and the PyTorch Llama differ past {args.tolerance:.0e}: {rel:.2e} relative")


if __name__ == "__main__":
    main()
