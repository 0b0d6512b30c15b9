"""Hugging Face BERT (BertForMaskedLM) from a config (no weights downloaded), unmodified.

Needs transformers (`pip install transformers`, or `pip install karma[hf]`).

    karma-plan examples/hf_bert.py --print-ir                     # BERT-base, T=512
    KARMA_HF=large karma-plan examples/hf_bert.py --print-ir      # BERT-large
    KARMA_HF=tiny karma-plan examples/hf_bert.py --print-ir       # 2 layers, hidden 64, T=64
    KARMA_SEQ=128 karma-plan examples/hf_bert.py --hardware v100-16g --gpu-mem 8G  # shorter sequences

Masked-language-model pretraining on random tokens: each sequence is padded after a random
length (attention_mask 0 there), and 15% of the real tokens are replaced by [MASK]; `labels`
holds the original token at those positions and -100 (ignored) elsewhere. The inputs are
keyword arguments, `model(input_ids=..., attention_mask=..., labels=...)`; the model computes
its own loss (`output.loss`), so there are no targets. `bert` turns the attention mask into an
additive [B, 1, T, T] mask once, before `bert.encoder.layer.0`, and every layer reads it. The
word embedding and the MLM decoder share one weight.
"""

import os

import torch

try:
    from transformers import BertConfig, BertForMaskedLM
except ImportError as e:
    raise ImportError("examples/hf_bert.py needs Hugging Face transformers; install it with "
                      "`pip install transformers` (or `pip install karma[hf]`)") from e

SIZES = {
    # name: (config fields, default sequence length, batch size)
    "tiny": (dict(num_hidden_layers=2, hidden_size=64, intermediate_size=256,
                  num_attention_heads=4, vocab_size=512, max_position_embeddings=128), 64, 2),
    "base": (dict(num_hidden_layers=12, hidden_size=768, intermediate_size=3072,
                  num_attention_heads=12, vocab_size=30522, max_position_embeddings=512), 512, 32),
    "large": (dict(num_hidden_layers=24, hidden_size=1024, intermediate_size=4096,
                   num_attention_heads=16, vocab_size=30522, max_position_embeddings=512), 512, 32),
}
SIZE = os.environ.get("KARMA_HF", "base")
if SIZE not in SIZES:
    raise ValueError(f"KARMA_HF={SIZE!r} is not a BERT size; use one of {', '.join(SIZES)}")
_CONFIG, _DEFAULT_SEQ, BATCH_SIZE = SIZES[SIZE]
SEQ_LEN = int(os.environ.get("KARMA_SEQ", _DEFAULT_SEQ))
if not 1 <= SEQ_LEN <= _CONFIG["max_position_embeddings"]:
    raise ValueError(f"KARMA_SEQ={SEQ_LEN} is outside 1..{_CONFIG['max_position_embeddings']} "
                     f"(max_position_embeddings of the {SIZE} size); pick a shorter sequence")
MASK_ID = 103  # [MASK] in BERT's vocabulary (inside the tiny one too)


def build_model() -> torch.nn.Module:
    # use_cache=False: an encoder never uses it, but the config's default says True.
    config = BertConfig(**_CONFIG, use_cache=False, attn_implementation="sdpa")
    return BertForMaskedLM(config)


def example_batch(batch_size: int):
    """({"input_ids", "attention_mask", "labels"}: int64 [B, T], None)."""
    tokens = torch.randint(0, _CONFIG["vocab_size"], (batch_size, SEQ_LEN))
    lengths = torch.randint(SEQ_LEN // 2 + 1, SEQ_LEN + 1, (batch_size, 1))
    attention_mask = torch.arange(SEQ_LEN) < lengths  # padding after each sequence's length
    masked = (torch.rand(batch_size, SEQ_LEN) < 0.15) & attention_mask
    return {
        "input_ids": torch.where(masked, MASK_ID, tokens),
        "attention_mask": attention_mask.long(),
        "labels": torch.where(masked, tokens, -100),  # -100: no loss at this position
    }, None
