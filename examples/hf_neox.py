"""Hugging Face GPT-NeoX (GPTNeoXForCausalLM) from a config (no weights downloaded), unmodified.

Needs transformers (`pip install transformers`, or `pip install karma[hf]`).

    karma-plan examples/hf_neox.py --print-ir                     # Pythia-6.9B-like, T=2048
    KARMA_HF=1b karma-plan examples/hf_neox.py --print-ir         # Pythia-1B-like
    KARMA_HF=tiny karma-plan examples/hf_neox.py --print-ir       # 2 layers, hidden 64, T=64
    KARMA_SEQ=1024 karma-plan examples/hf_neox.py --hardware a100-80g --gpu-mem 40G  # shorter sequences

The Pythia architecture: rotary embeddings on a quarter of each head's dimensions, and a
parallel residual (x + attn(ln1(x)) + mlp(ln2(x))). The inputs are keyword arguments,
`model(input_ids=..., labels=...)`; the model computes its own next-token loss (`output.loss`),
so there are no targets. `gpt_neox` computes the rotary cos/sin and the causal mask once,
before the first layer, and every layer `gpt_neox.layers.N` reads them.
"""

import os

import torch

try:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
except ImportError as e:
    raise ImportError("examples/hf_neox.py needs Hugging Face transformers; install it with "
                      "`pip install transformers` (or `pip install karma[hf]`)") from e

_ROPE = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25)
SIZES = {
    # name: (config fields, default sequence length, batch size)
    "tiny": (dict(num_hidden_layers=2, hidden_size=64, intermediate_size=256,
                  num_attention_heads=4, vocab_size=512, max_position_embeddings=128), 64, 2),
    "1b": (dict(num_hidden_layers=16, hidden_size=2048, intermediate_size=8192,
                num_attention_heads=8, vocab_size=50304, max_position_embeddings=2048), 2048, 4),
    "6.9b": (dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=16384,
                  num_attention_heads=32, vocab_size=50432, max_position_embeddings=2048), 2048, 2),
}
SIZE = os.environ.get("KARMA_HF", "6.9b")
if SIZE not in SIZES:
    raise ValueError(f"KARMA_HF={SIZE!r} is not a GPT-NeoX size; use one of {', '.join(SIZES)}")
_CONFIG, _DEFAULT_SEQ, BATCH_SIZE = SIZES[SIZE]
SEQ_LEN = int(os.environ.get("KARMA_SEQ", _DEFAULT_SEQ))
if not 1 <= SEQ_LEN <= _CONFIG["max_position_embeddings"]:
    raise ValueError(f"KARMA_SEQ={SEQ_LEN} is outside 1..{_CONFIG['max_position_embeddings']} "
                     f"(max_position_embeddings of the {SIZE} size); pick a shorter sequence")


def build_model() -> torch.nn.Module:
    # use_cache=False: training needs no KV cache, and torch.export cannot return a DynamicCache.
    # bos/eos default to 0 and 2: inside every vocabulary here.
    config = GPTNeoXConfig(**_CONFIG, rope_parameters=_ROPE, use_parallel_residual=True,
                           use_cache=False, attn_implementation="sdpa")
    return GPTNeoXForCausalLM(config)


def example_batch(batch_size: int):
    """({"input_ids", "labels"}: int64 [B, T], None): the model shifts the labels itself.

    labels is a copy, not the same tensor: separate storages keep byte counts and
    host-to-device copies simple.
    """
    input_ids = torch.randint(0, _CONFIG["vocab_size"], (batch_size, SEQ_LEN))
    return {"input_ids": input_ids, "labels": input_ids.clone()}, None
