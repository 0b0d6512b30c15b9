"""Block times in context: the runtime itself trains keep_all steps, in a process of its
own, and the trace of one of them times every block (the CPU backend's default).

[Note: block times in context] Timed alone, a block runs with its weights and inputs
warm in the caches and its allocations served at once; inside a training step it runs
after the others evicted them, under the runtime's bounded CPU cache, and the tied
weight's two gradients meet in its backward. On GPT-2 small (sequence 64, batch 2) the
keep_all step ran 1.16x what the blocks timed alone predicted: forwards 1.27x, the
embedding's backward 5.9x, its optimizer step 2.2x. So on the CPU backend, where a
keep_all step fits in RAM (its planned peak within half of MemAvailable) and takes
seconds (three steps within _BUDGET_S by the roofline), the runtime itself
trains keep_all steps (as many as fit the budget, three to six) and the third one's trace
gives every block's forward, backward and optimizer step (the host optimizer's too: the
same step on the same CPU), and the loss's forward and backward: the roofline's estimate of
the loss (three passes over what it saves at the memory bandwidth) put an 8-layer GPT's with
a vocabulary of 8192 at 5 ms, where its steps took 78 ms.

One step is one sample of a noisy machine, and the third an early one: on GPT-2 small
(sequence 64, batch 2) two runs of eight keep_all steps took 1.74 and 1.99 s in their
third step against medians of 2.16 and 2.15 s over steps 2-8, and plans calibrated on the
third step alone ran 0.82-1.21x their predictions. So the trace's times are scaled by the
median of the steps after the first over the third's own time.
Otherwise, or if that fails, the blocks are timed alone (blocks.py).

[Note: the selective recompute in context] A keep_all step runs no selective recompute, and
the runtime's trace would not time one apart from the backward it precedes. So a block's
selective recompute in context is its forward in context times the ratio of the two timed
alone (blocks.selective_ratios; karma.ir.timing's [Note: timing the selective recompute]).
A ratio rather than the time alone, because in context the blocks run slower than alone (the
tiny GPT's forwards 1.3-3.1x) and the planner weighs a selective recompute against a whole
one, which is the forward in context. The ratio's timing is kept cheap: forward and selective
recompute only (no backward, no optimizer step), each distinct block once (median of three
after a warm-up), at the largest batch whose roofline estimate of a forward and backward of
every distinct block stays within blocks._RATIO_BUDGET_S (5 s); the result is cached in the
blocks file with the rest. Where that timing fails, the roofline's share of the forward
stands in (problem.py, [Note: the selective recompute's time]). Measured on the 2-core
machine (one thread, under other jobs' load), forward alone, selective recompute alone, ratio:
  tiny GPT (KARMA_GPT=tiny, batch 4): a layer 0.34 ms, 0.63 ms, 1.8x; head and tail 1.9x;
  in context a layer's forward took 0.53-0.55 ms, its selective recompute so 0.96 ms; the
  ratios' timing (trace included) took 0.2-0.4 s of a 14.5 s calibration;
  tiny ResNet (KARMA_RESNET=tiny, batch 8): the bottlenecks 0.25-0.45 ms, 0.31-0.56 ms,
  0.87-1.7x (0.68-1.4x in the forward-only timing); the ratios' timing took 0.5 s;
  GPT-2 small at sequence 128: a layer 87 ms, 9.5 ms, 0.11 at batch 4, and 0.13 at batch 1
  (a smaller batch errs slow: the Python per op weighs more).
At the tiny sizes the dispatch modes' Python outweighs the matmuls the recompute skips (a tiny
GPT layer's 40 ops took 0.98 ms under the caching mode, 0.33 ms plain: 16 us an op), so a
selective recompute costs more than a whole one; the roofline's share said 0.2x for the tiny
GPT's layers, and 0.02x for GPT-2 small's.
Ratios of blocks under a millisecond vary by 10-20% from run to run.
Against the runtime (karma-run training every block selective, one thread): a selective
layer's backward took longer than a kept one's by 1.16-1.33 ms on the tiny GPT (predicted
0.96 ms) and by 9.8-10.5 ms on a 2x256x4 GPT at sequence 128, batch 4 (predicted 4.4 ms: its
forward in context 16.4 ms times 0.29). Alone, that layer's recompute inside checkpoint took
4.15 ms (timed here 3.75 ms), and checkpoint added about 2 ms more to its backward, as it
does to a whole recompute's, which neither time counts; the rest came with the context, so
the prediction errs fast. A selective block's forward runs under the caching mode too: 1.30-
1.38 ms against 0.45-0.53 ms kept on the tiny GPT, 17.2-17.5 against 13.1-15.2 ms on the
wider one, which the planner does not count either (it charges the plain forward).

Then, with the block times just measured, the runtime trains PROBE_STEPS steps of an
out-of-core probe, and the side streams' contention fractions and wait are fitted to its traced
steps ([Note: side streams timed in context] in karma/planner/fit_contention.py).

[Note: the process's own memory] On the CPU backend the measured peak is the process's
private memory above its baseline, and the process holds more than its tensors while it
trains: the stream workers' thread pools and malloc arenas, tensors under the CPU cache's
64 KiB, the autograd graph's nodes, Python objects. The demo's plan (GPT-2 small) held
24-25 MiB of it at every step's start after the first, and its memory through a step was
the schedule's live buffers plus 25-28 MiB; planned at 797 MiB of an 800 MiB budget
without it, it peaked at 804-807 MiB. The keep_all steps measure it
(RunReport.outside_private_bytes, the most at a step's start after the first), and the
planner counts it in every stage (Problem.process_bytes). Blocks timed alone do not
measure it (0).

The steps run in a process of their own, `karma-run` as a user runs it: the private
memory of a process that has done other work is no measure of a run's (in a test
process, pages its earlier work had freed served the run's first 3.8 MiB, and the
outside came to -3.8 MiB), and its step times are not those of a fresh karma-run.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from karma.calibrate.blocks import Timed
from karma.calibrate.measure_hw import mem_available_bytes
from karma.errors import KarmaError
from karma.ir.graph import BlockGraph
from karma.model_object import missing_entry
from karma.planner.hardware import Hardware
from karma.planner.simulate import SIDE_STREAMS
from karma.runtime.loop import trace_file
from karma.schedule import Schedule

if TYPE_CHECKING:
    from karma.calibrate import Probe

PROBE_STEPS = 4  # steps of the probe: the first warms up, the other three are traced
# A probe is run only where its side ops are planned at this much or more on average: a side
# op costs its stream's worker tens to hundreds of microseconds of Python however small it is,
# which no fraction of compute's cores explains (the tests' tiny GPT's average 272 us)
MIN_SIDE_OP_S = 1e-3
# set in the karma-run that calibration starts: a model file that plans when imported (a
# script's top level) would otherwise calibrate again, in a karma-run of its own, without end
CALIBRATING = "KARMA_CALIBRATING"
_BUDGET_S = 120.0  # the keep_all steps at most this long (roofline): [Note: block times in
# context]


def timed_in_context(graph: BlockGraph, hw: Hardware, keep_all: Callable[[Hardware], Schedule],
                     path: Path, say: Callable[[str], None], remeasure: bool = False,
                     probe: Callable[[Hardware, Timed], Probe] | None = None,
                     ratios: Callable[[], tuple[dict[str, float], ...]] | None = None
                     ) -> Timed | None:
    """Every block of `graph` timed in keep_all steps on this machine (`keep_all(hw)`: the
    keep_all schedule of `graph` on `hw`, this machine's profile), or None where a step does
    not fit or fails; with `ratios` (each block's selective recompute over its forward, timed
    alone: blocks.selective_ratios), its selective recompute ([Note: the selective recompute
    in context]); with `probe`, the side streams' fractions and wait too, fitted to a probe's
    steps ([Note: side streams timed in context])."""
    schedule = keep_all(hw)
    entry = schedule.model.entry
    if entry is not None and missing_entry(entry):
        say(f"{graph.model}'s {', '.join(missing_entry(entry))} cannot be imported again by a "
            "karma-run of its own (karma/model_object.py): timing its blocks one by one")
        return None
    need, free = schedule.predicted.peak_device_bytes, mem_available_bytes()
    n_steps = min(6, int(_BUDGET_S // max(schedule.predicted.step_s, 1e-9)))
    if need > free // 2 or n_steps < 3:
        say(f"a keep_all step of {graph.model} needs {need / 2**30:.1f} GiB of the "
            f"{free / 2**30:.1f} GiB free and about {schedule.predicted.step_s:.0f} s: "
            "timing its blocks one by one instead")
        return None
    say(f"timing the blocks of {graph.model} in {n_steps} keep_all steps on this machine (cpu, "
        f"batch {graph.batch_size}; {'again' if remeasure else 'once'}, cached in {path})")
    try:
        ops, run = _run(schedule, n_steps)
    except (OSError, ValueError, KeyError, KarmaError, subprocess.SubprocessError) as e:
        say(f"timing a keep_all step failed ({type(e).__name__}: {str(e)[:200]}); timing "
            "the blocks one by one instead")
        return None
    scale = median_over_traced(run["step_s"])
    took = {(op["kind"], op["block"]): (op["end_s"] - op["start_s"]) * scale for op in ops}
    n = len(graph.blocks)
    times = tuple((took[("forward", i)], took[("backward", i)]) for i in range(n))
    steps = tuple((took.get(("device_step", i), 0.0),) * 2 for i in range(n))
    timed = Timed(times, steps, int(run["outside_private_bytes"]), "in a keep_all step",
                  took.get(("loss", n - 1)))
    if ratios is not None:
        timed = _with_selective(timed, ratios, say)
    return timed if probe is None else _with_side_streams(timed, hw, probe, say)


def _with_selective(timed: Timed, ratios: Callable[[], tuple[dict[str, float], ...]],
                    say: Callable[[str], None]) -> Timed:
    """`timed` with each block's selective recompute: its forward in context times the ratio
    timed alone ([Note: the selective recompute in context]); as it was (the roofline's
    share) where timing them alone fails."""
    try:
        alone = ratios()
    except KarmaError as e:
        say(f"timing the selective recomputes alone failed ({e}); planning them with the "
            "roofline's share of the forward")
        return timed
    return replace(timed, selective_s=tuple(
        {policy: fwd * r for policy, r in by.items()}
        for (fwd, _), by in zip(timed.fwd_bwd_s, alone, strict=True)))


def _with_side_streams(timed: Timed, hw: Hardware, probe: Callable[[Hardware, Timed], Probe],
                       say: Callable[[str], None]) -> Timed:
    """`timed` with the side streams' fractions and wait fitted to PROBE_STEPS - 1 traced steps of
    the probe planned on `hw` with `timed` (from its second step on); as it was, with the
    profile's, where the probe fails."""
    try:
        planned = probe(hw, timed)
        side_s = [op.dur_s for op in planned.schedule.ops if op.stream in SIDE_STREAMS]
        if not side_s or statistics.mean(side_s) < MIN_SIDE_OP_S:
            say(f"not timing the side streams in context: the probe's side ops are planned at "
                f"{statistics.mean(side_s or [0.0]) * 1e6:.0f} us on average, too short to "
                "time; planning with the profile's contention fractions")
            return timed
        fitted = planned.fit(_run_traced(planned.schedule, PROBE_STEPS))
    except (OSError, ValueError, KeyError, KarmaError, subprocess.SubprocessError) as e:
        say(f"timing the side streams in an out-of-core probe failed ({type(e).__name__}: "
            f"{str(e)[:200]}); planning with the profile's contention fractions")
        return timed
    say("side streams beside compute, fitted to the probe's steps: "
        + ", ".join(f"{k} {v:.4f}" if k.endswith("_s") else f"{k} {v:.3f}"
                    for k, v in fitted.items()))
    return replace(timed, side_streams=fitted)


def _run(schedule: Schedule, n_steps: int) -> tuple[list[dict], dict]:
    """karma-run trains `schedule` for `n_steps` steps in a process of its own: the ops of
    its traced third step, and its report."""
    with tempfile.TemporaryDirectory(prefix="karma-calibrate-") as directory:
        d = Path(directory)
        _karma_run(schedule, d, n_steps, "--trace-step", "3", "--report",
                   str(d / "report.json"))
        return (json.loads((d / "trace.json").read_text())["ops"],
                json.loads((d / "report.json").read_text()))


def _run_traced(schedule: Schedule, n_steps: int) -> list[list[dict]]:
    """The ops of every step after the first of `n_steps` that karma-run trains of
    `schedule`, each step traced."""
    with tempfile.TemporaryDirectory(prefix="karma-calibrate-") as directory:
        d = Path(directory)
        _karma_run(schedule, d, n_steps, "--trace-steps", str(n_steps - 1))
        return [json.loads(trace_file(d / "trace.json", step, n_steps - 1).read_text())["ops"]
                for step in range(2, n_steps + 1)]


def _karma_run(schedule: Schedule, directory: Path, n_steps: int, *options: str) -> None:
    """karma-run trains `schedule` (saved in `directory`) for `n_steps` steps in a process of
    its own, tracing into directory/trace.json as `options` say."""
    # the karma this process runs, wherever it was imported from
    source = str(Path(__file__).resolve().parent.parent.parent)
    env = {**os.environ, CALIBRATING: "1", "PYTHONPATH": os.pathsep.join(
        [source, *filter(None, [os.environ.get("PYTHONPATH")])])}
    schedule.save(directory / "schedule.yaml")
    ran = subprocess.run(
        [sys.executable, "-m", "karma.cli.run", str(directory / "schedule.yaml"),
         "--steps", str(n_steps), "--trace", str(directory / "trace.json"), *options],
        env=env, capture_output=True, text=True, timeout=10 * _BUDGET_S)
    if ran.returncode != 0:
        raise KarmaError((ran.stderr.strip().splitlines() or ["no message"])[-1])


def median_over_traced(step_s: list[float]) -> float:
    """The median of the steps after the first over the third's time (the traced step):
    what scales its trace to a typical step ([Note: block times in context])."""
    return statistics.median(step_s[1:]) / step_s[2]


