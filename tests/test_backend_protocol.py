"""The engine keeps the backend's protocol, which the CUDA backend relies on (checked on CPU).

On CUDA an operation's device work is ordered by events: a stream that waits for an event
that was never recorded does not wait at all, and memory released before its copy has
finished is corrupted, both silently. `CheckingBackend` runs every schedule of the CPU tests
and fails on the first call that would be wrong on CUDA:

- `order_after(deps, ...)`: every dependency has been issued (its event recorded);
- `release_after(op, ...)`: the op has been issued;
- `allocated(op)`: called once, before the op's stream orders itself after it;
- `issued(op)`: once per op per iteration, and every op by the end of the iteration, or of
  the next one for the updates that the engine leaves running into it (engine.py, [Note:
  updates overlapped with the next forward]); ops are known by the engine's ids, unique
  across iterations.
"""

from __future__ import annotations

import threading

import pytest

from karma.runtime.backend import CpuBackend, CudaBackend
from tests.runtime_helpers import run
from tests.test_runtime import MODELS, STRATEGIES, load_small, schedule_or_skip


class CheckingBackend(CpuBackend):
    def __init__(self):
        super().__init__()
        self._lock = threading.Lock()
        self.violations: list[str] = []
        self.calls = 0
        self._issued: set = set()  # every op issued so far, of every iteration
        self._allocated: set = set()
        self._owed: set = set()  # ops of the previous iteration not yet issued at its end

    def begin_iteration(self, op_ids) -> None:
        self._ops = set(op_ids)

    def issued(self, op_id: int, stream: str) -> None:
        with self._lock:
            self.calls += 1
            if op_id in self._issued:
                self.violations.append(f"op {op_id} issued twice")
            self._issued.add(op_id)

    def order_after(self, deps, stream: str, op_id: int | None = None) -> None:
        with self._lock:
            self.calls += 1
            early = [d for d in deps if d not in self._issued]
            if early:
                self.violations.append(f"{stream} ordered after unissued ops {early}")

    def allocated(self, op_id: int) -> None:
        with self._lock:
            if op_id in self._allocated or op_id in self._issued:
                self.violations.append(f"op {op_id} allocated twice or after its issue")
            self._allocated.add(op_id)

    def release_after(self, op_id: int, release) -> None:
        with self._lock:
            if op_id not in self._issued:
                self.violations.append(f"release of op {op_id} before its issue")
        release()

    def end_iteration(self) -> None:
        with self._lock:
            missing = sorted(self._owed - self._issued)
            if missing:
                self.violations.append(f"ops {missing[:5]} never issued by the end of the "
                                       "iteration after theirs")
            self._owed = self._ops - self._issued


@pytest.mark.parametrize("strategy,fraction", STRATEGIES,
                         ids=[f"{s}@{f:g}" if s == "ilp" else s for s, f in STRATEGIES])
@pytest.mark.parametrize("name", MODELS)
def test_the_engine_keeps_the_backends_protocol(name, strategy, fraction, monkeypatch):
    schedule = schedule_or_skip(name, strategy, fraction)
    backend = CheckingBackend()
    monkeypatch.setattr("karma.runtime.runtime.make_backend", lambda kind: backend)
    report = run(schedule, load_small(name), 2)
    assert report.steps == [1, 2]
    assert not backend.violations, backend.violations[:5]
    assert backend.calls > 2 * len(schedule.ops)  # the checks ran


class FakeEvent:
    """Stands in for a torch.cuda.Event: finished when the test says so."""

    def __init__(self):
        self.finished = False

    def query(self) -> bool:
        return self.finished


class FakeStream:
    def __init__(self, events: list[FakeEvent]):
        self._events = events

    def synchronize(self) -> None:  # all work done: every event finished
        for e in self._events:
            e.finished = True


def test_cuda_releases_wait_for_their_copy():
    """CudaBackend's bookkeeping (no GPU needed): a release runs only once its op's event has
    finished, each exactly once, and all of them by the end of the iteration."""
    events = [FakeEvent(), FakeEvent(), FakeEvent()]
    backend = object.__new__(CudaBackend)  # no CUDA here: the fields a test needs, by hand
    backend._events = dict(enumerate(events))  # noqa: SLF001
    backend._pending = []  # noqa: SLF001
    backend._lock = threading.Lock()  # noqa: SLF001
    backend.streams = {"d2h": FakeStream(events)}
    released: list[int] = []
    backend.release_after(0, lambda: released.append(0))
    backend.release_after(1, lambda: released.append(1))
    assert released == []  # both copies in flight
    events[1].finished = True
    backend.release_after(2, lambda: released.append(2))  # polls
    assert released == [1]
    backend.end_iteration()  # synchronizes: the rest go
    assert sorted(released) == [0, 1, 2]
    backend.end_iteration()
    assert sorted(released) == [0, 1, 2]  # each once
