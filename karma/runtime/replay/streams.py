"""Streams that run the schedule's operations off the compute thread, in order.

A stream is a worker thread with a queue. Each operation waits until its dependencies are
issued (their threading events), asks the backend to order its work after theirs, runs, tells
the backend it is issued, and sets its own event. On the CPU backend the work runs on the
worker itself, playing a CUDA copy stream, so swap-outs, prefetches and host optimizer steps
really overlap with compute; on CUDA the worker enqueues the work on its CUDA stream. An
operation may return a release: what to drop once its work has finished (backends/backend.py). An
exception in a worker is kept and raised on the compute thread at its next wait.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from typing import NamedTuple

from karma.runtime.host.threads import use_threads_here
from karma.runtime.replay.chaos import Chaos, pause
from karma.schedule import Op


class OpFailed(RuntimeError):
    """An operation on a stream failed; the original error is its __cause__."""

    def __init__(self, message: str, stream: str):
        super().__init__(message)
        self.stream = stream


class Pending(NamedTuple):
    """An operation queued on a stream: what to run once its dependencies are issued."""

    op_id: Hashable  # its key in the events and the backend (the engine's gid)
    run: Callable[[], Callable[[], None] | None]  # returns what to release when done, if any
    deps: tuple[Hashable, ...]
    label: object  # how errors name it: the schedule's op id


class StreamWorker:
    """One stream: runs its operations one after another on its own thread."""

    def __init__(self, name: str, events: dict[Hashable, threading.Event], errors: list,
                 backend, chaos: Chaos | None = None, threads: int | None = None):
        """`threads`: the intra-op threads of this stream's kernels (host/threads.py); None:
        the process's."""
        self.name = name
        self._threads = threads
        self._chaos = chaos  # [Note: chaos timing]
        self._events = events  # op id -> issued event, shared by all streams
        self._backend = backend
        self._errors = errors  # shared: the first failure stops everything
        self._queue: queue.Queue[Pending | None] = queue.Queue()
        self.recorder = None  # a tracing.TraceRecorder while a step is traced, else None
        self._thread = threading.Thread(target=self._loop, name=f"karma-{name}", daemon=True)
        self._thread.start()

    def submit(self, op_id: Hashable, run: Callable[[], Callable[[], None] | None],
               deps: tuple[Hashable, ...], label: object = None) -> None:
        self._queue.put(Pending(op_id, run, deps, op_id if label is None else label))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=60)

    def _loop(self) -> None:
        if self._threads is not None:
            use_threads_here(self._threads)
        with self._backend.stream(self.name):
            while (item := self._queue.get()) is not None:
                pause(self._chaos)
                for d in item.deps:
                    while not (self._errors or self._events[d].wait(timeout=1.0)):
                        pass  # a failure elsewhere ends the wait (and skips the op)
                pause(self._chaos)
                if not self._errors:
                    try:
                        self._backend.order_after(item.deps, self.name, item.op_id)
                        recorder = self.recorder
                        if recorder is not None:
                            recorder.began(item.op_id, self.name)
                        release = item.run()
                        if recorder is not None:
                            recorder.ended(item.op_id, self.name)
                        pause(self._chaos)
                        self._backend.issued(item.op_id, self.name)
                        if release is not None:
                            self._backend.release_after(item.op_id, release)
                    except BaseException as e:  # noqa: BLE001 - handed to the compute thread
                        self._errors.append((self.name, item.label, e))
                self._events[item.op_id].set()
                # what the op held (a swap-in's fresh tensors, say) is not kept alive while
                # the stream waits for its next op
                item = release = None


class OpEvents:
    """Each op's *issued* event, for the ops in flight, and the compute thread's waits.

    [Note: operation ids across replays] Events and the backend know an op by
    `gid = generation * len(ops) + op.id`, the generation counting replays: an update
    deferred into the next replay (update.py) keeps its own events while the next
    replay's ops get theirs. Events of the last two generations are kept. Work queued
    behind the deferred updates has keys of its own, `("after", generation, n)`.
    """

    def __init__(self, ops: Sequence[Op], chaos: Chaos | None = None):
        self.events: dict[Hashable, threading.Event] = {}  # shared with every StreamWorker
        self.errors: list = []  # (stream, op label, exception): the first failure stops all
        self._ops = ops
        self._n_ops = len(ops)
        self._chaos = chaos
        self.generation = -1
        self.base = 0  # gid of this generation's op 0
        # (start, end) of each time the compute thread waited for another stream, this
        # replay, and the stream each wait is blamed on ([Note: which stream a wait is
        # blamed on])
        self.blocked: list[tuple[float, float]] = []
        self.blocked_on: list[str] = []

    def next_generation(self) -> list[int]:
        """Start a replay: drop the events of generations before the previous one (once
        done) and make this one's; returns its gids, in op order."""
        self.generation += 1
        self.base = self.generation * self._n_ops
        stale = [k for k in self.events if self._generation(k) < self.generation - 1]
        self.wait(stale)  # (done long ago: their waiters have run) before they are dropped
        for k in stale:
            del self.events[k]
        gids = [self.base + op.id for op in self._ops]
        for gid in gids:
            self.events[gid] = threading.Event()
        self.blocked = []
        self.blocked_on = []
        return gids

    def gids(self, ids) -> list[int]:
        """This generation's gids of local op ids."""
        return [self.base + i for i in ids]

    def done(self, key: Hashable) -> None:
        self.events[key].set()

    def wait(self, deps) -> None:
        """Block until `deps` are done; a wait is recorded with the stream it is blamed on.

        [Note: which stream a wait is blamed on] The compute thread waits for its
        dependencies one after another, so the last of them it finds not yet done is the last
        to finish: the one that held it. The whole wait is blamed on that op's stream, even
        when another stream was late too (a late swap-in behind a later fetch shows as h2d
        alone); karma-inspect --trace blames the planned waits the same way (timeline.py).
        """
        # [Note: a failed stream is seen at the next wait] A stream that fails sets the events
        # of the op that failed and of every op it then skips, so the early return below must
        # not hide the failure: without this check a run went on with its streams stopped
        # (no swap-outs, no host optimizer steps) and ended as if nothing had happened.
        raise_stream_failure(self.errors)
        pause(self._chaos)
        if all(self.events[d].is_set() for d in deps):
            return
        start = time.perf_counter()
        last = wait_for(self.events, deps, self.errors)
        pause(self._chaos)
        self.blocked.append((start, time.perf_counter()))
        self.blocked_on.append(self._stream_of(deps[-1] if last is None else last))

    def _generation(self, key: Hashable) -> int:
        return key // self._n_ops if isinstance(key, int) else key[1]

    def _stream_of(self, key: Hashable) -> str:
        """The stream of the op behind an event key (a gid, or work queued on the host)."""
        return self._ops[key % self._n_ops].stream if isinstance(key, int) else "host"


def wait_for(events: dict[int, threading.Event], deps, errors: list) -> Hashable | None:
    """Block the compute thread until `deps` are done; raise a stream's failure if any.
    Returns the last of `deps` that was not done yet when the wait reached it: the last to
    finish ([Note: which stream a wait is blamed on], OpEvents.wait); None if none blocked."""
    last = None
    for d in deps:
        if not events[d].is_set():
            last = d
        while not events[d].wait(timeout=1.0):
            if errors:
                break
        raise_stream_failure(errors)
    return last


def raise_stream_failure(errors: list) -> None:
    """Raise the first stream's failure on the compute thread, if a stream has failed."""
    if errors:
        name, op_id, e = errors[0]
        raise OpFailed(f"operation {op_id} on stream {name} failed: {e}", name) from e
