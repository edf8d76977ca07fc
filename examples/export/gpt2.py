"""A GPT-2-style model (nanoGPT's, trimmed): learned position embeddings, LayerNorm with
biases, causal self-attention from one fused c_attn projection, tanh-approximated GELU,
biases on every linear layer, and the output layer tied to the token embedding (one
parameter, two uses). forward(idx, targets) returns the mean cross entropy.

    python examples/export/gpt2.py --out outputs/export
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from common import main

# VOCAB: the ids of spmdx's "byte" tokenizer (256 bytes, BOS 256, EOS 257).
VOCAB, DIM, LAYERS, HEADS, BLOCK, BATCH, SEQ = 264, 64, 2, 4, 64, 8, 32


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(DIM, 3 * DIM)
        self.c_proj = nn.Linear(DIM, DIM)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(DIM, dim=2)
        k = k.view(B, T, HEADS, C // HEADS).transpose(1, 2)
        q = q.view(B, T, HEADS, C // HEADS).transpose(1, 2)
        v = v.view(B, T, HEADS, C // HEADS).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = nn.Linear(DIM, 4 * DIM)
        self.c_proj = nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(DIM)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(DIM)
        self.mlp = MLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, DIM),
            wpe=nn.Embedding(BLOCK, DIM),
            h=nn.ModuleList([Block() for _ in range(LAYERS)]),
            ln_f=nn.LayerNorm(DIM),
        ))
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * LAYERS))

    def forward(self, idx, targets):
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


if __name__ == "__main__":
    main("gpt2", GPT, True, BATCH, SEQ, VOCAB)
