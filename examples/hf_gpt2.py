"""Hugging Face GPT-2 built from a config (no weights downloaded) as a karma model file.

Needs transformers (`pip install transformers`, or `pip install karma[hf]`).

    karma-plan examples/hf_gpt2.py --print-ir                          # GPT-2 small (124M), T=1024
    KARMA_HF_GPT2=tiny karma-plan examples/hf_gpt2.py --print-ir       # 2 layers, n_embd 64, T=64
    KARMA_SEQ=512 karma-plan examples/hf_gpt2.py ...                   # shorter sequences

The Hugging Face model returns a ModelOutput; `HFCausalLM` wraps it so that forward(input_ids)
returns the logits [B, T, vocab], and holds it as `lm`, so module paths read
`lm.transformer.h.0`. The per-layer blocks are the children of the nn.ModuleList
`lm.transformer.h`. Two things a planner must handle: the token embedding and the LM head share
one weight (tie_word_embeddings; torch.export gives it two placeholders), and `lm.transformer`
builds a bool causal mask [B, 1, T, T] once, outside the blocks, that every block reads.
"""

import os

import torch
from torch import nn

try:
    from transformers import GPT2Config, GPT2LMHeadModel
except ImportError as e:
    raise ImportError(
        "examples/hf_gpt2.py needs Hugging Face transformers; install it with "
        "`pip install transformers` (or `pip install karma[hf]`)"
    ) from e

_VARIANTS = {
    # name: (config fields, default sequence length, batch size)
    "small": (dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024), 1024, 8),
    "tiny": (dict(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128), 64, 2),
}

VARIANT = os.environ.get("KARMA_HF_GPT2", "small")
if VARIANT not in _VARIANTS:
    raise ValueError(f"KARMA_HF_GPT2={VARIANT!r} is not a known variant; use small or tiny")
_CONFIG, _DEFAULT_SEQ, BATCH_SIZE = _VARIANTS[VARIANT]
SEQ_LEN = int(os.environ.get("KARMA_SEQ", _DEFAULT_SEQ))
if not 1 <= SEQ_LEN <= _CONFIG["n_positions"]:
    raise ValueError(
        f"KARMA_SEQ={SEQ_LEN} is outside 1..{_CONFIG['n_positions']} (n_positions of the "
        f"{VARIANT} variant); pick a shorter sequence"
    )


class HFCausalLM(nn.Module):
    """forward(input_ids) -> logits [B, T, vocab] of the wrapped Hugging Face causal LM `lm`."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, use_cache=False, return_dict=True).logits


def build_model() -> nn.Module:
    # use_cache=False: the default cache object is not a registered pytree, so export fails.
    # sdpa attention exports on meta and is what a real run uses on the GPU.
    # bos/eos default to 50256, outside the tiny vocabulary; use the last token id instead.
    last_token = _CONFIG["vocab_size"] - 1
    config = GPT2Config(
        **_CONFIG, bos_token_id=last_token, eos_token_id=last_token,
        use_cache=False, attn_implementation="sdpa",
    )
    return HFCausalLM(GPT2LMHeadModel(config))


def example_batch(batch_size: int):
    """Random token ids [B, T] and targets [B, T], int64 (no device: follows the default).

    Two separate contiguous tensors rather than views of one shifted sequence: the data is
    random anyway, and separate storages keep byte counts and host-to-device copies simple.
    """
    vocab = _CONFIG["vocab_size"]
    input_ids = torch.randint(0, vocab, (batch_size, SEQ_LEN))
    targets = torch.randint(0, vocab, (batch_size, SEQ_LEN))
    return input_ids, targets
