"""Hugging Face Qwen2 (Qwen2ForCausalLM) from a config (no weights downloaded), unmodified.

Needs transformers (`pip install transformers`, or `pip install karma[hf]`).

    karma-plan examples/hf_qwen2.py --print-ir                    # Qwen2-7B-like, T=4096
    KARMA_HF=0.5b karma-plan examples/hf_qwen2.py --print-ir      # Qwen2-0.5B-like (tied)
    KARMA_HF=tiny karma-plan examples/hf_qwen2.py --print-ir      # 2 layers, hidden 64, T=64
    KARMA_SEQ=1024 karma-plan examples/hf_qwen2.py --hardware a100-80g --gpu-mem 40G  # shorter sequences

Like Llama (grouped-query attention, rotary embeddings, RMSNorm, SwiGLU), plus biases on the
query, key and value projections and a 152K-token vocabulary, whose embedding and LM head are
a large share of the parameters. The inputs are keyword arguments, `model(input_ids=...,
labels=...)`; the model computes its own next-token loss (`output.loss`), so there are no
targets. The rotary cos/sin and the causal mask are made once, before `model.layers.0`, and
read by every layer.
"""

import os

import torch

try:
    from transformers import Qwen2Config, Qwen2ForCausalLM
except ImportError as e:
    raise ImportError("examples/hf_qwen2.py needs Hugging Face transformers; install it with "
                      "`pip install transformers` (or `pip install karma[hf]`)") from e

_QWEN2 = dict(rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
              max_position_embeddings=32768)
SIZES = {
    # name: (config fields, default sequence length, batch size)
    "tiny": (dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                  max_position_embeddings=128), 64, 2),
    "0.5b": (dict(_QWEN2, num_hidden_layers=24, hidden_size=896, intermediate_size=4864,
                  num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                  tie_word_embeddings=True), 4096, 2),
    "7b": (dict(_QWEN2, num_hidden_layers=28, hidden_size=3584, intermediate_size=18944,
                num_attention_heads=28, num_key_value_heads=4, vocab_size=152064), 4096, 1),
}
SIZE = os.environ.get("KARMA_HF", "7b")
if SIZE not in SIZES:
    raise ValueError(f"KARMA_HF={SIZE!r} is not a Qwen2 size; use one of {', '.join(SIZES)}")
_CONFIG, _DEFAULT_SEQ, BATCH_SIZE = SIZES[SIZE]
SEQ_LEN = int(os.environ.get("KARMA_SEQ", _DEFAULT_SEQ))
if not 1 <= SEQ_LEN <= _CONFIG["max_position_embeddings"]:
    raise ValueError(f"KARMA_SEQ={SEQ_LEN} is outside 1..{_CONFIG['max_position_embeddings']} "
                     f"(max_position_embeddings of the {SIZE} size); pick a shorter sequence")


def build_model() -> torch.nn.Module:
    # use_cache=False: training needs no KV cache, and torch.export cannot return a DynamicCache.
    config = Qwen2Config(**_CONFIG, use_cache=False, attn_implementation="sdpa")
    return Qwen2ForCausalLM(config)


def example_batch(batch_size: int):
    """({"input_ids", "labels"}: int64 [B, T], None): the model shifts the labels itself.

    labels is a copy, not the same tensor: separate storages keep byte counts and
    host-to-device copies simple.
    """
    input_ids = torch.randint(0, _CONFIG["vocab_size"], (batch_size, SEQ_LEN))
    return {"input_ids": input_ids, "labels": input_ids.clone()}, None
