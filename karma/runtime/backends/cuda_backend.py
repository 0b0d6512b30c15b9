"""The CUDA backend: compute on the current stream, copies and all-reduces on streams of
their own, ordered by events (backend.py says the contract and its Notes).

Its ordering is checked on the CPU by tests/protocol.py's CheckingBackend, and its event
bookkeeping by tests that fake the events; on a GPU by tests/test_gpu.py (bench/gpu_check.sh,
run on an H200: bench/RESULTS.md).

[Note: expandable segments] A schedule plans device memory to within a few percent of the
budget, and the caching allocator's fragmentation is not in the plan. On an H200 emulating a
card of the budget, GPT-2 small planned at half of what it needs ran out of memory asking for
its 786 MiB logits' log-softmax with 585 MiB reserved but free in pieces, its allocated bytes
inside the plan. Expandable segments (PyTorch's allocator maps more pages onto the end of a
segment instead of a new segment) leave no such pieces, so the backend turns them on, unless
the user configures the allocator (PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF). They can be
turned on after CUDA has started: the segments made before stay as they were.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import NamedTuple

import torch

from karma.errors import KarmaError
from karma.runtime.backends.backend import Backend, sum_over_ranks
from karma.units import format_bytes


class PendingRelease(NamedTuple):
    """What an in-flight copy still holds, and the event after which it may go."""

    op_id: int  # the op whose work reads or fills what `release` drops
    done: torch.cuda.Event
    release: Callable[[], None]


class CudaClock:
    """Stamps on the device's clock: a timing event recorded on the calling thread's current
    stream, read as seconds since this clock's origin once the work has finished (the
    all-reduces' times, and when compute waited for them: see CudaBackend.order_after). The
    origin moves to the start of each step (`restart`): event times are single-precision
    milliseconds, too coarse hours after one origin."""

    def __init__(self, device: torch.device):
        self._device = device
        self._origin = self.stamp()

    def restart(self) -> None:
        self._origin = self.stamp()

    def stamp(self, stream: torch.cuda.Stream | None = None) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream or torch.cuda.current_stream(self._device))
        return event

    def seconds(self, stamp: torch.cuda.Event) -> float:
        self._origin.synchronize()
        stamp.synchronize()
        return self._origin.elapsed_time(stamp) / 1e3  # milliseconds


class CudaBackend(Backend):
    """Compute on the current CUDA device's current stream; h2d, d2h and net streams of their
    own."""

    name = "cuda"
    pool_kind = "pinned"

    def __init__(self, device: torch.device | None = None):
        use_expandable_segments()
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
                        # all-reduces (several ranks): wait for the event of the backward that
                        # made the block's gradients final, and for compute up to where their
                        # flat buffer was allocated; the device step, the gradients' copy to
                        # the host and the host step wait for the all-reduce's event
                        "net": torch.cuda.Stream(self.device)}
        # op id -> recorded where the op's work ends on its stream (issued); streams wait on
        # it with wait_event, the host optimizer with synchronize
        self._events: dict[int, torch.cuda.Event] = {}
        self._stream_of: dict[int, str] = {}  # op id -> the stream it was issued on
        # op id -> recorded on compute where a fetch's or swap-in's memory was allocated; its
        # copy stream waits on it before writing
        self._allocated: dict[int, torch.cuda.Event] = {}
        self._pending: list[PendingRelease] = []  # released once their copy is done
        self._lock = threading.Lock()
        self.clock = CudaClock(self.device)  # the all-reduces' times (distributed/exchange.py)
        # (start, end) stamps of compute's waits for an all-reduce, this step
        self._net_waits: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def stream(self, name: str):
        """The worker thread of `name` enqueues its work on this CUDA stream."""
        if name in self.streams:
            return torch.cuda.stream(self.streams[name])  # and its device, for the thread
        return torch.cuda.device(self.device)  # host: CPU work, on a thread of this GPU

    def begin_replay(self, op_ids) -> None:
        """Events for this replay's ops (the engine's ids, unique across replays);
        the previous replay's stay, for the updates it left running (replay/update.py, [Note:
        updates overlapped with the next forward])."""
        op_ids = list(op_ids)
        floor = min(op_ids, default=0) - len(op_ids)
        self._events = {k: e for k, e in self._events.items() if k >= floor}
        self._stream_of = {k: s for k, s in self._stream_of.items() if k >= floor}
        self._events.update({i: torch.cuda.Event() for i in op_ids})

    def issued(self, op_id: int, stream: str) -> None:
        """The op's work is enqueued on `stream`: mark the point it ends at."""
        if stream in self.streams:
            self._events[op_id].record(self.streams[stream])
            self._stream_of[op_id] = stream

    def order_after(self, deps, stream: str, op_id: int | None = None) -> None:
        """Make `stream`'s next work wait for the device work of `deps` (already issued), and
        for the compute stream up to where op `op_id`'s memory was allocated."""
        if stream == "compute":
            self._poll()  # what finished copies hold goes back before compute allocates more
        events = [self._events[d] for d in deps]
        if op_id in self._allocated:
            events.append(self._allocated.pop(op_id))
        if stream not in self.streams:
            for event in events:
                event.synchronize()  # the host needs the bytes themselves
            return
        # compute waiting for an all-reduce is stamped before and after the wait: the part
        # of the all-reduce that compute did not hide (allreduce_hidden_s)
        on_net = stream == "compute" and any(self._stream_of.get(d) == "net" for d in deps)
        before = self.clock.stamp(self.compute) if on_net else None
        for event in events:
            self.streams[stream].wait_event(event)
        if on_net:
            self._net_waits.append((before, self.clock.stamp(self.compute)))

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

    def allocate(self, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """`make()` on the compute stream, from a side stream's worker, with the calling
        stream ordered after that point: memory a side stream fills and compute then owns
        (a gradient the all-reduce gives a parameter that had none on this rank)."""
        with torch.cuda.stream(self.compute):
            t = make()
            event = torch.cuda.Event()
            event.record(self.compute)
        torch.cuda.current_stream(self.device).wait_event(event)
        return t

    def collective(self, tensor: torch.Tensor, group, out: torch.Tensor | None = None) -> None:
        """Sum `tensor` over the ranks of `group`, in place, on the calling thread's current
        stream (the net stream: distributed/exchange.py says how NCCL and gloo meet it); with
        `out`, into `out` this rank's 1/N of the sum (a reduce-scatter)."""
        sum_over_ranks(tensor, group, out)

    def marker(self) -> Callable[[], None]:
        """A point on the calling thread's stream; calling the result makes the then-current
        stream wait for it (an unpack waiting for its swap-in)."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return lambda: torch.cuda.current_stream(self.device).wait_event(event)

    def release_after(self, op_id: int, release: Callable[[], None]) -> None:
        """Run `release` once op `op_id`'s device work has finished (call after issued())."""
        with self._lock:
            self._pending.append(PendingRelease(op_id, self._events[op_id], release))
        self._poll()

    def release_due(self, op_ids) -> None:
        """The schedule frees what ops `op_ids` hold by now: wait for their work and release
        it ([Note: released where the schedule frees])."""
        due = set(op_ids)
        with self._lock:
            ready = [p for p in self._pending if p.op_id in due]
            self._pending = [p for p in self._pending if p.op_id not in due]
        for p in ready:
            p.done.synchronize()
            p.release()

    def _poll(self) -> None:
        with self._lock:
            finished = [p.done.query() for p in self._pending]  # once each: it may change
            ready = [p for p, f in zip(self._pending, finished) if f]
            self._pending = [p for p, f in zip(self._pending, finished) if not f]
        for p in ready:
            p.release()

    def take_net_waits(self) -> list[tuple[float, float]]:
        """When compute waited for an all-reduce since the last call, on the clock's axis
        (call once the step's work has finished)."""
        waits, self._net_waits = self._net_waits, []
        return [(self.clock.seconds(a), self.clock.seconds(b)) for a, b in waits]

    def end_replay(self) -> None:
        for s in self.streams.values():
            s.synchronize()
        with self._lock:
            pending, self._pending = self._pending, []
        for p in pending:
            p.release()

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device)

    def device_id(self) -> str:
        """This GPU's UUID: the same for every process that uses it, whatever the device
        index each sees (distributed/process_group.py, [Note: choosing the collective backend])."""
        props = torch.cuda.get_device_properties(self.device)
        return str(getattr(props, "uuid", f"{os.uname().nodename}:cuda{self.device.index}"))

    def warm_up(self) -> None:
        """Make the allocations CUDA libraries keep for the process (cuBLAS workspaces on the
        compute stream) before the baseline is taken."""
        with torch.cuda.stream(self.compute):
            warm_up(self.device)

    def memory_baseline(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def peak_reserved_bytes(self) -> int:
        return torch.cuda.max_memory_reserved(self.device)

    def outside_allocator_bytes(self) -> int:
        return outside_allocator_bytes(self.device)

    def cap(self, nbytes: int) -> DeviceCap:
        """Emulate a GPU of `nbytes` (cap_device_memory)."""
        return cap_device_memory(nbytes, self.device)


ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def allocator_settings(environ) -> str | None:
    """The settings karma gives PyTorch's CUDA allocator ([Note: expandable segments]), or
    None where the user's environment configures it (options combine badly: expandable
    segments with max_split_size_mb grow the reserved bytes, pytorch/pytorch#123548)."""
    if any(environ.get(v) for v in ALLOC_CONF_VARS):
        return None
    return "expandable_segments:True"


def use_expandable_segments() -> None:
    settings = allocator_settings(os.environ)
    if settings is None:
        return
    # the setter moved to torch._C (PyTorch 2.13 deprecates torch.cuda.memory's)
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) \
        or torch.cuda.memory._set_allocator_settings
    setter(settings)


class DeviceCap(NamedTuple):
    """What --cap-device-memory set: the card's size, the memory in use outside PyTorch's
    allocator when it was set, and what the allocator may hold."""

    total_bytes: int
    outside_bytes: int
    allocator_bytes: int


def warm_up(device: torch.device) -> None:
    """A matrix product forward and backward on the current stream: cuBLAS makes its handle
    (outside the allocator) and its workspace (inside) now, not in the middle of a step."""
    a = torch.ones(64, 64, device=device, requires_grad=True)
    (a @ a).sum().backward()
    torch.cuda.synchronize(device)


def outside_allocator_bytes(device: torch.device) -> int:
    """Device memory in use that PyTorch's caching allocator does not hold: the CUDA context,
    library handles, NCCL's buffers (and other processes' memory)."""
    free, total = torch.cuda.mem_get_info(device)
    return total - free - torch.cuda.memory_reserved(device)


def cap_device_memory(nbytes: int, device: torch.device | None = None) -> DeviceCap:
    """Emulate a GPU of `nbytes`: PyTorch's caching allocator may hold `nbytes` less what is
    already in use outside it (the CUDA context, measured now), so that the whole card's use
    stays within `nbytes` as on a GPU of that size. karma-run --cap-device-memory, the
    reference and every contender of bench/gpu_throughput.py emulate a card this one way."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    warm_up(device)  # the context and cuBLAS's handle are then part of what is measured
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    outside = outside_allocator_bytes(device)
    limit = nbytes - outside
    if limit <= 0:
        raise KarmaError(
            f"a GPU of {format_bytes(nbytes)} leaves nothing for PyTorch: "
            f"{format_bytes(outside)} of the device is already in use outside its allocator "
            "(the CUDA context); emulate a larger GPU")
    torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), device)
    return DeviceCap(total, outside, limit)
