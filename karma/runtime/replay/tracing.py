"""Recording one replay's timeline: when each operation started and ended on its stream.

The engine calls `began` and `ended` around every operation of the traced replay (compute
ops on the compute thread, the others on their stream's worker), and nothing at all when no
step is traced. The result is a `timeline.StepTrace`, relative to the replay's start.

A compute op runs from when the compute thread has its dependencies (Engine._start) to when
the next compute op arrives (Engine._finish_previous). A recompute has no boundary of its own
that the hooks see: autograd runs it inside the block's backward, when the backward unpacks
what it saved. So a recompute is recorded as an instant at the backward's start, and the
backward's span holds both.

[Note: two clocks, one origin] On the CPU backend every stream runs on a thread of its own,
so `time.perf_counter()` at the start and end of an op is when it ran. On CUDA an op only
enqueues work: each stamp on a device stream (compute, h2d, d2h, net) is a timing event
recorded there, resolved after the work has finished; host work (the host optimizer) keeps
perf_counter. To put both on one axis the traced replay starts with a device
synchronize, then records the origin event: with the device idle, the origin event's time
is the perf_counter origin's, to within the launch latency (microseconds). The synchronize
costs the traced replay the overlap with what the previous one left running, once.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from karma.schedule import Schedule, schedule_sha256
from karma.timeline import ComputeWait, OpSpan, StepTrace


class TraceRecorder:
    """Collects the stamps of one replay's ops (by gid, the engine's id across
    replays: streams.py, [Note: operation ids across replays])."""

    def __init__(self, schedule: Schedule, backend, kept: Callable[[], int] | None = None):
        """`kept`: the bytes the CPU cache keeps now (cpu_cache.CPUCache), read at each compute
        op's end, where there is one."""
        self._schedule = schedule
        self._kept_now = kept
        self._kept: list[tuple[float, int]] = []
        self._backend = backend.name
        # stream name -> its CUDA stream on the CUDA backend; on the CPU, none
        self._device_streams: dict = getattr(backend, "streams", {}) if backend.name == "cuda" \
            else {}
        self._n_ops = len(schedule.ops)
        self._base = -1  # gid of the traced replay's op 0, once started
        self._began: dict[int, object] = {}  # gid -> a perf_counter time or a CUDA event
        self._ended: dict[int, object] = {}
        self._origin_s = 0.0
        self._origin_event = None

    def start(self, base: int) -> None:
        """The traced replay begins; its ops have gids base .. base + len(ops) - 1."""
        if self._device_streams:  # [Note: two clocks, one origin]
            torch.cuda.synchronize()
            self._origin_event = self._stamp("compute")
        self._origin_s = time.perf_counter()
        self._base = base
        if self._kept_now is not None:  # what the previous step left kept, before op 0
            self._kept.append((self._origin_s, self._kept_now()))

    def began(self, gid, stream: str) -> None:
        if self._traced(gid):
            self._began[gid] = self._stamp(stream)

    def ended(self, gid, stream: str) -> None:
        if self._traced(gid):
            self._ended[gid] = self._stamp(stream)
            if self._kept_now is not None and stream == "compute":
                self._kept.append((time.perf_counter(), self._kept_now()))

    def _traced(self, gid) -> bool:
        # other keys: the previous replay's deferred updates, work queued behind them
        return type(gid) is int and self._base <= gid < self._base + self._n_ops

    def _stamp(self, stream: str):
        device_stream = self._device_streams.get(stream)
        if device_stream is None:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(device_stream)
        return event

    def _seconds(self, stamp) -> float:
        """A stamp as seconds since the replay's origin."""
        if isinstance(stamp, float):
            return stamp - self._origin_s
        self._origin_event.synchronize()  # elapsed_time needs both events completed
        stamp.synchronize()
        return self._origin_event.elapsed_time(stamp) / 1e3  # milliseconds

    def finish(self, step: int, step_s: float, blocked, blocked_on,
               memory: list[tuple[float, int]] = ()) -> StepTrace:
        """The trace, once every traced op has run (after engine.settle()). `blocked` and
        `blocked_on`: the engine's compute waits of the replay and their streams;
        `memory`: the peak meter's samples (perf_counter seconds, bytes above the
        baseline), where it records them (the CPU backend's private memory)."""
        spans = []
        for op in self._schedule.ops:
            gid = self._base + op.id
            if gid in self._began and gid in self._ended:
                start_s, end_s = self._seconds(self._began[gid]), self._seconds(self._ended[gid])
                spans.append(OpSpan(op.id, op.kind, op.block, op.stream, start_s, end_s))
        waits = tuple(ComputeWait(stream, start - self._origin_s, end - self._origin_s)
                      for (start, end), stream in zip(blocked, blocked_on))
        samples = tuple((t - self._origin_s, nbytes) for t, nbytes in memory)
        kept = tuple((t - self._origin_s, nbytes) for t, nbytes in self._kept)
        return StepTrace(schedule_sha256(self._schedule), self._schedule.model.path,
                         self._backend, step, step_s, tuple(spans), waits, samples, kept)
