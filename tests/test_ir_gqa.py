"""Hugging Face attention measured as eager runs it: grouped-query attention, causal masks.

See `_eager_attention_masks` in karma/ir/trace.py and [Note: fused attention on the meta
device] in karma/ir/measure.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from karma.ir.measure import _fused_sdpa
from karma.modelfile import load_model_file
from karma.testing.autograd_saved import whole_model_saved_bytes
from tests.test_ir_shared import ir_saved_bytes

ROOT = Path(__file__).parent.parent


@pytest.mark.parametrize("path, env", [
    ("examples/hf_llama.py", {"KARMA_HF": "tiny"}),
    ("examples/hf_qwen2.py", {"KARMA_HF": "tiny"}),
    ("examples/hf_mistral.py", {"KARMA_HF": "tiny"}),  # sliding window 32 < T 64: a mask
    ("examples/hf_mixtral.py", {"KARMA_HF": "tiny"}),
    ("examples/hf_neox.py", {"KARMA_HF": "tiny"}),  # no GQA, but the same causal-mask skip
    ("tests/models/hf_llama_tiny.py", {}),
])
def test_ir_total_is_eagers_for_hugging_face_decoders(monkeypatch, path, env):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    mf = load_model_file(ROOT / path)
    ir = ir_saved_bytes(mf, batch_size=2)
    eager = whole_model_saved_bytes(mf, 2, eager=True)
    assert abs(ir - eager) <= 0.02 * eager, (ir, eager)


def _saved_bytes(fn, *tensors, **kwargs) -> list[tuple[tuple[int, ...], torch.dtype, int]]:
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype, t.untyped_storage().nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*tensors, **kwargs)
    return sorted(saved, key=str)


@pytest.mark.parametrize("kwargs", [
    dict(is_causal=True, enable_gqa=True),
    dict(attn_mask=torch.ones(16, 16, dtype=torch.bool).tril()[None, None], enable_gqa=True),
    dict(attn_mask=torch.ones(16, 16, dtype=torch.bool).tril()[None, None]),
])
def test_meta_sdpa_saves_what_the_cpu_kernel_saves(kwargs):
    """GQA: key and value saved unexpanded; a boolean mask: saved as a new float mask."""
    heads_kv = 2 if kwargs.get("enable_gqa") else 4
    shapes = [(2, 4, 16, 8), (2, heads_kv, 16, 8), (2, heads_kv, 16, 8)]
    real = [torch.randn(s, requires_grad=True) for s in shapes]
    meta = [torch.empty(s, device="meta", requires_grad=True) for s in shapes]
    meta_kwargs = {k: v.to("meta") if isinstance(v, torch.Tensor) else v
                   for k, v in kwargs.items()}
    expected = _saved_bytes(F.scaled_dot_product_attention, *real, **kwargs)
    assert _saved_bytes(_fused_sdpa, *meta, **meta_kwargs) == expected
