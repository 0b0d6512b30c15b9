"""How much compute slows the CPU backend's side streams, fitted to traced steps of an
out-of-core probe schedule (which the calibration runs: karma/calibrate/in_context.py).

[Note: side streams timed in context] The machine's profile times a copy and an AdamW step
beside a transformer-like layer on a second thread (measure_hw.py, [Note: measuring
contention]), and the simulator shares the cores between the busy streams by those fractions
([Note: processor sharing] in simulate.py). Inside a training step a side stream does worse:
on the 2-core test machine the swaps of an 8-layer GPT (width 512, sequence 256, batch 8)
moved at 4.8-5.0 GB/s beside its compute, where the profile said 31-36 GB/s alone and lost
0.56 of that beside the layer (13.6-15.9 GB/s); its host steps took 4.2x their planned
time. Three streams' OpenMP teams and the compute thread's share two cores, and the model's
kernels are not the layer's. So, as the blocks are timed in a keep_all step, the side
streams are timed in steps of a probe: every block swapped, its weights streamed, its
optimizer on the host (pipeline.probe_schedule), planned with the block times just measured.

Two things are fitted to the probe's traced steps:

- The wait: a side op started while compute runs first waits for a core ([Note: waiting for
  a core] in simulate.py). Over the copies that ran beside compute (three quarters of their
  span or more), measured seconds against planned seconds alone is a line whose slope is
  the slowdown and whose intercept is the wait: 1.39 and 1.43 ms fitted to the GPT's 400 and
  800 MiB plans' traces, where a 12.6 MB fetch (0.48 ms planned alone) took 1-12 ms.
- The fractions the side streams lose beside compute, h2d's (copy_slowdown_compute), d2h's
  (d2h_slowdown_compute) and the host optimizer's (host_slowdown_compute), set with the wait
  so that the simulator, replaying the probe, gives each stream the busy time its traced
  steps had (the median over the steps): a bisection each, in rounds, since streams on
  shared cores slow each other. One fraction for both copies did not do: the profile's
  rates alone are noisy (h2d 25-33, d2h 15-25 GB/s in three runs of the quick profile)
  while in a step both ran at about 5 GB/s, so a plan's fetches took 1.3-1.6x and its
  swap-outs 0.6-0.8x of what the one fraction gave them.

Fitted to the 400 MiB plan's traces, this put the 800 MiB plan's h2d, d2h and host at 1.09,
1.00 and 0.91 of its traced busy times (fitted to the 800 MiB plan's, the 400 MiB plan's at
0.91, 1.01 and 1.11); with one copy fraction and no wait, at 1.71, 0.88, 0.91 and 1.19,
0.62, 1.10. The rates alone and compute's fractions stay the profile's: fitted the same way,
compute's hit the bound (0.95), as its steps in the plan are slower than keep_all's by more
than sharing the cores explains.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import replace

from karma.planner.simulate import Contention, simulate
from karma.schedule import Schedule

# the side streams' fractions, and the stream whose busy time sets each
FITS = {"copy_slowdown_compute": ("h2d",), "d2h_slowdown_compute": ("d2h",),
        "host_slowdown_compute": ("host",)}
FITTED = (*FITS, "side_wait_s")  # every Hardware field the fit sets
MAX_SLOWDOWN = 0.95  # as measure_hw keeps a measured fraction
MAX_WAIT_S = 0.05  # a scheduler's time slice is milliseconds
_ROUNDS = 30  # at most: the fit stops once a round moves nothing by more than _SETTLED
_SETTLED = {"side_wait_s": 5e-5, **dict.fromkeys(FITS, 5e-4)}  # half the digits recorded
_STEPS = 20  # bisection steps: 0.95 / 2**20, finer than the 3 digits recorded


def fit_side_streams(schedule: Schedule, traces: Sequence[Sequence[Mapping]]
                     ) -> dict[str, float]:
    """The side streams' wait for a core (`side_wait_s`, to 0.1 ms) and fractions (FITS, to 3
    digits) with which the simulator gives `schedule`'s small copies and each of its side
    streams the busy time they had in its traced steps (`traces`: each step's ops as
    karma-run --trace writes them; the median over the steps).

    The small copies are those planned shorter than the median copy: the wait adds the same
    to every op, the fractions to each in proportion, so the small ones' time sets the wait.
    The wait is 0 where the small copies took no longer than the fractions explain, or where
    the copies are all of one size. A fraction keeps the profile's where its stream did no
    work in the traces, or where no fraction below MAX_SLOWDOWN makes it as slow as traced:
    then what slowed it is not the cores that compute shares (a small model's side ops, tens
    of microseconds planned, each take the stream's own Python overhead of a millisecond or
    so)."""
    contention = Contention.of(dict(schedule.hardware), schedule.config.nproc_per_node)
    copies = [op for op in schedule.ops if op.stream in ("h2d", "d2h")]
    cut_s = statistics.median(op.dur_s for op in copies) if copies else 0.0
    small = {op.id for op in copies if op.dur_s < cut_s}
    targets = {"side_wait_s": ((lambda op: op.id in small), MAX_WAIT_S)}
    targets |= {field: ((lambda op, s=streams: op.stream in s), MAX_SLOWDOWN)
                for field, streams in FITS.items()}

    def simulated(c: Contention, counted) -> float:
        sim = simulate(schedule.ops, schedule.buffers, contention=c)
        return sum(sim.end_s[op.id] - sim.start_s[op.id] for op in schedule.ops if counted(op))

    for _ in range(_ROUNDS):  # each sets the others' busy time too: fit in rounds
        before = contention
        for field, (counted, bound) in targets.items():
            ids = {op.id for op in schedule.ops if counted(op)}
            measured = statistics.median(_busy(ops, ids) for ops in traces)
            if measured <= 0.0:
                continue
            lo, hi = 0.0, bound
            for _ in range(_STEPS):  # the busy time grows with the fraction (the wait)
                mid = (lo + hi) / 2
                if simulated(replace(contention, **{field: mid}), counted) < measured:
                    lo = mid
                else:
                    hi = mid
            if hi < bound:  # at the bound, sharing the cores does not explain it
                contention = replace(contention, **{field: (lo + hi) / 2})
        if all(abs(getattr(contention, f) - getattr(before, f)) < _SETTLED[f] for f in targets):
            break
    fitted = {field: round(getattr(contention, field), 3) for field in FITS}
    if contention.d2h_slowdown_compute:  # 0 would mean h2d's (Contention)
        fitted["d2h_slowdown_compute"] = max(fitted["d2h_slowdown_compute"], 0.001)
    return {**fitted, "side_wait_s": round(contention.side_wait_s, 4)}


def _busy(ops: Sequence[Mapping], ids: set[int]) -> float:
    return sum(op["end_s"] - op["start_s"] for op in ops if op["op"] in ids)
