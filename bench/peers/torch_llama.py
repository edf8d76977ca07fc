"""The PyTorch peer of spmdx's N-rank training: the same Llama 3 (torchtitan's llama3 layout:
RMSNorm pre-norm blocks, rotary attention with theta 500000, causal scaled_dot_product_attention,
SwiGLU feed-forward, untied output) trained in eager PyTorch with DistributedDataParallel or
FSDP2 (torch.distributed.fsdp.fully_shard) over Gloo, one process per rank, or (mode local)
NPROC processes each training its own copy with no collective but a barrier before each step
(DDP's work without its communication: the floor under the same sharing of the cores), with the same
global batch, AdamW (betas 0.9/0.95, weight decay 0.1, fused as torchtitan's default), gradient
clipping at 1.0 and the same intra-op threads per rank as spmdx (cores / ranks). ddp_bf16 is DDP
with the forward and the loss under torch.autocast to bfloat16 (float32 parameters, gradients
reduced in float32); fsdp_bf16 is FSDP2 with MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32), as torchtitan's mixed precision (spmdx's training.mixed_precision_param).
One process on the CPU (NPROC must be 1; THREADS intra-op threads, default 1): mode cpu is eager
float32, cpu_bf16 the same with the forward and the loss under torch.autocast("cpu", bfloat16)
(float32 parameters and fused AdamW: torchtitan's mixed precision on one device), cpu_compile
float32 with the model under torch.compile (inductor; the optimizer eager; compiling happens in
the warm-up steps). Mode cuda: one process on cuda:0
(float32 with TF32 off, as spmdx's training.allow_tf32 = false; NPROC must be 1), each step's
time taken after torch.cuda.synchronize(); mode cuda_bf16 is the same under torch.autocast to
bfloat16 (float32 parameters and AdamW), as torchtitan's mixed precision on one device. Tokens are random: only time is compared.

Prints one line on rank 0: "MODE median_step_ms tokens_per_s".
Usage: python torch_llama.py MODE NPROC STEPS [FLAVOR] [LOCAL_BATCH] [SEQ_LEN]
       MODE: ddp|fsdp|local|ddp_bf16|fsdp_bf16 (NPROC ranks over Gloo), cpu|cpu_bf16|cpu_compile
       (one process on the CPU, NPROC 1, THREADS=N intra-op threads, default 1), cuda|cuda_bf16 (NPROC 1)
       FLAVOR: tiny|debugmodel|large (spmdx's model.flavor of llama)
       (defaults: debugmodel, 4, 128; steps 1-2 are warm-up and not counted, so STEPS >= 3)"""
import contextlib
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
    "large": dict(dim=2048, n_layers=8, n_heads=16, ffn_hidden=5632),
}
VOCAB = 264  # spmdx's "byte" tokenizer: 256 bytes, BOS 256, EOS 257, padded to a multiple of 8


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


def train(model, steps, local_batch, seq_len, seed, before_step, device="cpu", amp=contextlib.nullcontext):
    """Runs STEPS steps; returns their times in seconds. before_step() runs before each step's clock
    starts (a barrier, or a CUDA synchronize); the clock stops after the next one. The forward and
    the loss run inside amp() (torchtitan's maybe_enable_amp), the backward and AdamW outside."""
    # fused=True: torchtitan's default (optimizer.implementation = "fused"), and the form spmdx runs.
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    g = torch.Generator().manual_seed(seed)
    times = []
    for step in range(steps):
        tokens = torch.randint(0, VOCAB, (local_batch, seq_len + 1), generator=g).to(device)
        before_step()
        t0 = time.perf_counter()
        with amp():
            logits = model(tokens[:, :-1])
            # .float(): torchtitan's loss upcasts the logits (a no-op on float32 ones)
            loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def result(mode, times, tokens_per_step):
    ms = statistics.median(times[2:]) * 1e3
    return f"{mode} {ms:.1f} {tokens_per_step / ms * 1e3:.0f}"


def worker(rank, mode, n, steps, flavor, local_batch, seq_len, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))
    dist.init_process_group("gloo", rank=rank, world_size=n)
    torch.manual_seed(42)
    model = Llama(seq_len=seq_len, **FLAVORS[flavor])
    amp = contextlib.nullcontext
    if mode in ("ddp", "ddp_bf16"):
        model = nn.parallel.DistributedDataParallel(model)
        if mode == "ddp_bf16":  # float32 parameters and gradient all_reduce, bfloat16 compute
            amp = lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    elif mode in ("fsdp", "fsdp_bf16"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        # torchtitan's mixed precision under FSDP: bfloat16 all-gathered parameters and compute,
        # float32 gradient reduce_scatter into float32 shards
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mode == "fsdp_bf16" else MixedPrecisionPolicy()
        for layer in model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    times = train(model, steps, local_batch, seq_len, rank, dist.barrier, amp=amp)
    if rank == 0:
        queue.put(result(mode, times, local_batch * n * seq_len))
    dist.destroy_process_group()


def run_cuda(mode, steps, flavor, local_batch, seq_len):
    if not torch.cuda.is_available():
        sys.exit("cuda: torch sees no CUDA device (torch " + torch.__version__ + ")")
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 as spmdx computes it (allow_tf32 = false)
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(42)
    with torch.device("cuda:0"):
        model = Llama(seq_len=seq_len, **FLAVORS[flavor])
    autocast = mode == "cuda_bf16"  # torchtitan's single-device mixed precision: torch.autocast, float32 parameters and AdamW
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        times = train(model, steps, local_batch, seq_len, 0, torch.cuda.synchronize, "cuda:0")
    print(result(mode, times, local_batch * seq_len))


def run_cpu(mode, steps, flavor, local_batch, seq_len):
    torch.set_num_threads(int(os.environ.get("THREADS", "1")))
    torch.manual_seed(42)
    model = Llama(seq_len=seq_len, **FLAVORS[flavor])
    amp = contextlib.nullcontext
    if mode == "cpu_bf16":  # torchtitan's single-device mixed precision: float32 parameters and AdamW
        amp = lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    elif mode == "cpu_compile":
        model = torch.compile(model)  # inductor; steps 1-2 (compiling) are the warm-up
    times = train(model, steps, local_batch, seq_len, 0, lambda: None, amp=amp)
    print(result(mode, times, local_batch * seq_len))


MODES = ("ddp", "fsdp", "local", "ddp_bf16", "fsdp_bf16", "cpu", "cpu_bf16", "cpu_compile", "cuda", "cuda_bf16")


def main():
    mode, n, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    flavor = sys.argv[4] if len(sys.argv) > 4 else "debugmodel"
    local_batch = int(sys.argv[5]) if len(sys.argv) > 5 else 4
    seq_len = int(sys.argv[6]) if len(sys.argv) > 6 else 128
    one_process = mode.startswith(("cuda", "cpu"))
    if mode not in MODES or flavor not in FLAVORS or steps < 3 or n < 1 or (one_process and n != 1):
        sys.exit(__doc__)
    if mode.startswith("cuda"):
        return run_cuda(mode, steps, flavor, local_batch, seq_len)
    if mode.startswith("cpu"):
        return run_cpu(mode, steps, flavor, local_batch, seq_len)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.spawn(worker, args=(mode, n, steps, flavor, local_batch, seq_len, port, queue), nprocs=n, join=True)
    print(queue.get())


if __name__ == "__main__":
    main()
