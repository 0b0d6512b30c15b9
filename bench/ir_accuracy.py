"""IR accuracy: each block's act_bytes (measured on meta) against a real CPU forward.

    .venv/bin/python bench/ir_accuracy.py

Prints, per example at its small test size and batch 4, the largest relative difference
between a block's act_bytes and what autograd saved for that block on real CPU tensors.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from karma.ir import build_block_graph  # noqa: E402
from karma.modelfile import load_model_file  # noqa: E402
from tests.conftest import SMALL_ENV  # noqa: E402
from tests.test_ir import real_saved_bytes_per_block  # noqa: E402


def main() -> None:
    print(f"{'model':<8} {'blocks':>6} {'IR acts':>12} {'real acts':>12} {'max block err':>14}")
    for name in ("mlp", "gpt", "resnet"):
        os.environ.update(SMALL_ENV[name])
        mf = load_model_file(ROOT / "examples" / f"{name}.py")
        graph = build_block_graph(mf, batch_size=4)
        import torch

        torch.manual_seed(0)
        model = mf.build_model()
        inputs, _ = mf.checked_example_batch(4)
        real = real_saved_bytes_per_block(model, graph, inputs)
        errs = [abs(b.act_bytes - r) / r for b, r in zip(graph.blocks, real)]
        print(f"{name:<8} {len(graph.blocks):>6} {sum(b.act_bytes for b in graph.blocks):>12,}"
              f" {sum(real):>12,} {max(errs):>13.4%}")


if __name__ == "__main__":
    main()
