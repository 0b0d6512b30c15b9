"""Hugging Face Mixtral (MixtralForCausalLM) from a config (no weights downloaded), unmodified.

Needs transformers (`pip install transformers`, or `pip install karma[hf]`).

    karma-plan examples/hf_mixtral.py --print-ir                  # Mixtral-8x7B-like, T=4096
    KARMA_HF=tiny karma-plan examples/hf_mixtral.py --print-ir    # 2 layers, 4 experts, T=64
    KARMA_SEQ=1024 karma-plan examples/hf_mixtral.py --hardware h100-80g --gpu-mem 80G

A mixture of experts: each layer's feed-forward is 8 SwiGLU experts (4 for tiny), and a router
sends every token to its top 2, so which expert sees which token depends on the data. The
experts of a layer are stored as two 3-D parameters ([experts, 2 * ffn, hidden] and
[experts, hidden, ffn]) and run with "grouped_mm": tokens sorted by expert, one grouped
matrix multiply whose group sizes are tensors. Every shape is then static (tokens x top-k
rows), so torch.export traces it; the "eager" implementation loops over the experts that
received tokens, a data-dependent loop that torch.export cannot trace. In the exported fp32
graph the expert matmuls are the custom op `transformers::grouped_mm_fallback`, which
torch's FlopCounterMode does not know (nor `aten._grouped_mm`); karma registers their FLOP
formulas when it measures blocks (karma/ir/measure.py). The inputs are keyword
arguments, `model(input_ids=..., labels=...)`; the model computes its own next-token loss
(`output.loss`; no router auxiliary loss), so there are no targets.
"""

import os

import torch

try:
    from transformers import MixtralConfig, MixtralForCausalLM
except ImportError as e:
    raise ImportError("examples/hf_mixtral.py needs Hugging Face transformers; install it with "
                      "`pip install transformers` (or `pip install karma[hf]`)") from e

SIZES = {
    # name: (config fields, default sequence length, batch size)
    "tiny": (dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                  num_local_experts=4, max_position_embeddings=128), 64, 2),
    "8x7b": (dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336,
                  num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                  num_local_experts=8, max_position_embeddings=32768,
                  rope_parameters=dict(rope_type="default", rope_theta=1000000.0)), 4096, 1),
}
SIZE = os.environ.get("KARMA_HF", "8x7b")
if SIZE not in SIZES:
    raise ValueError(f"KARMA_HF={SIZE!r} is not a Mixtral size; use one of {', '.join(SIZES)}")
_CONFIG, _DEFAULT_SEQ, BATCH_SIZE = SIZES[SIZE]
SEQ_LEN = int(os.environ.get("KARMA_SEQ", _DEFAULT_SEQ))
if not 1 <= SEQ_LEN <= _CONFIG["max_position_embeddings"]:
    raise ValueError(f"KARMA_SEQ={SEQ_LEN} is outside 1..{_CONFIG['max_position_embeddings']} "
                     f"(max_position_embeddings of the {SIZE} size); pick a shorter sequence")


def build_model() -> torch.nn.Module:
    # use_cache=False: training needs no KV cache, and torch.export cannot return a DynamicCache.
    # experts_implementation="grouped_mm" is the default, named here because export needs it
    # ("eager" fails: GuardOnDataDependentSymNode in its loop over the experts hit).
    config = MixtralConfig(**_CONFIG, num_experts_per_tok=2, use_cache=False,
                           attn_implementation="sdpa", experts_implementation="grouped_mm")
    return MixtralForCausalLM(config)


def example_batch(batch_size: int):
    """({"input_ids", "labels"}: int64 [B, T], None): the model shifts the labels itself.

    labels is a copy, not the same tensor: separate storages keep byte counts and
    host-to-device copies simple.
    """
    input_ids = torch.randint(0, _CONFIG["vocab_size"], (batch_size, SEQ_LEN))
    return {"input_ids": input_ids, "labels": input_ids.clone()}, None
