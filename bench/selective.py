"""Selective recompute on the KARMA paper's models: each planned on one V100-16GB at 16 GiB,
with and without the selective choice, against the ideal and against selective everywhere.

    .venv/bin/python bench/selective.py [--json FILE]
    .venv/bin/python bench/selective.py --bounds

For each model: the ideal (keep_all with unlimited memory), the ILP's plan without selective
recompute (karma-plan --no-selective), with it but what a selective block keeps on the device
only (the ILP's choices without `kept: host`, a restriction this script makes) and with it
all (the default), each over the ideal, and
the selective_all baseline (torchtitan's default: every block keeps what its matmuls return)
over the ideal where it fits, else the memory it needs. Roofline block times from the
v100-16g profile (--no-measure: this machine is not a V100). Then what each last plan holds
on the device at its fullest stage (the ILP's memory model): the saved tensors several
blocks hold (a ResNet block's output, which the next block saves as its input; on the
device until that block's backward whatever either chooses), recomputing blocks' inputs,
what selective blocks keep, what keeping and swapped blocks save, and the rest.

--bounds: for the ResNets, the ILP's plan solved to a zero gap (the best plan karma's choices
allow, in its model), and what the ILP would reach were some copies free, bounds on what a
finer choice could gain and not plans karma makes: what selective blocks keep on the host
copied out at no copy-engine time; and besides, the tensors several blocks save (a block's
output, its next block's input) sent to the host at no copy-engine time once the reader
that holds them has run its forward.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from karma.api import plan_options, plan_report  # noqa: E402
from karma.planner import lowering  # noqa: E402
from karma.planner.memory import buffer_spans, stage_memory  # noqa: E402
from karma.schedule import HOST_TEMP_PREFIX  # noqa: E402
from karma.units import format_bytes  # noqa: E402

COMMAND = ".venv/bin/python bench/selective.py"
HARDWARE, BUDGET = "v100-16g", "16G"
# (label, model file, its environment, batch size): the paper's evaluation models
MODELS = (
    ("ResNet-50", "examples/resnet.py", {"KARMA_RESNET": "50"}, 512),
    ("ResNet-200", "examples/resnet.py", {"KARMA_RESNET": "200"}, 128),
    ("VGG16", "examples/vgg.py", {}, 256),
    ("WRN-28-10", "examples/wrn.py", {"KARMA_WRN": "28x10"}, 1024),
    ("GPT 1.5B (seq 1024)", "examples/gpt.py", {"KARMA_GPT": "xl", "KARMA_SEQ": "1024"}, 8),
)


def plan_one(path: str, env: dict[str, str], batch: int, selective: bool,
             kept_on_host: bool = True, gap: float = 0.01):
    os.environ.update(env)
    options = plan_options(gpu_mem=BUDGET, hardware=HARDWARE, batch_size=batch,
                           measure="estimate", selective=selective, gap=gap)
    with contextlib.nullcontext() if kept_on_host else kept_on_the_device():
        return plan_report(ROOT / path, options, log=lambda _: None)


@contextlib.contextmanager
def kept_on_the_device():
    """The ILP offered no `kept: host` choice: a selective block's kept outputs stay on the
    device from its forward to its backward."""
    offered = lowering.valid_choices
    with mock.patch.object(lowering, "valid_choices",
                           lambda problem, i: [c for c in offered(problem, i)
                                               if c.kept == "device"]):
        yield


# what the chosen plan holds at its fullest stage, by the lowering's buffer names
HELD = (("saved by several blocks", "shared."), ("inputs checkpointed", "ckpt."),
        ("kept by selective blocks", "sac."), ("saved by kept or swapped blocks", "act."))


def peak_held(report) -> dict[str, int]:
    """The device bytes live in the chosen plan's fullest stage (the ILP's memory model), by
    what they are: HELD's kinds, the rest as "other" (weights, gradients, optimizer state,
    temporaries, what a recompute makes again)."""
    problem, ev = report.problem, report.chosen
    choices = list(ev.plan.choices)
    per_stage = stage_memory(problem, choices, ev.training)
    peak = max(range(len(per_stage)), key=per_stage.__getitem__)
    held = {kind: 0 for kind, _ in HELD} | {"other": 0}
    frags = [lowering.common_fragment(problem)] + [
        lowering.fragment(problem, i, c, ev.training) for i, c in enumerate(choices)]
    for f in frags:
        device = [b for b in f.buffers if not b.name.startswith(HOST_TEMP_PREFIX)]
        for buf, (first, last, nbytes) in zip(device, buffer_spans(problem, f), strict=True):
            if first <= peak <= last:
                kind = next((k for k, prefix in HELD if buf.name.startswith(prefix)), "other")
                kind = "other" if buf.name.endswith("@re") else kind
                held[kind] += nbytes
    assert sum(held.values()) == per_stage[peak], (held, per_stage[peak])
    return held


@contextlib.contextmanager
def kept_copies_free():
    """A bound: a selective block's kept outputs go to the host in no time (the swap-out's
    copy takes 0 s; the swap-in is as planned)."""
    kept = lowering._kept

    def free(f, problem, st, i, c, *rest):
        kept(f, problem, st, i, c, *rest)
        for o in f.ops:
            if o.key == ("swap_out", i):
                o.dur_s = 0.0

    with mock.patch.object(lowering, "_kept", free):
        yield


@contextlib.contextmanager
def held_outputs_free():
    """A bound: a saved tensor that a later block holds (HeldSaved) until its backward, where
    no other block holds it longer, leaves the device in no time once the forward after that
    block's is over and is back from the backward before that block's (the runtime has no
    such copy)."""
    activations = lowering._activations

    def offloaded(f, problem, st, i, c, fwd, bwd):
        activations(f, problem, st, i, c, fwd, bwd)
        for h in problem.held_by_first_reader[i]:
            reader = h.next_reader
            if h.freed_after(c.act) != reader or reader + 1 >= len(problem.blocks):
                continue
            name = f"shared.{h.made_by}.{i}.{reader}"
            next(b for b in f.buffers if b.name == name).free = ("forward", reader + 1)
            f.buffer(f"{name}@in", i, h.bytes, ("backward", reader + 1), ("backward", reader))

    with mock.patch.object(lowering, "_activations", offloaded):
        yield


def bounds(path: str, env: dict[str, str], batch: int) -> tuple[float, list[float]]:
    """The ideal's step, and the ILP plan's: as karma makes it, solved to a zero gap, with
    kept copies free, and with the held outputs free too."""
    plans = [plan_one(path, env, batch, selective=True),
             plan_one(path, env, batch, selective=True, gap=0.0)]
    with kept_copies_free():
        plans.append(plan_one(path, env, batch, selective=True))
        with held_outputs_free():
            plans.append(plan_one(path, env, batch, selective=True))
    return plans[0].schedule.predicted.ideal_s, [p.chosen.step_s for p in plans]


def row(label: str, path: str, env: dict[str, str], batch: int) -> dict:
    start = time.perf_counter()
    before = plan_one(path, env, batch, selective=False)
    device = plan_one(path, env, batch, selective=True, kept_on_host=False)
    after = plan_one(path, env, batch, selective=True)
    ideal_s = after.schedule.predicted.ideal_s
    sel = after.baselines["selective_all"]
    acts = after.chosen.plan.counts()
    return {
        "model": label, "batch": batch, "ideal_s": ideal_s,
        "before_s": before.chosen.step_s, "device_s": device.chosen.step_s,
        "after_s": after.chosen.step_s,
        "selective_all_s": sel.step_s if sel.feasible else None,
        "selective_all_peak_bytes": sel.stage_peak_bytes,
        "decisions": {k: acts[k] for k in ("keep", "swap", "recompute", "selective",
                                           "kept_on_host")},
        "solve_s": {"before": before.chosen.plan.solve_s, "device": device.chosen.plan.solve_s,
                    "after": after.chosen.plan.solve_s},
        "peak_held_bytes": peak_held(after),
        "seconds": time.perf_counter() - start,
    }


def table(rows: list[dict]) -> str:
    lines = ["| model | batch | ideal | ILP without selective, over ideal | ILP, kept on the "
             "device only | ILP, over ideal | selective everywhere, over ideal | ILP over "
             "selective everywhere | keep / swap / recompute / selective (of them kept on the "
             "host) | solve |",
             "| --- | ---: | ---: | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ideal = r["ideal_s"]
        sel = (f"{r['selective_all_s']:.3f} s, {r['selective_all_s'] / ideal:.2f}x"
               if r["selective_all_s"] is not None else
               f"does not fit (needs {format_bytes(r['selective_all_peak_bytes'])})")
        vs = (f"{r['after_s'] / r['selective_all_s']:.2f}x" if r["selective_all_s"] else "-")
        d = r["decisions"]
        solve = " / ".join(f"{r['solve_s'][k]:.2f}" for k in ("before", "device", "after"))
        lines.append(
            f"| {r['model']} | {r['batch']} | {ideal:.3f} s | {r['before_s']:.3f} s, "
            f"{r['before_s'] / ideal:.3f}x | {r['device_s']:.3f} s, "
            f"{r['device_s'] / ideal:.3f}x | {r['after_s']:.3f} s, "
            f"**{r['after_s'] / ideal:.3f}x** | {sel} | {vs} | {d['keep']} / {d['swap']} / "
            f"{d['recompute']} / {d['selective']} ({d['kept_on_host']}) | {solve} s |")
    return "\n".join(lines)


def held_table(rows: list[dict]) -> str:
    """What each ILP plan (with the host) holds at its fullest stage."""
    kinds = [k for k, _ in HELD] + ["other"]
    lines = ["| model | " + " | ".join(kinds) + " | in all |",
             "| --- |" + " ---: |" * (len(kinds) + 1)]
    for r in rows:
        held = r["peak_held_bytes"]
        lines.append(f"| {r['model']} | " + " | ".join(format_bytes(held[k]) for k in kinds)
                     + f" | {format_bytes(sum(held.values()))} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="FILE", help="write the rows as JSON too")
    ap.add_argument("--bounds", action="store_true",
                    help="the ResNets' plans were some copies free, instead")
    args = ap.parse_args()
    if args.bounds:
        print(f"    {COMMAND} --bounds\n")
        print("| model | batch | ILP, over ideal | solved to a zero gap | kept outputs' copies "
              "free | and the held outputs' too |\n| --- | ---: | --- | --- | --- | --- |")
        for label, path, env, batch in MODELS[:2]:
            ideal_s, steps = bounds(path, env, batch)
            print(f"| {label} | {batch} | " + " | ".join(
                f"{s:.3f} s, {s / ideal_s:.3f}x" for s in steps) + " |")
        return 0
    rows = []
    for label, path, env, batch in MODELS:
        rows.append(row(label, path, env, batch))
        print(f"{label}: {rows[-1]['seconds']:.0f} s", file=sys.stderr)
    print(f"    {COMMAND}\n")
    print(table(rows))
    print("\nWhat each plan (the last ILP) holds on the device at its fullest stage:\n")
    print(held_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
