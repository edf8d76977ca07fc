"""A Hugging Face transformers model as transformers itself exports it: Qwen3ForCausalLM from
the `transformers` package (pinned by scripts/setup), default attention (`sdpa`, with the mask
transformers builds under torch.export) and config defaults, random weights from a small config
built in code (no download; `from_pretrained` gives the same program with trained weights).
Wrapped so that forward(input_ids) returns the logits; spmdx appends mean cross entropy.

    python examples/export/transformers_qwen3.py --out outputs/export
"""
import torch
import transformers

from common import main

# VOCAB: the ids of spmdx's "byte" tokenizer (256 bytes, BOS 256, EOS 257).
VOCAB, BATCH, SEQ = 264, 8, 32


class LogitsOnly(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


def make():
    config = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=16, intermediate_size=160, max_position_embeddings=128, bos_token_id=256, eos_token_id=257)
    return LogitsOnly(transformers.Qwen3ForCausalLM(config)).eval()


if __name__ == "__main__":
    main("transformers_qwen3", make, False, BATCH, SEQ, VOCAB)
