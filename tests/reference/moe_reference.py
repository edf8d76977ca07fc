#!/usr/bin/env python3
"""An independent float64 Mixture-of-Experts model (Qwen3-MoE and DeepSeek-V3 shapes) in plain
PyTorch, written from torchtitan's MoE and its models (torchtitan/models/moe/moe.py at tag v0.2.2:
TokenChoiceTopKRouter with node-limited routing, TokenReorderer, GroupedExperts' for-loop path,
MoE.forward; the auxiliary-loss-free load balancing of components/optimizer.py's
build_optimizers_with_moe_load_balancing, an optimizer step pre-hook; models/qwen3/model/model.py
for the q/k norms and the cos/sin RoPE; models/deepseek_v3 for the dense first layers and the
interleaved complex RoPE; the learning-rate schedule is torchtitan v0.2.2's, transcribed in
torchtitan_lr.py beside this file), checked against spmdx step by step.

It runs `spmdx run` with --debug.dump_initial_weights, --debug.dump_batches and a checkpoint
every step, then trains the same model from spmdx's initial weights on spmdx's batches in
float64, and compares per step, relative to the reference: the loss and the gradient norm
(spmdx's metrics.jsonl), |spmdx - reference| / |reference|, the learning rate each step ran
with (metrics.jsonl's lr against LambdaLR's get_last_lr()), every parameter (spmdx's
checkpoint, exported with `spmdx export`), ||spmdx - reference|| / ||reference|| per tensor,
and every MoE layer's load-balancing buffer layers.L.moe.expert_bias by its largest absolute
difference (it starts at 0, so a relative one means nothing at step 0; it moves by
load_balance_coeff = 1e-3 steps). Exits 1 naming the first step's quantity past --tolerance.
Not yet measured against spmdx (written before its MoE ran): a throwaway stand-in for spmdx that
wrote this model's own float32-rounded outputs in those files agreed to 4e-8, and failed under each
--perturb.

Routing is discrete: a token whose k-th and (k+1)-th expert scores (or whose last chosen and
first dropped expert group) lie closer than float32's rounding can pick another expert in spmdx
than here, and that one choice moves the parameters by far more than the tolerance. Each step
prints the reference's smallest such margin over all tokens and MoE layers, so a failure at a
step whose margin is ~1e-7 or less reads as a near-tie, not as a bug.

--perturb plants a bug in the reference that the comparison must catch: no_route_norm (the top-k
scores not renormalised to sum 1), score_before_experts (the scores applied to the experts'
input, not their output), no_bias_update (the load-balancing pre-hook skipped: expert_bias stays
0), no_group_limit (deepseek_v3 only: plain top-k over all experts, not over the
num_limited_groups best groups). --self-check needs no spmdx: it checks the MoE layer (forward
and gradients) against a per-token computation, the bias update, RoPE and GQA, and trains each
flavor from random weights with and without each perturbation to show how far each moves it.

The model's shape comes from the flavor table below, not from spmdx (spmdx's tensors are checked
against it); the training settings (lr, betas, schedule, clipping) from the job's config as spmdx
prints it. Nothing is shared with spmdx's own code or with bench/peers/.

    moe_reference.py --spmdx build/bin/spmdx --config CONFIG.toml --steps 10 [-- spmdx run options]
    moe_reference.py --self-check
"""
import argparse
import json
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
from safetensors_io import read_safetensors, write_safetensors  # noqa: E402

torch.set_default_dtype(torch.float64)

# [model] name -> flavor -> shape. rope: "cos_sin" is Qwen3's (HF's rotate_half on [seq, head_dim]
# tables), "complex" is Llama's / DeepSeek-V3's interleaved pairs; neither is scaled. Layers below
# n_dense_layers have a dense SwiGLU of ffn_hidden; the rest are MoE layers (moe: torchtitan's MoEArgs).
FLAVORS = {
    "qwen3": {
        "tiny_moe": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, qk_norm=True, norm_eps=1e-6,
                         rope="cos_sin", rope_theta=1e6, n_dense_layers=0, ffn_hidden=None,
                         moe=dict(num_experts=8, top_k=2, hidden_dim=32, num_shared_experts=0, score_func="softmax",
                                  route_norm=True, route_scale=1.0, score_before_experts=False, num_expert_groups=None,
                                  num_limited_groups=None, load_balance_coeff=1e-3)),
    },
    "deepseek_v3": {
        # plain multi-head attention of head_dim 16 in place of MLA
        "tiny_moe": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=16, qk_norm=False, norm_eps=1e-5,
                         rope="complex", rope_theta=10000.0, n_dense_layers=1, ffn_hidden=128,
                         moe=dict(num_experts=8, top_k=2, hidden_dim=32, num_shared_experts=1, score_func="sigmoid",
                                  route_norm=True, route_scale=2.5, score_before_experts=False, num_expert_groups=4,
                                  num_limited_groups=2, load_balance_coeff=1e-3)),
    },
}
PERTURBATIONS = ["none", "no_route_norm", "score_before_experts", "no_bias_update", "no_group_limit"]
# spmdx's own tables and buffers that the reference makes itself or has no use for.
IGNORED = ("rope.", "freqs_cis", "rope_cache")


def moe_layers(a):
    return list(range(a["n_dense_layers"], a["n_layers"]))


def param_shapes(a, vocab):
    """Every parameter's torchtitan FQN and shape ([out, in] as nn.Linear)."""
    d, hd, m = a["dim"], a["head_dim"], a["moe"]
    s = {"tok_embeddings.weight": (vocab, d), "norm.weight": (d,), "output.weight": (vocab, d)}
    for l in range(a["n_layers"]):
        q = f"layers.{l}."
        s[q + "attention_norm.weight"] = s[q + "ffn_norm.weight"] = (d,)
        s[q + "attention.wq.weight"] = (a["n_heads"] * hd, d)
        s[q + "attention.wk.weight"] = s[q + "attention.wv.weight"] = (a["n_kv_heads"] * hd, d)
        s[q + "attention.wo.weight"] = (d, a["n_heads"] * hd)
        if a["qk_norm"]:
            s[q + "attention.q_norm.weight"] = s[q + "attention.k_norm.weight"] = (hd,)
        if l < a["n_dense_layers"]:
            h = a["ffn_hidden"]
            s[q + "feed_forward.w1.weight"] = s[q + "feed_forward.w3.weight"] = (h, d)
            s[q + "feed_forward.w2.weight"] = (d, h)
        else:
            E, h = m["num_experts"], m["hidden_dim"]
            s[q + "moe.router.gate.weight"] = (E, d)
            s[q + "moe.experts.w1"] = s[q + "moe.experts.w3"] = (E, h, d)
            s[q + "moe.experts.w2"] = (E, d, h)
            if m["num_shared_experts"]:
                hs = h * m["num_shared_experts"]
                s[q + "moe.shared_experts.w1.weight"] = s[q + "moe.shared_experts.w3.weight"] = (hs, d)
                s[q + "moe.shared_experts.w2.weight"] = (d, hs)
    return s


def bias_name(l):
    return f"layers.{l}.moe.expert_bias"


def rope_tables(a, seq_len):
    hd = a["head_dim"]
    freqs = 1.0 / (a["rope_theta"] ** (torch.arange(0, hd, 2)[: (hd // 2)].double() / hd))
    angles = torch.outer(torch.arange(seq_len).double(), freqs)  # [seq, hd/2]
    if a["rope"] == "cos_sin":  # torchtitan qwen3's precompute_rope_cache: cat(freqs, freqs), cos then sin
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()
    assert a["rope"] == "complex"
    return torch.polar(torch.ones_like(angles), angles)  # complex128


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(a, x, rope):
    """x [bs, seq, heads, head_dim]."""
    seqlen = x.shape[1]
    if a["rope"] == "cos_sin":
        cos, sin = (t[:seqlen].view(1, seqlen, 1, -1) for t in rope)
        return x * cos + rotate_half(x) * sin
    x_ = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_ * rope[:seqlen].view(1, seqlen, 1, x_.shape[-1])).flatten(3)


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def swiglu(x, w1, w2, w3):
    return (F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T


def attention(p, q, a, x, rope):
    bs, seqlen, _ = x.shape
    hd = a["head_dim"]
    xq = (x @ p[q + "attention.wq.weight"].T).view(bs, seqlen, -1, hd)
    xk = (x @ p[q + "attention.wk.weight"].T).view(bs, seqlen, -1, hd)
    xv = (x @ p[q + "attention.wv.weight"].T).view(bs, seqlen, -1, hd)
    if a["qk_norm"]:  # qwen3: nn.RMSNorm(head_dim) on each head, before RoPE
        xq = rms_norm(xq, p[q + "attention.q_norm.weight"], a["norm_eps"])
        xk = rms_norm(xk, p[q + "attention.k_norm.weight"], a["norm_eps"])
    xq, xk = apply_rope(a, xq, rope), apply_rope(a, xk, rope)
    rep = a["n_heads"] // a["n_kv_heads"]  # kv head j serves query heads j*rep .. j*rep+rep-1
    xk, xv = xk.repeat_interleave(rep, dim=2), xv.repeat_interleave(rep, dim=2)
    o = F.scaled_dot_product_attention(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), is_causal=True)
    return o.transpose(1, 2).contiguous().view(bs, seqlen, -1) @ p[q + "attention.wo.weight"].T


# ---- torchtitan's MoE (models/moe/moe.py, v0.2.2), in float64 --------------------------------------


def node_limited_scores(scores_for_choice, m, margins):
    # TokenChoiceTopKRouter._get_node_limited_routing_scores
    E, G = m["num_experts"], m["num_expert_groups"]
    assert E % G == 0 and E // G >= 2 and m["num_limited_groups"] is not None
    scores_grouped = scores_for_choice.view(-1, G, E // G)
    group_scores = scores_grouped.topk(2, dim=-1)[0].sum(dim=-1)
    _, group_idx = torch.topk(group_scores, k=m["num_limited_groups"], dim=-1, sorted=False)
    group_mask = torch.ones_like(group_scores, dtype=torch.bool)
    group_mask.scatter_(1, group_idx, False)  # False = selected groups (keep)
    if margins is not None and m["num_limited_groups"] < G:
        g = group_scores.detach().sort(dim=-1, descending=True)[0]
        margins.append((g[:, m["num_limited_groups"] - 1] - g[:, m["num_limited_groups"]]).min().item())
    return scores_grouped.masked_fill(group_mask.unsqueeze(-1), float("-inf")).view(-1, E)


def router(x, gate, expert_bias, m, margins=None):
    """TokenChoiceTopKRouter.forward: (top_scores [N, k], selected_experts_indices [N, k], num_tokens_per_expert [E])."""
    scores = x @ gate.T
    if m["score_func"] == "sigmoid":
        scores = torch.sigmoid(scores)
    elif m["score_func"] == "softmax":
        scores = F.softmax(scores, dim=1)
    else:
        raise NotImplementedError(m["score_func"])
    scores_for_choice = scores if expert_bias is None else scores + expert_bias
    if m["num_expert_groups"] is not None:
        scores_for_choice = node_limited_scores(scores_for_choice, m, margins)
    _, selected_experts_indices = torch.topk(scores_for_choice, k=m["top_k"], dim=-1, sorted=False)
    if margins is not None and m["top_k"] < m["num_experts"]:
        c = scores_for_choice.detach().sort(dim=-1, descending=True)[0]
        margins.append((c[:, m["top_k"] - 1] - c[:, m["top_k"]]).min().item())
    # the expert_bias only routes: the gating values come from the original scores
    top_scores = scores.gather(dim=1, index=selected_experts_indices)
    if m["route_norm"]:
        top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
    top_scores = top_scores * m["route_scale"]
    num_tokens_per_expert = torch.histc(selected_experts_indices.view(-1).double(), bins=m["num_experts"], min=0, max=m["num_experts"])
    return top_scores, selected_experts_indices, num_tokens_per_expert


def reorder(top_scores, selected_experts_indices, m):
    # TokenReorderer.forward
    num_tokens_per_expert = torch.histc(selected_experts_indices.view(-1).double(), bins=m["num_experts"], min=0, max=m["num_experts"])
    token_indices_experts_sorted = torch.argsort(selected_experts_indices.view(-1), stable=True)
    top_scores_experts_sorted = top_scores.view(-1)[token_indices_experts_sorted]
    token_indices_experts_sorted = token_indices_experts_sorted // m["top_k"]
    return top_scores_experts_sorted, token_indices_experts_sorted, num_tokens_per_expert


def run_experts_for_loop(w1, w2, w3, x, num_tokens_per_expert):
    # _run_experts_for_loop (no padding here: every row belongs to an expert)
    counts = [int(c) for c in num_tokens_per_expert.tolist()]
    assert sum(counts) == x.shape[0]
    out = []
    for e, x_e in enumerate(torch.split(x, counts, dim=0)):
        h = F.silu(x_e @ w1[e].transpose(-2, -1)) * (x_e @ w3[e].transpose(-2, -1))
        out.append(h @ w2[e].transpose(-2, -1))
    return torch.cat(out, dim=0)


def moe(p, q, m, x, expert_bias, tokens_per_expert, margins=None):
    """MoE.forward on x [bs, slen, dim]; adds this batch's expert counts to tokens_per_expert (no grad)."""
    bs, slen, dim = x.shape
    x = x.view(-1, dim)
    top_scores, selected, num_tokens_per_expert = router(x, p[q + "moe.router.gate.weight"], expert_bias, m, margins)
    if tokens_per_expert is not None:
        with torch.no_grad():
            tokens_per_expert.add_(num_tokens_per_expert)
    top_scores_experts_sorted, token_indices_experts_sorted, num_tokens_per_expert = reorder(top_scores, selected, m)
    token_indices_experts_sorted = token_indices_experts_sorted.reshape(-1, 1).expand(-1, dim)
    routed_input = torch.gather(x, dim=0, index=token_indices_experts_sorted)
    if m["score_before_experts"]:
        routed_input = routed_input * top_scores_experts_sorted.reshape(-1, 1)
    routed_output = run_experts_for_loop(p[q + "moe.experts.w1"], p[q + "moe.experts.w2"], p[q + "moe.experts.w3"], routed_input, num_tokens_per_expert)
    if m["num_shared_experts"]:
        out = swiglu(x, p[q + "moe.shared_experts.w1.weight"], p[q + "moe.shared_experts.w2.weight"], p[q + "moe.shared_experts.w3.weight"])
    else:
        out = torch.zeros_like(x)
    if not m["score_before_experts"]:
        routed_output = routed_output * top_scores_experts_sorted.reshape(-1, 1)
    out = out.scatter_add(dim=0, index=token_indices_experts_sorted, src=routed_output)
    return out.reshape(bs, slen, dim)


@torch.no_grad()
def update_expert_bias(expert_bias, tokens_per_expert, m):
    """build_optimizers_with_moe_load_balancing's _update_expert_bias (one rank, no recomputation), per MoE layer."""
    for l in expert_bias:
        t = tokens_per_expert[l]
        delta = m["load_balance_coeff"] * torch.sign(t.mean() - t)
        delta = delta - delta.mean()
        expert_bias[l].add_(delta)
        t.zero_()


def forward(p, a, tokens, rope, expert_bias, tokens_per_expert, margins=None):
    h = p["tok_embeddings.weight"][tokens]
    for l in range(a["n_layers"]):
        q = f"layers.{l}."
        h = h + attention(p, q, a, rms_norm(h, p[q + "attention_norm.weight"], a["norm_eps"]), rope)
        y = rms_norm(h, p[q + "ffn_norm.weight"], a["norm_eps"])
        if l < a["n_dense_layers"]:
            h = h + swiglu(y, p[q + "feed_forward.w1.weight"], p[q + "feed_forward.w2.weight"], p[q + "feed_forward.w3.weight"])
        else:
            h = h + moe(p, q, a["moe"], y, expert_bias.get(l), tokens_per_expert.get(l), margins)
    return rms_norm(h, p["norm.weight"], a["norm_eps"]) @ p["output.weight"].T


class Reference:
    """The float64 model and torchtitan's training step: AdamW over every parameter, clip_grad_norm_,
    the load-balancing pre-hook, then LambdaLR."""

    def __init__(self, a, init, seq_len, optimizer, schedule, max_norm, steps, bias_update=True):
        self.a, self.max_norm, self.bias_update = a, max_norm, bias_update
        self.p = {n: torch.tensor(np.asarray(init[n]), dtype=torch.float64, requires_grad=True) for n in param_shapes(a, init["tok_embeddings.weight"].shape[0])}
        balanced = a["moe"]["load_balance_coeff"] is not None
        self.expert_bias = {l: torch.tensor(np.asarray(init[bias_name(l)]), dtype=torch.float64) for l in moe_layers(a)} if balanced else {}
        self.tokens_per_expert = {l: torch.zeros(a["moe"]["num_experts"]) for l in moe_layers(a)}
        self.rope = rope_tables(a, seq_len)
        o, s = optimizer, schedule
        self.opt = torch.optim.AdamW(list(self.p.values()), lr=o["lr"], betas=(o["beta1"], o["beta2"]), eps=o["eps"], weight_decay=o["weight_decay"])
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.opt, build_lr_lambda(steps, s["warmup_steps"], None if s["decay_ratio"] == -1 else s["decay_ratio"], s["decay_type"], s["min_lr_factor"],
                                      None if s.get("total_steps", -1) == -1 else s["total_steps"]))

    def step(self, tokens, labels):
        """One training step; returns loss, grad norm, the lr it ran with, and the smallest routing margin."""
        self.opt.zero_grad()
        lr = self.schedule.get_last_lr()[0]
        margins = []
        logits = forward(self.p, self.a, tokens, self.rope, self.expert_bias, self.tokens_per_expert, margins)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(list(self.p.values()), self.max_norm, foreach=True)
        if self.bias_update:  # torchtitan registers it as the optimizers' step pre-hook
            update_expert_bias(self.expert_bias, self.tokens_per_expert, self.a["moe"])
        else:
            for t in self.tokens_per_expert.values():
                t.zero_()
        self.opt.step()
        self.schedule.step()
        return loss.item(), grad_norm.item(), lr, min(margins, default=float("inf"))

    def state(self):
        """Every parameter and expert bias, by name, as float64 arrays."""
        return {n: t.detach().numpy().copy() for n, t in self.p.items()} | {bias_name(l): b.numpy().copy() for l, b in self.expert_bias.items()}


def flavor(name, flavor_name, perturb="none"):
    if name not in FLAVORS or flavor_name not in FLAVORS[name]:
        sys.exit(f"no MoE flavor {name}/{flavor_name} in the reference's table (it has {[f'{n}/{f}' for n in FLAVORS for f in FLAVORS[n]]})")
    a = dict(FLAVORS[name][flavor_name])
    a["moe"] = dict(a["moe"])
    if perturb == "no_route_norm":
        a["moe"]["route_norm"] = False
    elif perturb == "score_before_experts":
        a["moe"]["score_before_experts"] = True
    elif perturb == "no_group_limit":
        if a["moe"]["num_expert_groups"] is None:
            sys.exit(f"--perturb no_group_limit: {name}/{flavor_name} has no expert groups to drop")
        a["moe"]["num_expert_groups"] = a["moe"]["num_limited_groups"] = None
    return a


def rel(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def compare(ref, got):
    """One step's differences, {quantity: value}, each side (loss, grad_norm, lr, {name: tensor}) with the reference's
    tensors named: relative to the reference, except the expert biases (largest absolute difference)."""
    (loss, grad_norm, lr, tensors), (got_loss, got_grad_norm, got_lr, got_tensors) = ref, got
    d = {"loss": abs(got_loss - loss) / abs(loss), "grad_norm": abs(got_grad_norm - grad_norm) / abs(grad_norm),
         "lr": abs(got_lr - lr) / max(abs(lr), 1e-300)}
    for n, t in tensors.items():
        g = np.asarray(got_tensors[n], dtype=np.float64)
        d[n] = float(np.abs(g - t).max()) if n.endswith(".moe.expert_bias") else rel(g, t)
    return d


def check_init(a, init):
    """spmdx's initial tensors against the flavor's: the same parameters, of the same shapes, and zero biases."""
    shapes = param_shapes(a, init["tok_embeddings.weight"].shape[0])
    buffers = {bias_name(l): (a["moe"]["num_experts"],) for l in moe_layers(a)} if a["moe"]["load_balance_coeff"] is not None else {}
    names = {n for n in init if not n.startswith(IGNORED) and not n.endswith(".moe.tokens_per_expert")}
    expected = set(shapes) | set(buffers)
    missing, extra = sorted(expected - names), sorted(names - expected)
    if missing or extra:
        sys.exit(f"spmdx's initial tensors are not the flavor's: missing {missing}, unexpected {extra}")
    wrong = {n: (tuple(init[n].shape), s) for n, s in {**shapes, **buffers}.items() if tuple(init[n].shape) != s}
    assert not wrong, f"spmdx's tensor shapes are not the flavor's (spmdx, reference): {wrong}"
    assert all(not np.any(init[n]) for n in buffers), "spmdx's expert_bias does not start at 0"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spmdx")
    ap.add_argument("--config")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--tolerance", type=float, default=1e-5)
    ap.add_argument("--dump", help="spmdx's dump folder (default: a temporary one)")
    ap.add_argument("--table", help="also write the per-step comparison here, as JSON")
    ap.add_argument("--perturb", choices=PERTURBATIONS, default="none",
                    help="change the reference as a bug in spmdx would (top-k scores not renormalised, scores applied before the "
                    "experts, no expert-bias update, no node-limited routing): the comparison must fail")
    ap.add_argument("--collapse-routing", action="store_true",
                    help="start from router gates of zeros (spmdx's other initial weights, loaded back by checkpoint.initial_load_path): every "
                    "score ties, so at step 1 every token picks the same top_k experts (the lowest ids) and the other experts receive nothing")
    ap.add_argument("--self-check", action="store_true", help="check the reference itself (no spmdx needed) and exit")
    ap.add_argument("run", nargs="*", help="more `spmdx run` options (after --), e.g. --nproc 2 --parallelism.expert_parallel_degree 2")
    args = ap.parse_args()
    if args.self_check:
        return self_check(args.tolerance)
    if not args.spmdx or not args.config:
        ap.error("--spmdx and --config are needed (or --self-check)")

    dump = args.dump or tempfile.mkdtemp(prefix="spmdx-moe-reference-")
    run = [args.spmdx, "run", args.config, "--training.steps", str(args.steps), "--job.dump_folder", dump, "--debug.dump_batches", "true",
           "--debug.dump_initial_weights", "true", "--checkpoint.enable", "true", "--checkpoint.interval", "1"] + args.run
    if "--nproc" not in args.run:
        run += ["--nproc", "1"]
    if args.collapse_routing:
        first_dump = os.path.join(dump, "first")
        subprocess.run([args.spmdx, "run", args.config, "--training.steps", "1", "--job.dump_folder", first_dump, "--debug.dump_initial_weights", "true"] + args.run,
                       check=True, capture_output=True)
        weights = {n: t for n, t in read_safetensors(os.path.join(first_dump, "debug", "initial.safetensors")).items()
                   if not n.startswith("rope.") and not n.endswith(("expert_bias", "tokens_per_expert"))}
        for n in weights:
            if n.endswith("router.gate.weight"):
                weights[n] = np.zeros_like(weights[n])
        collapsed = os.path.join(dump, "collapsed.safetensors")
        write_safetensors(collapsed, weights)
        run += ["--checkpoint.initial_load_path", collapsed]
    cfg = tomllib.loads(subprocess.run(run + ["--print-config"], check=True, capture_output=True, text=True).stdout)
    r = subprocess.run(run, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"spmdx run failed ({' '.join(run)}):\n{r.stdout}{r.stderr}")
    metrics = [json.loads(line) for line in open(os.path.join(dump, "metrics.jsonl"))]

    a = flavor(cfg["model"]["name"], cfg["model"]["flavor"], args.perturb)
    init = read_safetensors(os.path.join(dump, "debug", "initial.safetensors"))
    check_init(a, init)
    ref = Reference(a, init, cfg["training"]["seq_len"], cfg["optimizer"], cfg["lr_scheduler"], cfg["training"]["max_norm"], args.steps,
                    bias_update=args.perturb != "no_bias_update")
    rows, worst, first = [], (0.0, "", float("inf")), None
    for step in range(1, args.steps + 1):
        tokens = torch.from_numpy(np.load(os.path.join(dump, "debug", "batches", f"step-{step}.tokens.npy")))
        labels = torch.from_numpy(np.load(os.path.join(dump, "debug", "batches", f"step-{step}.labels.npy")))
        loss, grad_norm, lr, margin = ref.step(tokens, labels)
        exported = os.path.join(dump, f"step-{step}.safetensors")
        subprocess.run([args.spmdx, "export", os.path.join(dump, "checkpoint", f"step-{step}"), exported], check=True, capture_output=True)
        got = read_safetensors(exported)
        absent = [bias_name(l) for l in ref.expert_bias if bias_name(l) not in got]
        if absent:
            sys.exit(f"spmdx's checkpoint step-{step} has no {absent}")
        m = metrics[step - 1]
        d = compare((loss, grad_norm, lr, ref.state()), (m["loss"], m["grad_norm"], m["lr"], got))
        params = {n: v for n, v in d.items() if n in ref.p}
        biases = {n: v for n, v in d.items() if n.endswith("expert_bias")}
        row = {"step": step, "loss": m["loss"], "reference_loss": loss, "loss_rel": d["loss"], "grad_norm_rel": d["grad_norm"], "lr_rel": d["lr"],
               "param_rel_max": max(params.values()), "param_rel_max_of": max(params, key=params.get),
               "expert_bias_abs_max": max(biases.values(), default=0.0), "route_margin": margin}
        rows.append(row)
        print(f"step {step:3d}  loss {m['loss']:.6f} ref {loss:.6f}  rel: loss {d['loss']:.1e}  grad_norm {d['grad_norm']:.1e}  "
              f"params {row['param_rel_max']:.1e} ({row['param_rel_max_of']})  abs: expert_bias {row['expert_bias_abs_max']:.1e}  "
              f"route margin {margin:.1e}")
        for what, v in d.items():
            if v > worst[0]:
                worst = (v, f"step {step}: {what}", margin)
            if first is None and v > args.tolerance:
                first = (v, f"step {step}: {what}", margin)
    if not args.dump:
        shutil.rmtree(dump, ignore_errors=True)
    if args.table:
        with open(args.table, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"largest difference {worst[0]:.2e} at {worst[1]} (tolerance {args.tolerance:.0e}; expert_bias absolute, the rest relative)")
    if first is not None:
        sys.exit(f"spmdx differs from the float64 reference past {args.tolerance:.0e}: first at {first[1]}, off by {first[0]:.2e} "
                 f"(the reference's smallest routing margin at that step: {first[2]:.1e}; ~1e-7 or less can be a float32 near-tie)")


# ---- --self-check --------------------------------------------------------------------------------


def naive_moe(p, q, m, x, expert_bias):
    """The MoE layer token by token, with Python's sorted() for every choice: (out [N, dim], counts [E])."""
    E, k = m["num_experts"], m["top_k"]
    counts = [0] * E
    rows = []
    for t in range(x.shape[0]):
        xt = x[t]
        logits = p[q + "moe.router.gate.weight"] @ xt
        s = torch.sigmoid(logits) if m["score_func"] == "sigmoid" else torch.exp(logits) / torch.exp(logits).sum()
        c = [s[e].detach().item() + (0.0 if expert_bias is None else expert_bias[e].item()) for e in range(E)]
        allowed = list(range(E))
        if m["num_expert_groups"] is not None:
            per = E // m["num_expert_groups"]
            groups = [list(range(g * per, (g + 1) * per)) for g in range(m["num_expert_groups"])]
            score = [sum(sorted((c[e] for e in g), reverse=True)[:2]) for g in groups]
            best = sorted(range(len(groups)), key=lambda g: -score[g])[: m["num_limited_groups"]]
            allowed = [e for g in best for e in groups[g]]
        chosen = sorted(allowed, key=lambda e: -c[e])[:k]
        w = torch.stack([s[e] for e in chosen])
        if m["route_norm"]:
            w = w / (w.sum() + 1e-20)
        w = w * m["route_scale"]
        y = torch.zeros_like(xt)
        if m["num_shared_experts"]:
            y = swiglu(xt, p[q + "moe.shared_experts.w1.weight"], p[q + "moe.shared_experts.w2.weight"], p[q + "moe.shared_experts.w3.weight"])
        for e, we in zip(chosen, w):
            counts[e] += 1
            w1, w2, w3 = (p[q + f"moe.experts.w{i}"][e] for i in (1, 2, 3))
            y = y + (swiglu(xt * we, w1, w2, w3) if m["score_before_experts"] else we * swiglu(xt, w1, w2, w3))
        rows.append(y)
    return torch.stack(rows), counts


def random_init(a, vocab, g, std=0.02):
    init = {}
    for n, s in param_shapes(a, vocab).items():
        init[n] = torch.ones(s) if n.endswith("norm.weight") else torch.nn.init.trunc_normal_(torch.empty(s), std=std, a=-2 * std, b=2 * std, generator=g)
    for l in moe_layers(a):
        init[bias_name(l)] = torch.zeros(a["moe"]["num_experts"])
    return {n: t.numpy() for n, t in init.items()}


def self_check(tolerance):
    g = torch.Generator().manual_seed(0)
    failures = []

    def check(ok, what):
        print(("ok    " if ok else "FAIL  ") + what)
        if not ok:
            failures.append(what)

    def maxrel(x, y):
        return (x - y).abs().max().item() / max(y.abs().max().item(), 1e-300)

    # 1. The MoE layer against the per-token one: output, counts, and every gradient, with a random
    #    expert_bias that changes the routing, for each flavor and each perturbed setting.
    for name, flavors in FLAVORS.items():
        for fname in flavors:
            for perturb in ["none", "no_route_norm", "score_before_experts", "no_group_limit"]:
                if perturb == "no_group_limit" and FLAVORS[name][fname]["moe"]["num_expert_groups"] is None:
                    continue
                a = flavor(name, fname, perturb)
                m, q = a["moe"], "layers.0."
                p = {n: (torch.randn(s, generator=g) * 0.3).requires_grad_() for n, s in param_shapes(dict(a, n_dense_layers=0, n_layers=1), 16).items() if ".moe." in n}
                x = torch.randn(2, 24, a["dim"], generator=g, requires_grad=True)
                bias = torch.randn(m["num_experts"], generator=g) * 0.05
                tpe = torch.zeros(m["num_experts"])
                margins = []
                out = moe(p, q, m, x, bias, tpe, margins)
                cot = torch.randn(out.shape, generator=g)
                grads = torch.autograd.grad((out * cot).sum(), [x] + list(p.values()))
                ref, counts = naive_moe(p, q, m, x.view(-1, a["dim"]), bias)
                ref = ref.view(out.shape)
                ref_grads = torch.autograd.grad((ref * cot).sum(), [x] + list(p.values()))
                err = max([maxrel(out, ref)] + [maxrel(u, v) for u, v in zip(grads, ref_grads)])
                routed_by_bias = not torch.equal(router(x.view(-1, a["dim"]), p[q + "moe.router.gate.weight"], None, m)[1].sort(-1)[0],
                                                 router(x.view(-1, a["dim"]), p[q + "moe.router.gate.weight"], bias, m)[1].sort(-1)[0])
                check(err <= 1e-12 and tpe.tolist() == counts and routed_by_bias,
                      f"{name}/{fname} MoE layer{'' if perturb == 'none' else ' (' + perturb + ')'}: forward and gradients against the per-token "
                      f"computation, largest relative difference {err:.1e}; tokens per expert {[int(c) for c in counts]}; "
                      f"the bias changes the routing: {routed_by_bias}; smallest margin {min(margins):.1e}")

    # 2. The load-balancing update keeps sum(expert_bias) = 0 and moves it against the load.
    m = dict(FLAVORS["qwen3"]["tiny_moe"]["moe"])
    bias, worst_sum, against = {0: torch.zeros(8)}, 0.0, True
    for _ in range(50):
        counts = torch.randint(0, 6, (8,), generator=g).double()
        before = bias[0].clone()
        update_expert_bias(bias, {0: counts.clone()}, m)
        delta = bias[0] - before
        worst_sum = max(worst_sum, abs(bias[0].sum().item()))
        over, under = counts > counts.mean(), counts < counts.mean()
        if over.any() and under.any():
            against &= delta[over].max().item() < delta[under].min().item()
    check(worst_sum < 1e-15 and against, f"expert bias update: |sum(expert_bias)| at most {worst_sum:.1e} over 50 updates; "
          f"overloaded experts always lowered against underloaded ones: {against}")

    # 3. RoPE (both conventions): q·k depends only on the distance; position 0 is the identity.
    for conv in ("cos_sin", "complex"):
        a = dict(head_dim=16, rope=conv, rope_theta=10000.0)
        rope = rope_tables(a, 12)
        xq, xk = torch.randn(1, 12, 1, 16, generator=g), torch.randn(1, 12, 1, 16, generator=g)
        xq[:], xk[:] = xq[:, :1], xk[:, :1]  # the same vector at every position
        rq, rk = apply_rope(a, xq, rope), apply_rope(a, xk, rope)
        dots = (rq[0, :, 0] @ rk[0, :, 0].T)
        err = max((dots.diagonal(o)[1:] - dots.diagonal(o)[0]).abs().max().item() for o in range(-6, 7))
        check(err < 1e-12 and torch.allclose(rq[0, 0], xq[0, 0], rtol=0, atol=1e-15), f"RoPE {conv}: q·k by distance only ({err:.1e})")

    # 4. GQA: kv head j serves query heads j*rep .. j*rep+rep-1, as SDPA's enable_gqa does.
    q_, k_, v_ = torch.randn(1, 4, 8, 16, generator=g), torch.randn(1, 2, 8, 16, generator=g), torch.randn(1, 2, 8, 16, generator=g)
    mine = F.scaled_dot_product_attention(q_, k_.repeat_interleave(2, 1), v_.repeat_interleave(2, 1), is_causal=True)
    err = maxrel(mine, F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, enable_gqa=True))
    check(err < 1e-14, f"GQA by repeat_interleave against SDPA's enable_gqa: {err:.1e}")

    # 5. Train each flavor from random weights on random tokens, then once per perturbation, and compare
    #    as main() compares spmdx: each perturbation must move something past the tolerance.
    optimizer = dict(lr=8e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    schedule = dict(warmup_steps=2, decay_ratio=-1, decay_type="linear", min_lr_factor=0.0)
    steps, vocab, seq = 4, 128, 32
    for name, flavors in FLAVORS.items():
        for fname in flavors:
            a = flavor(name, fname)
            init = random_init(a, vocab, g)
            batches = [(torch.randint(0, vocab, (2, seq), generator=g), torch.randint(0, vocab, (2, seq), generator=g)) for _ in range(steps)]
            base = Reference(a, init, seq, optimizer, schedule, 1.0, steps)
            record, margins = [], []
            for tokens, labels in batches:
                loss, grad_norm, lr, margin = base.step(tokens, labels)
                record.append((loss, grad_norm, lr, base.state()))
                margins.append(margin)
            sums = max(abs(b.sum().item()) for b in base.expert_bias.values())
            moved = min(np.abs(b.numpy()).max() for b in base.expert_bias.values())
            check(all(np.isfinite(r[0]) for r in record) and sums < 1e-15 and moved > 0,
                  f"{name}/{fname} trains {steps} steps: loss {record[0][0]:.4f} -> {record[-1][0]:.4f} (ln V = {np.log(vocab):.4f}); "
                  f"expert_bias max |.| {moved:.1e}, |sum| {sums:.1e}; smallest routing margin {min(margins):.1e}")
            for perturb in PERTURBATIONS[1:]:
                if perturb == "no_group_limit" and a["moe"]["num_expert_groups"] is None:
                    continue
                # the perturbed reference against the right one, in the place of spmdx
                planted = Reference(flavor(name, fname, perturb), init, seq, optimizer, schedule, 1.0, steps, bias_update=perturb != "no_bias_update")
                caught = None
                for step, ((tokens, labels), right) in enumerate(zip(batches, record), 1):
                    d = compare(planted.step(tokens, labels)[:3] + (planted.state(),), right)
                    what = max(d, key=d.get)
                    if caught is None and d[what] > tolerance:
                        caught = f"at step {step} by {what}, off by {d[what]:.1e}"
                check(caught is not None, f"{name}/{fname} --perturb {perturb} is caught {caught or 'by nothing'}")
    print(f"self-check: {'all passed' if not failures else str(len(failures)) + ' failed'}")
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
