"""Selective recompute on the KARMA paper's models: each planned on one V100-16GB at 16 GiB,
with and without the selective choice, against the ideal and against selective everywhere.

    .venv/bin/python bench/selective.py [--json FILE]
    .venv/bin/python bench/selective.py --bounds

For each model: the ideal (keep_all with unlimited memory), the ILP's plan without selective
recompute (karma-plan --no-selective), with it but what a selective block keeps on the device
only (the ILP's choices without `kept: host`, a restriction this script makes), with it all
but no two blocks recomputed under one checkpoint (--no-pairs) and with everything (the
default), each over the ideal, and
the selective_all baseline (torchtitan's default: every block keeps what its matmuls return)
over the ideal where it fits, else the memory it needs. Roofline block times from the
v100-16g profile (--no-measure: this machine is not a V100). Then what each model's plan
with the selective choice (the last of the three ILPs) holds on the device at its fullest
stage (the ILP's memory model): the saved tensors several
blocks hold (a ResNet block's output, which the next block saves as its input; on the
device until that block's backward whatever either chooses), recomputing blocks' inputs,
what selective blocks keep, what keeping and swapped blocks save, and the rest.

--bounds: for the ResNets, the ILP's plan solved to a zero gap (the optimum of the ILP's
objective over its choices, where CBC proves it within karma-plan's time limit), and what the ILP would reach were some copies free, bounds on
what a finer choice could gain and not plans karma makes: what selective blocks keep on the
host copied out at no copy-engine time; and besides, the tensors several blocks save (a
block's output, its next block's input) sent to the host at no copy-engine time once the
reader that holds them has run its forward. Last, a prototype of that choice at the copy
engines' speed (held_outputs_offered), the ILP's objective at a zero gap.
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

import pulp  # noqa: E402

from karma.api import plan_options, plan_report  # noqa: E402
from karma.planner import formulation, ilp, lowering  # noqa: E402
from karma.planner.fragment import ProtoBuffer  # noqa: E402
from karma.planner.memory import buffer_spans, host_temp_by_stage, stage_memory  # noqa: E402
from karma.planner.plan import evaluate  # noqa: E402
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
             kept_on_host: bool = True, gap: float = 0.01, pairs: bool = True):
    os.environ.update(env)
    options = plan_options(gpu_mem=BUDGET, hardware=HARDWARE, batch_size=batch,
                           measure="estimate", selective=selective, gap=gap, pairs=pairs)
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
    """The device bytes live in the chosen plan's fullest stage (the ILP's memory model,
    stage_memory), by what they are: HELD's kinds, the rest as "other" (weights, gradients,
    optimizer state, temporaries, host step temporaries where they land on the device, what
    a recompute makes again)."""
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
    held["other"] += host_temp_by_stage(problem, frags[1:], ev.training)[peak]
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
    """A bound: a saved tensor that a later block holds (HeldSaved, its next reader) until its
    backward, once its first reader lets go of it, leaves the device in no time once the
    forward after the next reader's is over and is back from the backward before that
    reader's (the runtime has no such copy). Sound for tensors two blocks read, as a ResNet
    block's output (HeldSaved does not say whether a third reads it)."""
    activations = lowering._activations

    def offloaded(f, problem, st, i, c, fwd, bwd):
        activations(f, problem, st, i, c, fwd, bwd)
        for h in problem.held_by_first_reader[i]:
            reader = h.next_reader
            if h.freed_after(c.act) != reader or reader + 1 >= len(problem.blocks) \
                    or h.bytes == 0:  # (a buffer of no bytes is not made)
                continue
            name = f"shared.{h.made_by}.{i}.{reader}"
            next(b for b in f.buffers if b.name == name).free = ("forward", reader + 1)
            f.buffer(f"{name}@in", i, h.bytes, ("backward", reader + 1), ("backward", reader))

    with mock.patch.object(lowering, "_activations", offloaded):
        yield


HELD_KEPT = {"device": "device+held", "host": "host+held"}  # the prototype's kept values


def held_reads(problem, r: int) -> list:
    """The HeldSaved tensors block r holds for an earlier block (r is their next reader)."""
    return [h for held in problem.held_by_first_reader for h in held if h.next_reader == r]


@contextlib.contextmanager
def held_outputs_offered(parts: int):
    """A prototype choice, not one karma has: a recomputing block r that holds tensors an
    earlier block made (held_reads) may send them to the host in `parts` equal copies, one a
    stage, in the forwards after its own, and take them back likewise in the backwards
    before its own, at the profile's copy speeds; only where their first reader lets go of
    them (a constraint). Each such choice is a selective or recompute choice with kept
    HELD_KEPT[kept]; the device memory it frees is a buffer of negative bytes from the
    forward after its last copy out to the backward before its first copy in (the ILP's
    memory model only: solve it with ilp._solve, not the simulator)."""
    plain = {v: k for k, v in HELD_KEPT.items()}
    check, offered, kept = lowering.Choice.__post_init__, lowering.valid_choices, lowering._kept
    activations, tag, formulate = lowering._activations, formulation._tag, ilp.formulate

    def check_held(c):
        if c.kept not in plain:
            check(c)

    def with_held(problem, r):
        choices = offered(problem, r)
        if not held_reads(problem, r) or r + parts + 1 > len(problem.blocks) - 1:
            return choices
        held = []
        for c in choices:
            if c.act in ("recompute", "selective"):
                h = object.__new__(lowering.Choice)  # past check_held: frozen fields
                for name, value in vars(c).items():
                    object.__setattr__(h, name, value)
                object.__setattr__(h, "kept", HELD_KEPT[c.kept])
                held.append(h)
        return choices + held

    def plain_kept(c):
        return lowering.Choice(c.act, c.weights, c.optim, c.ahead, c.policy, plain[c.kept],
                               c.with_next, c.with_prev)

    def kept_as_planned(f, problem, st, i, c, *rest):
        kept(f, problem, st, i, plain_kept(c) if c.kept in plain else c, *rest)

    def copies(f, problem, st, r, c, fwd, bwd):
        activations(f, problem, st, r, c, fwd, bwd)
        if c.kept not in plain:
            return
        nbytes = sum(h.bytes for h in held_reads(problem, r))
        for k in range(parts):
            f.op(("held_out", r, k), "swap_out", r, st.fwd(r + 1 + k), "d2h",
                 problem.d2h_s(nbytes) / parts, nbytes // parts)
            f.op(("held_in", r, k), "swap_in", r, st.bwd(r + parts - k), "h2d",
                 problem.h2d_s(nbytes) / parts, nbytes // parts)
        f.buffers.append(ProtoBuffer(f"held.{r}", r, -nbytes, ("forward", r + parts + 1),
                                     ("backward", r + parts + 1)))
        f.host_bytes += nbytes
        f.pinned_bytes += nbytes

    def tagged(c):
        return tag(plain_kept(c)) + "H" if c.kept in plain else tag(c)

    def coupled(problem, *args, **kwargs):
        f = formulate(problem, *args, **kwargs)
        for r, choices in f.options.items():
            held = [f.x[r, c] for c in choices if c.kept in plain]
            for h in held_reads(problem, r) if held else ():
                first = h.first_reader
                lets_go = [f.x[first, c] for c in f.options[first]
                           if h.freed_after(c.act) == r]
                f.lp += pulp.lpSum(held) <= pulp.lpSum(lets_go), \
                    f"held_{r}_{first}_{h.made_by}"
        return f

    with mock.patch.object(lowering.Choice, "__post_init__", check_held), \
            mock.patch.object(lowering, "valid_choices", with_held), \
            mock.patch.object(lowering, "_kept", kept_as_planned), \
            mock.patch.object(lowering, "_activations", copies), \
            mock.patch.object(formulation, "_tag", tagged), \
            mock.patch.object(ilp, "formulate", coupled):
        yield


def exact_objective(report) -> tuple[float, float, int]:
    """The ILP's objective for report's problem and budget solved to a zero gap: seconds,
    solve seconds, and how many blocks take a HELD_KEPT choice."""
    problem = report.problem
    limits = formulation.Limits(report.chosen.capacity_bytes, problem.host_mem_bytes,
                                problem.pinned_mem_bytes)
    solution = ilp._solve(problem, limits, time_limit_s=600, gap=0.0)
    plan = solution.plan
    if plan.status != "optimal":
        raise SystemExit(f"CBC did not prove its plan optimal in 600 s: {plan.note}")
    held = sum(c.kept in HELD_KEPT.values() for c in plan.choices)
    return float(plan.note.rpartition("objective ")[2].split()[0]), plan.solve_s, held


def relaxed_step(report) -> float:
    """The simulated step of the ILP's plan for report's problem and budget with the lowering
    as patched now (some copies free), CBC started from report's plan (which the patch only
    makes faster: the bound is never slower than the plan, whatever CBC reaches in 60 s)."""
    problem, chosen = report.problem, report.chosen
    plan = ilp.solve_ilp(problem, chosen.capacity_bytes, start=chosen.plan)
    return evaluate(problem, plan, chosen.capacity_bytes).step_s


def bounds(path: str, env: dict[str, str], batch: int, parts: int | None = 2) -> dict:
    """The ideal's step, the ILP plan's as karma makes it, solved to a zero gap, with kept
    copies free, with the held outputs free too, and (the ILP's objective, a zero gap) with
    held_outputs_offered(parts) unless parts is None."""
    made = plan_one(path, env, batch, selective=True)
    exact = plan_one(path, env, batch, selective=True, gap=0.0)
    with kept_copies_free():
        kept_free = relaxed_step(made)
        with held_outputs_free():
            held_free = relaxed_step(made)
    offered_s = offered_solve_s = offered_blocks = None
    if parts is not None:
        with held_outputs_offered(parts):
            offered_s, offered_solve_s, offered_blocks = exact_objective(made)
    return {"ideal_s": made.schedule.predicted.ideal_s, "ilp_s": made.chosen.step_s,
            "exact_s": exact.chosen.step_s, "exact_solve_s": exact.chosen.plan.solve_s,
            "exact_status": exact.chosen.plan.status,
            "kept_free_s": kept_free, "held_free_s": held_free,
            "offered_s": offered_s, "offered_solve_s": offered_solve_s,
            "offered_blocks": offered_blocks, "parts": parts}


def bounds_row(label: str, batch: int, b: dict) -> str:
    def over(key: str) -> str:
        return f"{b[key]:.3f} s, {b[key] / b['ideal_s']:.3f}x"

    offered = "-" if b["offered_s"] is None else (
        f"{over('offered_s')} ({b['offered_blocks']} blocks, CBC {b['offered_solve_s']:.0f} s)")
    proved = "" if b["exact_status"] == "optimal" else ", stopped at its time limit"
    return (f"| {label} | {batch} | {over('ilp_s')} | {over('exact_s')} (CBC "
            f"{b['exact_solve_s']:.1f} s{proved}) | {over('kept_free_s')} | "
            f"{over('held_free_s')} | {offered} |")


def row(label: str, path: str, env: dict[str, str], batch: int) -> dict:
    start = time.perf_counter()
    before = plan_one(path, env, batch, selective=False)
    device = plan_one(path, env, batch, selective=True, kept_on_host=False)
    unpaired = plan_one(path, env, batch, selective=True, pairs=False)
    after = plan_one(path, env, batch, selective=True)
    ideal_s = after.schedule.predicted.ideal_s
    sel = after.baselines["selective_all"]
    acts = after.chosen.plan.counts()
    return {
        "model": label, "batch": batch, "ideal_s": ideal_s,
        "before_s": before.chosen.step_s, "device_s": device.chosen.step_s,
        "unpaired_s": unpaired.chosen.step_s, "after_s": after.chosen.step_s,
        "selective_all_s": sel.step_s if sel.feasible else None,
        "selective_all_peak_bytes": sel.stage_peak_bytes,
        "decisions": {k: acts[k] for k in ("keep", "swap", "recompute", "selective",
                                           "kept_on_host")}
        | {"pairs": sum(c.with_next for c in after.chosen.plan.choices)},
        "solve_s": {"before": before.chosen.plan.solve_s, "device": device.chosen.plan.solve_s,
                    "unpaired": unpaired.chosen.plan.solve_s, "after": after.chosen.plan.solve_s},
        "peak_held_bytes": peak_held(after),
        "seconds": time.perf_counter() - start,
    }


def table(rows: list[dict]) -> str:
    lines = ["| model | batch | ideal | ILP without selective, over ideal | ILP, kept on the "
             "device only | ILP without pairs | ILP, over ideal | selective everywhere, over "
             "ideal | ILP over selective everywhere | keep / swap / recompute / selective (of "
             "them kept on the host), pairs | solve |",
             "| --- | ---: | ---: | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ideal = r["ideal_s"]
        sel = (f"{r['selective_all_s']:.3f} s, {r['selective_all_s'] / ideal:.2f}x"
               if r["selective_all_s"] is not None else
               f"does not fit (needs {format_bytes(r['selective_all_peak_bytes'])})")
        vs = (f"{r['after_s'] / r['selective_all_s']:.2f}x" if r["selective_all_s"] else "-")
        d = r["decisions"]
        solve = " / ".join(f"{r['solve_s'][k]:.2f}"
                           for k in ("before", "device", "unpaired", "after"))
        lines.append(
            f"| {r['model']} | {r['batch']} | {ideal:.3f} s | {r['before_s']:.3f} s, "
            f"{r['before_s'] / ideal:.3f}x | {r['device_s']:.3f} s, "
            f"{r['device_s'] / ideal:.3f}x | {r['unpaired_s']:.3f} s, "
            f"{r['unpaired_s'] / ideal:.3f}x | {r['after_s']:.3f} s, "
            f"**{r['after_s'] / ideal:.3f}x** | {sel} | {vs} | {d['keep']} / {d['swap']} / "
            f"{d['recompute']} / {d['selective']} ({d['kept_on_host']}), {d['pairs']} | "
            f"{solve} s |")
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
                    help="print, instead, the ResNets' plans solved to a zero gap and with some "
                         "copies free")
    args = ap.parse_args()
    if args.bounds:
        print(f"    {COMMAND} --bounds\n")
        print("| model | batch | ILP, over ideal | solved to a zero gap | kept outputs' copies "
              "free | and the held outputs' too | the held outputs offered at the engines' "
              "speed, in 2 parts (ILP objective, a zero gap) |\n"
              "| --- | ---: | --- | --- | --- | --- | --- |")
        for label, path, env, batch in MODELS[:2]:
            # ResNet-200's prototype ILP is not proven optimal in 600 s: ResNet-50's only
            parts = 2 if label == "ResNet-50" else None
            print(bounds_row(label, batch, bounds(path, env, batch, parts)), flush=True)
        return 0
    rows = []
    for label, path, env, batch in MODELS:
        rows.append(row(label, path, env, batch))
        print(f"{label}: {rows[-1]['seconds']:.0f} s", file=sys.stderr)
    print(f"    {COMMAND}\n")
    print(table(rows))
    print("\nWhat each ILP plan with the selective choice holds on the device at its fullest "
          "stage:\n")
    print(held_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
