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
The fractions the side streams lose beside compute (hardware.py, [Note: contention between
streams]) are then set so that the simulator, replaying the probe with them, gives each
side stream the busy time its traced steps had (the median over the steps):
copy_slowdown_compute from h2d and d2h, host_slowdown_compute from the host optimizer; a
bisection each, in rounds, since streams on shared cores slow each other. On the GPT's
400 MiB plan's own traces this gave 0.864 and 0.812 (the profile: 0.564 and 0.391), and the
simulator then put h2d, d2h and host at 168, 130 and 148 ms a step against 164, 144 and 148
ms traced (70, 48 and 72 ms before). The rates alone and compute's fractions stay the
profile's: fitted the same way, compute's hit the bound (0.95), as its steps in the plan
are slower than keep_all's by more than sharing the cores explains.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import replace

from karma.planner.simulate import Contention, simulate
from karma.schedule import Schedule

# the side streams' fractions, and the streams whose busy time sets each
FITS = {"copy_slowdown_compute": ("h2d", "d2h"), "host_slowdown_compute": ("host",)}
MAX_SLOWDOWN = 0.95  # as measure_hw keeps a measured fraction
_ROUNDS = 3
_STEPS = 20  # bisection steps: 0.95 / 2**20, finer than the 3 digits recorded


def fit_side_fractions(schedule: Schedule, traces: Sequence[Sequence[Mapping]]
                       ) -> dict[str, float]:
    """The side streams' fractions that make the simulator's busy time of each side stream of
    `schedule` that of its traced steps (`traces`: each step's ops as karma-run --trace
    writes them; the median over the steps), rounded to 3 digits. A fraction keeps the
    profile's where its streams did no work in the traces, or where no fraction below
    MAX_SLOWDOWN makes them as slow as traced: then what slowed them is not the cores that
    compute shares (a small model's side ops, tens of microseconds planned, each take the
    stream's own Python overhead of a millisecond or so)."""
    contention = Contention.of(dict(schedule.hardware))

    def simulated(c: Contention, streams: tuple[str, ...]) -> float:
        sim = simulate(schedule.ops, schedule.buffers, contention=c)
        return sum(sim.end_s[op.id] - sim.start_s[op.id] for op in schedule.ops
                   if op.stream in streams)

    for _ in range(_ROUNDS):  # streams on shared cores slow each other: fit in rounds
        for field, streams in FITS.items():
            measured = statistics.median(_busy(ops, streams) for ops in traces)
            if measured <= 0.0:
                continue
            lo, hi = 0.0, MAX_SLOWDOWN
            for _ in range(_STEPS):  # the busy time grows with the fraction
                mid = (lo + hi) / 2
                if simulated(replace(contention, **{field: mid}), streams) < measured:
                    lo = mid
                else:
                    hi = mid
            if hi < MAX_SLOWDOWN:  # at the bound, sharing the cores does not explain it
                contention = replace(contention, **{field: (lo + hi) / 2})
    return {field: round(getattr(contention, field), 3) for field in FITS}


def _busy(ops: Sequence[Mapping], streams: tuple[str, ...]) -> float:
    return sum(op["end_s"] - op["start_s"] for op in ops if op["stream"] in streams)
