"""Hugging Face T5 (T5ForConditionalGeneration) from a config (no weights downloaded), unmodified.

Needs transformers (`pip install transformers`, or `pip install karma[hf]`).

    karma-plan examples/hf_t5.py --print-ir                       # T5-base, 512 -> 128 tokens
    KARMA_HF=xl karma-plan examples/hf_t5.py --print-ir           # T5-v1.1-XL-like (gated GELU)
    KARMA_HF=tiny karma-plan examples/hf_t5.py --print-ir         # 2+2 layers, d_model 64, 64 -> 16
    KARMA_SEQ=1024 karma-plan examples/hf_t5.py --hardware v100-16g --gpu-mem 16G  # longer inputs (targets T/4)

An encoder-decoder: the encoder reads KARMA_SEQ tokens (padded after a random length, with
attention_mask 0 there), the decoder predicts KARMA_SEQ // 4 target tokens, as in T5's
span-corruption pretraining (512 -> 114). The inputs are keyword arguments,
`model(input_ids=..., attention_mask=..., labels=...)`; the model shifts the labels right into
its decoder inputs and computes its own loss (`output.loss`), so there are no targets.
What crosses between blocks: the first layer of each stack (`encoder.block.0`,
`decoder.block.0`) computes the relative-position bias [B, heads, T, T] (mask included) that
every later layer of its stack reads, and every decoder layer reads the encoder's output.
"""

import os

import torch

try:
    from transformers import T5Config, T5ForConditionalGeneration
except ImportError as e:
    raise ImportError("examples/hf_t5.py needs Hugging Face transformers; install it with "
                      "`pip install transformers` (or `pip install karma[hf]`)") from e

SIZES = {
    # name: (config fields, default encoder sequence length, batch size)
    "tiny": (dict(num_layers=2, d_model=64, d_kv=16, d_ff=128, num_heads=4, vocab_size=512), 64, 2),
    "base": (dict(num_layers=12, d_model=768, d_kv=64, d_ff=3072, num_heads=12,
                  vocab_size=32128), 512, 32),
    "xl": (dict(num_layers=24, d_model=2048, d_kv=64, d_ff=5120, num_heads=32, vocab_size=32128,
                feed_forward_proj="gated-gelu", tie_word_embeddings=False), 512, 8),
}
SIZE = os.environ.get("KARMA_HF", "base")
if SIZE not in SIZES:
    raise ValueError(f"KARMA_HF={SIZE!r} is not a T5 size; use one of {', '.join(SIZES)}")
_CONFIG, _DEFAULT_SEQ, BATCH_SIZE = SIZES[SIZE]
SEQ_LEN = int(os.environ.get("KARMA_SEQ", _DEFAULT_SEQ))
if SEQ_LEN < 4:
    raise ValueError(f"KARMA_SEQ={SEQ_LEN} is too short: the targets are KARMA_SEQ // 4 tokens; "
                     "use 4 or more")
TARGET_LEN = SEQ_LEN // 4


def build_model() -> torch.nn.Module:
    # use_cache=False: training needs no KV cache, and torch.export cannot return a cache object.
    # The decoder starts from the pad token (0), as in T5.
    config = T5Config(**_CONFIG, decoder_start_token_id=0, use_cache=False,
                      attn_implementation="sdpa")
    return T5ForConditionalGeneration(config)


def example_batch(batch_size: int):
    """({"input_ids", "attention_mask": [B, T], "labels": [B, T // 4]}, all int64; None)."""
    vocab = _CONFIG["vocab_size"]
    lengths = torch.randint(SEQ_LEN // 2 + 1, SEQ_LEN + 1, (batch_size, 1))
    return {
        "input_ids": torch.randint(0, vocab, (batch_size, SEQ_LEN)),
        "attention_mask": (torch.arange(SEQ_LEN) < lengths).long(),  # padding after the length
        "labels": torch.randint(0, vocab, (batch_size, TARGET_LEN)),
    }, None
