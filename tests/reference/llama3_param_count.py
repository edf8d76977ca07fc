"""Parameter counts of torchtitan's Llama 3 flavors, from a plain PyTorch definition on the meta
device (no memory): the module structure of torchtitan/models/llama3/model/model.py (embedding,
per layer attention wq/wk/wv/wo without bias, RMSNorm weights, SwiGLU w1/w2/w3, final norm,
output), with its ModelArgs and FeedForward sizing. Prints {"flavor": count} as JSON.

    python tests/reference/llama3_param_count.py [--vocab 128256]
"""
import argparse
import json

import torch
from torch import nn

FLAVORS = {  # torchtitan's llama3_args
    "8B": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024),
    "70B": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096),
    "405B": dict(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2, multiple_of=4096),
}


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim, multiple_of, ffn_dim_multiplier):
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        if ffn_dim_multiplier is not None:
            hidden_dim = int(ffn_dim_multiplier * hidden_dim)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)


class Attention(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads):
        super().__init__()
        head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)


class Block(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.attention = Attention(a["dim"], a["n_heads"], a["n_kv_heads"])
        self.feed_forward = FeedForward(a["dim"], 4 * a["dim"], a["multiple_of"], a["ffn_dim_multiplier"])
        self.attention_norm = nn.RMSNorm(a["dim"])
        self.ffn_norm = nn.RMSNorm(a["dim"])


class Transformer(nn.Module):
    def __init__(self, a, vocab):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, a["dim"])
        self.layers = nn.ModuleList(Block(a) for _ in range(a["n_layers"]))
        self.norm = nn.RMSNorm(a["dim"])
        self.output = nn.Linear(a["dim"], vocab, bias=False)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--vocab", type=int, default=128256)
    args = p.parse_args()
    counts = {}
    with torch.device("meta"):
        for name, a in FLAVORS.items():
            counts[name] = sum(t.numel() for t in Transformer(a, args.vocab).parameters())
    print(json.dumps(counts))


if __name__ == "__main__":
    main()
