"""Sharded host state: each rank keeps 1/N of a host-stepped block's fp32 state.

[Note: sharded host state] With config.host_state sharded on N ranks, dim 0 of each
parameter of a host-stepped block is cut in N parts of `rows` = dim 0 / N rows (rounded up;
the last ranks' parts are short or empty, a 0-dim parameter is one row). Rank r keeps rows
[r rows, (r + 1) rows) of
- the fp32 master weights, which its optimizer steps (so the optimizer state is 1/N too:
  AdamW, SGD and the like are elementwise, and step a part of a tensor as they step the whole
  of it, bit for bit). They are its rows of the whole weights, in place;
- the gradients: the reduce-scatter leaves each rank the average of its rows
  (distributed/exchange.py, [Note: the reduce-scatter's layout]), and only those are copied
  to the host. Gradients added up over micro-batches are added up whole, as the plain loop adds them on
  every rank, and exchanged once at the end; the rank's rows of that sum are its shard.
With clipping the exchange is an all-reduce instead, so that each gradient's norm is taken
whole, as clip_grad_norm_ takes it; the shard is then cut from the whole average.

After its host step a rank all-gathers the stepped masters (on the net stream, over the
host group: gloo) into the whole weights, which the block's uploads or fetches copy to the
device: one copy a node (host/nodecopy.py), padded to N x rows rows, its rank r's part
being rank r's masters, so that the all-gather is in place (each rank's input is its own part of the
output, which the collective leaves as it is). A rank then holds 12 bytes a parameter / N
(gradients and AdamW's moments) and its share of the node's copy, 4 bytes a parameter / the
node's ranks: on one node, 16 / N, 1/N of a rank with replicated state.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from karma.runtime.distributed.cut import Cut, rows_of
from karma.runtime.distributed.process_group import Ranks, lost
from karma.runtime.host.nodecopy import NodeCopy
from karma.runtime.host.tier import BuildInTier, HostPool
from karma.runtime.params.weights import BlockWeights, SharedStorage, zero_state_template
from karma.schedule import Schedule


def sharded_params(schedule: Schedule) -> list[str]:
    """The parameters whose host state is sharded: those of the host-stepped blocks."""
    if not schedule.config.sharded:
        return []
    return [n for b in schedule.blocks if b.optim == "host" for n in b.params]


def _row_shape(p: torch.Tensor) -> tuple[int, ...]:
    return tuple(p.shape[1:])


class ShardedWeights(BlockWeights):
    """One host-stepped block's weights with sharded host state: the operations of
    weights.BlockWeights (the engine cannot tell them apart) over this rank's rows; the host
    step, each master lent its gradient, and the optimizer state's placement are its."""

    def __init__(self, name: str, params: list[tuple[str, torch.nn.Parameter]], weights: str,
                 make_optimizer: Callable, pool: HostPool, node: NodeCopy,
                 shared: SharedStorage, ranks: Ranks, accumulate: int,
                 device: torch.device | None = None, tier: BuildInTier | None = None):
        self.name = name
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.weights, self.optim = weights, "host"
        self._pool = pool
        self._ranks = ranks
        world, rank = ranks.world_size, ranks.rank
        self.cuts = [Cut.of(p.shape, world, rank) for p in self.params]
        # the whole weights the device copies are filled from, padded so that the all-gather
        # writes them in place; this rank's masters, padded likewise to `rows` rows
        self._gathered = [node.empty((c.rows * world, *_row_shape(p)), p.dtype)
                          for p, c in zip(self.params, self.cuts)]
        self.whole = [g.narrow(0, 0, p.shape[0] if p.dim() else 1).view(p.shape)
                      for g, p in zip(self._gathered, self.params)]
        self._own = [g.narrow(0, rank * c.rows, c.rows)
                     for g, c in zip(self._gathered, self.cuts)]
        self.masters = [torch.nn.Parameter(g.narrow(0, c.start, c.stop - c.start))
                        for g, c in zip(self._gathered, self.cuts)]
        with torch.no_grad():
            for p, w, o in zip(self.params, self.whole, self._gathered):
                o.zero_()  # the padding too: the all-gather sends it
                w.copy_(p.detach())
        # gradients added up over micro-batches are added up whole (their shard: a view)
        self.sums = [pool.empty(p.shape, p.dtype) for p in self.params] if accumulate > 1 \
            else None
        self.host_grads = [rows_of(s, c) for s, c in zip(self.sums, self.cuts)] if self.sums \
            else [pool.empty(m.shape, m.dtype) for m in self.masters]
        # whole-shaped host tensors lent the sums as .grad for their exchange
        self._holders = [w.detach().requires_grad_() for w in self.whole] if self.sums else []
        self.has_grad = [False] * len(self.params)
        self._make_optimizer = make_optimizer
        self.optimizer = make_optimizer(self.masters) if self.params else None
        self._state_in_pool = False
        self._host_setup(make_optimizer, self.whole, device, tier, pool, shared)

    # --- the schedule's operations ---------------------------------------------------------

    def grads_to_host(self, add: bool = False):
        """Copy this rank's rows of the averaged gradients to the host; with accumulation the
        whole gradients, added to the earlier micro-batches' (exchanged later, whole)."""
        leaving = []
        for k, p in enumerate(self.params):
            if p.grad is None:
                self.has_grad[k] = self.has_grad[k] and add
                continue
            if self.sums is None:
                self.host_grads[k].copy_(rows_of(p.grad, self.cuts[k]), non_blocking=True)
            elif add and self.has_grad[k]:
                self.sums[k].add_(p.grad.to(self.sums[k].device))
            else:
                self.sums[k].copy_(p.grad, non_blocking=True)
            self.has_grad[k] = True
            leaving.append(p.grad)
            p.grad = None
        return leaving.clear

    @property
    def exchange_holders(self) -> list[torch.Tensor]:
        """The host tensors whose .grad the exchange of gradients added up on the host
        averages (reduce_host_grads lends them the sums)."""
        return self._holders

    def whole_grads(self) -> list[torch.Tensor | None]:
        """Each parameter's final gradient whole, where the host holds it (the sums of an
        accumulation), for the clipping norms; None where it holds only the shard."""
        if self.sums is None:
            return [None] * len(self.params)
        return [s if has else None for s, has in zip(self.sums, self.has_grad)]

    def reduce_host_grads(self, reduce):
        """Exchange the gradients added up on the host (`reduce` of the holders' .grad)."""
        for h, s, has in zip(self._holders, self.sums, self.has_grad):
            h.grad = s if has else None
        release = reduce(self._holders)
        for k, (h, s) in enumerate(zip(self._holders, self.sums)):
            self.has_grad[k] = h.grad is not None
            if h.grad is not None and h.grad is not s:
                s.copy_(h.grad)
            h.grad = None
        return release

    def all_gather(self) -> None:
        """Gather every rank's stepped masters into the whole weights (on the net stream)."""
        try:
            for gathered, own in zip(self._gathered, self._own):
                dist.all_gather_into_tensor(gathered.view(-1), own.view(-1),
                                            group=self._ranks.host_net)
        except RuntimeError as e:
            raise lost(self._ranks, "in an all-gather of the weights", e) from e

    def upload(self) -> None:
        with torch.no_grad():
            for p, w in zip(self.params, self.whole):
                p.copy_(w, non_blocking=True)

    # --- checkpoints ---------------------------------------------------------------------

    def current(self) -> dict[str, torch.Tensor]:
        """Up-to-date values of the block's parameters: the whole weights, as gathered."""
        return {n: w.detach() for n, w in zip(self.names, self.whole)}

    def load(self, values: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for n, p, w in zip(self.names, self.params, self.whole):
                w.copy_(values[n])  # the masters with it: they are its rows
                if self.weights == "resident":
                    p.copy_(values[n])

    def optimizer_state(self) -> dict | None:
        """The optimizer's state_dict with each parameter's state whole, as one optimizer over
        the whole parameters would hold it: gathered from every rank, so every rank calls it,
        in the same order (checkpoints: loop.py; Runtime.state_dict)."""
        if self.optimizer is None:
            return None
        sd = self.optimizer.state_dict()
        shaped = self.shaped_keys()
        world = self._ranks.world_size
        for k, st in sd["state"].items():
            p, m, c = self.params[k], self.masters[k], self.cuts[k]
            for key, v in list(st.items()):
                if not shaped(key, v, m.shape):
                    continue
                own = v.new_zeros((c.rows, *v.shape[1:]))
                own.narrow(0, 0, v.shape[0]).copy_(v)
                gathered = v.new_empty((world * c.rows, *v.shape[1:]))
                try:
                    dist.all_gather_into_tensor(gathered.view(-1), own.view(-1),
                                                group=self._ranks.host_net)
                except RuntimeError as e:
                    raise lost(self._ranks, "gathering the optimizer state", e) from e
                st[key] = gathered.narrow(0, 0, p.shape[0] if p.dim() else 1).view(p.shape)
        return sd

    def load_optimizer_state(self, sd: dict) -> None:
        """Load a state_dict whose states are whole (optimizer_state's): this rank's rows."""
        sd = {**sd, "state": dict(sd["state"])}
        shaped = self.shaped_keys()
        for k, st in sd["state"].items():
            p, c = self.params[k], self.cuts[k]
            sd["state"][k] = {key: rows_of(v, c).clone() if shaped(key, v, p.shape) else v
                              for key, v in st.items()}
        super().load_optimizer_state(sd)

    def shaped_keys(self) -> Callable[[str, object, torch.Size], bool]:
        """Whether a state entry is per element of its parameter (cut as the parameter is):
        as zero_state_template found for the optimizer, else by shape."""
        template = zero_state_template(self._make_optimizer)
        if template is not None:
            return lambda key, v, shape: isinstance(v, torch.Tensor) and template.get(
                key, (False,))[0]
        return lambda key, v, shape: isinstance(v, torch.Tensor) and v.dim() > 0 \
            and v.shape == shape
