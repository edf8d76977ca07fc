#!/usr/bin/env python3
"""An independent float64 Llama 3 in plain PyTorch, written from torchtitan's llama3 model and
training loop (torchtitan/models/llama3/model/model.py, train.py; the learning-rate schedule is
torchtitan v0.2.2's components/lr_scheduler.py, transcribed in torchtitan_lr.py beside this file),
checked against spmdx step by step.

It runs `spmdx run` with --debug.dump_initial_weights, --debug.dump_batches and a checkpoint
every step, then trains the same model from spmdx's initial weights on spmdx's batches in
float64, and compares per step, relative to the reference: the loss and the gradient norm
(spmdx's metrics.jsonl), |spmdx - reference| / |reference|, the learning rate each step ran
with (metrics.jsonl's lr against LambdaLR's get_last_lr()), and every parameter (spmdx's
checkpoint, exported with `spmdx export`), ||spmdx - reference|| / ||reference|| per tensor.
Tensors compare by norm because, per element, AdamW's first steps divide gradients of about
1e-10 by eps = 1e-8, so a few elements carry float32's rounding of such gradients (1e-3 of
them). Exits 1 naming the first quantity past --tolerance. Measured here: 9.4e-7 on one rank,
4.4e-7 on fsdp x tp 2 x 2; --perturb plants a bug in the reference (norm eps 1e-6 for 1e-5,
no RoPE scaling, no weight decay on norms) and each then differs by 1.3e-5 to 1.2e-3.

The model's shape comes from torchtitan's flavor table below, not from spmdx; the training
settings (lr, betas, schedule, clipping) from the job's config as spmdx prints it. Nothing is
shared with spmdx's own code or with bench/peers/.

    llama3_reference.py --spmdx build/bin/spmdx --config configs/llama_debug.toml --steps 10 [-- spmdx run options]

With --fault-tolerance (spmdx run with fault_tolerance.enable and SPMDX_FAULT killing ranks):
each step trains on the rows of the replica groups metrics.jsonl says trained it ("replicas":
group g holds rows [g B/R, (g+1) B/R) of the global batch of B rows, R groups: dp_replicate is
the mesh's outermost dim), as torchft's replica groups each read their own part of the batch and
a missing group's part is not trained; parameters compare at every step spmdx checkpointed (the
live groups save for a group away too).
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torchtitan_lr import build_lr_lambda  # noqa: E402  torchtitan v0.2.2's schedule
from safetensors_io import read_safetensors  # noqa: E402

torch.set_default_dtype(torch.float64)
PERTURB_NORM_IN_BF16 = False  # --perturb norm_in_bf16

# torchtitan's llama3 flavors (TransformerModelArgs), and spmdx's own `tiny`.
FLAVORS = {
    "debugmodel": dict(dim=256, n_layers=6, n_heads=16, multiple_of=256, ffn_dim_multiplier=None, rope_theta=500000, norm_eps=1e-5),
    "tiny": dict(dim=64, n_layers=2, n_heads=4, ffn_hidden=192, rope_theta=500000, norm_eps=1e-5),
}
# torchtitan's RoPEScalingArgs() defaults (Llama 3.1), applied by precompute_freqs_cis.
ROPE_SCALING = dict(scaling_factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


def ffn_hidden(a):
    if "ffn_hidden" in a:
        return a["ffn_hidden"]
    hidden = int(2 * 4 * a["dim"] / 3)
    if a["ffn_dim_multiplier"] is not None:
        hidden = int(a["ffn_dim_multiplier"] * hidden)
    return a["multiple_of"] * ((hidden + a["multiple_of"] - 1) // a["multiple_of"])


def apply_scaling(freqs, s):
    low_freq_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_freq_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
    wavelen = 2 * torch.pi / freqs
    new_freqs = torch.where(wavelen > low_freq_wavelen, freqs / s["scaling_factor"], freqs)
    smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
    return torch.where(
        (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen),
        (1 - smooth) * new_freqs / s["scaling_factor"] + smooth * new_freqs,
        new_freqs,
    )


def precompute_freqs_cis(dim, end, theta):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].double() / dim))
    freqs = apply_scaling(freqs, ROPE_SCALING)
    freqs = torch.outer(torch.arange(end).double(), freqs)
    return torch.polar(torch.ones_like(freqs), freqs)  # complex128


def apply_rotary_emb(xq, xk, freqs_cis):
    # torchtitan's: in float (complex64 at least), the result cast back to xq's dtype.
    xq_ = torch.view_as_complex(xq.double().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.double().reshape(*xk.shape[:-1], -1, 2))
    f = freqs_cis[: xq.shape[1]].view(1, xq.shape[1], 1, xq_.shape[-1])
    return torch.view_as_real(xq_ * f).flatten(3).type_as(xq), torch.view_as_real(xk_ * f).flatten(3).type_as(xk)


def rms_norm(x, w, eps):
    if x.dtype == torch.bfloat16 and not PERTURB_NORM_IN_BF16:  # torchtitan's RMSNorm: normalise x.float(), then type_as(x)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * w
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def forward(p, a, tokens, freqs_cis):
    bs, seqlen = tokens.shape
    hd = a["dim"] // a["n_heads"]
    h = p["tok_embeddings.weight"][tokens]
    for l in range(a["n_layers"]):
        q = f"layers.{l}."
        x = rms_norm(h, p[q + "attention_norm.weight"], a["norm_eps"])
        xq = (x @ p[q + "attention.wq.weight"].T).view(bs, seqlen, -1, hd)
        xk = (x @ p[q + "attention.wk.weight"].T).view(bs, seqlen, -1, hd)
        xv = (x @ p[q + "attention.wv.weight"].T).view(bs, seqlen, -1, hd)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        o = F.scaled_dot_product_attention(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), is_causal=True)
        h = h + o.transpose(1, 2).contiguous().view(bs, seqlen, -1) @ p[q + "attention.wo.weight"].T
        y = rms_norm(h, p[q + "ffn_norm.weight"], a["norm_eps"])
        h = h + (F.silu(y @ p[q + "feed_forward.w1.weight"].T) * (y @ p[q + "feed_forward.w3.weight"].T)) @ p[q + "feed_forward.w2.weight"].T
    h = rms_norm(h, p["norm.weight"], a["norm_eps"])
    return h @ p["output.weight"].T


def rel(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spmdx", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--tolerance", type=float, default=2e-6)
    ap.add_argument("--dump", help="spmdx's dump folder (default: a temporary one)")
    ap.add_argument("--table", help="also write the per-step comparison here, as JSON")
    ap.add_argument("--perturb", choices=["none", "norm_eps", "rope_scaling", "norm_decay", "norm_in_bf16", "lr_before_1284"], default="none",
                    help="change the reference as a bug in spmdx would (norm eps 1e-6, no RoPE scaling, no weight decay on norms, "
                    "norms computed in bfloat16 under --mixed-precision): the comparison must fail")
    ap.add_argument("--mixed-precision", choices=["none", "bfloat16", "autocast"], default="none",
                    help="bfloat16: as FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) under torchtitan: float32 "
                    "master weights and AdamW, the forward and backward on bfloat16 copies of the weights, norms and the loss in float32; "
                    "autocast: the float32 model's forward under torch.autocast('cpu', dtype=torch.bfloat16) instead (PyTorch's own "
                    "op lists decide what runs in bfloat16). spmdx runs with --training.mixed_precision_param bfloat16 for both")
    ap.add_argument("--first-loss-tolerance", type=float, default=1e-6,
                    help="under --mixed-precision, the first step's loss (same weights, same batch: only where the casts are can differ) "
                    "must agree this closely (at least 1e-5 where spmdx says its bfloat16 GEMMs are upcast to float32: a CPU without "
                    "bfloat16 instructions); later steps carry bfloat16's rounding and are held to --tolerance")
    ap.add_argument("--fault-tolerance", action="store_true",
                    help="train each step on the rows of the replica groups metrics.jsonl lists as live for it (see above)")
    ap.add_argument("run", nargs="*", help="more `spmdx run` options (after --), e.g. --nproc 4 --parallelism.tensor_parallel_degree 2")
    args = ap.parse_args()

    dump = args.dump or tempfile.mkdtemp(prefix="spmdx-reference-")
    run = [args.spmdx, "run", args.config, "--training.steps", str(args.steps), "--job.dump_folder", dump, "--debug.dump_batches", "true",
           "--debug.dump_initial_weights", "true", "--checkpoint.enable", "true", "--checkpoint.interval", "1"] + args.run
    mixed = args.mixed_precision != "none"
    autocast = args.mixed_precision == "autocast"
    if mixed:
        run += ["--training.mixed_precision_param", "bfloat16"]
    if "--nproc" not in args.run:
        run += ["--nproc", "1"]
    cfg = tomllib.loads(subprocess.run(run + ["--print-config"], check=True, capture_output=True, text=True).stdout)
    r = subprocess.run(run, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"spmdx run failed ({' '.join(run)}):\n{r.stdout}{r.stderr}")
    metrics = [json.loads(line) for line in open(os.path.join(dump, "metrics.jsonl"))]

    a = dict(FLAVORS[cfg["model"]["flavor"]])
    if args.perturb == "norm_eps":
        a["norm_eps"] = 1e-6
    if args.perturb == "norm_in_bf16":
        global PERTURB_NORM_IN_BF16
        PERTURB_NORM_IN_BF16 = True
    if args.perturb == "rope_scaling":
        ROPE_SCALING["scaling_factor"] = 1.0
    assert cfg["model"]["name"] == "llama", "the reference is Llama 3"
    init = read_safetensors(os.path.join(dump, "debug", "initial.safetensors"))
    names = [n for n in init if not n.startswith("rope.")]  # the rope tables are spmdx's: the reference makes its own
    p = {n: torch.tensor(init[n], dtype=torch.float32 if mixed else torch.float64, requires_grad=True) for n in names}
    a["vocab_size"] = p["tok_embeddings.weight"].shape[0]
    assert p["layers.0.feed_forward.w1.weight"].shape[0] == ffn_hidden(a), "spmdx's FFN size is not torchtitan's"
    seq_len = cfg["training"]["seq_len"]
    freqs_cis = precompute_freqs_cis(a["dim"] // a["n_heads"], seq_len, a["rope_theta"])

    o = cfg["optimizer"]
    decayed = [t for n, t in p.items() if not (args.perturb == "norm_decay" and n.endswith("norm.weight"))]
    groups = [{"params": decayed}]
    if len(decayed) < len(p):
        groups.append({"params": [t for n, t in p.items() if n.endswith("norm.weight")], "weight_decay": 0.0})
    opt = torch.optim.AdamW(groups, lr=o["lr"], betas=(o["beta1"], o["beta2"]), eps=o["eps"], weight_decay=o["weight_decay"])
    s = cfg["lr_scheduler"]
    lr_of = None
    if args.perturb == "lr_before_1284":  # torchtitan's schedule before its PR #1284 (no virtual stable step: the last step's lr is 0)
        assert s["decay_ratio"] == -1 and s["decay_type"] == "linear" and s["min_lr_factor"] == 0, "lr_before_1284 plants the plain linear decay"
        w, d = s["warmup_steps"], args.steps - s["warmup_steps"]
        lr_of = lambda c: (c + 1) / w if c < w else 1 - (c + 1 - w) / d  # noqa: E731
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lr_of or build_lr_lambda(args.steps, s["warmup_steps"], None if s["decay_ratio"] == -1 else s["decay_ratio"], s["decay_type"], s["min_lr_factor"],
                             None if s.get("total_steps", -1) == -1 else s["total_steps"]))
    rows, worst = [], (0.0, "")
    assert len(metrics) == args.steps and [m["step"] for m in metrics] == list(range(1, args.steps + 1)), "metrics.jsonl must hold every step once"
    replicas = cfg["parallelism"]["data_parallel_replicate_degree"]
    if args.fault_tolerance:
        assert any(len(m["replicas"]) < replicas for m in metrics), "--fault-tolerance: no step ran with a group away (did SPMDX_FAULT kill a rank?)"
    for step in range(1, args.steps + 1):
        tokens = torch.from_numpy(np.load(os.path.join(dump, "debug", "batches", f"step-{step}.tokens.npy")))
        labels = torch.from_numpy(np.load(os.path.join(dump, "debug", "batches", f"step-{step}.labels.npy")))
        if args.fault_tolerance:
            live = metrics[step - 1]["replicas"]
            per = tokens.shape[0] // replicas
            keep = torch.cat([torch.arange(g * per, (g + 1) * per) for g in live])
            tokens, labels = tokens[keep], labels[keep]
        opt.zero_grad()
        lr = schedule.get_last_lr()[0]
        if autocast:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = forward(p, a, tokens, freqs_cis)
        else:
            logits = forward({n: t.to(torch.bfloat16) for n, t in p.items()} if mixed else p, a, tokens, freqs_cis)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(list(p.values()), cfg["training"]["max_norm"], foreach=True)
        opt.step()
        schedule.step()
        m = metrics[step - 1]
        saved = os.path.join(dump, "checkpoint", f"step-{step}")
        if args.fault_tolerance and not os.path.isdir(saved):  # a save the job did not make (checkpoint.interval)
            print(f"step {step:3d}  loss {m['loss']:.6f} ref {loss.item():.6f}  replicas {m['replicas']}  (no checkpoint: a group was away)")
            for what, v in (("loss", abs(m["loss"] - loss.item()) / abs(loss.item())), ("grad_norm", abs(m["grad_norm"] - grad_norm.item()) / abs(grad_norm.item()))):
                if v > worst[0]:
                    worst = (v, f"step {step}: {what}")
            continue
        exported = os.path.join(dump, f"step-{step}.safetensors")
        subprocess.run([args.spmdx, "export", saved, exported], check=True, capture_output=True)
        got = read_safetensors(exported)
        row = {"step": step, "loss": m["loss"], "reference_loss": loss.item(), "loss_rel": abs(m["loss"] - loss.item()) / abs(loss.item()),
               "grad_norm_rel": abs(m["grad_norm"] - grad_norm.item()) / abs(grad_norm.item()),
               "lr_rel": abs(m["lr"] - lr) / max(abs(lr), 1e-300)}
        param_rel = {n: rel(got[n], p[n].detach().numpy()) for n in names}
        row["param_rel_max"] = max(param_rel.values())
        row["param_rel_max_of"] = max(param_rel, key=param_rel.get)
        rows.append(row)
        print(f"step {step:3d}  loss {m['loss']:.6f} ref {loss.item():.6f}  rel: loss {row['loss_rel']:.1e}  grad_norm {row['grad_norm_rel']:.1e}  "
              f"params {row['param_rel_max']:.1e} ({row['param_rel_max_of']})")
        for what, v in (("loss", row["loss_rel"]), ("grad_norm", row["grad_norm_rel"]), ("lr", row["lr_rel"]), (row["param_rel_max_of"], row["param_rel_max"])):
            if v > worst[0]:
                worst = (v, f"step {step}: {what}")
    if not args.dump:
        shutil.rmtree(dump, ignore_errors=True)
    if args.table:
        with open(args.table, "w") as f:
            json.dump(rows, f, indent=1)
    first_tolerance = args.first_loss_tolerance
    if mixed and "bfloat16 GEMMs upcast to float32" in r.stdout and first_tolerance < 1e-5:
        # A CPU without bfloat16 dot products (spmdx's banner says so): spmdx's linears and
        # attention run float32 kernels on the upcast operands and round once, PyTorch's its
        # bfloat16 kernels (also float32 sums, another order): a few outputs a bfloat16 ulp apart.
        # Measured with SPMDX_HALF_GEMM=upcast on llama debugmodel: 1.4e-6.
        first_tolerance = 1e-5
        print(f"first loss held to {first_tolerance:.0e}: spmdx's bfloat16 GEMMs are upcast to float32 on this CPU")
    if mixed and rows[0]["loss_rel"] > first_tolerance:
        sys.exit(f"spmdx differs from the {args.mixed_precision} reference past {first_tolerance:.0e}: step 1: loss is off by {rows[0]['loss_rel']:.2e} relative")
    print(f"largest relative difference {worst[0]:.2e} at {worst[1]} (tolerance {args.tolerance:.0e})")
    if worst[0] > args.tolerance:
        sys.exit(f"spmdx differs from the float64 reference past {args.tolerance:.0e}: {worst[1]} is off by {worst[0]:.2e} relative")


if __name__ == "__main__":
    main()
