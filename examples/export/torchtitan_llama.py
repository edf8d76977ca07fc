"""A torchtitan-style Llama 3 (torchtitan/models/llama3/model/model.py, trimmed): RMSNorm,
complex rotary embeddings (freqs_cis buffer, view_as_complex), grouped-query attention
(repeat_kv), causal SDPA, SwiGLU; torchtitan's parameter names. forward(tokens) returns
logits: spmdx appends cross entropy (`[model] loss = "cross_entropy"`).

    python examples/export/torchtitan_llama.py --out outputs/export
    python examples/export/torchtitan_llama.py --out DIR --layers 32 --dim 4096 --heads 32 --kv-heads 8 --ffn 14336 --zeros

The size flags (defaults: the small model below) and --zeros (all weights zero: a file of a
given size, fast to write) are for benchmarks.
"""
import argparse
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from common import main

# VOCAB: the ids of spmdx's "byte" tokenizer (256 bytes, BOS 256, EOS 257).
VOCAB, DIM, LAYERS, HEADS, KV_HEADS, FFN, BATCH, SEQ = 264, 64, 2, 4, 2, 160, 8, 32


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    return torch.polar(torch.ones(end, dim // 2), torch.outer(t, freqs).float())


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x, n_rep):
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return x[:, :, :, None, :].expand(bs, slen, n_kv_heads, n_rep, head_dim).reshape(bs, slen, n_kv_heads * n_rep, head_dim)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = DIM // HEADS
        self.wq = nn.Linear(DIM, HEADS * self.head_dim, bias=False)
        self.wk = nn.Linear(DIM, KV_HEADS * self.head_dim, bias=False)
        self.wv = nn.Linear(DIM, KV_HEADS * self.head_dim, bias=False)
        self.wo = nn.Linear(HEADS * self.head_dim, DIM, bias=False)

    def forward(self, x, freqs_cis):
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        keys = repeat_kv(xk, HEADS // KV_HEADS)
        values = repeat_kv(xv, HEADS // KV_HEADS)
        xq, xk, xv = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        out = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, FFN, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = Attention()
        self.feed_forward = FeedForward()
        self.attention_norm = nn.RMSNorm(DIM, eps=1e-5)
        self.ffn_norm = nn.RMSNorm(DIM, eps=1e-5)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.register_buffer("freqs_cis", precompute_freqs_cis(DIM // HEADS, SEQ * 2), persistent=True)
        self.layers = nn.ModuleDict({str(i): TransformerBlock() for i in range(LAYERS)})
        self.norm = nn.RMSNorm(DIM, eps=1e-5)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        freqs_cis = self.freqs_cis[0 : tokens.shape[1]]
        for layer in self.layers.values():
            h = layer(h, freqs_cis)
        return self.output(self.norm(h))


def sized():
    """Reads the size flags (leaving the rest to common.main) into the module's constants."""
    global VOCAB, DIM, LAYERS, HEADS, KV_HEADS, FFN, BATCH, SEQ
    ap = argparse.ArgumentParser(add_help=False)
    for flag, value in (("--vocab", VOCAB), ("--dim", DIM), ("--layers", LAYERS), ("--heads", HEADS), ("--kv-heads", KV_HEADS),
                        ("--ffn", FFN), ("--batch", BATCH), ("--seq", SEQ)):
        ap.add_argument(flag, type=int, default=value)
    ap.add_argument("--zeros", action="store_true")
    a, rest = ap.parse_known_args()
    sys.argv = [sys.argv[0]] + rest
    VOCAB, DIM, LAYERS, HEADS, KV_HEADS, FFN, BATCH, SEQ = a.vocab, a.dim, a.layers, a.heads, a.kv_heads, a.ffn, a.batch, a.seq

    def make():
        if not a.zeros:
            return Transformer()
        with torch.device("meta"):
            m = Transformer()
        m = m.to_empty(device="cpu")
        with torch.no_grad():
            for p in m.parameters():
                p.zero_()
            m.freqs_cis.copy_(precompute_freqs_cis(DIM // HEADS, SEQ * 2))
        return m
    return make


if __name__ == "__main__":
    make = sized()
    main("torchtitan_llama", make, False, BATCH, SEQ, VOCAB)
