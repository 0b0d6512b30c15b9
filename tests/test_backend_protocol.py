"""The engine keeps the backend's protocol, which the CUDA backend relies on (checked on CPU).

`CheckingBackend` (tests/protocol.py) runs every schedule of the CPU tests and fails on the
first call that would be wrong on CUDA. The two-rank schedules of tests/test_distributed.py
run under it too (tests/dist_worker.py), with their real collectives; here, a schedule whose
all-reduce is misplaced, and an exchange that drops its buffer itself, are caught.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from karma.runtime.backends.cuda_backend import CudaBackend, allocator_settings
from karma.runtime.distributed.process_group import Ranks
from karma.testing.exactness import plan, run
from tests.matrix import MODELS, STRATEGIES, cells
from tests.protocol import CheckingBackend
from tests.runtime_helpers import load_small


@pytest.mark.parametrize("name,strategy,fraction", cells(MODELS, STRATEGIES))
def test_the_engine_keeps_the_backends_protocol(name, strategy, fraction, monkeypatch):
    schedule = plan(load_small(name), strategy, fraction)
    backend = CheckingBackend(schedule)
    monkeypatch.setattr("karma.runtime.runtime.make_backend", lambda kind: backend)
    report = run(schedule, load_small(name), 2)
    assert report.steps == [1, 2]
    assert not backend.violations, backend.violations[:5]
    assert backend.calls > 2 * len(schedule.ops)  # the checks ran


# --- the net stream, in one process: two ranks' schedule, a collective that sums nothing ----

def two_ranks_in_one_process(monkeypatch, schedule) -> CheckingBackend:
    """Run `schedule` (planned for 2 ranks) here as rank 0 of 2, with no other rank: the
    collective leaves its buffer as it is (protocol only, no numbers checked)."""
    ranks = Ranks(rank=0, world_size=2, owns_group=False, net=None, dist_backend="gloo")
    for name in ("barrier", "agree", "leave"):
        monkeypatch.setattr(f"karma.runtime.distributed.process_group.{name}", lambda *a, **k: None)
    monkeypatch.setattr("karma.runtime.distributed.process_group.join", lambda *a, **k: ranks)
    monkeypatch.setattr("karma.runtime.distributed.process_group.gather",
                        lambda ranks, value, where: [value])
    backend = CheckingBackend(schedule, fake_collective=True)
    monkeypatch.setattr("karma.runtime.runtime.make_backend", lambda kind: backend)
    return backend


def misplace_allreduce(schedule, block: int):
    """The schedule with block `block`'s all-reduce ordered after what its backward waits
    for instead of after the backward: as if planned into the backward's stage."""
    ops = list(schedule.ops)
    ar = next(op for op in ops if op.kind == "allreduce" and op.block == block)
    bwd = next(op for op in ops if op.kind == "backward" and op.block == block)
    ops[ar.id] = replace(ar, deps=bwd.deps)
    return replace(schedule, ops=tuple(ops))


@pytest.fixture(scope="module")
def gpt_two_ranks():
    """Replicated host state: sharded state gathers its weights in collectives of its own,
    which need the other rank (tests/test_distributed.py runs them)."""
    return plan(load_small("gpt"), "ilp", 0.6, world_size=2, host_state="replicated")


def test_the_net_stream_keeps_the_protocol_in_one_process(gpt_two_ranks, monkeypatch):
    backend = two_ranks_in_one_process(monkeypatch, gpt_two_ranks)
    run(gpt_two_ranks, load_small("gpt"), 2)
    assert not backend.violations, backend.violations[:5]
    assert backend.collectives == 2 * len(gpt_two_ranks.blocks)  # one per block and step


def test_a_misplaced_collective_is_caught(gpt_two_ranks, monkeypatch):
    block = len(gpt_two_ranks.blocks) // 2
    backend = two_ranks_in_one_process(monkeypatch, gpt_two_ranks)
    broken = misplace_allreduce(gpt_two_ranks, block)
    # the validator refuses such a schedule before it runs; the checker is the second line,
    # for an engine that would misplace it by itself
    monkeypatch.setattr("karma.runtime.bringup.validate", lambda schedule: None)
    run(broken, load_small("gpt"), 1)
    caught = [v for v in backend.violations if "before its gradients' event" in v]
    assert caught and f"all-reduce of block {block})" in caught[0], backend.violations[:5]


def test_an_exchange_that_frees_its_own_buffer_is_caught(gpt_two_ranks, monkeypatch):
    """A release that does not wait for the all-reduce's event: on CUDA the buffer could be
    reused while the collective still reads it."""
    from karma.runtime.distributed.exchange import GradientExchange

    reduce = GradientExchange.reduce

    def frees_at_once(self, flats):
        reduce(self, flats)()  # drops the buffers before the op is even issued
        return None

    backend = two_ranks_in_one_process(monkeypatch, gpt_two_ranks)
    monkeypatch.setattr(GradientExchange, "reduce", frees_at_once)
    run(gpt_two_ranks, load_small("gpt"), 1)
    assert any("handed no release of its buffer" in v for v in backend.violations), \
        backend.violations[:5]


def test_a_release_the_engine_forgets_to_force_is_caught(monkeypatch):
    """The engine hands the backend the releases that are due where each compute op starts;
    without that, on a GPU that is behind, they would come late (the checker holds them as
    such a GPU would)."""
    schedule = plan(load_small("gpt"), "swap_all", 1.0)
    backend = CheckingBackend(schedule)
    monkeypatch.setattr("karma.runtime.runtime.make_backend", lambda kind: backend)
    monkeypatch.setattr(CheckingBackend, "release_due", lambda self, op_ids: None)
    run(schedule, load_small("gpt"), 1)
    assert any("still held" in v for v in backend.violations), backend.violations[:5]


class FakeEvent:
    """Stands in for a torch.cuda.Event: finished when the test says so, or once waited for."""

    def __init__(self):
        self.finished = False

    def query(self) -> bool:
        return self.finished

    def synchronize(self) -> None:
        self.finished = True


class FakeStream:
    def __init__(self, events: list[FakeEvent]):
        self._events = events

    def synchronize(self) -> None:  # all work done: every event finished
        for e in self._events:
            e.finished = True


def test_cuda_releases_wait_for_their_copy():
    """CudaBackend's bookkeeping (no GPU needed): a release runs only once its op's event has
    finished, each exactly once, and all of them by the end of the replay."""
    events = [FakeEvent(), FakeEvent(), FakeEvent()]
    backend = fake_cuda_backend(events)
    released: list[int] = []
    backend.release_after(0, lambda: released.append(0))
    backend.release_after(1, lambda: released.append(1))
    assert released == []  # both copies in flight
    events[1].finished = True
    backend.release_after(2, lambda: released.append(2))  # polls
    assert released == [1]
    backend.end_replay()  # synchronizes: the rest go
    assert sorted(released) == [0, 1, 2]
    backend.end_replay()
    assert sorted(released) == [0, 1, 2]  # each once


def fake_cuda_backend(events: list[FakeEvent]) -> CudaBackend:
    backend = object.__new__(CudaBackend)  # no CUDA here: the fields a test needs, by hand
    backend._events = dict(enumerate(events))  # noqa: SLF001
    backend._pending = []  # noqa: SLF001
    backend._lock = threading.Lock()  # noqa: SLF001
    backend.streams = {"d2h": FakeStream(events)}
    return backend


def test_cuda_releases_what_is_due_there_waiting_for_its_copy():
    """release_due waits for the copies of the ops named (event.synchronize) and releases
    what they hold at once; the others stay pending."""
    events = [FakeEvent(), FakeEvent()]
    backend = fake_cuda_backend(events)
    released: list[int] = []
    backend.release_after(0, lambda: released.append(0))
    backend.release_after(1, lambda: released.append(1))
    backend.release_due([0])
    assert released == [0] and events[0].finished  # waited for, then released
    assert not events[1].finished
    backend.release_due([0])  # nothing left of it
    assert released == [0]


def test_the_cuda_allocator_gets_expandable_segments_unless_the_user_configures_it():
    """[Note: expandable segments]: karma's setting, or none where the environment has one."""
    assert allocator_settings({}) == "expandable_segments:True"
    assert allocator_settings({"PYTORCH_CUDA_ALLOC_CONF": ""}) == "expandable_segments:True"
    assert allocator_settings({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}) is None
    assert allocator_settings({"PYTORCH_ALLOC_CONF": "expandable_segments:False"}) is None
