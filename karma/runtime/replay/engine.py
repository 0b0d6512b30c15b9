"""The engine: replays a schedule's operations around the model's own forward and backward.

Compute runs where it always does: `model(x)`, `loss_fn`, `loss.backward()` on the calling
thread. The engine learns where that execution is from its hooks (hooks.py) and at each
point

1. checks that it is the compute operation the schedule expects next (else DivergedError),
2. marks the previous compute operation done, which releases what the schedule frees there,
3. issues every copy and host operation of the stages reached so far to its stream,
4. waits for the operation's dependencies (the stage barrier: swap-ins and fetches it needs),
   and releases what the side operations of the earlier stages held (backends/backend.py, [Note:
   released where the schedule frees]).

Copy streams, the all-reduces of several ranks (`net`) and the host optimizer are
`StreamWorker`s; each of their operations waits for its own dependencies, and the backend
(backends/backend.py) orders the work on the device. The roles it calls: the replay tables
(tables.py), the hooks (hooks.py), the update side of a step (update.py), each block's
weights (params/weights.py) and swapped activations (swap.py), evaluation (evaluation.py).
Bring-up builds the weights, the storage of streamed parameters and the swap stores and
hands them over (EngineParts, bringup.py); the engine wires the replay over them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from karma.errors import KarmaError
from karma.runtime.backends.backend import Backend
from karma.runtime.distributed.exchange import GradientExchange
from karma.runtime.host.threads import host_stream_threads
from karma.runtime.params.streamed import SharedStorage
from karma.runtime.params.weights import BlockWeights
from karma.runtime.replay.chaos import Chaos, pause
from karma.runtime.replay.evaluation import BlockByBlock
from karma.runtime.replay.hooks import BlockHooks
from karma.runtime.replay.kept import KeptSwap
from karma.runtime.replay.streams import OpEvents, StreamWorker, raise_stream_failure
from karma.runtime.replay.swap import SwapStore
from karma.runtime.replay.tables import DivergedError, ReplayTables
from karma.runtime.replay.training_options import GradClip, MixedPrecision
from karma.runtime.replay.update import Updates
from karma.schedule import EXCHANGE_KINDS, Op, Schedule


@dataclass(frozen=True)
class EngineParts:
    """What bring-up builds for the engine (bringup.py, build_engine_parts), the model's
    tensors already on the backend's device."""

    weights: list[BlockWeights]  # each block's, in the schedule's order
    shared: SharedStorage  # the storage of streamed parameters, which fetches fill
    # block index -> where its swapped activations go (a selective block's kept outputs)
    swaps: dict[int, SwapStore | KeptSwap]
    backend: Backend
    precision: MixedPrecision  # the schedule's dtype (training_options.py)
    exchange: GradientExchange | None = None  # on several ranks
    clip: GradClip | None = None  # the schedule's clip_grad_norm


class Engine:
    """Hooks a model so that each replay follows `schedule`."""

    def __init__(self, schedule: Schedule, model: torch.nn.Module, parts: EngineParts):
        """Wire the replay of `schedule` over `model` and the `parts` bring-up built for it:
        the tables, the streams and their events, the hooks and the update side."""
        self.schedule = schedule
        self.model = model
        self.blocks = schedule.blocks
        self.backend = parts.backend
        self.exchange = parts.exchange
        self.precision = parts.precision
        self.weights = parts.weights
        self.shared = parts.shared
        self.swaps = parts.swaps
        self.tables = ReplayTables.of(schedule)
        named = dict(model.named_parameters(remove_duplicate=False))
        # weight buffer -> its parameters; op id -> the parameters it releases when done
        self._params = {buf: [named[n] for n in names]
                        for buf, names in self.tables.weight_params.items()}
        self._releases = {op: [self._params[buf] for buf in bufs]
                          for op, bufs in self.tables.releases.items()}
        self.chaos = Chaos.from_env()  # [Note: chaos timing]: None unless KARMA_CHAOS is set
        self.events = OpEvents(schedule.ops, self.chaos)
        host_threads = host_stream_threads(self.backend.device.type)
        self.streams = {name: StreamWorker(name, self.events.events, self.events.errors,
                                           self.backend, self.chaos,
                                           host_threads if name == "host" else None)
                        for name in ("h2d", "d2h", "net", "host")}
        self.updates = Updates(self.tables, self.weights, model, parts.clip, self.events,
                               self.backend, self.streams["host"])
        self.hooks = BlockHooks(model, self.blocks, self.swaps, self.precision)
        self._evaluation = BlockByBlock(self.blocks, named, self.shared)
        self.recorder = None  # a tracing.TraceRecorder while a step is traced (trace())
        self._active = False  # inside a replay
        self._cursor = 0  # the next compute op's index in tables.compute_ops
        self._issued = 0  # side ops issued so far (they are issued in list order)
        self._last_compute: int | None = None  # the compute op running now

    # --- one replay -------------------------------------------------------------------

    def begin_replay(self, update: bool = True, first: bool = True) -> None:
        """Start replaying the schedule for one micro-batch. `update`: the last micro-batch of
        an optimizer step, whose all-reduces, optimizer steps and uploads run (the others
        skip them: schedule.LAST_MICRO_BATCH_KINDS). `first`: the first, whose gradients start
        the accumulation."""
        gids = self.events.next_generation()
        self.updates.begin_replay(update, first)
        self.backend.begin_replay(gids)
        self._cursor = 0
        self._issued = 0
        self._last_compute = None
        if self.recorder is not None:
            self.recorder.start(self.events.base)
        self.hooks.follow(partial(self._arrive, "forward"), partial(self._arrive, "backward"))
        self._active = True
        self._issue_through(0)  # the prologue's fetches

    def before_loss(self) -> None:
        self.hooks.leave_block()
        self._arrive("loss", len(self.blocks) - 1)

    def end_replay(self) -> None:
        self._arrive("end", -1)
        running = self.updates.left_running()
        self.events.wait([self.events.base + op.id for op in self.schedule.ops
                          if op.id not in running])
        self.updates.carry(running)
        self.backend.end_replay()  # every stream's work finished; deferred releases done
        for store in self.swaps.values():
            store.reset()
        self.hooks.stop()
        self._active = False

    @property
    def blocked(self) -> list[tuple[float, float]]:
        """(start, end) of each time the compute thread waited for another stream, this
        replay ([Note: which stream a wait is blamed on], streams.py)."""
        return self.events.blocked

    @property
    def blocked_on(self) -> list[str]:
        """The stream each of `blocked` is blamed on."""
        return self.events.blocked_on

    @property
    def grad_norm(self) -> float | None:
        """This step's global gradient norm before clipping (with clipping)."""
        return self.updates.grad_norm

    def on_each_stream(self, run: Callable[[], None]) -> None:
        """Run `run` once on the thread of every stream the schedule uses, out of the
        schedule, and wait for them all (bring-up starts their OpenMP teams this way)."""
        used = {op.stream for op in self.schedule.ops}  # (net: on several ranks only)
        keys = {name: ("on each stream", name) for name in self.streams if name in used}
        for name, key in keys.items():
            self.events.events[key] = threading.Event()
            self.streams[name].submit(key, run, ())
        for key in keys.values():
            self.events.events[key].wait()
            del self.events.events[key]
        raise_stream_failure(self.events.errors)

    def settle(self) -> None:
        """Wait for the updates the last replay left running (update.py)."""
        self.updates.settle()

    def after_host_updates(self, fn) -> None:
        """Run `fn` once the host steps in flight have run, or now if none are."""
        self.updates.after_host_updates(fn)

    @contextlib.contextmanager
    def evaluating(self):
        """A forward without gradients (evaluation.py), after the last step's updates."""
        if self._active:
            raise KarmaError("evaluate() was called inside a replay")
        self.settle()
        self.hooks.follow(self._evaluation.enter)
        try:
            yield
        finally:
            self._evaluation.release()
            self.hooks.stop()

    def trace(self, recorder) -> None:
        """Record the next replay's operations in `recorder` (tracing.TraceRecorder) on
        every stream; None stops recording."""
        self.recorder = recorder
        for s in self.streams.values():
            s.recorder = recorder

    def abandon(self) -> None:
        """A step failed: leave its swap block's saved-tensor hooks (they would catch every
        later autograd op in the process), stop following the model's execution, and have
        the streams drop what is queued instead of waiting for compute that will not come
        (each finishes the op it is running)."""
        self.hooks.stop()
        self._active = False
        if not self.events.errors:
            self.events.errors.append(("compute", -1, RuntimeError("the replay was abandoned")))

    def close(self) -> None:
        """Remove the hooks and stop the streams, once each has run what is queued (after
        `abandon`, once each has finished the op it is running): the host tier they write
        to goes away next."""
        self._active = False
        self.hooks.remove()
        for s in self.streams.values():
            s.close()

    # --- the schedule's cursor -------------------------------------------------------------

    def _arrive(self, kind: str, block: int) -> None:
        """Execution reached compute op (kind, block): run everything the schedule puts first."""
        compute_ops = self.tables.compute_ops
        while True:
            if self._cursor >= len(compute_ops):
                if kind == "end":
                    break
                raise DivergedError(f"{kind} of block {block} ran after the schedule's last "
                                    "compute operation")
            op = compute_ops[self._cursor]
            if op.kind == "device_step":
                self._start(op)
                if self.updates.updating:
                    self.weights[op.block].device_step()
                continue
            if op.kind == "recompute" and kind == "backward" and (
                    op.block == block or op.block == block - 1 and self.blocks[op.block].with_next):
                self._start(op)  # runs inside the backward, when it unpacks (a pair's both)
                continue
            if kind == "end" and op.kind in ("backward", "recompute"):
                self._start(op)  # a block whose input needs no gradient: no hook fires
                continue
            if (op.kind, op.block) == (kind, block):
                self._start(op)
                return
            raise DivergedError(self._divergence(op, kind, block))
        self._finish_previous()
        self._issue_through(float("inf"))

    def _divergence(self, op: Op, kind: str, block: int) -> str:
        """What was expected and what ran; control flow is blamed only when the forward
        called its blocks in another order (else it is karma's hooks that lost their way)."""
        name = self.blocks[block].name if block >= 0 else "-"
        text = (f"execution diverged from the schedule: expected {op.kind} of block "
                f"{op.block} ({self.blocks[op.block].name}), but {kind} of block {block} "
                f"({name}) ran")
        if kind == "forward" and op.kind == "forward" and not self.blocks[op.block].modules:
            return (f"{text}; block {op.block} runs no module of its own that karma can hook "
                    "(code at the top of the model's forward, such as a parameter of the root "
                    "module): a limit of karma; move that code into a submodule, or name the "
                    "blocks with karma-plan --blocks REGEX")
        if kind == "forward" and op.kind == "forward":
            return (f"{text}; the model's forward (build_model() in the model file) called its "
                    "blocks in another order than when it was planned: data-dependent control "
                    "flow? Make the order fixed, or re-plan")
        return (f"{text}; karma's hooks saw the backward out of the planned order: this is a "
                "bug in karma; please report it with the schedule and the model file")

    def _start(self, op: Op) -> None:
        self._finish_previous()
        self._issue_through(op.stage)  # the gradients' last side ops, before waiting for them
        if op.kind == "device_step" and self.updates.updating:
            self.updates.before_step()
        deps = self.events.gids(op.deps) + self.updates.carried(op)
        self.events.wait(deps)
        # what the side ops of earlier stages hold is free from here on: [Note: released
        # where the schedule frees] (backends/backend.py)
        self.backend.release_due(self.events.gids(self.tables.due[op.id]))
        gid = self.events.base + op.id
        self.backend.order_after(deps, "compute", gid)
        if self.recorder is not None:
            self.recorder.began(gid, "compute")
        self._cursor += 1
        self._last_compute = op.id

    def _finish_previous(self) -> None:
        if self._last_compute is None:
            return
        gid = self.events.base + self._last_compute
        released = self._releases.get(self._last_compute, ())
        self._last_compute = None
        if self.recorder is not None:
            self.recorder.ended(gid, "compute")
        for params in released:
            self.shared.release(params)
        pause(self.chaos)
        self.backend.issued(gid, "compute")
        self.events.done(gid)

    def _issue_through(self, stage: float) -> None:
        """Hand every side op of stages <= stage to its stream."""
        side_ops = self.tables.side_ops
        while self._issued < len(side_ops) and side_ops[self._issued].stage <= stage:
            op = side_ops[self._issued]
            self._issued += 1
            if self.updates.skips(op):
                self._skip(op)
                continue
            if op.kind == "host_step":
                self.updates.before_step()
            with self.backend.allocating():
                run, allocated = self._prepare(op)
            gid = self.events.base + op.id
            if allocated:
                self.backend.allocated(gid)
            releases = self._releases.get(op.id, ())
            if releases:  # weights freed when the op's work is done
                run = partial(self._run_then_release, run, releases)
            deps = self.events.gids(op.deps) + self.updates.carried(op)
            pause(self.chaos)
            self.streams[op.stream].submit(gid, run, tuple(deps), label=op.id)

    def _skip(self, op: Op) -> None:
        """An update op of a micro-batch that does not end the step: done at once."""
        for params in self._releases.get(op.id, ()):
            self.shared.release(params)
        gid = self.events.base + op.id
        self.backend.issued(gid, "compute")
        self.events.done(gid)

    def _run_then_release(self, run, releases):
        after = run()

        def release():
            if after is not None:
                after()
            for params in releases:
                self.shared.release(params)

        return release

    def _prepare(self, op: Op):
        """(what the op's stream runs, whether device memory was allocated for it here).

        [Note: fetch memory allocated at issue] A fetch or a swap-in gets its device memory
        here, on the compute thread, when the stage that issues it starts: on CUDA the copy
        stream then waits for compute only up to that point (backend.allocated), not for
        whatever compute was enqueued by the time the copy stream got to it.
        """
        w = self.weights[op.block]
        if op.kind == "fetch":
            fill = self.shared.claim(self._params[op.uses[0]])
            return partial(self.shared.fill, fill), bool(fill)
        if op.kind == "swap_in":
            store = self.swaps[op.block]
            fresh = store.allocate()
            return partial(store.swap_in, fresh, self.backend), bool(fresh)
        if op.kind in EXCHANGE_KINDS and self.exchange is not None:
            # distributed/exchange.py, [Note: the flat buffer's life]
            cuts = w.layout.cuts if op.kind == "reduce_scatter" else None
            if op.block in self.tables.reduce_on_host:
                flats = self.exchange.prepare(w.layout.exchange_holders, cuts)
                reduce = partial(self.exchange.reduce, flats)
                return partial(self.updates.reduce_host_grads, w, reduce), bool(flats)
            flats = self.exchange.prepare(w.params, cuts)
            return partial(self.exchange.reduce, flats), bool(flats)
        if op.kind == "all_gather":
            return w.layout.all_gather, False
        if op.kind == "swap_out":
            return self.swaps[op.block].prepare_swap_out(), False
        if op.kind == "grads_to_host":
            return self.updates.grads_to_host(w, op.block), False
        if op.kind == "host_step":
            return w.host_step, False
        if op.kind == "upload":
            return w.upload, False
        raise DivergedError(f"operation {op.id} ({op.kind}) is not supported by this runtime")

