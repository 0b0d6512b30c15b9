"""The update side of an optimizer step: accumulation, clipping, updates left running.

- Accumulation (config.accumulate N): the schedule's ops are replayed once per micro-batch;
  the update ops (schedule.LAST_MICRO_BATCH_KINDS) run only in the last one (`skips`), and
  the first one's gradients start the sums.
- Clipping (config.clip_grad_norm X): before the step's first optimizer step, every gradient
  is final and they are all clipped together (`before_step`), as
  `clip_grad_norm_(model.parameters(), X)` would.
- With clipping, the host steps and uploads may run on into the next replay (`carried`,
  `settle`, `after_host_updates`).

[Note: gradients accumulate where the block steps] Over the micro-batches of one optimizer
step, a device-stepped block's gradients add up in .grad (autograd does it, as in the plain
loop), a host-stepped block's in its host gradients (each grads_to_host adds); on several
ranks the latter are all-reduced on the host, which the schedule shows by ordering the
block's all-reduce after its grads_to_host (ReplayTables.reduce_on_host).

[Note: updates overlapped with the next forward] With clipping no optimizer steps before the
backward ends, so the host steps and the uploads after them are left running when the
replay returns, and the next replay waits for each block's update where it first needs
it: a block's forward waits for the uploads of the weights it uses, a fetch for the host step
of the weights it copies. Everything that reads weights or optimizer state from outside
(checkpoints, evaluation, the LR schedule's copy into host optimizers) waits for them all
first: `settle`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable

import torch

from karma.runtime.params.weights import BlockWeights
from karma.runtime.replay.streams import OpEvents, StreamWorker
from karma.runtime.replay.tables import ReplayTables
from karma.runtime.replay.training_options import GradClip
from karma.schedule import LAST_MICRO_BATCH_KINDS, Op


class Updates:
    """Which micro-batch runs, the clipping of the step's gradients, and the updates that the
    previous replay left running."""

    def __init__(self, tables: ReplayTables, weights: list[BlockWeights],
                 model: torch.nn.Module, clip: GradClip | None, events: OpEvents, backend,
                 host: StreamWorker):
        self._tables = tables
        self._model = model
        self.clip = clip
        self._events = events
        self._backend = backend
        self._host = host  # the host optimizer's stream, which runs the host steps
        self._owner = {id(p): (w, k) for w in weights for k, p in enumerate(w.params)}
        self.updating = True  # the running micro-batch ends the step: its update ops run
        self.first = True  # the running micro-batch starts the step: its gradients start sums
        self.grad_norm: float | None = None  # this step's, before clipping (with clipping)
        # id(param) -> the norm of its final gradient, taken where the gradient became final
        # on another stream (training_options.py, [Note: clipping from per-parameter norms])
        self.norms: dict[int, torch.Tensor] = {}
        self._began = False  # the step's first optimizer step has been reached
        self._carried: dict[int, int] = {}  # local op id -> gid of a deferred op in flight
        self._after: list[Hashable] = []  # keys of work queued behind the host steps in flight

    def begin_replay(self, update: bool, first: bool) -> None:
        """A micro-batch starts (after the events of the new generation are made)."""
        self.updating, self.first = update, first
        self._began = False
        self.grad_norm = None
        self.norms = {}
        self._after = [k for k in self._after if k in self._events.events]

    def skips(self, op: Op) -> bool:
        """An update op of a micro-batch that does not end the step: done at once."""
        return op.kind in LAST_MICRO_BATCH_KINDS and not self.updating

    # --- updates left running --------------------------------------------------------------

    def carried(self, op: Op) -> list[int]:
        """The gids of the previous replay's updates, still in flight, that `op` waits for:
        a forward the uploads of the weights it reads, a fetch the host step that updates the
        masters it copies."""
        if not self._carried:
            return []
        if op.kind == "forward":
            ids = self._tables.forward_waits[op.block]
        elif op.kind == "fetch" and op.id in self._tables.fetch_waits:
            ids = (self._tables.fetch_waits[op.id],)
        else:
            return []
        return [self._carried[i] for i in ids if i in self._carried]

    def left_running(self) -> frozenset[int]:
        """The ops of this replay that the engine does not wait for at its end."""
        return self._tables.deferred if self.updating else frozenset()

    def carry(self, ids: frozenset[int]) -> None:
        """The replay has ended, leaving ops `ids` (local) running into the next one."""
        self._carried = {i: self._events.base + i for i in ids}

    def settle(self) -> None:
        """Wait for the updates left running by the last replay (and what was queued
        behind them): after this, weights, optimizer states and learning rates are final."""
        self._events.wait([*self._carried.values(), *self._after])
        self._carried = {}
        self._after = []

    def after_host_updates(self, fn: Callable[[], None]) -> None:
        """Run `fn` once the host steps in flight have run (on the host stream, behind them),
        or now if none are."""
        if not self._carried:
            fn()
            return
        key = ("after", self._events.generation, len(self._after))
        self._events.events[key] = threading.Event()
        self._after.append(key)
        self._host.submit(key, lambda: fn(), (), label="after the host steps")

    # --- gradients and clipping ------------------------------------------------------------

    def before_step(self) -> None:
        """Before the step's first optimizer step (on the compute thread): with clipping,
        wait until every gradient is final (the schedule orders every step after them: the
        validator checks it) and clip them all, in model.parameters() order."""
        if self._began or self.clip is None:
            return
        self._began = True
        gids = self._events.gids(self._tables.grad_ops)
        self._events.wait(gids)
        self._backend.order_after(gids, "compute")  # device gradients: after their all-reduces
        self._backend.order_after(gids, "host")  # host gradients: their copies have landed
        holders, norms = [], []
        for p in self._model.parameters():  # the plain loop's order; tied weights once
            w, k = self._owner[id(p)]
            holder = w.grad_holder(k)
            holders.append(holder)
            if holder.grad is not None:  # a device gradient, or one whose norm is still due
                norm = self.norms.get(id(p))
                norms.append(self.clip.norm(holder.grad) if norm is None else norm)
        self.grad_norm = self.clip.clip(holders, norms)

    def grads_to_host(self, w: BlockWeights, block: int) -> Callable:
        """What block `block`'s grads_to_host runs: the copy (added to the earlier
        micro-batches' after the first), and in the step's last micro-batch with clipping
        the norms of the gradients it makes final."""
        add = not self.first
        if self.clip is None or not self.updating or block in self._tables.reduce_on_host:
            return lambda: w.grads_to_host(add=add)
        return lambda: self._grads_to_host_with_norms(w, add)

    def reduce_host_grads(self, w: BlockWeights, reduce: Callable[[], Callable | None]):
        """All-reduce block w's gradients accumulated on the host (`reduce` runs the
        collective); with clipping, their norms are taken once they are final."""
        release = w.reduce_host_grads(lambda holders: reduce())
        if self.clip is not None:
            self._host_norms(w)
        return release

    def _grads_to_host_with_norms(self, w: BlockWeights, add: bool):
        """The block's gradients are final here, so their norms are taken too: from the
        device gradient before it goes, or from the host sum of an accumulation."""
        if not add:
            for p in w.params:
                if p.grad is not None:
                    self.norms[id(p)] = self.clip.norm(p.grad)
        release = w.grads_to_host(add=add)
        if add:
            self._host_norms(w)
        return release

    def _host_norms(self, w: BlockWeights) -> None:
        for p, g in zip(w.params, w.whole_grads()):
            if g is not None:
                self.norms[id(p)] = self.clip.norm(g)
