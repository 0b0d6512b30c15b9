"""The performance model: an event simulation of one iteration of a schedule's operations.

Each stream runs its operations in order; an operation starts when its stream is free and its
dependencies have finished, and lasts its predicted duration. Buffers are allocated when
their allocating operation starts and freed when their freeing operation ends, which gives
the device memory timeline. The simulation also checks the schedule: every buffer an
operation uses must be filled and not yet freed when the operation starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from karma.errors import KarmaError
from karma.schedule import STREAMS, Buffer, Op


class ScheduleError(KarmaError):
    """A schedule that cannot run as written (a buffer used before it is filled, ...)."""


@dataclass(frozen=True)
class SimResult:
    iteration_s: float
    busy_s: dict[str, float]  # per stream
    peak_device_bytes: int
    timeline: tuple[tuple[float, int], ...]  # (time, device bytes allocated from then on)
    start_s: tuple[float, ...]  # per op
    end_s: tuple[float, ...]  # per op
    lower_bound_s: float  # max over streams of busy time: no schedule of these ops is faster
    transfer_bytes: dict[str, int]  # bytes moved per copy stream


def simulate(ops: Sequence[Op], buffers: Sequence[Buffer]) -> SimResult:
    start = [0.0] * len(ops)
    end = [0.0] * len(ops)
    free_at = dict.fromkeys(STREAMS, 0.0)
    for op in ops:
        ready = max((end[d] for d in op.deps), default=0.0)
        if any(d >= op.id for d in op.deps):
            raise ScheduleError(f"op {op.id} ({op.kind} of block {op.block}) depends on a "
                                "later op; the op list must be in issue order")
        start[op.id] = max(ready, free_at[op.stream])
        end[op.id] = start[op.id] + op.dur_s
        free_at[op.stream] = end[op.id]

    _check_residency(ops, buffers, start, end)

    events: list[tuple[float, int, int]] = []  # (time, order: frees first, delta)
    for b in buffers:
        events.append((start[b.alloc] if b.alloc is not None else 0.0, 1, b.bytes))
        if b.free is not None:
            events.append((end[b.free], 0, -b.bytes))
    events.sort()
    timeline, current, peak = [], 0, 0
    for t, _, delta in events:
        current += delta
        peak = max(peak, current)
        if timeline and timeline[-1][0] == t:
            timeline[-1] = (t, current)
        else:
            timeline.append((t, current))

    busy = dict.fromkeys(STREAMS, 0.0)
    moved = {"h2d": 0, "d2h": 0}
    for op in ops:
        busy[op.stream] += op.dur_s
        if op.stream in moved:
            moved[op.stream] += op.bytes
    return SimResult(
        iteration_s=max(end, default=0.0),
        busy_s=busy,
        peak_device_bytes=peak,
        timeline=tuple(timeline),
        start_s=tuple(start),
        end_s=tuple(end),
        lower_bound_s=max(busy.values()),
        transfer_bytes=moved,
    )


def _check_residency(ops: Sequence[Op], buffers: Sequence[Buffer], start: list[float],
                     end: list[float]) -> None:
    by_name = {b.name: b for b in buffers}
    for op in ops:
        for name in op.uses:
            b = by_name.get(name)
            if b is None:
                continue  # an empty buffer (zero bytes) is never listed
            if b.alloc is not None and b.alloc != op.id and end[b.alloc] > start[op.id] + 1e-12:
                raise ScheduleError(
                    f"op {op.id} ({op.kind} of block {op.block}) starts at {start[op.id]:.6f} s "
                    f"before buffer {name} is filled (at {end[b.alloc]:.6f} s)")
            if b.free is not None and b.free != op.id and end[b.free] <= start[op.id]:
                raise ScheduleError(
                    f"op {op.id} ({op.kind} of block {op.block}) uses buffer {name} after "
                    f"op {b.free} freed it")
