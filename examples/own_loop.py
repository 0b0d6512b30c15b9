"""Your own training loop, with karma as a library: plan, train, evaluate, save.

    python examples/own_loop.py                                   # tiny GPT, CPU backend
    python examples/own_loop.py --model examples/mlp.py --gpu-mem 40M --steps 20
    KARMA_GPT=small python examples/own_loop.py --gpu-mem 800M --batch-size 2 --steps 50

The loop, the data, the logging and the evaluation are yours; karma plans the memory
(`karma.plan`, what karma-plan does) and runs each training step as planned
(`karma.Runtime.step`, what karma-run does on every step). With the model file's own data,
as here, the parameters come out bitwise those of `karma-run` on the same schedule.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

import karma


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(Path(__file__).with_name("gpt.py")))
    # the tiny GPT's keep_all needs under 1 MiB of tensors; its process outside them measured
    # 1.2-5.1 MiB ([Note: the process's own memory] in karma/calibrate/in_context.py)
    p.add_argument("--gpu-mem", default="16M", help="the memory budget (default 16M)")
    p.add_argument("--hardware", default="cpu")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--eval-every", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("out/own_loop"),
                   help="where the schedule and the final state go")
    args = p.parse_args(argv)
    os.environ.setdefault("KARMA_GPT", "tiny")  # read by examples/gpt.py when it is imported

    schedule = karma.plan(args.model, gpu_mem=args.gpu_mem, hardware=args.hardware,
                          batch_size=args.batch_size)
    args.out.mkdir(parents=True, exist_ok=True)
    schedule.save(args.out / "schedule.yaml")  # karma-run and karma-inspect read it too
    print(f"planned {len(schedule.blocks)} blocks for {args.gpu_mem}: predicted "
          f"{schedule.predicted.step_s:.3g} s and "
          f"{schedule.predicted.peak_device_bytes / 2**20:.1f} MiB per step")

    with karma.Runtime(schedule, seed=0) as rt:
        mf = rt.model_file  # your own data pipeline would go here instead
        data = mf.batches(rt.batch_size)
        held_out = _held_out(mf, rt.batch_size)
        for step in range(1, args.steps + 1):
            inputs, targets = next(data)
            t0 = time.perf_counter()
            loss = rt.step(inputs, targets)
            print(f"step {step}: loss {loss:.4f} in {time.perf_counter() - t0:.3f} s, "
                  f"peak {rt.last.peak_bytes / 2**20:.1f} MiB")
            if args.eval_every and step % args.eval_every == 0:
                losses = [rt.evaluate(x, y) for x, y in held_out]
                print(f"  eval loss {sum(losses) / len(losses):.4f}")
        torch.save(rt.state_dict()["model"], args.out / "model.pt")
    print(f"wrote {args.out / 'model.pt'} (loads into the model file's build_model())")


def _held_out(mf, batch_size: int) -> list:
    """The model file's eval_batches, or else one example batch drawn aside (the global RNG,
    which the training's dropout draws from, is left as it was)."""
    if mf.eval_batches is not None:
        return mf.checked_eval_batches(batch_size)  # drawn aside from the global RNG too
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(12345)
        return [mf.example_batch(batch_size)]


if __name__ == "__main__":
    try:
        main()
    except karma.KarmaError as e:  # bad input: one line that says what and how to fix it
        print(f"own_loop: error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
