"""The two backends behind the engine: where compute runs and how the streams order work.

Every operation of the schedule has two moments: *issued* (its work has been handed to its
stream) and *done* (the work has finished). The engine and the stream workers wait for the
issue of an operation's dependencies on the CPU (threading events), then ask the backend to
order their own work after those dependencies:

- `cpu`: operations run synchronously on their stream's worker thread, so issued is done and
  there is nothing more to order. The host tier is file-backed.
- `cuda`: operations are enqueued on CUDA streams (compute on the current stream, one stream
  for each of h2d and d2h); each records a CUDA event when issued, and a device stream orders
  itself after a dependency with `wait_event`, without blocking the CPU. Work on the host
  (the host optimizer) waits for the event itself. The host tier is pinned memory.

[Note: device memory across streams, without record_stream] A tensor that a copy stream reads
(a swap-out's activations, a gradient on its way to the host) stays referenced until that
copy's event has completed (`release_after`), and only then goes back to the caching
allocator; a pinned host slot that a copy reads or writes is freed the same way. Device
memory that a copy stream fills (a swap-in, a weight fetch) is allocated on the compute
stream by the compute thread when it issues the copy (`allocating`, engine._prepare), and the
copy stream waits for the compute stream up to that point (`allocated`): the allocator may
hand out a block the compute stream freed moments ago. `record_stream` would
tie each block to the copy stream until the allocator next polls it, which fragments memory
(PYTORCH_NOTES).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import NamedTuple

import torch


class PendingRelease(NamedTuple):
    """What an in-flight copy still holds, and the event after which it may go."""

    done: torch.cuda.Event
    release: Callable[[], None]


class CpuBackend:
    """Compute on the CPU; copies and host steps finish on their worker thread."""

    name = "cpu"
    pool_kind = "file"

    def __init__(self):
        self.device = torch.device("cpu")

    def stream(self, name: str):
        return contextlib.nullcontext()

    def begin_iteration(self, op_ids) -> None:
        pass

    def issued(self, op_id: int, stream: str) -> None:
        pass

    def order_after(self, deps, stream: str, op_id: int | None = None) -> None:
        pass

    def allocating(self):
        return contextlib.nullcontext()

    def allocated(self, op_id: int) -> None:
        pass

    def marker(self) -> Callable[[], None] | None:
        return None  # work on the CPU is done when it returns: nothing to wait for

    def release_after(self, op_id: int, release: Callable[[], None]) -> None:
        release()  # the op has finished: nothing reads what it used any more

    def end_iteration(self) -> None:
        pass

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t

    # No device-memory counters: the peak is the process's private memory (peak.PrivatePeak).

    def cap(self, nbytes: int) -> int:
        from karma.errors import KarmaError
        raise KarmaError("--cap-device-memory caps a GPU's memory; on the CPU backend cap the "
                         "process with prlimit --data=BYTES (see make demo)")


class CudaBackend:
    """Compute on the current CUDA device's current stream; h2d and d2h streams of their own."""

    name = "cuda"
    pool_kind = "pinned"

    def __init__(self, device: torch.device | None = None):
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        # compute: forward (main thread) and backward (autograd's device thread, which runs
        # each node on its forward's stream); it waits for the swap-ins and fetches of its op
        self.compute = torch.cuda.current_stream(self.device)
        self.streams = {"compute": self.compute,
                        # swap-ins, weight fetches, uploads: wait for compute up to where their
                        # memory was allocated, and for their stage barrier
                        "h2d": torch.cuda.Stream(self.device),
                        # swap-outs, gradients to the host: wait for the compute that made them
                        "d2h": torch.cuda.Stream(self.device),
                        # all-reduces (several ranks): wait for the block's backward
                        "net": torch.cuda.Stream(self.device)}
        # op id -> recorded where the op's work ends on its stream (issued); streams wait on
        # it with wait_event, the host optimizer with synchronize
        self._events: dict[int, torch.cuda.Event] = {}
        # op id -> recorded on compute where a fetch's or swap-in's memory was allocated; its
        # copy stream waits on it before writing
        self._allocated: dict[int, torch.cuda.Event] = {}
        self._pending: list[PendingRelease] = []  # released by _poll once their copy is done
        self._lock = threading.Lock()

    def stream(self, name: str):
        """The worker thread of `name` enqueues its work on this CUDA stream."""
        if name in self.streams:
            return torch.cuda.stream(self.streams[name])
        return contextlib.nullcontext()  # host: CPU work

    def begin_iteration(self, op_ids) -> None:
        """Events for this iteration's ops (the engine's ids, unique across iterations);
        the previous iteration's stay, for the updates it left running (engine.py, [Note:
        updates overlapped with the next forward])."""
        op_ids = list(op_ids)
        floor = min(op_ids, default=0) - len(op_ids)
        self._events = {k: e for k, e in self._events.items() if k >= floor}
        self._events.update({i: torch.cuda.Event() for i in op_ids})

    def issued(self, op_id: int, stream: str) -> None:
        """The op's work is enqueued on `stream`: mark the point it ends at."""
        if stream in self.streams:
            self._events[op_id].record(self.streams[stream])

    def order_after(self, deps, stream: str, op_id: int | None = None) -> None:
        """Make `stream`'s next work wait for the device work of `deps` (already issued), and
        for the compute stream up to where op `op_id`'s memory was allocated."""
        if stream == "compute":
            self._poll()  # what finished copies hold goes back before compute allocates more
        events = [self._events[d] for d in deps]
        if op_id in self._allocated:
            events.append(self._allocated.pop(op_id))
        for event in events:
            if stream in self.streams:
                self.streams[stream].wait_event(event)
            else:
                event.synchronize()  # the host needs the bytes themselves

    def allocating(self):
        """Allocate device memory that a copy stream will fill on the compute stream (see the
        Note), from the compute thread."""
        return torch.cuda.stream(self.compute)

    def allocated(self, op_id: int) -> None:
        """Op `op_id`'s memory was just allocated: its copy stream must not write it before
        the compute stream reaches this point (the memory may have been compute's a moment
        ago)."""
        event = torch.cuda.Event()
        event.record(self.compute)
        self._allocated[op_id] = event

    def marker(self) -> Callable[[], None]:
        """A point on the calling thread's stream; calling the result makes the then-current
        stream wait for it (an unpack waiting for its swap-in)."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return lambda: torch.cuda.current_stream(self.device).wait_event(event)

    def release_after(self, op_id: int, release: Callable[[], None]) -> None:
        """Run `release` once op `op_id`'s device work has finished (call after issued())."""
        with self._lock:
            self._pending.append(PendingRelease(self._events[op_id], release))
        self._poll()

    def _poll(self) -> None:
        with self._lock:
            finished = [p.done.query() for p in self._pending]  # once each: it may change
            ready = [p for p, f in zip(self._pending, finished) if f]
            self._pending = [p for p, f in zip(self._pending, finished) if not f]
        for p in ready:
            p.release()

    def end_iteration(self) -> None:
        for s in self.streams.values():
            s.synchronize()
        with self._lock:
            pending, self._pending = self._pending, []
        for p in pending:
            p.release()

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device)

    def warm_up(self) -> None:
        """Make the allocations CUDA libraries keep for the process (cuBLAS workspaces on the
        compute stream) before the baseline is taken."""
        with torch.cuda.stream(self.compute):
            a = torch.ones(64, 64, device=self.device, requires_grad=True)
            (a @ a).sum().backward()
        torch.cuda.synchronize(self.device)

    def memory_baseline(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def cap(self, nbytes: int) -> int:
        """Let the caching allocator hold at most `nbytes` (a smaller GPU, emulated);
        returns the device's total memory."""
        total = torch.cuda.get_device_properties(self.device).total_memory
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(min(1.0, nbytes / total), self.device)
        return total


def make_backend(device_kind: str):
    if device_kind == "cuda":
        if not torch.cuda.is_available():
            from karma.errors import KarmaError
            raise KarmaError("this schedule was planned for a CUDA GPU and none is available "
                             "here; re-plan with --hardware cpu to train on the CPU backend")
        return CudaBackend()
    return CpuBackend()
