"""How far the host optimizer's fused kernel moves training from the plain PyTorch loop.

    .venv/bin/python bench/fused_vs_plain.py [--steps 100] [--seed 0]
        [--plot bench/fused_vs_plain.png] [--json FILE]

The demo's model (karma/demo.py: examples/gpt.py at GPT-2 small, sequence 64, batch 2) is
trained twice by the plain loop of karma.reference (train_reference), from the same seed and
the same batches, on the CPU under one thread, as karma's exactness references run:
- plain: the model file's optimizer as it makes it (AdamW on CPU tensors: PyTorch's default
  single-tensor path);
- fused: every parameter stepped by `host_make_optimizer(mf.make_optimizer, "fused")`, the
  same AdamW on torch's fused CPU kernel: what karma computes when every block is stepped on
  the host (`--strategy offload_all`). The kernel is elementwise: one optimizer over all
  parameters steps them to the same bits as one optimizer per block does.

Printed, after step 1, step 10 and the last step, with p a parameter of the plain run and f
the same parameter of the fused run:
- relative difference: max over parameters of max|f - p| / max|p| (the parameter named);
- the whole model's: ||f - p|| / ||p||, Euclidean norms over all parameters together;
- the share of elements whose bits differ.
Then both final losses and the largest difference between the two loss curves. The plot shows
both curves overlaid beside their difference (fused minus plain).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from karma.demo import BATCH, ENV  # noqa: E402 - the demo's model size and batch
from karma.modelfile import ModelFile, load_model_file  # noqa: E402
from karma.reference import train_reference  # noqa: E402
from karma.runtime.params.host_optimizer import host_make_optimizer, is_fused  # noqa: E402

TINY = torch.finfo(torch.float32).tiny


@dataclasses.dataclass(frozen=True)
class Run:
    """One training run: its losses and copies of its parameters after some steps."""

    losses: list[float]  # per step
    params: dict[int, list[torch.Tensor]]  # step -> parameters, in model.parameters() order
    names: list[str]  # the parameters' names, in the same order
    wall_s: float


@dataclasses.dataclass(frozen=True)
class Difference:
    """How far the fused run's parameters are from the plain run's after a given step."""

    step: int
    relative: float  # max over parameters of max|f - p| / max|p|
    worst: str  # the parameter where `relative` is reached
    whole: float  # ||f - p|| / ||p|| over all parameters together
    differing: float  # share of elements whose bits differ


def train(mf: ModelFile, make_optimizer: Callable, steps: int, seed: int,
          keep: list[int]) -> Run:
    """train_reference with `make_optimizer` for the model file's, the parameters copied
    after each step in `keep`."""
    params: list[torch.Tensor] = []
    copies: dict[int, list[torch.Tensor]] = {}

    def recording(ps) -> torch.optim.Optimizer:
        params.extend(ps)  # train_reference makes its optimizer over model.parameters()
        return make_optimizer(params)

    step = 0

    def on_step() -> None:
        nonlocal step
        step += 1
        if step in keep:
            copies[step] = [p.detach().clone() for p in params]

    start = time.perf_counter()
    run = train_reference(dataclasses.replace(mf, make_optimizer=recording), int(BATCH), steps,
                          seed, on_step=on_step)
    wall_s = time.perf_counter() - start
    names = [n for n, _ in run.model.named_parameters()]
    return Run(run.losses, copies, names, wall_s)


def checked_fused(make_optimizer: Callable) -> Callable:
    """host_make_optimizer(make_optimizer, "fused"), failing if it did not take the fused
    kernel (the comparison would then be of the plain path with itself)."""
    make = host_make_optimizer(make_optimizer, "fused")

    def made(params) -> torch.optim.Optimizer:
        opt = make(params)
        if not is_fused(opt):
            raise RuntimeError(f"the model file's {type(opt).__name__} cannot step through "
                               "the fused CPU kernel (host_optimizer.can_fuse)")
        return opt

    return made


def difference(step: int, plain: list[torch.Tensor], fused: list[torch.Tensor],
               names: list[str]) -> Difference:
    """The fused run's parameters against the plain run's (Difference's fields)."""
    relative, worst, gap_sq, norm_sq, differing, total = 0.0, "", 0.0, 0.0, 0, 0
    for p, f, name in zip(plain, fused, names):
        gap = (f - p).abs()
        rel = (gap.max() / p.abs().max().clamp_min(TINY)).item()
        if rel > relative:
            relative, worst = rel, name
        gap_sq += gap.double().square().sum().item()
        norm_sq += p.double().square().sum().item()
        differing += int((f.view(torch.int32) != p.view(torch.int32)).sum())
        total += p.numel()
    return Difference(step, relative, worst, (gap_sq / norm_sq) ** 0.5, differing / total)


def plot(plain: list[float], fused: list[float], path: Path, title: str) -> None:
    """Both loss curves overlaid, beside their difference, as a PNG at `path`."""
    from matplotlib.figure import Figure

    steps = range(1, len(plain) + 1)
    fig = Figure(figsize=(11.0, 4.2), dpi=110, layout="constrained")
    curves, gap = fig.subplots(1, 2)
    curves.plot(steps, plain, label="plain (single-tensor AdamW)", linewidth=2.2, alpha=0.6)
    curves.plot(steps, fused, label="fused (host optimizer)", linewidth=1.0, color="black",
                linestyle="--")
    curves.set(xlabel="step", ylabel="training loss", title="loss")
    curves.legend(fontsize=8)
    gap.plot(steps, [f - p for p, f in zip(plain, fused)], color="#d62728", linewidth=1.2)
    gap.axhline(0.0, color="gray", linewidth=0.8)
    gap.set(xlabel="step", ylabel="fused - plain", title="loss difference")
    for ax in (curves, gap):
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, format="png")


def report(plain: Run, fused: Run, diffs: list[Difference]) -> dict:
    """Print the comparison; return it as a dict."""
    gaps = [abs(f - p) for p, f in zip(plain.losses, fused.losses)]
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    print("after step | relative difference: max_param max|f-p| / max|p| (parameter) | "
          "||f-p|| / ||p||, all parameters | elements whose bits differ")
    for d in diffs:
        print(f"{d.step:10d} | {d.relative:.3e} ({d.worst}) | {d.whole:.3e} | "
              f"{100 * d.differing:.2f}%")
    print(f"final loss: plain {plain.losses[-1]:.6f}, fused {fused.losses[-1]:.6f}, "
          f"difference {fused.losses[-1] - plain.losses[-1]:+.3e}")
    print(f"largest difference between the loss curves: {gaps[worst]:.3e} at step {worst + 1} "
          f"(plain {plain.losses[worst]:.6f}, fused {fused.losses[worst]:.6f})")
    print(f"wall: plain {plain.wall_s:.0f} s, fused {fused.wall_s:.0f} s")
    return {"plain_losses": plain.losses, "fused_losses": fused.losses,
            "params": [dataclasses.asdict(d) for d in diffs],
            "max_loss_difference": gaps[worst], "max_loss_difference_step": worst + 1,
            "wall_s": {"plain": plain.wall_s, "fused": fused.wall_s}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", type=Path, default=ROOT / "bench" / "fused_vs_plain.png")
    p.add_argument("--json", type=Path, help="write all numbers to this file")
    args = p.parse_args()
    if args.steps < 1:
        p.error(f"--steps {args.steps}: give at least 1")
    if not args.plot.parent.is_dir():
        p.error(f"--plot {args.plot}: directory {args.plot.parent} does not exist")
    torch.set_num_threads(1)
    os.environ.update(ENV)  # examples/gpt.py reads its size at import
    mf = load_model_file(ROOT / "examples" / "gpt.py")
    keep = sorted({s for s in (1, 10, args.steps) if s <= args.steps})
    sizes = " ".join(f"{k}={v}" for k, v in ENV.items())
    print(f"examples/gpt.py {sizes}, batch {BATCH}, {args.steps} steps, seed {args.seed}, "
          f"1 thread, torch {torch.__version__}", flush=True)
    plain = train(mf, mf.make_optimizer, args.steps, args.seed, keep)
    fused = train(mf, checked_fused(mf.make_optimizer), args.steps, args.seed, keep)
    diffs = [difference(s, plain.params[s], fused.params[s], plain.names) for s in keep]
    numbers = report(plain, fused, diffs)
    plot(plain.losses, fused.losses, args.plot,
         f"examples/gpt.py {sizes}, batch {BATCH}, seed {args.seed}: plain AdamW against "
         "the host optimizer's fused kernel")
    print(f"plot: {args.plot}")
    if args.json:
        args.json.write_text(json.dumps({"config": {**ENV, "batch": int(BATCH),
                                                    "steps": args.steps, "seed": args.seed,
                                                    "torch": torch.__version__},
                                         **numbers}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
