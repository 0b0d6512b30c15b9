"""The gradient exchange of several ranks: a block's gradients averaged on the `net` stream.

[Note: all-reduce on device gradients] A block's gradients are averaged where the backward
left them, on the device, before any copy to the host: the host optimizer then receives the
averaged gradient with one device-to-host copy instead of one per rank, NCCL reduces device
memory over the fastest links, and the planner's model (the all-reduce's stage between the
block's backward and its gradients' copy or device step) is what runs. Gradients are summed
and divided by the number of ranks, as DDP does. A parameter with no gradient on a rank
contributes zeros there, and a flag counts the ranks that had one: where none had, it keeps
no gradient and the optimizer skips it, as plain PyTorch does. Every rank makes the same calls
in the same order. A block's gradients travel as one flat buffer per dtype (the planner counts
it, `artmp.i`): one collective per block instead of one per tensor cut a tiny GPT's exchange
on gloo from 45 ms to 8 ms a step. Gradients accumulated on the host over micro-batches are
all-reduced there the same way, staged through the same flat buffer on the device.

[Note: the flat buffer's life] The buffer is allocated when the all-reduce is issued
(`prepare`, called by Engine._prepare on the compute thread when the all-reduce's stage
starts), on the compute stream, and the backend records where (`allocated`). The net stream's
worker then orders the net stream after the event of the op that made the gradients final
(the block's backward, or its copy to the host) and after that allocation, and `reduce`
copies the gradients in, runs the collective and copies the averages back. The all-reduce's
event (recorded when the op is issued) comes after all of it; the device step, the copy to
the host and the host step wait for it through their dependencies, like any op. `reduce`
returns the release of the buffer, which the backend runs once that event has completed or,
at the latest, where the schedule frees the buffer (backends/backend.py, [Note: released where the
schedule frees]). Nothing calls record_stream: the buffer stays referenced until then.

How each collective meets the net stream (PyTorch's ProcessGroupNCCL.cpp and
ProcessGroupGlooCuda.cpp):
- NCCL enqueues on a stream of its own after an event recorded on the calling thread's current
  stream (the net stream, in the worker), and `wait()` (all_reduce without async_op calls it)
  makes the current stream wait for the collective's end without blocking the CPU.
- gloo all-reduces a CUDA tensor by copying it into pinned host memory on a stream of its own
  that first waits for the current stream, reducing on the CPU and copying back; `wait()`
  blocks the calling thread (the net worker, not compute) until the reduction is done, then
  makes the current stream wait for the copy back. gloo records its stream on the buffer
  (recordStream) itself; the buffer is kept past the all-reduce's event anyway.
Either way the collective is complete, on the net stream, before the all-reduce's event.

The counts of the ranks that had each gradient are read on the CPU (`tolist`), which waits
for the collective on the net worker's thread; the compute thread does not wait for it.

[Note: the reduce-scatter's layout] With sharded host state (params/layout.py) a host-stepped
block's gradients are reduce-scattered: rank r needs the average of rows [r c, (r+1) c) of
dim 0 of each gradient (c = dim 0 / N, rounded up). So the flat buffer is laid out rank by
rank: rank r's chunk holds those rows of every gradient, each padded with zeros to c rows,
then one flag per tensor (every rank writes its flags into every chunk, so each chunk's sum
counts the ranks that had each gradient). After the collective a rank holds the sums of its
own chunk, and writes their averages back into its rows of each gradient, where the copy to
the host (or, for gradients added up on the host, the host step) reads them. The other rows
are left as they were: nothing reads them. The sums are those of an all-reduce: on two
ranks each element is a + b either way, bit for bit the average of the all-reduce.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from karma.runtime.distributed.cut import Cut, rows_of
from karma.runtime.distributed.process_group import Ranks, lost


class Flat(NamedTuple):
    """One collective: the tensors whose gradients it averages (one dtype) and its buffer,
    their gradients end to end and then one flag per tensor; with `cuts`, a reduce-scatter
    over a buffer laid out rank by rank ([Note: the reduce-scatter's layout])."""

    tensors: list[torch.Tensor]
    buffer: torch.Tensor
    cuts: list[Cut] | None = None  # each tensor's rows on this rank


class GradientExchange:
    """Averages a block's gradients over the ranks, on the `net` stream; times each call."""

    def __init__(self, ranks: Ranks, backend):
        """`backend`: where the buffers live, how the net stream's work is timed, how a
        gradient a rank lacked is allocated, and the collective itself (backends/backend.py)."""
        self.ranks = ranks
        self._backend = backend
        self._clock = backend.clock
        self.intervals: list[tuple[object, object]] = []  # (start, end) stamps, this step

    def prepare(self, tensors: list[torch.Tensor],
                cuts: list[Cut] | None = None) -> list[Flat]:
        """The flat buffers for the gradients of `tensors` (a block's parameters, or their host
        masters), one per dtype in the same order on every rank; allocate them where the
        backend's compute allocates (see [Note: the flat buffer's life]). With `cuts` (one per
        tensor: its rows on this rank), buffers for a reduce-scatter."""
        cut_of = dict(zip(map(id, tensors), cuts)) if cuts is not None else None
        trained = [t for t in tensors if t.requires_grad]  # frozen ones never have gradients
        flats = []
        for dtype in sorted({t.dtype for t in trained}, key=str):
            group = [t for t in trained if t.dtype == dtype]
            if cut_of is None:
                size = sum(t.numel() for t in group) + len(group)
                group_cuts = None
            else:
                group_cuts = [cut_of[id(t)] for t in group]
                size = self.ranks.world_size * _chunk_numel(group, group_cuts)
            flats.append(Flat(group, torch.empty(size, dtype=dtype, device=self._backend.device),
                              group_cuts))
        return flats

    def reduce(self, flats: list[Flat]) -> Callable[[], None]:
        """Average the gradients of each flat's tensors over the ranks (on the net stream);
        returns the release of the buffers, for after the all-reduce's event."""
        start = self._clock.stamp()
        for flat in flats:
            if flat.cuts is None:
                self._reduce(flat)
            else:
                self._reduce_scatter(flat)
        self.intervals.append((start, self._clock.stamp()))
        return flats.clear

    def _reduce(self, flat: Flat) -> None:
        """One collective: the gradients, zeros where this rank has none, then one flag per
        tensor that counts the ranks that had one."""
        tensors, buffer = flat.tensors, flat.buffer
        n = len(tensors)
        parts = buffer[:-n].split([t.numel() for t in tensors])
        for t, part in zip(tensors, parts):
            if t.grad is None:
                part.zero_()
            else:
                part.copy_(t.grad.reshape(-1), non_blocking=True)
        had = [t.grad is not None for t in tensors]
        flags = buffer[-n:]
        if all(had):
            flags.fill_(1.0)
        else:
            for k, h in enumerate(had):
                flags[k].fill_(float(h))
        try:
            self._backend.collective(buffer, self.ranks.net)
        except RuntimeError as e:
            raise lost(self.ranks, "in a gradient exchange", e) from e
        counts = flags.tolist()
        buffer[:-n].div_(self.ranks.world_size)
        with torch.no_grad():
            for t, part, count in zip(tensors, parts, counts):
                if count == 0:
                    t.grad = None  # no rank had one: the optimizer skips it, as in plain PyTorch
                elif t.grad is None:
                    t.grad = self._new_grad(t, part)
                else:
                    t.grad.copy_(part.view_as(t.grad))

    def _reduce_scatter(self, flat: Flat) -> None:
        """One reduce-scatter ([Note: the reduce-scatter's layout]): the average of this
        rank's rows of each gradient written back into them."""
        tensors, buffer, cuts = flat
        n, world = len(tensors), self.ranks.world_size
        chunk = buffer.numel() // world
        chunks = buffer.view(world, chunk)
        offset = 0
        for t, cut in zip(tensors, cuts):
            width = cut.rows * _row_numel(t)
            region = chunks[:, offset:offset + width]
            if t.grad is None:
                region.zero_()
            else:
                _spread_rows(t.grad, cut.rows, region)
            offset += width
        had = [float(t.grad is not None) for t in tensors]
        chunks[:, offset:].copy_(torch.tensor(had, dtype=buffer.dtype).expand(world, n))
        mine = torch.empty(chunk, dtype=buffer.dtype, device=buffer.device)
        try:
            self._backend.collective(buffer, self.ranks.net, out=mine)
        except RuntimeError as e:
            raise lost(self.ranks, "in a gradient exchange", e) from e
        counts = mine[-n:].tolist()
        mine[:-n].div_(world)
        offset = 0
        with torch.no_grad():
            for t, cut, count in zip(tensors, cuts, counts):
                width = cut.rows * _row_numel(t)
                rows = cut.stop - cut.start
                part = mine[offset:offset + rows * _row_numel(t)]
                offset += width
                if count == 0:
                    t.grad = None  # no rank had one: the optimizer skips it
                    continue
                if t.grad is None:
                    t.grad = self._backend.allocate(
                        lambda t=t: torch.zeros(t.shape, dtype=t.dtype, device=t.device))
                rows_of(t.grad, cut).copy_(part.view(rows_of(t.grad, cut).shape))

    def _new_grad(self, t: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
        """A gradient for `t`, which had none on this rank, holding `part`: allocated where
        compute allocates (it is compute's from here on), filled on the net stream."""
        grad = self._backend.allocate(
            lambda: torch.empty(t.shape, dtype=t.dtype, device=t.device))
        grad.copy_(part.view(t.shape))
        return grad

    def take_intervals(self) -> list[tuple[float, float]]:
        """The (start, end) of each all-reduce since the last call, in seconds on the
        backend's clock (call once the step's work has finished)."""
        stamps, self.intervals = self.intervals, []
        seconds = self._clock.seconds
        return [(seconds(a), seconds(b)) for a, b in stamps]


def _row_numel(t: torch.Tensor) -> int:
    """Elements in one row of dim 0 (a 0-dim tensor is one row of one)."""
    return math.prod(t.shape[1:])  # from the shape: a streamed weight may have no storage


def _chunk_numel(tensors: list[torch.Tensor], cuts: list[Cut]) -> int:
    """One rank's chunk of a reduce-scatter: each tensor's rows, padded, then the flags."""
    return sum(c.rows * _row_numel(t) for t, c in zip(tensors, cuts)) + len(tensors)


def _spread_rows(grad: torch.Tensor, rows: int, region: torch.Tensor) -> None:
    """Copy `grad`'s rows into `region` ([N, rows x row] of the buffer): rank r's part gets
    rows [r rows, (r + 1) rows), zero-padded past the last row."""
    whole = grad.reshape(grad.shape[0] if grad.dim() else 1, -1)
    dim0, world = whole.shape[0], region.shape[0]
    view = region.unflatten(1, (rows, whole.shape[1]))
    full = dim0 // rows
    view[:full].copy_(whole[:full * rows].view(full, rows, -1), non_blocking=True)
    if full < world:
        left = dim0 - full * rows
        view[full, :left].copy_(whole[full * rows:], non_blocking=True)
        view[full, left:].zero_()
        view[full + 1:].zero_()


def hidden_s(busy: list[tuple[float, float]], blocked: list[tuple[float, float]]) -> float:
    """How much of the `busy` intervals (all-reduces) fell outside `blocked` ones (compute
    waiting): the part of the exchange that compute hid. `blocked` are disjoint."""
    total = 0.0
    for start, end in busy:
        overlap = sum(max(0.0, min(end, b_end) - max(start, b_start))
                      for b_start, b_end in blocked)
        total += (end - start) - overlap
    return total
