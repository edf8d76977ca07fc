"""The PyTorch peer of spmdx's N-rank training: the same Llama 3 (torchtitan's llama3 layout:
RMSNorm pre-norm blocks, rotary attention with theta 500000, causal scaled_dot_product_attention,
SwiGLU feed-forward, untied output) trained in eager PyTorch with DistributedDataParallel or
FSDP2 (torch.distributed.fsdp.fully_shard) over Gloo, one process per rank, with the same
global batch, AdamW (betas 0.9/0.95, weight decay 0.1), gradient clipping at 1.0 and the same
intra-op threads per rank as spmdx (cores / ranks). Tokens are random: only time is compared.

Prints one line on rank 0: "MODE median_step_ms tokens_per_s".
Usage: python torch_llama.py ddp|fsdp NPROC STEPS [FLAVOR] [LOCAL_BATCH] [SEQ_LEN]
       (defaults: debugmodel, 4, 128; steps 1-2 are warm-up and not counted, so STEPS >= 3)"""
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

FLAVORS = {  # spmdx's models::model_args
    "tiny": dict(dim=64, n_layers=2, n_heads=4, ffn_hidden=192),
    "debugmodel": dict(dim=256, n_layers=6, n_heads=16, ffn_hidden=768),
}
VOCAB = 256  # spmdx's "byte" tokenizer


class Attention(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.n_heads, self.hd = n_heads, dim // n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x, freqs):
        b, s, d = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.hd)
        k = self.wk(x).view(b, s, self.n_heads, self.hd)
        v = self.wv(x).view(b, s, self.n_heads, self.hd)

        def rotary(t):
            c = torch.view_as_complex(t.float().reshape(b, s, self.n_heads, -1, 2))
            return torch.view_as_real(c * freqs[None, :, None, :]).flatten(3).type_as(t)

        q, k, v = rotary(q).transpose(1, 2), rotary(k).transpose(1, 2), v.transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, d))


class Block(nn.Module):
    def __init__(self, dim, n_heads, ffn_hidden):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim, eps=1e-5)
        self.attention = Attention(dim, n_heads)
        self.ffn_norm = nn.RMSNorm(dim, eps=1e-5)
        self.w1 = nn.Linear(dim, ffn_hidden, bias=False)
        self.w2 = nn.Linear(ffn_hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn_hidden, bias=False)

    def forward(self, h, freqs):
        h = h + self.attention(self.attention_norm(h), freqs)
        y = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(y)) * self.w3(y))


class Llama(nn.Module):
    def __init__(self, dim, n_layers, n_heads, ffn_hidden, seq_len):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads, ffn_hidden) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, VOCAB, bias=False)
        hd = dim // n_heads
        inv = 1.0 / (500000.0 ** (torch.arange(0, hd, 2).float() / hd))
        self.register_buffer("freqs", torch.polar(torch.ones(seq_len, hd // 2), torch.outer(torch.arange(seq_len).float(), inv)),
                             persistent=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.freqs)
        return self.output(self.norm(h))


def worker(rank, mode, n, steps, flavor, local_batch, seq_len, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))
    dist.init_process_group("gloo", rank=rank, world_size=n)
    torch.manual_seed(42)
    model = Llama(seq_len=seq_len, **FLAVORS[flavor])
    if mode == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4, betas=(0.9, 0.95), weight_decay=0.1)
    g = torch.Generator().manual_seed(rank)
    times = []
    for step in range(steps):
        tokens = torch.randint(0, VOCAB, (local_batch, seq_len + 1), generator=g)
        dist.barrier()
        t0 = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        ms = statistics.median(times[2:]) * 1e3
        queue.put(f"{mode} {ms:.1f} {local_batch * n * seq_len / ms * 1e3:.0f}")
    dist.destroy_process_group()


def main():
    mode, n, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    flavor = sys.argv[4] if len(sys.argv) > 4 else "debugmodel"
    local_batch = int(sys.argv[5]) if len(sys.argv) > 5 else 4
    seq_len = int(sys.argv[6]) if len(sys.argv) > 6 else 128
    if mode not in ("ddp", "fsdp") or flavor not in FLAVORS or steps < 3:
        sys.exit(__doc__)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.spawn(worker, args=(mode, n, steps, flavor, local_batch, seq_len, port, queue), nprocs=n, join=True)
    print(queue.get())


if __name__ == "__main__":
    main()
