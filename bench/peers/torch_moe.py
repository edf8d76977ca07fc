"""The PyTorch peer of spmdx's Mixture-of-Experts training (bench/moe.sh): Qwen3-MoE as torchtitan
builds it (models/qwen3: q/k RMSNorm on each head before RoPE, rotate_half RoPE of theta 1e6 on
cos/sin tables, GQA by repeating the KV heads, causal scaled_dot_product_attention, RMSNorm eps
1e-6, untied output; every FFN an MoE layer as torchtitan's models/moe/moe.py: TokenChoiceTopKRouter
(gate in float32, softmax scores, expert_bias added for choosing only, top-k, route_norm),
TokenReorderer (histc counts, stable argsort by expert), the slots' tokens gathered, GroupedExperts
(SwiGLU per expert), weighted by their scores after the experts and scatter_add-ed back; no shared
experts; DeepSeek-V3's load balancing as torchtitan's optimizer pre-hook: tokens_per_expert summed
over the ranks by all_reduce, expert_bias += 1e-3 x sign(mean - load), centred), trained in eager
PyTorch with AdamW (betas 0.9/0.95, weight decay 0.1, fused as torchtitan's default) and gradient
clipping at 1.0, as bench/peers/torch_llama.py trains Llama.

The experts run as torchtitan's _run_experts_grouped_mm (torch._grouped_mm with offs = the
cumulative counts) where torch._grouped_mm runs forward and backward on this CPU in float32 (checked
against the for-loop at start, on a small case with an empty group); torchtitan casts to bfloat16
there for its CUDA kernel and pads each group to 8 rows, neither of which is done here (spmdx
computes in float32 and CPU grouped_mm needs no alignment). Else, or with MOE_EXPERTS=for_loop, as
torchtitan's _run_experts_for_loop (torch.split by the counts, one SwiGLU per expert). The line
printed says which ran.

Modes: one (1 process, every core's threads; NPROC must be 1), fsdp (FSDP2 fully_shard per layer
and the whole model over Gloo, NPROC processes of cores / NPROC intra-op threads each, as spmdx
gives its ranks). LOCAL_BATCH rows per process, SEQ_LEN tokens a row, random tokens: only time is
compared.

Prints one line: "MODE median_step_ms tokens_per_s experts=grouped_mm|for_loop" (steps 1-2 are
warm-up, not counted).
Usage: python torch_moe.py one|fsdp NPROC STEPS FLAVOR LOCAL_BATCH SEQ_LEN [N_LAYERS]
       FLAVOR: tiny_moe or debugmodel_moe (spmdx's qwen3 flavors); N_LAYERS: -1 or absent for the flavor's"""
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

FLAVORS = {  # spmdx's qwen3 flavors (core/src/models/model.cpp), torchtitan's for debugmodel_moe
    "tiny_moe": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, experts=8, moe_hidden=32, top_k=2),
    "debugmodel_moe": dict(dim=256, n_layers=8, n_heads=16, n_kv_heads=8, head_dim=128, experts=64, moe_hidden=768, top_k=8),
}
VOCAB = 264  # spmdx's "byte" tokenizer: 256 bytes, BOS 256, EOS 257, padded to a multiple of 8
EPS = 1e-6
THETA = 1e6
LOAD_BALANCE_COEFF = 1e-3


def grouped_mm_works():
    """torch._grouped_mm forward and backward in float32 on this CPU, against the for-loop, with an empty group."""
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(24, 16, generator=g, requires_grad=True)
        w = torch.randn(3, 8, 16, generator=g, requires_grad=True)  # [E, out, in] as torchtitan's w1
        counts = [10, 0, 14]
        offs = torch.tensor(counts).cumsum(0).to(torch.int32)
        y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        cot = torch.randn(y.shape, generator=g)
        gx, gw = torch.autograd.grad(y, (x, w), cot)
        ref = torch.cat([xe @ w[e].T for e, xe in enumerate(torch.split(x, counts))])
        rx, rw = torch.autograd.grad(ref, (x, w), cot)
        return all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in ((y, ref), (gx, rx), (gw, rw)))
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, head_dim):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.hd = n_heads, n_kv_heads, head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.q_norm = nn.RMSNorm(head_dim, eps=EPS)
        self.k_norm = nn.RMSNorm(head_dim, eps=EPS)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.q_norm(self.wq(x).view(b, s, -1, self.hd))
        k = self.k_norm(self.wk(x).view(b, s, -1, self.hd))
        v = self.wv(x).view(b, s, -1, self.hd)
        cos, sin = cos[None, :s, None, :], sin[None, :s, None, :]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        rep = self.n_heads // self.n_kv_heads  # torchtitan's repeat_kv
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class MoE(nn.Module):
    """torchtitan's MoE.forward: router, reorderer, grouped experts, weighted scatter_add."""

    def __init__(self, dim, experts, moe_hidden, top_k, grouped_mm):
        super().__init__()
        self.E, self.k, self.grouped_mm = experts, top_k, grouped_mm
        self.gate = nn.Linear(dim, experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(experts, moe_hidden, dim))
        self.w2 = nn.Parameter(torch.empty(experts, dim, moe_hidden))
        self.w3 = nn.Parameter(torch.empty(experts, moe_hidden, dim))
        for w in (self.w1, self.w2, self.w3):
            nn.init.trunc_normal_(w, std=0.02)
        self.register_buffer("expert_bias", torch.zeros(experts))
        self.register_buffer("tokens_per_expert", torch.zeros(experts))

    def experts(self, x, counts):
        if self.grouped_mm:  # _run_experts_grouped_mm in float32
            offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
            h = F.silu(torch._grouped_mm(x, self.w1.transpose(-2, -1), offs=offs)) * torch._grouped_mm(x, self.w3.transpose(-2, -1), offs=offs)
            return torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=offs)
        out = []  # _run_experts_for_loop
        for e, x_e in enumerate(torch.split(x, counts.tolist(), dim=0)):
            h = F.silu(x_e @ self.w1[e].transpose(-2, -1)) * (x_e @ self.w3[e].transpose(-2, -1))
            out.append(h @ self.w2[e].transpose(-2, -1))
        return torch.cat(out, dim=0)

    def forward(self, x):
        b, s, dim = x.shape
        x = x.view(-1, dim)
        # TokenChoiceTopKRouter: the gate in float32, softmax, the bias only to choose, route_norm
        scores = F.softmax(self.gate(x).float(), dim=1)
        _, selected = torch.topk(scores + self.expert_bias, k=self.k, dim=-1, sorted=False)
        top_scores = scores.gather(dim=1, index=selected)
        top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
        counts = torch.histc(selected.view(-1).float(), bins=self.E, min=0, max=self.E)
        with torch.no_grad():
            self.tokens_per_expert.add_(counts)
        # TokenReorderer
        order = torch.argsort(selected.view(-1), stable=True)
        scores_sorted = top_scores.view(-1)[order]
        token_idx = (order // self.k).reshape(-1, 1).expand(-1, dim)
        routed = self.experts(torch.gather(x, dim=0, index=token_idx), counts.to(torch.int64))
        routed = (routed.float() * scores_sorted.reshape(-1, 1)).to(x.dtype)
        out = torch.zeros_like(x).scatter_add(dim=0, index=token_idx, src=routed)
        return out.view(b, s, dim)


class Block(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, head_dim, experts, moe_hidden, top_k, grouped_mm):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim, eps=EPS)
        self.attention = Attention(dim, n_heads, n_kv_heads, head_dim)
        self.ffn_norm = nn.RMSNorm(dim, eps=EPS)
        self.moe = MoE(dim, experts, moe_hidden, top_k, grouped_mm)

    def forward(self, h, cos, sin):
        h = h + self.attention(self.attention_norm(h), cos, sin)
        return h + self.moe(self.ffn_norm(h))


class Qwen3MoE(nn.Module):
    def __init__(self, dim, n_layers, n_heads, n_kv_heads, head_dim, experts, moe_hidden, top_k, seq_len, grouped_mm):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads, n_kv_heads, head_dim, experts, moe_hidden, top_k, grouped_mm) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim, eps=EPS)
        self.output = nn.Linear(dim, VOCAB, bias=False)
        inv = 1.0 / (THETA ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
        angles = torch.outer(torch.arange(seq_len).float(), inv)
        angles = torch.cat([angles, angles], dim=-1)  # torchtitan qwen3's precompute_rope_cache
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.cos, self.sin)
        return self.output(self.norm(h))


def load_balance_hook(model, distributed):
    """torchtitan's build_optimizers_with_moe_load_balancing pre-hook: the step's tokens per expert summed
    over the ranks (one all_reduce of every layer's counts), then expert_bias moved against the load."""
    moes = [layer.moe for layer in model.layers]

    @torch.no_grad()
    def hook(*_):
        tpe = torch.stack([m.tokens_per_expert for m in moes])
        if distributed:
            dist.all_reduce(tpe)
        for m, t in zip(moes, tpe):
            delta = LOAD_BALANCE_COEFF * torch.sign(t.mean() - t)
            m.expert_bias.add_(delta - delta.mean())
            m.tokens_per_expert.zero_()

    return hook


def train(model, steps, local_batch, seq_len, seed, distributed):
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    opt.register_step_pre_hook(load_balance_hook(model, distributed))
    g = torch.Generator().manual_seed(seed)
    times = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (local_batch, seq_len + 1), generator=g)
        if distributed:
            dist.barrier()
        t0 = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times


def result(mode, times, tokens_per_step, grouped_mm):
    ms = statistics.median(times[2:]) * 1e3
    return f"{mode} {ms:.1f} {tokens_per_step / ms * 1e3:.0f} experts={'grouped_mm' if grouped_mm else 'for_loop'}"


def build(flavor, n_layers, seq_len, grouped_mm):
    args = dict(FLAVORS[flavor])
    if n_layers > 0:
        args["n_layers"] = n_layers
    torch.manual_seed(42)
    return Qwen3MoE(seq_len=seq_len, grouped_mm=grouped_mm, **args)


def worker(rank, n, steps, flavor, n_layers, local_batch, seq_len, grouped_mm, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))
    dist.init_process_group("gloo", rank=rank, world_size=n)
    model = build(flavor, n_layers, seq_len, grouped_mm)
    from torch.distributed.fsdp import fully_shard
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    times = train(model, steps, local_batch, seq_len, rank, True)
    if rank == 0:
        queue.put(result("fsdp", times, local_batch * n * seq_len, grouped_mm))
    dist.destroy_process_group()


def main():
    if len(sys.argv) < 7:
        sys.exit(__doc__)
    mode, n, steps, flavor = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    local_batch, seq_len = int(sys.argv[5]), int(sys.argv[6])
    n_layers = int(sys.argv[7]) if len(sys.argv) > 7 else -1
    if mode not in ("one", "fsdp") or flavor not in FLAVORS or steps < 3 or (mode == "one" and n != 1):
        sys.exit(__doc__)
    choice = os.environ.get("MOE_EXPERTS", "auto")
    if choice not in ("auto", "grouped_mm", "for_loop"):
        sys.exit("MOE_EXPERTS must be auto, grouped_mm or for_loop")
    grouped_mm = choice != "for_loop" and grouped_mm_works()
    if choice == "grouped_mm" and not grouped_mm:
        sys.exit("MOE_EXPERTS=grouped_mm: torch._grouped_mm does not run forward and backward in float32 on this CPU (torch " + torch.__version__ + ")")
    if mode == "one":
        model = build(flavor, n_layers, seq_len, grouped_mm)
        print(result(mode, train(model, steps, local_batch, seq_len, 0, False), local_batch * seq_len, grouped_mm))
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.spawn(worker, args=(n, steps, flavor, n_layers, local_batch, seq_len, grouped_mm, port, queue), nprocs=n, join=True)
    print(queue.get())


if __name__ == "__main__":
    main()
