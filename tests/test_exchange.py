"""The gradient exchange's own logic (runtime/distributed/exchange.py), one rank in one
process, no GPU needed.

Two ranks' sums are played by a backend whose collective adds what "the other rank" sent;
the CUDA backend's bookkeeping of compute's waits for the net stream runs on fake streams,
events and clock (the CUDA calls themselves run only on a GPU: tests/test_gpu.py).
"""

from __future__ import annotations

import threading

import torch

from karma.runtime.backends.backend import CpuBackend
from karma.runtime.backends.cuda_backend import CudaBackend
from karma.runtime.distributed.exchange import GradientExchange
from karma.runtime.distributed.process_group import Ranks

RANKS = Ranks(rank=0, world_size=2, owns_group=False, net=None, dist_backend="gloo")


class OtherRank(CpuBackend):
    """The collective adds `other`, the flat buffer the other rank sends."""

    def __init__(self, other: torch.Tensor):
        super().__init__()
        self.other = other
        self.sent: list[torch.Tensor] = []
        self.allocations = 0

    def collective(self, tensor, group) -> None:
        self.sent.append(tensor.clone())
        tensor.add_(self.other)

    def allocate(self, make):
        self.allocations += 1
        return make()


def test_gradients_are_averaged_and_each_gets_one_where_any_rank_had_one():
    a = torch.nn.Parameter(torch.zeros(2, 2))
    b = torch.nn.Parameter(torch.zeros(3))  # no gradient here, one on the other rank
    c = torch.nn.Parameter(torch.zeros(1))  # no gradient on any rank
    frozen = torch.nn.Parameter(torch.zeros(5), requires_grad=False)
    a.grad = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    # the other rank: a's gradient, b's, zeros for c; then the flags (a, b, c)
    other = torch.tensor([5.0, 6.0, 7.0, 8.0, 2.0, 4.0, 6.0, 0.0, 1.0, 1.0, 0.0])
    backend = OtherRank(other)
    exchange = GradientExchange(RANKS, backend)
    flats = exchange.prepare([a, b, c, frozen])
    assert [f.tensors for f in flats] == [[a, b, c]] and flats[0].buffer.numel() == 11
    release = exchange.reduce(flats)
    assert torch.equal(backend.sent[0], torch.tensor(
        [1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]))  # zeros, flags 1, 0, 0
    assert torch.equal(a.grad, torch.tensor([[3.0, 4.0], [5.0, 6.0]]))
    assert torch.equal(b.grad, torch.tensor([1.0, 2.0, 3.0]))
    assert backend.allocations == 1  # b's new gradient, allocated where compute allocates
    assert c.grad is None and frozen.grad is None
    release()
    assert flats == []  # the buffers are gone with the release, not before
    [(start, end)] = exchange.take_intervals()
    assert start <= end and exchange.take_intervals() == []


def test_one_collective_per_dtype_in_the_same_order_on_every_rank():
    params = [torch.nn.Parameter(torch.zeros(2, dtype=dtype))
              for dtype in (torch.float32, torch.bfloat16, torch.float32)]
    for p in params:
        p.grad = torch.ones_like(p)
    exchange = GradientExchange(RANKS, CpuBackend())
    flats = exchange.prepare(params)
    assert [f.buffer.dtype for f in flats] == sorted({torch.float32, torch.bfloat16}, key=str)
    assert [len(f.tensors) for f in flats] == [1, 2]


class FakeEvent:
    def __init__(self):
        self.stream = None

    def record(self, stream) -> None:
        self.stream = stream


class FakeStream:
    def __init__(self, name: str):
        self.name = name
        self.waited: list = []

    def wait_event(self, event) -> None:
        self.waited.append(event)


class FakeClock:
    """Stamps are (stream, tick); a stamp's seconds are its tick."""

    def __init__(self):
        self.ticks = 0

    def stamp(self, stream=None):
        self.ticks += 1
        return stream.name, float(self.ticks)

    def seconds(self, stamp) -> float:
        return stamp[1]


def fake_cuda_backend() -> CudaBackend:
    backend = object.__new__(CudaBackend)  # no CUDA here: the fields, by hand
    names = ("compute", "h2d", "d2h", "net")
    backend.streams = {n: FakeStream(n) for n in names}
    backend.compute = backend.streams["compute"]
    backend._events = {i: FakeEvent() for i in range(4)}  # noqa: SLF001
    backend._stream_of = {}  # noqa: SLF001
    backend._allocated = {}  # noqa: SLF001
    backend._pending = []  # noqa: SLF001
    backend._lock = threading.Lock()  # noqa: SLF001
    backend._net_waits = []  # noqa: SLF001
    backend.clock = FakeClock()
    return backend


def test_compute_waits_for_the_net_are_stamped_on_the_compute_stream():
    """allreduce_hidden_s on CUDA: compute's waits for an all-reduce, bracketed by stamps on
    the compute stream before and after its wait_event; other waits are not stamped."""
    backend = fake_cuda_backend()
    backend.issued(0, "compute")
    backend.issued(1, "net")
    backend.issued(2, "h2d")
    backend.order_after([2], "compute")  # a fetch: not the exchange's
    assert backend.take_net_waits() == []
    backend.order_after([0, 1], "compute")  # a device step after its all-reduce
    assert backend.streams["compute"].waited[-2:] == [backend._events[0],  # noqa: SLF001
                                                      backend._events[1]]  # noqa: SLF001
    assert backend._net_waits[0][0][0] == "compute"  # noqa: SLF001
    assert backend.take_net_waits() == [(1.0, 2.0)]
    backend.order_after([1], "d2h")  # a copy after the all-reduce: compute did not wait
    assert backend.take_net_waits() == []
