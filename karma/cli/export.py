"""karma-export: a checkpoint as a plain state_dict file, for any PyTorch code.

    karma-export ckpt -o model.pt                    # the newest complete checkpoint in ckpt
    karma-export ckpt/step_40 -o model.safetensors   # one checkpoint, as safetensors
    karma-export ckpt -o model.pt --optimizer        # and model.optimizer.pt beside it

Exit codes: 0 written; 2 bad input (no complete checkpoint, a damaged one, no safetensors).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from karma.cli.common import run_cli
from karma.units import format_bytes

PROG = "karma-export"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Export a karma checkpoint as a plain "
                                                       "state_dict file.")
    p.add_argument("checkpoint", help="a --checkpoint-dir (its newest complete checkpoint) "
                                      "or one of its step_N directories")
    p.add_argument("-o", "--output", required=True, metavar="FILE",
                   help="the model's state_dict (.safetensors: in that format)")
    p.add_argument("--safetensors", action="store_true",
                   help="write safetensors whatever FILE's suffix (needs the package)")
    p.add_argument("--optimizer", action="store_true",
                   help="also write the whole optimizer state as FILE's stem + .optimizer.pt")
    return p


def _export(args: argparse.Namespace) -> int:
    from karma.runtime.checkpoints.export import export_checkpoint, resolve

    step_dir = resolve(Path(args.checkpoint))
    written = export_checkpoint(step_dir, args.output, optimizer=args.optimizer,
                                fmt="safetensors" if args.safetensors else None)
    for path in written:
        print(f"wrote {path} ({format_bytes(path.stat().st_size)}) from {step_dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(PROG, _export, _parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
