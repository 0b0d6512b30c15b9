"""Hugging Face Llama (LlamaForCausalLM) from a config (no weights downloaded), unmodified.

Needs transformers (`pip install transformers`, or `pip install karma[hf]`).

    karma-plan examples/hf_llama.py --print-ir                    # Llama-3-8B-like, T=4096
    KARMA_HF=1b karma-plan examples/hf_llama.py --print-ir        # Llama-3.2-1B-like (tied)
    KARMA_HF=tiny karma-plan examples/hf_llama.py --print-ir      # 2 layers, hidden 64, T=64
    KARMA_SEQ=1024 karma-plan examples/hf_llama.py --hardware a100-80g --gpu-mem 40G  # shorter sequences

The inputs are keyword arguments, `model(input_ids=..., labels=...)`, and the model computes its
own next-token loss (`output.loss`; it shifts the labels itself), so there are no targets.
Grouped-query attention (8 key/value heads for 32 query heads) and rotary position embeddings:
`model.model` computes the rotary cos/sin tables and the causal mask once, before the first
layer, and every layer `model.layers.N` reads them.
"""

import os

import torch

try:
    from transformers import LlamaConfig, LlamaForCausalLM
except ImportError as e:
    raise ImportError("examples/hf_llama.py needs Hugging Face transformers; install it with "
                      "`pip install transformers` (or `pip install karma[hf]`)") from e

_LLAMA3 = dict(vocab_size=128256, rope_parameters=dict(rope_type="default", rope_theta=500000.0),
               bos_token_id=128000, eos_token_id=128001, max_position_embeddings=8192)
SIZES = {
    # name: (config fields, default sequence length, batch size)
    "tiny": (dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                  max_position_embeddings=128, bos_token_id=1, eos_token_id=2), 64, 2),
    "1b": (dict(_LLAMA3, num_hidden_layers=16, hidden_size=2048, intermediate_size=8192,
                num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True), 4096, 2),
    "8b": (dict(_LLAMA3, num_hidden_layers=32, hidden_size=4096, intermediate_size=14336,
                num_attention_heads=32, num_key_value_heads=8), 4096, 1),
}
SIZE = os.environ.get("KARMA_HF", "8b")
if SIZE not in SIZES:
    raise ValueError(f"KARMA_HF={SIZE!r} is not a Llama size; use one of {', '.join(SIZES)}")
_CONFIG, _DEFAULT_SEQ, BATCH_SIZE = SIZES[SIZE]
SEQ_LEN = int(os.environ.get("KARMA_SEQ", _DEFAULT_SEQ))
if not 1 <= SEQ_LEN <= _CONFIG["max_position_embeddings"]:
    raise ValueError(f"KARMA_SEQ={SEQ_LEN} is outside 1..{_CONFIG['max_position_embeddings']} "
                     f"(max_position_embeddings of the {SIZE} size); pick a shorter sequence")


def build_model() -> torch.nn.Module:
    # use_cache=False: training needs no KV cache, and torch.export cannot return a DynamicCache.
    config = LlamaConfig(**_CONFIG, use_cache=False, attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def example_batch(batch_size: int):
    """({"input_ids", "labels"}: int64 [B, T], None): the model shifts the labels itself.

    labels is a copy, not the same tensor: separate storages keep byte counts and
    host-to-device copies simple.
    """
    input_ids = torch.randint(0, _CONFIG["vocab_size"], (batch_size, SEQ_LEN))
    return {"input_ids": input_ids, "labels": input_ids.clone()}, None
