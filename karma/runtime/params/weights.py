"""A block's weights, their gradients and their optimizer, wherever the schedule puts them.

- resident + device optimizer: as in plain PyTorch; the block's optimizer steps on the device.
- resident + host optimizer: fp32 master weights, gradients and optimizer state live in the
  host tier; gradients go to the host after the block's backward, the host steps the master
  weights, and the upload copies them back into the device weights.
- streamed (always with the host optimizer): the device weights exist only between a fetch
  and its release (streamed.py, [Note: weights released by storage resize]).

Where a host-stepped block's masters, host gradients and optimizer state live, whole on every
rank or 1/N on each, is its layout's (layout.py); the operations below are the same for both.

Each block has its own optimizer, made by the model file's make_optimizer over the block's
own parameters: per-parameter optimizers (SGD, Adam, AdamW, ...) then step exactly as one
optimizer over all parameters would. A block stepped on the host gets it through
host_optimizer.host_make_optimizer (torch's fused CPU kernel by default).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from karma.runtime.host.tier import BuildInTier, HostPool
from karma.runtime.params.host_optimizer import keep_implementation
from karma.runtime.params.layout import HostLayout, PerElement
from karma.runtime.params.optimizer_state import StateTemplate, zero_state, zero_state_template
from karma.runtime.params.placement import place_param
from karma.runtime.params.streamed import SharedStorage


class BlockWeights:
    """One block's own parameters and its optimizer; a host-stepped block's state where its
    `layout` keeps it."""

    def __init__(self, name: str, params: list[tuple[str, torch.nn.Parameter]], weights: str,
                 optim: str, make_optimizer: Callable, pool: HostPool, shared: SharedStorage,
                 layout: HostLayout | None = None, device: torch.device | None = None,
                 tier: BuildInTier | None = None):
        """`layout`: where the masters, host gradients and optimizer state of a block stepped
        on the host live (layout.py), built over `params`; None for one stepped on the device.
        The parameters move to `device` here (placement.py); streamed ones are registered in
        `shared`, their fetches filled from the layout's whole weights."""
        if (optim == "host") != (layout is not None):
            raise ValueError(f"block {name}: optim {optim!r} needs "
                             f"{'a host-state layout' if optim == 'host' else 'no layout'}; "
                             "give a layout exactly to the blocks stepped on the host")
        self.name = name
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.weights, self.optim = weights, optim
        self.layout = layout
        self._pool = pool
        self._make_optimizer = make_optimizer
        self._state_in_pool = False
        # whether each host gradient holds this step's gradient: a parameter that got
        # none (unused, frozen) is skipped by the optimizer, as in plain PyTorch
        self.has_grad = [False] * len(self.params)
        if layout is None:
            for p in self.params:
                place_param(p, device, False, tier, pool)
            self.optimizer = make_optimizer(self.params) if self.params else None
            return
        self.optimizer = make_optimizer(layout.masters) if self.params else None
        template = zero_state_template(make_optimizer) if self.optimizer else None
        if template is not None:
            self._prefill_state(template)
        streamed = weights == "streamed"
        for p in self.params:
            place_param(p, device, streamed, tier, pool)
        if streamed:
            for p, source in zip(self.params, layout.whole):
                shared.register(p, source)

    # --- the schedule's operations ---------------------------------------------------------

    def device_step(self) -> None:
        if self.optimizer is not None:
            self.optimizer.step()
            for p in self.params:
                p.grad = None

    def grads_to_host(self, add: bool = False):
        """Copy the gradients, or the part of each the layout keeps, into the host tier (`add`:
        add them to what earlier micro-batches of the step left there, as autograd adds into
        .grad); the device gradients are dropped once the copy has finished (the returned
        release)."""
        leaving = []
        for k, p in enumerate(self.params):
            if p.grad is None:
                self.has_grad[k] = self.has_grad[k] and add
                continue
            host, part = self.layout.landing(k, p.grad)
            if add and self.has_grad[k]:
                host.add_(part.to(host.device))  # a blocking copy first on CUDA
            else:
                host.copy_(part, non_blocking=True)
                self.has_grad[k] = True
            leaving.append(p.grad)
            p.grad = None
        return leaving.clear

    def grad_holder(self, k: int) -> torch.Tensor:
        """The tensor whose .grad is parameter k's final gradient: the parameter (device
        optimizer) or its host master, lent the host gradient."""
        if self.layout is None:
            return self.params[k]
        master = self.layout.masters[k]
        master.grad = self.layout.host_grads[k] if self.has_grad[k] else None
        return master

    def whole_grads(self) -> list[torch.Tensor | None]:
        """Each parameter's final gradient whole, where the host holds it (the layout's sums),
        for the clipping norms; None where it has none, or holds only this rank's rows."""
        sums = self.layout.sums
        if sums is None:
            return [None] * len(self.params)
        return [s if has else None for s, has in zip(sums, self.has_grad)]

    def reduce_host_grads(self, reduce):
        """Exchange the gradients added up on the host: `reduce` of the layout's exchange
        holders, each lent its sum as .grad; returns what `reduce` returns."""
        holders, sums = self.layout.exchange_holders, self.layout.sums
        for h, s, has in zip(holders, sums, self.has_grad):
            h.grad = s if has else None
        release = reduce(holders)
        for k, (h, s) in enumerate(zip(holders, sums)):
            self.has_grad[k] = h.grad is not None
            if h.grad is not None and h.grad is not s:
                s.copy_(h.grad)
            h.grad = None
        return release

    def host_step(self) -> None:
        if self.optimizer is None:
            return
        for k in range(len(self.params)):
            self.grad_holder(k)  # each master lent its host gradient, or None
        self.optimizer.step()
        for m in self.layout.masters:
            m.grad = None
        if not self._state_in_pool:
            self._move_state_to_pool()

    def upload(self) -> None:
        with torch.no_grad():
            for p, w in zip(self.params, self.layout.whole):
                p.copy_(w, non_blocking=True)

    # --- checkpoints ---------------------------------------------------------------------

    def current(self) -> dict[str, torch.Tensor]:
        """Up-to-date values of the block's parameters (the whole weights when on the host)."""
        source = self.params if self.layout is None else self.layout.whole
        return {n: t.detach() for n, t in zip(self.names, source)}

    def load(self, values: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for k, (n, p) in enumerate(zip(self.names, self.params)):
                if self.layout is not None:  # the masters with it (sharded: they are its rows)
                    self.layout.whole[k].copy_(values[n])
                if self.weights == "resident":
                    p.copy_(values[n])

    def optimizer_state(self) -> dict | None:
        """The optimizer's state_dict as one optimizer over the block's whole parameters would
        hold it (None: no optimizer). With sharded state it is gathered from every rank, so
        every rank calls it, in the same order (checkpoints: loop.py; Runtime.state_dict)."""
        if self.optimizer is None:
            return None
        sd = self.optimizer.state_dict()
        return sd if self.layout is None else self.layout.whole_state(sd, self.shaped_keys())

    def load_optimizer_state(self, sd: dict) -> None:
        """Load a state_dict whose states are whole (optimizer_state's)."""
        if self.layout is not None:
            sd = self.layout.own_state(sd, self.shaped_keys())
        self.load_own_optimizer_state(sd)

    def load_own_optimizer_state(self, sd: dict) -> None:
        """Load a state_dict of what this rank holds (a sharded block's rows already cut);
        the state moves into the host tier at the next host step. The optimizer keeps its
        kernel, whatever the state_dict's groups say (host_optimizer.py)."""
        keep_implementation(self.optimizer, lambda: self.optimizer.load_state_dict(sd))
        self._state_in_pool = False

    def shaped_keys(self) -> PerElement:
        """Whether a state entry is per element of its parameter (cut as the parameter is):
        as zero_state_template found for the optimizer, else by shape."""
        template = zero_state_template(self._make_optimizer)
        if template is not None:
            return lambda key, v, shape: isinstance(v, torch.Tensor) and template.get(
                key, (False,))[0]
        return lambda key, v, shape: isinstance(v, torch.Tensor) and v.dim() > 0 \
            and v.shape == shape

    def _prefill_state(self, template: StateTemplate) -> None:
        """Create the optimizer's state in the host tier before its first step
        (optimizer_state.py, [Note: optimizer state born in the host tier])."""
        for m in self.layout.masters:
            self.optimizer.state[m] = zero_state(
                template, lambda dtype, m=m: self._pool.empty(m.shape, dtype).zero_())
        self._state_in_pool = True

    def _move_state_to_pool(self) -> None:
        """After the first step, optimizer state tensors move into the host tier."""
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.numel() > 1:
                    state[key] = self._pool.copy_of(value)
        self._state_in_pool = True
