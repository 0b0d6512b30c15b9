"""Hugging Face GPT-2 (GPT2LMHeadModel) from a config (no weights downloaded), unmodified.

Needs transformers (`pip install transformers`, or `pip install karma[hf]`).

    karma-plan examples/hf_gpt2.py --print-ir                     # GPT-2 small (124M), T=1024
    KARMA_HF=tiny karma-plan examples/hf_gpt2.py --print-ir       # 2 layers, n_embd 64, T=64
    KARMA_HF=xl karma-plan examples/hf_gpt2.py --print-ir         # GPT-2 XL (1.5B)
    KARMA_SEQ=512 karma-plan examples/hf_gpt2.py ...              # shorter sequences

KARMA_HF_GPT2 is the older name of KARMA_HF here and wins when both are set. The inputs are
keyword arguments, `model(input_ids=..., labels=...)`; the model computes its own next-token
loss (`output.loss`; it shifts the labels itself), so there are no targets. Module paths
read `transformer.h.0`; the per-layer blocks are the children of the nn.ModuleList
`transformer.h`. Two things a planner must handle: the token embedding and the LM head share
one weight (tie_word_embeddings; torch.export gives it two placeholders), and `transformer`
builds a bool causal mask [B, 1, T, T] once, outside the blocks, that every block reads.
"""

import os

import torch

try:
    from transformers import GPT2Config, GPT2LMHeadModel
except ImportError as e:
    raise ImportError("examples/hf_gpt2.py needs Hugging Face transformers; install it with "
                      "`pip install transformers` (or `pip install karma[hf]`)") from e

_GPT2 = dict(vocab_size=50257, n_positions=1024)
SIZES = {
    # name: (config fields, default sequence length, batch size)
    "tiny": (dict(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128), 64, 2),
    "small": (dict(_GPT2, n_layer=12, n_embd=768, n_head=12), 1024, 8),
    "medium": (dict(_GPT2, n_layer=24, n_embd=1024, n_head=16), 1024, 8),
    "xl": (dict(_GPT2, n_layer=48, n_embd=1600, n_head=25), 1024, 8),
}
_VAR = "KARMA_HF_GPT2" if os.environ.get("KARMA_HF_GPT2") else "KARMA_HF"
SIZE = os.environ.get(_VAR, "small")
if SIZE not in SIZES:
    raise ValueError(f"{_VAR}={SIZE!r} is not a GPT-2 size; use one of {', '.join(SIZES)}")
_CONFIG, _DEFAULT_SEQ, BATCH_SIZE = SIZES[SIZE]
SEQ_LEN = int(os.environ.get("KARMA_SEQ", _DEFAULT_SEQ))
if not 1 <= SEQ_LEN <= _CONFIG["n_positions"]:
    raise ValueError(f"KARMA_SEQ={SEQ_LEN} is outside 1..{_CONFIG['n_positions']} (n_positions "
                     f"of the {SIZE} size); pick a shorter sequence")


def build_model() -> torch.nn.Module:
    # use_cache=False: training needs no KV cache, and torch.export cannot return a DynamicCache.
    # bos/eos default to 50256, outside the tiny vocabulary; use the last token id instead.
    last_token = _CONFIG["vocab_size"] - 1
    config = GPT2Config(**_CONFIG, bos_token_id=last_token, eos_token_id=last_token,
                        use_cache=False, attn_implementation="sdpa")
    return GPT2LMHeadModel(config)


def example_batch(batch_size: int):
    """({"input_ids", "labels"}: int64 [B, T], None): the model shifts the labels itself.

    labels is a copy, not the same tensor: separate storages keep byte counts and
    host-to-device copies simple.
    """
    input_ids = torch.randint(0, _CONFIG["vocab_size"], (batch_size, SEQ_LEN))
    return {"input_ids": input_ids, "labels": input_ids.clone()}, None
