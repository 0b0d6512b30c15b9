"""Calibrated planning: when karma plans for this machine, it measures it.

    cal = calibrate(mf, graph, options, planning)   # options: PlanOptions; planning: FromPlanning
    cal.hardware        # the profile to plan with: built-in sizes, this machine's rates (on
                        # the CPU, the side streams' fractions and wait fitted in context)
    cal.measured        # planner.problem.Measurements: per block (fwd s, bwd s), its
                        # selective recompute's s and (device s, host s) of its optimizer
                        # step, the process outside its tensors (CPU), the loss; None or 0
                        # where estimated
    cal.summary         # one line for karma-plan: where the block times came from

One way through: `calibrate` is the entry, and what it needs from planning (the roofline
estimate of each block, a keep_all schedule to run) comes in as `FromPlanning`, so that
calibration never calls back into the planner. Its rooms:

- machine.py: which built-in profile is this machine (`local_device`), and its rates;
- measure_hw.py: measuring a device's rates (what `karma-profile` runs);
- blocks.py: block times, cached, and timing blocks one by one (karma.ir.timing);
- host_step.py: each block's host optimizer step, timed as the host stream runs it;
- in_context.py: timing them in keep_all steps that karma-run trains (the CPU backend), and
  the side streams in steps of an out-of-core probe;
- cache.py: the JSON files under $XDG_CACHE_HOME/karma, named by a hash of their key.

How to measure is PlanOptions.measure: "cached" (the default) measures this machine once and
then reads the cache, "fresh" measures it again (karma-plan --remeasure), "estimate" never
measures (--no-measure). Planning for another built-in profile, or for a karma-profile file
(which may describe another machine), uses that profile's numbers and the roofline estimate.
If timing the blocks fails by default, the plan uses the roofline estimate and says so: a
plan that worked before calibration keeps working; asked to measure afresh, it fails.

[Note: a machine whose speed drifts] A shared machine's speed changes under its other
tenants: on the 2-core CI machine the same in-context calibration of the fidelity MLP (2048
wide, 8 deep, batch 512) put its keep_all step at 1.50 s and, 45 minutes later, at 1.04 s,
and plans calibrated at the first ran 0.68-0.76x their predictions at the second. The cache
keeps the first measurement, so `remeasure` (karma-plan --remeasure) measures the machine and
the blocks again, and karma-run says so when the steps of a measured plan take outside
0.8-1.25x the predicted time (wider than the fidelity bound: a demo calibrated a minute
before ran 1.16x, the noise of eight steps on this machine).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from karma.calibrate.blocks import Timed, blocks_key, read_times, selective_ratios, timed_alone
from karma.calibrate.cache import cache_path, write
from karma.calibrate.host_step import host_step_times
from karma.calibrate.in_context import timed_in_context
from karma.calibrate.machine import (
    allocating_as_the_runtime_does,
    local_device,
    measured_machine,
)
from karma.errors import KarmaError
from karma.ir.graph import BlockGraph
from karma.modelfile import ModelFile
from karma.planner.hardware import Hardware
from karma.planner.options import PlanOptions
from karma.planner.problem import ESTIMATED, Measurements
from karma.schedule import Schedule

__all__ = ["Calibration", "FromPlanning", "Probe", "calibrate"]


@dataclass(frozen=True)
class FromPlanning:
    """What calibration needs from the planner, handed in by the caller (karma.api)."""

    # each block's forward + backward seconds on the profile given, by its roofline: sizes
    # the batch blocks are timed at ([Note: timing at a smaller batch], blocks.py)
    roofline_s: tuple[float, ...]
    # the graph's keep_all schedule on a profile, memory unlimited, its model file named by
    # an absolute path: what the in-context timing trains (in_context.py)
    keep_all: Callable[[Hardware], Schedule]
    # the probe that times the side streams in context, planned on a profile with the block
    # times measured ([Note: side streams timed in context]); None: not timed
    probe: Callable[[Hardware, Timed], Probe] | None = None


@dataclass(frozen=True)
class Probe:
    """An out-of-core schedule to train a few steps of, and what fits the side streams'
    contention fractions and wait (Hardware fields) to its traced steps' ops."""

    schedule: Schedule
    fit: Callable[[Sequence[Sequence[Mapping]]], dict[str, float]]


@dataclass(frozen=True)
class Calibration:
    """What to plan with, and where its numbers came from."""

    hardware: Hardware  # the profile given, with this machine's rates when it was measured
    measured: Measurements  # what was measured (Measurements(): nothing, the roofline estimate)
    summary: str  # e.g. "measured on this machine (cached in ~/.cache/karma/blocks-....json)"


def calibrate(mf: ModelFile, graph: BlockGraph, options: PlanOptions, planning: FromPlanning,
              log: Callable[[str], None] | None = None) -> Calibration:
    """The profile and block times to plan `graph` with for `options` (its hardware, the
    blocks' regex and how to measure: the module docstring)."""
    say = log or (lambda line: None)
    hw = options.profile
    if options.measure == "estimate":
        return Calibration(hw, ESTIMATED, "roofline estimate (--no-measure)")
    fresh = options.measure == "fresh"
    device = local_device(options.hardware)
    if device is None:
        if fresh:
            raise KarmaError(f"--remeasure (measure='fresh') measures this machine, and the "
                             f"{hw.name} profile is not it; plan for this machine's profile "
                             "(--hardware cpu, or the local GPU's), or leave --remeasure out")
        return Calibration(hw, ESTIMATED, f"roofline estimate from the {hw.name} profile "
                                          "(not this machine)")
    with allocating_as_the_runtime_does(device):
        hw = measured_machine(device, hw, say, fresh)
    start = time.perf_counter()
    try:
        host_s = host_step_times(mf, graph, options.host_optimizer, device, say, fresh)
        planning = replace(planning, probe=None if planning.probe is None else (
            lambda hw, timed, probe=planning.probe: probe(hw, with_host_steps(timed, host_s))))
        timed, path, now = _block_times(
            mf, graph, planning, device, options.blocks, say,
            in_context_hw=hw if device == "cpu" and options.blocks is None else None,
            remeasure=fresh, host_optimizer=options.host_optimizer)
    except KarmaError as e:
        if fresh:  # asked for: the error is the answer
            raise
        say(f"could not time the blocks ({e}); planning with the roofline estimate "
            "(--no-measure skips trying)")
        return Calibration(hw, ESTIMATED, "roofline estimate (timing the blocks failed)")
    how = (f"measured now in {time.perf_counter() - start:.0f} s" if now
           else "measured on this machine")
    timed = with_host_steps(timed, host_s)
    if timed.side_streams:  # fitted in context: [Note: side streams timed in context]
        hw = replace(hw, **timed.side_streams)
    where = timed.where + (", side streams in an out-of-core probe's steps"
                           if timed.side_streams else "")
    return Calibration(hw, timed.measured, f"{how}, {where} (cached in {path})")


def with_host_steps(timed: Timed, host_s: Sequence[float]) -> Timed:
    """`timed` with each block's host optimizer step as the host stream runs it
    (host_step.py, [Note: timing the host step as the runtime runs it])."""
    return replace(timed, step_s=tuple((device_s, h) for (device_s, _), h
                                       in zip(timed.step_s, host_s, strict=True)))


def _block_times(mf: ModelFile, graph: BlockGraph, planning: FromPlanning, device: str,
                 blocks_regex: str | None, say: Callable[[str], None],
                 in_context_hw: Hardware | None = None, remeasure: bool = False,
                 host_optimizer: str = "fused") -> tuple[Timed, Path, bool]:
    """Every block's (fwd s, bwd s) at the graph's batch, its selective recompute's s and
    (device s, host s) of its optimizer step, where they were timed, and whether now (else
    from the cache). With `in_context_hw` (this machine's CPU profile), in a whole training
    step if one fits ([Note: block times in context]), else block by block.
    `host_optimizer`: the host kernel (blocks_key)."""
    key = blocks_key(mf, graph, device, blocks_regex, in_context_hw is not None,
                     host_optimizer)
    path = cache_path("blocks", key)
    cached = None if remeasure else read_times(path, len(graph.blocks))
    if cached is not None:
        return cached, path, False
    timed, how = None, {}
    if in_context_hw is not None:
        ratios = partial(selective_ratios, mf, graph, planning.roofline_s, device,
                         blocks_regex, say)
        timed = timed_in_context(graph, in_context_hw, planning.keep_all, path, say, remeasure,
                                 planning.probe, ratios)
    if timed is None:  # not in context, or a keep_all step does not fit or failed
        timed, how = timed_alone(mf, graph, planning.roofline_s, device, blocks_regex, path,
                                 say, remeasure)
    write(path, {"key": key, **how, **vars(timed)}, say)
    return timed, path, True
