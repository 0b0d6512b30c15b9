"""The backend contract: where compute runs and how the streams order work; the CPU backend.

Every operation of the schedule has two moments: *issued* (its work has been handed to its
stream) and *done* (the work has finished). The engine and the stream workers wait for the
issue of an operation's dependencies on the CPU (threading events), then ask the backend to
order their own work after those dependencies:

- `cpu`: operations run synchronously on their stream's worker thread, so issued is done and
  there is nothing more to order. The host tier is file-backed.
- `cuda` (cuda_backend.py): operations are enqueued on CUDA streams (compute on the current
  stream, one stream for each of h2d, d2h and net); each records a CUDA event when issued,
  and a device stream orders itself after a dependency with `wait_event`, without blocking
  the CPU. Work on the host (the host optimizer) waits for the event itself. The host
  tier is pinned memory.

[Note: device memory across streams, without record_stream] A tensor that a copy stream reads
(a swap-out's activations, a gradient on its way to the host) stays referenced until that
copy's event has completed (`release_after`), and only then goes back to the caching
allocator; a pinned host slot that a copy reads or writes is freed the same way. Device
memory that a copy stream fills (a swap-in, a weight fetch, an all-reduce's flat buffer) is
allocated on the compute stream by the compute thread when it issues the copy (`allocating`,
Engine._prepare), and the copy stream waits for the compute stream up to that point
(`allocated`): the allocator may hand out a block the compute stream freed moments ago.
`record_stream` would tie each block to the copy stream until the allocator next polls it,
which fragments memory (PYTORCH_NOTES).

[Note: released where the schedule frees] The compute thread only enqueues work, so on a GPU it
runs ahead of the device; a release that waited for a later poll to find its copy done would
come later than the schedule's buffer table says, and every allocation made meanwhile would
add to the peak the planner bounded (GPT-2 medium swap_all at 16G: 9.39 GiB planned, 11.1 to
17.8 GiB simulated with releases 4 to 16 compute ops late). The schedule frees a buffer at the
end of its op, and its stage-by-stage bound (schedule_check) counts it through that op's stage
only; so when compute starts an op of a later stage, the engine hands the backend the side ops
of the stages before it (`release_due`), and the backend waits on the CPU for those copies'
events and releases what they held, there, before compute allocates more. Polls may still
release earlier.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
import torch.distributed

from karma.errors import KarmaError


class Backend(Protocol):
    """What the engine, its streams and its roles ask of a backend; both backends name it.

    The rules a backend relies on, which tests/protocol.py's CheckingBackend checks on the CPU
    for every schedule the tests run (on CUDA a break is silent: a stream that waits for an
    event never recorded does not wait at all, memory released before its copy has finished
    is corrupted, a collective whose stream was never ordered after the gradients' event
    all-reduces whatever its buffer held):

    - `order_after(deps, ...)` only after every dependency has been `issued`;
    - `release_after(op, ...)` only after the op has been `issued`; a release of a side op on
      a barrier stream is forced by `release_due` before any compute op of a later stage
      starts ([Note: released where the schedule frees]);
    - `allocated(op)` once, before the op's stream is ordered after it;
    - `issued(op)` once per op per replay, every op by the end of its replay or of the
      next one for the updates left running into it (replay/update.py); ops are known by the
      engine's gids, unique across replays ([Note: operation ids across replays]);
    - each collective runs on a net stream already ordered after the event of the op that
      made its block's gradients final and after its flat buffer's allocation, and hands the
      buffer's release to `release_after` (distributed/exchange.py).
    """

    name: str  # "cpu" or "cuda"
    pool_kind: str  # the host tier's memory: "file" (CPU backend) or "pinned" (CUDA)
    device: torch.device  # where compute runs
    clock: Any  # stamps for the all-reduces' times (WallClock, or CudaClock on CUDA)

    def stream(self, name: str) -> contextlib.AbstractContextManager:
        """Entered by stream `name`'s worker thread for its whole life."""

    def begin_replay(self, op_ids: Iterable[int]) -> None:
        """A replay starts; its ops have these gids."""

    def issued(self, op_id: int, stream: str) -> None:
        """Op `op_id`'s work has been handed to `stream`: its end is marked."""

    def order_after(self, deps, stream: str, op_id: int | None = None) -> None:
        """`stream`'s next work comes after the work of `deps` (issued) and after where op
        `op_id`'s memory was allocated."""

    def allocating(self) -> contextlib.AbstractContextManager:
        """Around the allocation of memory a side stream will fill (on the compute thread)."""

    def allocated(self, op_id: int) -> None:
        """Op `op_id`'s memory was just allocated."""

    def allocate(self, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """`make()` from a side stream's worker, as memory compute will own."""

    def collective(self, tensor: torch.Tensor, group, out: torch.Tensor | None = None) -> None:
        """Sum `tensor` over the ranks of `group`, in place (the exchange's all-reduce); with
        `out`, into `out` this rank's 1/N of the sum (a reduce-scatter)."""

    def marker(self) -> Callable[[], None] | None:
        """A point on the calling thread's stream; calling the result makes the then-current
        stream wait for it (None: nothing to wait for)."""

    def release_after(self, op_id: int, release: Callable[[], None]) -> None:
        """Run `release` once op `op_id`'s work has finished."""

    def release_due(self, op_ids) -> None:
        """The schedule frees what ops `op_ids` hold by now: release it."""

    def take_net_waits(self) -> list[tuple[float, float]] | None:
        """When compute waited for an all-reduce since the last call (None: the compute
        thread's own waits say it)."""

    def end_replay(self) -> None:
        """Every stream's work of the replay has been issued: finish it."""

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A batch's tensor on the compute device."""

    def device_id(self) -> str | None:
        """The device's identity, the same in every process that uses it (None: no GPU)."""

    def cap(self, nbytes: int):
        """Emulate a device of `nbytes` (--cap-device-memory)."""


def sum_over_ranks(tensor: torch.Tensor, group, out: torch.Tensor | None = None) -> None:
    """Sum `tensor` over the ranks of `group`, in place (an all-reduce); with `out`, into
    `out` this rank's 1/N of the sum (a reduce-scatter): `Backend.collective` on both
    backends, on the calling thread's current stream."""
    if out is None:
        torch.distributed.all_reduce(tensor, group=group)
    else:
        torch.distributed.reduce_scatter_tensor(out, tensor, group=group)


class WallClock:
    """Stamps on the CPU's clock: where work runs on the thread that stamps it (the CPU
    backend), a stamp before and one after the work bound it."""

    def restart(self) -> None:
        pass

    def stamp(self) -> float:
        return time.perf_counter()

    def seconds(self, stamp: float) -> float:
        return stamp


class CpuBackend(Backend):
    """Compute on the CPU; copies and host steps finish on their worker thread."""

    name = "cpu"
    pool_kind = "file"

    def __init__(self):
        self.device = torch.device("cpu")
        self.clock = WallClock()  # the all-reduces run on the net worker: it times them

    def stream(self, name: str):
        return contextlib.nullcontext()

    def begin_replay(self, op_ids) -> None:
        pass

    def issued(self, op_id: int, stream: str) -> None:
        pass

    def order_after(self, deps, stream: str, op_id: int | None = None) -> None:
        pass

    def allocating(self):
        return contextlib.nullcontext()

    def allocated(self, op_id: int) -> None:
        pass

    def allocate(self, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        return make()

    def collective(self, tensor: torch.Tensor, group, out: torch.Tensor | None = None) -> None:
        sum_over_ranks(tensor, group, out)  # on the net stream's worker, which waits for it

    def marker(self) -> Callable[[], None] | None:
        return None  # work on the CPU is done when it returns: nothing to wait for

    def release_after(self, op_id: int, release: Callable[[], None]) -> None:
        release()  # the op has finished: nothing reads what it used any more

    def release_due(self, op_ids) -> None:
        pass  # released when their ops finished

    def take_net_waits(self) -> list[tuple[float, float]] | None:
        return None  # the compute thread's own waits (Engine.blocked) are compute's

    def end_replay(self) -> None:
        pass

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def device_id(self) -> str | None:
        return None  # no GPU: nothing for ranks to share

    # No device-memory counters: the peak is the process's private memory (peak.PrivatePeak).

    def cap(self, nbytes: int) -> int:
        raise KarmaError("--cap-device-memory caps a GPU's memory; on the CPU backend cap the "
                         "process with prlimit --data=BYTES (see make demo)")
