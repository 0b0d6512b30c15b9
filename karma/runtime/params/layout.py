"""Where a host-stepped block's fp32 state lives: whole on every rank, or 1/N on each.

A block stepped on the host keeps fp32 master weights, the host gradients its optimizer reads
and that optimizer's state in host memory. Its BlockWeights (weights.py) runs the schedule's
operations alike whichever layout holds that state; the layout owns what differs, as FSDP2's
FSDPParam carries its sharding:

- where the masters and host gradients live (`masters`, `host_grads`), the whole weights the
  uploads, fetches and checkpoints read (`whole`), where gradients added up over
  micro-batches are added up whole (`sums`) and the host tensors lent them for an exchange
  on the host (`exchange_holders`);
- which part of a device gradient goes to which host tensor (`landing`);
- the all-gather of the stepped masters into the whole weights (`all_gather`);
- the optimizer state whole for a checkpoint, and cut again when one is loaded
  (`whole_state`, `own_state`).

ReplicatedLayout: every rank holds all of it (one rank, or config.host_state replicated).

ShardedLayout: [Note: sharded host state] With config.host_state sharded on N ranks, dim 0
of each parameter of a host-stepped block is cut in N parts (distributed/cut.py). Rank r
keeps its rows of
- the fp32 master weights, which its optimizer steps (so the optimizer state is 1/N too:
  AdamW, SGD and the like are elementwise, and step a part of a tensor as they step the whole
  of it, bit for bit). They are its rows of the whole weights, in place;
- the gradients: the reduce-scatter leaves each rank the average of its rows
  (distributed/exchange.py, [Note: the reduce-scatter's layout]), and only those are copied
  to the host. Gradients added up over micro-batches are added up whole, as the plain loop
  adds them on every rank, and exchanged once at the end; the rank's rows of that sum are
  its shard.
With clipping the exchange is an all-reduce instead, so that each gradient's norm is taken
whole, as clip_grad_norm_ takes it; the shard is then cut from the whole average.

After its host step a rank all-gathers the stepped masters (on the net stream, over the host
group: gloo) into the whole weights, which the block's uploads or fetches copy to the device:
one copy a node (host/nodecopy.py), padded to N x rows rows, its rank r's part being rank r's
masters, so that the all-gather is in place (each rank's input is its own part of the output,
which the collective leaves as it is). A rank then holds 12 bytes a parameter / N (gradients
and AdamW's moments) and its share of the node's copy, 4 bytes a parameter / the node's
ranks: on one node, 16 / N, 1/N of a rank with replicated state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from karma.errors import KarmaError
from karma.runtime.distributed.cut import Cut, rows_of
from karma.runtime.distributed.process_group import Ranks, lost
from karma.runtime.host.nodecopy import NodeCopy
from karma.runtime.host.tier import HostPool
from karma.schedule import Schedule

PerElement = Callable[[str, object, torch.Size], bool]  # (key, entry, parameter shape) -> cut?


class HostLayout(Protocol):
    """What BlockWeights asks of the layout of a host-stepped block's state (parameter k of
    the block is entry k of each list)."""

    masters: list[torch.nn.Parameter]  # what the block's optimizer steps
    host_grads: list[torch.Tensor]  # each master's gradient, as the optimizer reads it
    whole: list[torch.Tensor]  # the whole weights: uploads, fetches and checkpoints read them
    # each gradient whole on the host, added up over micro-batches (None: the host receives
    # only this rank's rows); `exchange_holders` are lent them as .grad for an exchange
    sums: list[torch.Tensor] | None
    exchange_holders: list[torch.Tensor]
    cuts: list[Cut] | None  # each parameter's rows on this rank (None: nothing is cut)

    def landing(self, k: int, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the host tensor that receives parameter k's device gradient `grad`, the part of
        `grad` it receives)."""

    def all_gather(self) -> None:
        """Gather every rank's stepped masters into the whole weights (on the net stream)."""

    def whole_state(self, sd: dict, per_element: PerElement) -> dict:
        """The optimizer's state_dict `sd` with each state whole (every rank calls it)."""

    def own_state(self, sd: dict, per_element: PerElement) -> dict:
        """A state_dict of whole states (whole_state's) cut to what this rank holds."""


class ReplicatedLayout:
    """Every rank holds the block's whole host state: masters in the host tier, copied from the
    parameters' initial values, and a host gradient of each parameter's shape."""

    cuts = None

    def __init__(self, params: list[torch.nn.Parameter], pool: HostPool):
        self.masters = [torch.nn.Parameter(pool.copy_of(p.detach())) for p in params]
        self.host_grads = [pool.empty(p.shape, p.dtype) for p in params]
        self.whole = self.masters  # the uploads and fetches copy the masters themselves
        self.sums = self.host_grads  # micro-batches add up in the host gradients
        self.exchange_holders = self.masters  # lent their host gradients

    def landing(self, k: int, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.host_grads[k], grad

    def all_gather(self) -> None:
        raise KarmaError("the schedule all-gathers a block whose host state is replicated: "
                         "all-gathers are for sharded host state; re-plan the schedule")

    def whole_state(self, sd: dict, per_element: PerElement) -> dict:
        return sd  # whole already

    def own_state(self, sd: dict, per_element: PerElement) -> dict:
        return sd  # this rank holds all of it


class ShardedLayout:
    """This rank's rows of the block's host state ([Note: sharded host state]); the whole
    weights in the node's copy, which the all-gather fills."""

    def __init__(self, params: list[torch.nn.Parameter], pool: HostPool, node: NodeCopy,
                 ranks: Ranks, accumulate: int):
        """`accumulate`: micro-batches per step; above 1 the gradients are added up whole."""
        self._ranks = ranks
        self._shapes = [p.shape for p in params]
        world, rank = ranks.world_size, ranks.rank
        self.cuts = [Cut.of(p.shape, world, rank) for p in params]
        # the whole weights the device copies are filled from, padded so that the all-gather
        # writes them in place; this rank's part of them (`_own`, padded to `rows` rows) and
        # its masters (its rows, unpadded)
        self._gathered = [node.empty((c.rows * world, *p.shape[1:]), p.dtype)
                          for p, c in zip(params, self.cuts)]
        self.whole = [g.narrow(0, 0, p.shape[0] if p.dim() else 1).view(p.shape)
                      for g, p in zip(self._gathered, params)]
        self._own = [g.narrow(0, rank * c.rows, c.rows)
                     for g, c in zip(self._gathered, self.cuts)]
        self.masters = [torch.nn.Parameter(g.narrow(0, c.start, c.stop - c.start))
                        for g, c in zip(self._gathered, self.cuts)]
        with torch.no_grad():
            for p, w, g in zip(params, self.whole, self._gathered):
                g.zero_()  # the padding too: the all-gather sends it
                w.copy_(p.detach())
        # gradients added up over micro-batches are added up whole (their shard: a view)
        self.sums = [pool.empty(p.shape, p.dtype) for p in params] if accumulate > 1 else None
        self.host_grads = [rows_of(s, c) for s, c in zip(self.sums, self.cuts)] if self.sums \
            else [pool.empty(m.shape, m.dtype) for m in self.masters]
        # whole-shaped host tensors lent the sums as .grad for their exchange
        self.exchange_holders = [w.detach().requires_grad_() for w in self.whole] \
            if self.sums else []

    def landing(self, k: int, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """With accumulation the whole gradient, into its sum (exchanged later, whole); else
        this rank's rows of the averaged gradient, into the host gradient."""
        if self.sums is not None:
            return self.sums[k], grad
        return self.host_grads[k], rows_of(grad, self.cuts[k])

    def all_gather(self) -> None:
        for gathered, own in zip(self._gathered, self._own):
            self._gather(gathered, own, "in an all-gather of the weights")

    def whole_state(self, sd: dict, per_element: PerElement) -> dict:
        """Each per-element entry gathered from every rank, as one optimizer over the whole
        parameters would hold it; every rank calls it, in the same order (checkpoints:
        loop.py; Runtime.state_dict)."""
        world = self._ranks.world_size
        for k, st in sd["state"].items():
            shape, c = self._shapes[k], self.cuts[k]
            for key, v in list(st.items()):
                if not per_element(key, v, self.masters[k].shape):
                    continue
                own = v.new_zeros((c.rows, *v.shape[1:]))
                own.narrow(0, 0, v.shape[0]).copy_(v)
                gathered = v.new_empty((world * c.rows, *v.shape[1:]))
                self._gather(gathered, own, "gathering the optimizer state")
                st[key] = gathered.narrow(0, 0, shape[0] if len(shape) else 1).view(shape)
        return sd

    def own_state(self, sd: dict, per_element: PerElement) -> dict:
        """This rank's rows of each per-element entry."""
        sd = {**sd, "state": dict(sd["state"])}
        for k, st in sd["state"].items():
            shape, c = self._shapes[k], self.cuts[k]
            sd["state"][k] = {key: rows_of(v, c).clone() if per_element(key, v, shape) else v
                              for key, v in st.items()}
        return sd

    def _gather(self, gathered: torch.Tensor, own: torch.Tensor, where: str) -> None:
        """Every rank's `own` into `gathered`, rank by rank, over the host group."""
        try:
            dist.all_gather_into_tensor(gathered.view(-1), own.view(-1),
                                        group=self._ranks.host_net)
        except RuntimeError as e:
            raise lost(self._ranks, where, e) from e


def sharded_params(schedule: Schedule) -> list[str]:
    """The parameters whose host state is sharded: those of the host-stepped blocks."""
    if not schedule.config.sharded:
        return []
    return [n for b in schedule.blocks if b.optim == "host" for n in b.params]
