"""A Hugging Face Mixture of Experts as transformers exports it: Qwen3MoeForCausalLM from the
`transformers` package (pinned by scripts/setup), its default experts implementation (the grouped
GEMM that exports as the custom op transformers.grouped_mm_fallback) and config defaults, random
weights from a small config built in code (8 experts, top 2; no download). Wrapped so that
forward(input_ids) returns the logits; spmdx appends mean cross entropy.

    python examples/export/transformers_qwen3_moe.py --out outputs/export
    build/bin/spmdx run examples/export/transformers_qwen3_moe.toml --nproc 2   # expert parallelism 2
"""
import transformers

from common import main
from transformers_qwen3 import LogitsOnly

# VOCAB: the ids of spmdx's "byte" tokenizer (256 bytes, BOS 256, EOS 257).
VOCAB, BATCH, SEQ = 264, 8, 32


def make():
    config = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                         max_position_embeddings=128, bos_token_id=256, eos_token_id=257)
    return LogitsOnly(transformers.Qwen3MoeForCausalLM(config)).eval()


if __name__ == "__main__":
    main("transformers_qwen3_moe", make, False, BATCH, SEQ, VOCAB)
