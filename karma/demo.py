"""`make demo`: karma's main job on an embedded default.

Today this traces GPT-2 (an example model file) on the meta device, so that no memory is
allocated, and prints its block graph and what training it in-core would need. Run it as
`python -m karma.demo [MODEL.py]`.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from karma.ir import build_block_graph
from karma.modelfile import load_model_file
from karma.units import format_bytes

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "examples" / "gpt.py"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    path = Path(argv[0]) if argv else DEFAULT_MODEL
    os.environ.setdefault("KARMA_GPT", "small")
    mf = load_model_file(path)
    start = time.perf_counter()
    graph = build_block_graph(mf, model_name=str(path))
    traced_s = time.perf_counter() - start
    print(graph.table())
    weights = graph.total_param_bytes
    acts = sum(b.act_bytes for b in graph.blocks) + graph.loss_act_bytes
    in_core = 4 * weights + acts  # weights, gradients, AdamW's two moments, activations
    print(
        f"\nIn-core training at batch {graph.batch_size} needs about {format_bytes(in_core)} on "
        f"the device: {format_bytes(weights)} of weights, as much again of gradients, twice that "
        f"of AdamW state, and {format_bytes(acts)} of saved activations.\n"
        f"Traced on the meta device in {traced_s:.1f} s without allocating the model."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
