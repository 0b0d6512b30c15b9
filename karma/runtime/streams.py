"""Streams that run the schedule's operations off the compute thread, in order.

A stream is a worker thread with a queue. Each operation waits until its dependencies are
issued (their threading events), asks the backend to order its work after theirs, runs, tells
the backend it is issued, and sets its own event. On the CPU backend the work runs on the
worker itself, playing a CUDA copy stream, so swap-outs, prefetches and host optimizer steps
really overlap with compute; on CUDA the worker enqueues the work on its CUDA stream. An
operation may return a release: what to drop once its work has finished (backend.py). An
exception in a worker is kept and raised on the compute thread at its next wait.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Hashable
from typing import NamedTuple

from karma.runtime.chaos import Chaos, pause


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
                 backend, chaos: Chaos | None = None):
        self.name = name
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


def wait_for(events: dict[int, threading.Event], deps, errors: list) -> Hashable | None:
    """Block the compute thread until `deps` are done; raise a stream's failure if any.
    Returns the last of `deps` that was not done yet when the wait reached it: the last to
    finish (engine.py, [Note: which stream a wait is blamed on]); None if none blocked."""
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
