"""The engine: replays a schedule's operations around the model's own forward and backward.

Compute runs where it always does: `model(x)`, `loss_fn`, `loss.backward()` on the calling
thread. The engine learns where that execution is from hooks (a forward pre-hook on each
block's modules, a gradient hook on each block's input) and at each such point

1. checks that it is the compute operation the schedule expects next (else DivergedError),
2. marks the previous compute operation done, which releases what the schedule frees there,
3. issues every copy and host operation of the stages reached so far to its stream,
4. waits for the operation's dependencies (the stage barrier: swap-ins and fetches it needs),
   and releases what the side operations of the earlier stages held (backend.py, [Note:
   released where the schedule frees]).

Copy streams, the all-reduces of several ranks (`net`) and the host optimizer are
`StreamWorker`s; each of their operations waits for its own dependencies, and the backend
(backend.py) orders the work on the device. Recompute blocks run under non-reentrant
checkpointing, swap blocks under their `SwapStore`'s saved-tensors hooks.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections import defaultdict
from functools import partial

import torch
from torch.utils.checkpoint import checkpoint

from karma.errors import KarmaError
from karma.modelfile import output_tensors
from karma.runtime.backend import CpuBackend
from karma.runtime.chaos import Chaos, pause
from karma.runtime.exchange import GradientExchange
from karma.runtime.host import BuildInTier, HostPool
from karma.runtime.streams import StreamWorker, raise_stream_failure, wait_for
from karma.runtime.swap import DivergedError, SwapStore
from karma.runtime.training import GradClip, MixedPrecision
from karma.runtime.weights import BlockWeights, SharedStorage
from karma.schedule import (
    BARRIER_STREAMS,
    DEFERRED_KINDS,
    GRAD_KINDS,
    LAST_MICRO_BATCH_KINDS,
    Schedule,
)
from karma.schedule_check import check_model_names, validate

_WEIGHT_BUFFER = re.compile(r"w\.(\d+)@([fb])(\d*)$")


class Engine:
    """Hooks a model so that each training iteration follows `schedule`."""

    def __init__(self, schedule: Schedule, model: torch.nn.Module, make_optimizer,
                 pool: HostPool, backend=None, exchange: GradientExchange | None = None,
                 tier: BuildInTier | None = None, precision: MixedPrecision | None = None,
                 clip: GradClip | None = None):
        """`model` is built on the CPU (its large tensors in the host tier when built under
        `tier`); the engine places it on the backend's device. `precision` and `clip` are the
        schedule's training options (training.py)."""
        self.schedule = schedule
        self.model = model
        self.backend = backend or CpuBackend()
        self.device = self.backend.device
        self.pool = pool
        self.blocks = schedule.blocks
        self.exchange = exchange
        if schedule.config.world_size > 1 and exchange is None:
            raise KarmaError(f"this schedule was planned for {schedule.config.world_size} ranks; "
                             "run it on that many (karma-run under torchrun)")
        validate(schedule)  # a Schedule made in memory was never loaded (and checked)
        self.precision = precision or MixedPrecision(self.backend.device.type, None)
        self.clip = clip
        named = dict(model.named_parameters(remove_duplicate=False))
        check_model_names(schedule, named, {name for name, _ in model.named_modules()})
        self.shared = SharedStorage()
        self.weights = [
            BlockWeights(b.name, [(n, named[n]) for n in b.params], b.weights, b.optim,
                         make_optimizer, pool, self.shared, self.device, tier)
            for b in self.blocks
        ]
        _place_buffers(model, self.device, tier, pool)
        # after placement: a parameter's storage is the one on the device
        self.param_storages = {p.untyped_storage()._cdata for p in model.parameters()}
        self.swaps = {b.index: SwapStore(b.name, pool, self.param_storages, self.device)
                      for b in self.blocks if b.act == "swap"}
        self._named = named
        self._params_of_buffer: dict[str, list[torch.nn.Parameter]] = {}

        ops = schedule.ops
        self.compute_ops = [op for op in ops if op.stream == "compute"]
        self.side_ops = [op for op in ops if op.stream != "compute"]
        self.releases: dict[int, list[list[torch.nn.Parameter]]] = defaultdict(list)
        for buf in schedule.buffers:
            if buf.free is not None and _WEIGHT_BUFFER.match(buf.name):
                self.releases[buf.free].append(self._fetch_params(buf.name))
        self._due = _releases_due(self.compute_ops, self.side_ops)
        # [Note: operation ids across iterations] Events and the backend know an op by
        # `gid = generation * len(ops) + op.id`, the generation counting iterations: an update
        # deferred into the next iteration (see _deferred) keeps its own events while the
        # next iteration's ops get theirs. Events of the last two generations are kept.
        self._events: dict = {}  # gid -> issued
        self._n_ops = len(ops)
        self._gen = -1
        self._base = 0  # gid of this generation's op 0
        self._errors: list = []
        self.chaos = Chaos.from_env()  # [Note: chaos timing]: None unless KARMA_CHAOS is set
        self.streams = {name: StreamWorker(name, self._events, self._errors, self.backend,
                                           self.chaos)
                        for name in ("h2d", "d2h", "net", "host")}
        # (start, end) of each time the compute thread waited for another stream, this step,
        # and the stream each wait is blamed on ([Note: which stream a wait is blamed on])
        self.blocked: list[tuple[float, float]] = []
        self.blocked_on: list[str] = []
        self.recorder = None  # a tracing.TraceRecorder while a step is traced (trace())
        self._handles: list = []
        self._restore: list = []
        self._install_hooks()
        self._active = False
        self._evaluating = False
        self._hooks_ctx = None  # the running swap block's saved-tensor hooks, entered
        self._current_block: int | None = None
        self._ran_in_block: set[str] = set()
        self._calls: dict[int, int] = defaultdict(int)
        self._eval_claimed: list[torch.nn.Parameter] = []
        self._grad_ops = [op.id for op in ops if op.kind in GRAD_KINDS]
        # [Note: gradients accumulate where the block steps] Over the micro-batches of one
        # optimizer step, a device-stepped block's gradients add up in .grad (autograd does
        # it, as in the plain loop), a host-stepped block's in its host gradients (each
        # grads_to_host adds); on several ranks the latter are all-reduced on the host, which
        # the schedule shows by ordering the block's all-reduce after its grads_to_host.
        order = {(op.kind, op.block): op.id for op in ops}
        self._reduce_on_host = {
            b.index for b in self.blocks
            if ("allreduce", b.index) in order and ("grads_to_host", b.index) in order
            and order["allreduce", b.index] > order["grads_to_host", b.index]}
        self._owner = {id(p): (w, k) for w in self.weights for k, p in enumerate(w.params)}
        self._updating = True
        self._first_micro = True
        self._update_began = False
        self.grad_norm: float | None = None  # this step's, before clipping (with clipping)
        # id(param) -> the norm of its final gradient, taken where the gradient became final
        # on another stream (training.py, [Note: clipping from per-parameter norms])
        self._norms: dict[int, torch.Tensor] = {}
        # [Note: updates overlapped with the next forward] With clipping no optimizer steps
        # before the backward ends, so the host steps and the uploads after them are left
        # running when the iteration returns, and the next iteration waits for each block's
        # update where it first needs it: a block's forward waits for the uploads of the
        # weights it uses, a fetch for the host step of the weights it copies. Everything
        # that reads weights or optimizer state from outside (checkpoints, evaluation, the
        # LR schedule's copy into host optimizers) waits for them all first: settle().
        self._deferred = {op.id for op in ops if op.kind in DEFERRED_KINDS} \
            if clip is not None else set()
        self._carried: dict[int, object] = {}  # local op id -> gid of a deferred op in flight
        self._after_update: list = []  # keys of work queued behind the host steps in flight
        uploads = {op.block: op.id for op in ops if op.kind == "upload"}
        self._host_step_of = {op.block: op.id for op in ops if op.kind == "host_step"}
        owner = {n: b.index for b in self.blocks for n in b.params}
        self._forward_waits = {  # the uploads of the weights each block's forward reads
            b.index: [uploads[o] for o in {b.index, *(owner[n] for n in b.shared_params
                                                      if n in owner)} if o in uploads]
            for b in self.blocks}

    # --- one iteration -------------------------------------------------------------------

    def begin_iteration(self, update: bool = True, first: bool = True) -> None:
        """Start replaying the schedule for one micro-batch. `update`: the last micro-batch of
        an optimizer step, whose all-reduces, optimizer steps and uploads run (the others
        skip them: schedule.LAST_MICRO_BATCH_KINDS). `first`: the first, whose gradients start the
        accumulation."""
        self._updating = update
        self._first_micro = first
        self._update_began = False
        self.grad_norm = None
        self._norms = {}
        self._gen += 1
        self._base = self._gen * self._n_ops
        stale = [k for k in self._events if self._generation(k) < self._gen - 1]
        self._wait(stale)  # (done long ago: their waiters have run) before they are dropped
        for k in stale:
            del self._events[k]
        self._after_update = [k for k in self._after_update if k in self._events]
        gids = [self._base + op.id for op in self.schedule.ops]
        for gid in gids:
            self._events[gid] = threading.Event()
        self.backend.begin_iteration(gids)
        self._cursor = 0
        self._issued = 0  # side ops issued so far (they are issued in list order)
        self._last_compute: int | None = None
        self._calls: dict[int, int] = defaultdict(int)
        self._current_block: int | None = None
        self._ran_in_block: set[str] = set()
        self._hooks_ctx = None
        self._output_grad_seen = False
        self.blocked = []
        self.blocked_on = []
        if self.recorder is not None:
            self.recorder.start(self._base)
        self._active = True
        self._issue_through(0)  # the prologue's fetches

    def before_loss(self) -> None:
        self._leave_block()
        self._arrive("loss", len(self.blocks) - 1)

    def end_iteration(self) -> None:
        self._arrive("end", -1)
        deferred = self._deferred if self._updating else set()
        self._wait([self._base + op.id for op in self.schedule.ops if op.id not in deferred])
        self._carried = {i: self._base + i for i in deferred}
        self.backend.end_iteration()  # every stream's work finished; deferred releases done
        for store in self.swaps.values():
            store.reset()
        self._active = False

    def settle(self) -> None:
        """Wait for the updates left running by the last iteration (and what was queued
        behind them): after this, weights, optimizer states and learning rates are final."""
        self._wait([*self._carried.values(), *self._after_update])
        self._carried = {}
        self._after_update = []

    def after_host_updates(self, fn) -> None:
        """Run `fn` once the host steps in flight have run (on the host stream, behind them),
        or now if none are."""
        if not self._carried:
            fn()
            return
        key = ("after", self._gen, len(self._after_update))
        self._events[key] = threading.Event()
        self._after_update.append(key)
        self.streams["host"].submit(key, lambda: fn(), (), label="after the host steps")

    def trace(self, recorder) -> None:
        """Record the next iteration's operations in `recorder` (tracing.TraceRecorder) on
        every stream; None stops recording."""
        self.recorder = recorder
        for s in self.streams.values():
            s.recorder = recorder

    def abandon(self) -> None:
        """A step failed: leave its swap block's saved-tensor hooks (they would catch every
        later autograd op in the process) and stop following the model's execution."""
        self._leave_block()
        self._active = False
        self._evaluating = False

    def close(self, failed: bool = False) -> None:
        """Remove the hooks and stop the streams. After a failure the streams drop what is
        queued instead of waiting for compute that will not come; each finishes the op it
        is running before the host tier they write to goes away."""
        if failed and not self._errors:
            self._errors.append(("compute", -1, RuntimeError("the iteration was abandoned")))
        self.abandon()
        for h in self._handles:
            h.remove()
        for module, forward in self._restore:
            module.forward = forward
        for s in self.streams.values():
            s.close()

    # --- hooks -----------------------------------------------------------------------------

    def _install_hooks(self) -> None:
        by_module: dict[str, list[int]] = defaultdict(list)
        for b in self.blocks:
            for m in b.modules:
                by_module[m].append(b.index)
        modules = dict(self.model.named_modules())
        for name, blocks in by_module.items():
            module = modules[name]
            self._handles.append(module.register_forward_pre_hook(
                partial(self._on_module, name, blocks), with_kwargs=True))
            # [Note: recomputing blocks of several modules] a head or tail block is not one
            # call: its modules that own parameters are checkpointed one by one, and the
            # parameter-free ones between them (activations, pooling, often in place) run
            # as they are, since checkpointing an in-place op's input breaks autograd.
            single = all(len(self.blocks[i].modules) == 1 for i in blocks)
            if any(self.blocks[i].act == "recompute" for i in blocks) and (
                    single or any(True for _ in module.parameters())):
                self._wrap_recompute(module)
        self._handles.append(self.model.register_forward_hook(self._on_model_output))

    def _on_module(self, name: str, blocks: list[int], module, args, kwargs) -> None:
        if not self._active and not self._evaluating:
            return
        call = self._calls[id(module)]
        self._calls[id(module)] += 1
        i = blocks[min(call, len(blocks) - 1)]  # a module called several times: one block a call
        if i == self._current_block and name not in self._ran_in_block:
            self._ran_in_block.add(name)
            return  # another module of the block that is running
        self._leave_block()
        self._ran_in_block = {name}
        if self._evaluating:
            self._eval_enter(i)
            return
        if i > 0:
            latest = _latest_made((*args, *kwargs.values()))
            if latest is not None:  # its gradient is ready when block i's backward ends
                latest.register_hook(partial(self._on_grad, i - 1))
        self._arrive("forward", i)
        self._current_block = i
        if i in self.swaps:
            self._hooks_ctx = self.swaps[i].hooks()
            self._hooks_ctx.__enter__()

    def _on_model_output(self, module, args, output) -> None:
        """The last block's backward starts when the first gradient reaches a tensor of the
        model's output, wherever it sits (a loss, logits, an encoder's last state)."""
        if not self._active:
            return
        for t in output_tensors(output):
            if t.requires_grad:
                t.register_hook(self._on_output_grad)

    def _on_output_grad(self, grad):
        if not self._output_grad_seen:
            self._output_grad_seen = True
            self._arrive("backward", len(self.blocks) - 1)
        return None

    def _on_grad(self, block: int, grad):
        self._arrive("backward", block)
        return None

    # --- evaluation: forward only, streamed weights fetched block by block ----------------

    def begin_eval(self) -> None:
        """A forward without gradients: nothing is saved, so nothing is swapped or
        recomputed; each block's streamed weights are fetched before it runs and released
        after (synchronously: evaluation is rare and needs no overlap)."""
        if self._active:
            raise KarmaError("evaluate() was called inside a training iteration")
        self.settle()
        self._evaluating = True
        self._calls = defaultdict(int)
        self._current_block = None
        self._eval_claimed = []

    def end_eval(self) -> None:
        self._eval_release()
        self._current_block = None
        self._evaluating = False

    def _eval_enter(self, i: int) -> None:
        self._eval_release()
        b = self.blocks[i]
        streamed = [p for n in (*b.params, *b.shared_params)
                    if self.shared.is_streamed(p := self._named[n])]
        self.shared.fill(self.shared.claim(streamed))
        self._eval_claimed = streamed
        self._current_block = i

    def _eval_release(self) -> None:
        if self._eval_claimed:  # claim, fill, compute and release all run on the compute
            self.shared.release(self._eval_claimed)  # stream: the allocator orders reuse
        self._eval_claimed = []

    def _leave_block(self) -> None:
        if self._current_block is not None:
            self.precision.block_done()
        if self._hooks_ctx is not None:
            self._hooks_ctx.__exit__(None, None, None)
            self._hooks_ctx = None
        self._current_block = None

    def _wrap_recompute(self, module: torch.nn.Module) -> None:
        forward = module.forward
        buffers = list(module.buffers())

        def context_fn():
            return contextlib.nullcontext(), _restore_buffers(buffers)

        def checkpointed(*args, **kwargs):
            return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn,
                              **kwargs)

        self._restore.append((module, forward))
        module.forward = checkpointed

    # --- the schedule's cursor -------------------------------------------------------------

    def _arrive(self, kind: str, block: int) -> None:
        """Execution reached compute op (kind, block): run everything the schedule puts first."""
        while True:
            if self._cursor >= len(self.compute_ops):
                if kind == "end":
                    break
                raise DivergedError(f"{kind} of block {block} ran after the schedule's last "
                                    "compute operation")
            op = self.compute_ops[self._cursor]
            if op.kind == "device_step":
                self._start(op)
                if self._updating:
                    self.weights[op.block].device_step()
                continue
            if op.kind == "recompute" and kind == "backward" and op.block == block:
                self._start(op)  # runs inside the backward, when it unpacks
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

    def _divergence(self, op, kind: str, block: int) -> str:
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

    def _start(self, op) -> None:
        self._finish_previous()
        self._issue_through(op.stage)  # the gradients' last side ops, before waiting for them
        if op.kind == "device_step" and self._updating:
            self._begin_update()
        deps = self._gids(op.deps)
        if op.kind == "forward" and self._carried:
            deps += self._take_carried(self._forward_waits[op.block])
        self._wait(deps)
        # what the side ops of earlier stages hold is free from here on: [Note: released
        # where the schedule frees] (backend.py)
        self.backend.release_due(self._gids(self._due[op.id]))
        self.backend.order_after(deps, "compute", self._base + op.id)
        if self.recorder is not None:
            self.recorder.began(self._base + op.id, "compute")
        self._cursor += 1
        self._last_compute = op.id

    def _generation(self, key) -> int:
        return key // self._n_ops if isinstance(key, int) else key[1]

    def _gids(self, ids) -> list:
        return [self._base + i for i in ids]

    def _take_carried(self, ids) -> list:
        """The gids of those of `ids` (local) deferred from the previous iteration."""
        return [self._carried[i] for i in ids if i in self._carried]

    def _wait(self, deps) -> None:
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
        raise_stream_failure(self._errors)
        pause(self.chaos)
        if all(self._events[d].is_set() for d in deps):
            return
        start = time.perf_counter()
        last = wait_for(self._events, deps, self._errors)
        pause(self.chaos)
        self.blocked.append((start, time.perf_counter()))
        self.blocked_on.append(self._stream_of(deps[-1] if last is None else last))

    def _stream_of(self, key) -> str:
        """The stream of the op behind an event key (a gid, or work queued on the host)."""
        return self.schedule.ops[key % self._n_ops].stream if isinstance(key, int) else "host"

    def _finish_previous(self) -> None:
        if self._last_compute is None:
            return
        done = self._last_compute
        self._last_compute = None
        if self.recorder is not None:
            self.recorder.ended(self._base + done, "compute")
        for params in self.releases.get(done, ()):
            self.shared.release(params)
        pause(self.chaos)
        self.backend.issued(self._base + done, "compute")
        self._events[self._base + done].set()

    def _issue_through(self, stage: float) -> None:
        """Hand every side op of stages <= stage to its stream."""
        while self._issued < len(self.side_ops) and self.side_ops[self._issued].stage <= stage:
            op = self.side_ops[self._issued]
            self._issued += 1
            if op.kind in LAST_MICRO_BATCH_KINDS and not self._updating:
                self._skip(op)
                continue
            if op.kind == "host_step":
                self._begin_update()
            with self.backend.allocating():
                run, allocated = self._prepare(op)
            gid = self._base + op.id
            if allocated:
                self.backend.allocated(gid)
            releases = self.releases.get(op.id, ())
            if releases:  # weights freed when the op's work is done
                run = partial(self._run_then_release, run, releases)
            deps = self._gids(op.deps)
            if op.kind == "fetch" and self._carried:  # the host step that updates the masters
                owner = int(_WEIGHT_BUFFER.match(op.uses[0])[1])
                deps += self._take_carried([self._host_step_of.get(owner, -1)])
            pause(self.chaos)
            self.streams[op.stream].submit(gid, run, tuple(deps), label=op.id)

    def _skip(self, op) -> None:
        """An update op of a micro-batch that does not end the step: done at once."""
        for params in self.releases.get(op.id, ()):
            self.shared.release(params)
        self.backend.issued(self._base + op.id, "compute")
        self._events[self._base + op.id].set()

    def _begin_update(self) -> None:
        """Before the step's first optimizer step: with clipping, wait until every gradient
        is final (the schedule orders every step after them: the validator checks it) and clip
        them all, as clip_grad_norm_(model.parameters(), X) would."""
        if self._update_began or self.clip is None:
            return
        self._update_began = True
        gids = self._gids(self._grad_ops)
        self._wait(gids)
        self.backend.order_after(gids, "compute")  # device gradients: after their all-reduces
        self.backend.order_after(gids, "host")  # host gradients: their copies have landed
        holders, norms = [], []
        for p in self.model.parameters():  # the plain loop's order; tied weights once
            w, k = self._owner[id(p)]
            holder = w.grad_holder(k)
            holders.append(holder)
            if holder.grad is not None:  # a device gradient, or one whose norm is still due
                norm = self._norms.get(id(p))
                norms.append(self.clip.norm(holder.grad) if norm is None else norm)
        self.grad_norm = self.clip.clip(holders, norms)

    def _run_then_release(self, run, releases):
        after = run()

        def release():
            if after is not None:
                after()
            for params in releases:
                self.shared.release(params)

        return release

    def _prepare(self, op):
        """(what the op's stream runs, whether device memory was allocated for it here).

        [Note: fetch memory allocated at issue] A fetch or a swap-in gets its device memory
        here, on the compute thread, when the stage that issues it starts: on CUDA the copy
        stream then waits for compute only up to that point (backend.allocated), not for
        whatever compute was enqueued by the time the copy stream got to it.
        """
        if op.kind == "fetch":
            fill = self.shared.claim(self._fetch_params(op.uses[0]))
            return partial(self.shared.fill, fill), bool(fill)
        if op.kind == "swap_in":
            store = self.swaps[op.block]
            fresh = store.allocate()
            return partial(store.swap_in, fresh, self.backend), bool(fresh)
        if op.kind == "allreduce" and self.exchange is not None:
            # exchange.py, [Note: the flat buffer's life]
            w = self.weights[op.block]
            if op.block in self._reduce_on_host:
                flats = self.exchange.prepare(w.masters)
                return partial(self._reduce_host_grads, w, flats), bool(flats)
            flats = self.exchange.prepare(w.params)
            return partial(self.exchange.reduce, flats), bool(flats)
        return self._action(op), False

    def _action(self, op):
        w = self.weights[op.block]
        if op.kind == "swap_out":
            return self.swaps[op.block].swap_out
        if op.kind == "grads_to_host":
            add = not self._first_micro
            if self.clip is None or not self._updating or op.block in self._reduce_on_host:
                return partial(w.grads_to_host, add=add)
            return partial(self._grads_to_host_with_norms, w, add)
        if op.kind == "host_step":
            return w.host_step
        if op.kind == "upload":
            return w.upload
        raise DivergedError(f"operation {op.id} ({op.kind}) is not supported by this runtime")

    def _grads_to_host_with_norms(self, w: BlockWeights, add: bool):
        """grads_to_host in the step's last micro-batch with clipping: the block's gradients
        are final here, so their norms are taken too (from the device gradient before it
        goes, or from the host sum of an accumulation)."""
        if not add:
            for p in w.params:
                if p.grad is not None:
                    self._norms[id(p)] = self.clip.norm(p.grad)
        release = w.grads_to_host(add=add)
        if add:
            self._host_norms(w)
        return release

    def _reduce_host_grads(self, w: BlockWeights, flats):
        release = w.reduce_host_grads(lambda holders: self.exchange.reduce(flats))
        if self.clip is not None:
            self._host_norms(w)
        return release

    def _host_norms(self, w: BlockWeights) -> None:
        for p, g, has in zip(w.params, w.host_grads, w.has_grad):
            if has:
                self._norms[id(p)] = self.clip.norm(g)

    def _fetch_params(self, buffer: str) -> list[torch.nn.Parameter]:
        """The parameters behind weight buffer `w.OWNER@fUSER` / `w.OWNER@bUSER` (looked up
        once per buffer, not once per step)."""
        if buffer not in self._params_of_buffer:
            m = _WEIGHT_BUFFER.match(buffer)
            if m is None:
                raise DivergedError(f"fetch of unknown buffer {buffer!r}")
            owner, user = int(m[1]), int(m[3]) if m[3] else int(m[1])
            owned = set(self.blocks[owner].params)
            names = self.blocks[owner].params if user == owner else [
                n for n in self.blocks[user].shared_params if n in owned]
            self._params_of_buffer[buffer] = [self._named[n] for n in names]
        return self._params_of_buffer[buffer]


def _releases_due(compute_ops, side_ops) -> dict[int, list[int]]:
    """For each compute op, the side ops on the barrier streams whose stages end before its
    own and that no earlier compute op was handed: what they hold is free when it starts."""
    due: dict[int, list[int]] = {}
    handed = 0
    side = [op for op in side_ops if op.stream in BARRIER_STREAMS]
    for op in compute_ops:
        start = handed
        while handed < len(side) and side[handed].stage < op.stage:
            handed += 1
        due[op.id] = [s.id for s in side[start:handed]]
    return due


def _place_buffers(model: torch.nn.Module, device: torch.device, tier: BuildInTier | None,
                   pool: HostPool) -> None:
    """Module buffers (BatchNorm statistics, masks) live on the compute device."""
    for module in model.modules():
        for name, buf in module._buffers.items():  # noqa: SLF001 - as Module._apply does
            if buf is None:
                continue
            built_in = tier.adopt(buf) if tier is not None else None
            if built_in is not None or buf.device != device:
                module._buffers[name] = buf.to(device, copy=True)  # noqa: SLF001
            if built_in is not None:
                pool.free(built_in)


def _latest_made(values) -> torch.Tensor | None:
    """Of a block's inputs that require grad, the one made last: the previous block's output
    (not, say, a mask or a position bias made once for every block, whatever the order of
    the arguments). Autograd numbers its nodes in the order they are made."""
    made = [a for a in values if isinstance(a, torch.Tensor) and a.requires_grad]
    if not made:
        return None
    return max(made, key=lambda t: t.grad_fn._sequence_nr() if t.grad_fn is not None else -1)


@contextlib.contextmanager
def _restore_buffers(buffers: list[torch.Tensor]):
    """Recomputing a forward must not update running statistics a second time."""
    saved = [b.clone() for b in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, s in zip(buffers, saved):
                b.copy_(s)
