"""What one optimizer step measured, gathered micro-batch by micro-batch."""

from __future__ import annotations

from dataclasses import dataclass

from karma.timeline import StepTrace


@dataclass(frozen=True)
class StepStats:
    """What one optimizer step (all its micro-batches) measured."""

    loss: float  # the mean of its micro-batches' losses
    step_s: float
    lr: float | None  # param group 0's learning rate in this step (None: no optimizer)
    peak_bytes: int  # above the baseline: private memory (CPU) or device memory (CUDA)
    allreduce_intervals: tuple[tuple[float, float], ...]  # (start, end) of each all-reduce
    blocked: tuple[tuple[float, float], ...]  # when the compute thread waited for a stream
    grad_norm: float | None = None  # the global gradient norm before clipping (with clipping)
    blocked_on: tuple[str, ...] = ()  # the stream each of `blocked` is blamed on
    trace: StepTrace | None = None  # this step's timeline, if trace_next_step() asked for it
    # when compute waited while an all-reduce ran, on the clock of `allreduce_intervals`: the
    # compute thread's waits on the CPU backend, the compute stream's waits for the net
    # stream on CUDA (backends/cuda_backend.py, CudaBackend.order_after)
    allreduce_blocked: tuple[tuple[float, float], ...] = ()

    def wait_s_by_stream(self) -> dict[str, float]:
        """Seconds the compute thread waited, per stream blamed (replay/streams.py, [Note: which
        stream a wait is blamed on])."""
        total: dict[str, float] = {}
        for (start, end), stream in zip(self.blocked, self.blocked_on):
            total[stream] = total.get(stream, 0.0) + (end - start)
        return total


class StepTally:
    """The figures of the optimizer step under way, one micro-batch at a time."""

    def __init__(self):
        self.begin(None)

    def begin(self, lr: float | None) -> None:
        """A step starts, with learning rate `lr`."""
        self._lr = lr
        self._micro: list[tuple[float, float, int]] = []  # (loss, seconds, peak bytes) each
        self._blocked: list[tuple[float, float]] = []
        self._blocked_on: list[str] = []

    def add(self, loss: float, seconds: float, peak_bytes: int,
            blocked: list[tuple[float, float]], blocked_on: list[str]) -> None:
        """One micro-batch's figures (`blocked`, `blocked_on`: its waits, Engine.blocked)."""
        self._micro.append((loss, seconds, peak_bytes))
        self._blocked += blocked
        self._blocked_on += blocked_on

    @property
    def blocked(self) -> list[tuple[float, float]]:
        return self._blocked

    def finish(self, grad_norm: float | None, trace: StepTrace | None,
               allreduce_intervals=(), allreduce_blocked=()) -> StepStats:
        """The step's StepStats, once its last micro-batch has run."""
        losses, times, peaks = zip(*self._micro)
        return StepStats(sum(losses) / len(losses), sum(times), self._lr, max(peaks),
                         tuple(allreduce_intervals), tuple(self._blocked), grad_norm,
                         tuple(self._blocked_on), trace, tuple(allreduce_blocked))
