"""karma-plan: turn a model file into a block graph (and, with the planner, a schedule).

    karma-plan examples/gpt.py --print-ir
    KARMA_GPT=xl karma-plan examples/gpt.py --print-ir --batch-size 8 --json
"""

from __future__ import annotations

import argparse

from karma.cli.common import positive_int, run_cli
from karma.errors import KarmaError
from karma.ir import build_block_graph
from karma.modelfile import load_model_file


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="karma-plan",
        description="Plan out-of-core training for a model file (see README: model files).",
    )
    p.add_argument("model", help="a model file: a Python file defining build_model() and "
                                 "example_batch(batch_size)")
    p.add_argument("--print-ir", action="store_true",
                   help="print the block graph (blocks, sizes, FLOPs, edges) and exit")
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help="samples per step and rank (default: the model file's BATCH_SIZE, or 8)")
    p.add_argument("--blocks", metavar="REGEX", default=None,
                   help="module paths whose calls are blocks, e.g. 'h\\.\\d+' "
                        "(default: every call of a repeated layer)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    return p


def _plan(args: argparse.Namespace) -> int:
    mf = load_model_file(args.model)
    graph = build_block_graph(mf, args.batch_size, args.blocks, model_name=args.model)
    if args.print_ir:
        print(graph.to_json() if args.json else graph.table())
        return 0
    raise KarmaError("planning is not available in this version; use --print-ir to see the "
                     "block graph")


def main(argv: list[str] | None = None) -> int:
    return run_cli("karma-plan", _plan, _parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
