"""Hugging Face Mistral (MistralForCausalLM) from a config (no weights downloaded), unmodified.

Needs transformers (`pip install transformers`, or `pip install karma[hf]`).

    karma-plan examples/hf_mistral.py --print-ir                   # Mistral-7B-v0.1-like, T=4096
    KARMA_HF=tiny karma-plan examples/hf_mistral.py --print-ir     # 2 layers, hidden 64, T=64
    KARMA_SEQ=8192 karma-plan examples/hf_mistral.py --hardware h100-80g --gpu-mem 80G  # longer sequences

Like Llama (grouped-query attention, rotary embeddings), with sliding-window attention: each
token attends to the last `sliding_window` tokens only (4096 for 7B; 32 for tiny, so that the
tiny sequences of 64 tokens use the window). The window is in the mask, which `model.model`
builds once, before the first layer, and every layer `model.layers.N` reads. The inputs are
keyword arguments, `model(input_ids=..., labels=...)`; the model computes its own next-token
loss (`output.loss`), so there are no targets.
"""

import os

import torch

try:
    from transformers import MistralConfig, MistralForCausalLM
except ImportError as e:
    raise ImportError("examples/hf_mistral.py needs Hugging Face transformers; install it with "
                      "`pip install transformers` (or `pip install karma[hf]`)") from e

SIZES = {
    # name: (config fields, default sequence length, batch size)
    "tiny": (dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                  max_position_embeddings=128, sliding_window=32), 64, 2),
    "7b": (dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336,
                num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                max_position_embeddings=32768, sliding_window=4096), 4096, 1),
}
SIZE = os.environ.get("KARMA_HF", "7b")
if SIZE not in SIZES:
    raise ValueError(f"KARMA_HF={SIZE!r} is not a Mistral size; use one of {', '.join(SIZES)}")
_CONFIG, _DEFAULT_SEQ, BATCH_SIZE = SIZES[SIZE]
SEQ_LEN = int(os.environ.get("KARMA_SEQ", _DEFAULT_SEQ))
if not 1 <= SEQ_LEN <= _CONFIG["max_position_embeddings"]:
    raise ValueError(f"KARMA_SEQ={SEQ_LEN} is outside 1..{_CONFIG['max_position_embeddings']} "
                     f"(max_position_embeddings of the {SIZE} size); pick a shorter sequence")


def build_model() -> torch.nn.Module:
    # use_cache=False: training needs no KV cache, and torch.export cannot return a DynamicCache.
    config = MistralConfig(**_CONFIG, use_cache=False, attn_implementation="sdpa")
    return MistralForCausalLM(config)


def example_batch(batch_size: int):
    """({"input_ids", "labels"}: int64 [B, T], None): the model shifts the labels itself.

    labels is a copy, not the same tensor: separate storages keep byte counts and
    host-to-device copies simple.
    """
    input_ids = torch.randint(0, _CONFIG["vocab_size"], (batch_size, SEQ_LEN))
    return {"input_ids": input_ids, "labels": input_ids.clone()}, None
