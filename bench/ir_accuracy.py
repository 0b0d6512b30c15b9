"""IR accuracy: the IR's saved bytes against what autograd really saves.

    .venv/bin/python bench/ir_accuracy.py [--whole-model]

1. Per block: for each example at its small test size and batch 4, the largest relative
   difference between what the IR says a block's backward reads (its act_bytes and the
   shared storages it saves) and what autograd saved for that block on real CPU tensors.
2. Whole model: the IR's total (each saved storage once: the blocks' act_bytes, the shared
   saved storages, the loss's) against autograd over the whole model's forward and loss,
   each storage once, parameters and buffers excluded: on the traced graph run unsplit on
   meta tensors with the IR's fused-attention rerouting ("traced"), and on the model file's
   own model on real CPU tensors ("eager"). "per block" is what summing each block's saved
   bytes would give (a storage several blocks save counted by each).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from karma.ir.build import build_block_graph  # noqa: E402
from karma.modelfile import load_model_file  # noqa: E402
from karma.testing.autograd_saved import (  # noqa: E402
    real_saved_bytes_per_block,
    whole_model_saved_bytes,
)
from karma.testing.exactness import SMALL_ENV  # noqa: E402

# (label, model file, environment, batch size)
WHOLE_MODEL_CASES = [
    ("gpt tiny", "examples/gpt.py", {"KARMA_GPT": "tiny"}, 4),
    ("gpt small T=128", "examples/gpt.py", {"KARMA_GPT": "small", "KARMA_SEQ": "128"}, 2),
    ("resnet tiny", "examples/resnet.py", {"KARMA_RESNET": "tiny"}, 4),
    ("resnet50 64px", "examples/resnet.py", {"KARMA_RESNET": "50", "KARMA_RESNET_IMAGE": "64"}, 2),
    ("mlp", "examples/mlp.py", SMALL_ENV["mlp"], 4),
    ("hf_gpt2 tiny", "examples/hf_gpt2.py", {"KARMA_HF_GPT2": "tiny"}, 2),
    ("unet", "tests/models/unet.py", {}, 4),
    ("llama tiny", "tests/models/hf_llama_tiny.py", {}, 2),
    # the Hugging Face zoo, unmodified (examples/hf_*.py at KARMA_HF=tiny)
    *[(f"{name} tiny", f"examples/{name}.py", {"KARMA_HF": "tiny"}, 2)
      for name in ("hf_llama", "hf_qwen2", "hf_mistral", "hf_mixtral", "hf_neox", "hf_bert",
                   "hf_t5", "hf_vit")],
]


def per_block() -> None:
    print(f"{'model':<8} {'blocks':>6} {'IR acts':>12} {'real acts':>12} {'max block err':>14}")
    for name in ("mlp", "gpt", "resnet"):
        with mock.patch.dict(os.environ, SMALL_ENV[name]):
            mf = load_model_file(ROOT / "examples" / f"{name}.py")
            graph = build_block_graph(mf, batch_size=4)
            torch.manual_seed(0)
            model = mf.build_model()
            inputs, _ = mf.checked_example_batch(4)
            real = real_saved_bytes_per_block(model, graph, inputs)
        ir = [graph.block_saved_bytes(i) for i in range(len(graph.blocks))]
        errs = [abs(b - r) / r for b, r in zip(ir, real)]
        print(f"{name:<8} {len(graph.blocks):>6} {sum(ir):>12,} {sum(real):>12,}"
              f" {max(errs):>13.4%}")


def whole_model() -> None:
    print(f"\n{'model':<16} {'per block':>12} {'IR total':>12} {'traced':>12} {'eager':>12}"
          f" {'IR/traced':>10} {'IR/eager':>9}  shared (producer->readers bytes)")
    for label, path, env, batch in WHOLE_MODEL_CASES:
        with mock.patch.dict(os.environ, env):
            mf = load_model_file(ROOT / path)
            graph = build_block_graph(mf, batch_size=batch)
            traced = whole_model_saved_bytes(mf, batch)
            eager = whole_model_saved_bytes(mf, batch, eager=True)
        summed = sum(graph.block_saved_bytes(i) for i in range(len(graph.blocks)))
        summed += graph.loss_act_bytes
        total = graph.saved_bytes + graph.loss_act_bytes
        shared = ", ".join(f"{'in' if s.producer < 0 else s.producer}->"
                           f"{','.join(map(str, s.readers))} {s.bytes:,}"
                           for s in graph.shared_saved[:4])
        more = len(graph.shared_saved) - 4
        print(f"{label:<16} {summed:>12,} {total:>12,} {traced:>12,} {eager:>12,}"
              f" {total / traced - 1:>+10.2%} {total / eager - 1:>+9.2%}  {shared}"
              + (f", +{more} more" if more > 0 else ""), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    if "--whole-model" not in sys.argv[1:]:
        per_block()
    whole_model()
