"""A block's weights, their gradients and their optimizer, wherever the schedule puts them.

- resident + device optimizer: as in plain PyTorch; the block's optimizer steps on the device.
- resident + host optimizer: fp32 master weights, gradients and optimizer state live in the
  host tier; gradients go to the host after the block's backward, the host steps the master
  weights, and the upload copies them back into the device weights.
- streamed (always with the host optimizer): the device weights exist only between a fetch
  and its release. [Note: weights released by storage resize] Release shrinks the parameter's
  storage to zero bytes and fetch regrows and refills it, as FSDP does: the Parameter objects,
  and the views of them that autograd saved in the forward, stay valid across the two.

Each block has its own optimizer, made by the model file's make_optimizer over the block's
own parameters: per-parameter optimizers (SGD, Adam, AdamW, ...) then step exactly as one
optimizer over all parameters would.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from karma.runtime.host.tier import BuildInTier, HostPool


class SharedStorage:
    """Reference-counted materialisation of streamed parameters (shared by all blocks)."""

    def __init__(self):
        self._refs: dict[int, int] = {}  # id(param) -> fetches not yet released
        self._masters: dict[int, torch.Tensor] = {}  # id(param) -> host master
        self._lock = threading.Lock()

    def register(self, param: torch.nn.Parameter, master: torch.Tensor) -> None:
        self._masters[id(param)] = master
        self._refs[id(param)] = 0
        param.untyped_storage().resize_(0)

    def is_streamed(self, param: torch.nn.Parameter) -> bool:
        return id(param) in self._masters

    def claim(self, params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
        """Count a fetch of `params` (on the compute thread, when the fetch is issued) and give
        storage back to those that had none: the ones `fill` must copy."""
        fill = []
        with self._lock:
            for p in params:
                self._refs[id(p)] += 1
                if self._refs[id(p)] == 1:
                    p.untyped_storage().resize_(p.numel() * p.element_size())
                    fill.append(p)
        return fill

    def fill(self, params: list[torch.nn.Parameter]) -> None:
        """Copy the host masters into the storage `claim` gave back (on the h2d stream)."""
        for p in params:
            # the refill must not look like an in-place change to the views autograd saved
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(p):
                p.copy_(self._masters[id(p)], non_blocking=True)

    def release(self, params: list[torch.nn.Parameter]) -> None:
        with self._lock:
            for p in params:
                self._refs[id(p)] -= 1
                if self._refs[id(p)] == 0:
                    p.untyped_storage().resize_(0)

    def master(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        return self._masters.get(id(p))


class BlockWeights:
    """One block's own parameters and its optimizer."""

    def __init__(self, name: str, params: list[tuple[str, torch.nn.Parameter]], weights: str,
                 optim: str, make_optimizer: Callable, pool: HostPool, shared: SharedStorage,
                 device: torch.device | None = None, tier: BuildInTier | None = None):
        self.name = name
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.weights, self.optim = weights, optim
        self._pool = pool
        self._shared = shared
        self._state_in_pool = False
        if optim == "host":
            self.masters = [torch.nn.Parameter(pool.copy_of(p.detach())) for p in self.params]
            self.host_grads = [pool.empty(p.shape, p.dtype) for p in self.params]
            # whether each host gradient holds this step's gradient: a parameter that got
            # none (unused, frozen) is skipped by the optimizer, as in plain PyTorch
            self.has_grad = [False] * len(self.params)
            self.optimizer = make_optimizer(self.masters) if self.params else None
            self._host_setup(make_optimizer, self.masters, device, tier, pool, shared)
        else:
            self.masters, self.host_grads = [], []
            for p in self.params:
                _place(p, device, False, tier, pool)
            self.optimizer = make_optimizer(self.params) if self.params else None

    def _host_setup(self, make_optimizer: Callable, sources: list[torch.Tensor],
                    device: torch.device | None, tier: BuildInTier | None, pool: HostPool,
                    shared: SharedStorage) -> None:
        """A host-stepped block, its masters and optimizer made: the optimizer's state born
        in the host tier, the parameters on the device (streamed: filled from `sources`)."""
        template = zero_state_template(make_optimizer) if self.optimizer else None
        if template is not None:
            self._prefill_state(template)
        for p in self.params:
            _place(p, device, self.weights == "streamed", tier, pool)
        if self.weights == "streamed":
            for p, source in zip(self.params, sources):
                shared.register(p, source)

    # --- the schedule's operations ---------------------------------------------------------

    def device_step(self) -> None:
        if self.optimizer is not None:
            self.optimizer.step()
            for p in self.params:
                p.grad = None

    def grads_to_host(self, add: bool = False):
        """Copy the gradients into the host tier (`add`: add them to what earlier
        micro-batches of the step left there, as autograd adds into .grad); the device
        gradients are dropped once the copy has finished (the returned release)."""
        leaving = []
        for k, (p, g) in enumerate(zip(self.params, self.host_grads)):
            if p.grad is None:
                self.has_grad[k] = self.has_grad[k] and add
            elif add and self.has_grad[k]:
                g.add_(p.grad.to(g.device))  # a blocking copy first on CUDA
                leaving.append(p.grad)
            else:
                g.copy_(p.grad, non_blocking=True)
                self.has_grad[k] = True
                leaving.append(p.grad)
            p.grad = None
        return leaving.clear

    def grad_holder(self, k: int) -> torch.Tensor:
        """The tensor whose .grad is parameter k's final gradient: the parameter (device
        optimizer) or its host master, lent the host gradient."""
        if self.optim != "host":
            return self.params[k]
        self.masters[k].grad = self.host_grads[k] if self.has_grad[k] else None
        return self.masters[k]

    @property
    def exchange_holders(self) -> list[torch.Tensor]:
        """The host tensors whose .grad the exchange of gradients added up on the host
        averages (reduce_host_grads lends them the host gradients)."""
        return self.masters

    def whole_grads(self) -> list[torch.Tensor | None]:
        """Each parameter's final gradient on the host, for the clipping norms (None: none)."""
        return [g if has else None for g, has in zip(self.host_grads, self.has_grad)]

    def reduce_host_grads(self, allreduce):
        """All-reduce the gradients accumulated on the host (`allreduce` of tensors' .grad,
        the masters lent their host gradients); returns what `allreduce` returns."""
        holders = [self.grad_holder(k) for k in range(len(self.params))]
        release = allreduce(holders)
        for k, m in enumerate(holders):
            self.has_grad[k] = m.grad is not None
            if m.grad is not None and m.grad is not self.host_grads[k]:
                self.host_grads[k].copy_(m.grad)
            m.grad = None
        return release

    def host_step(self) -> None:
        if self.optimizer is None:
            return
        for k in range(len(self.masters)):
            self.grad_holder(k)  # each master lent its host gradient, or None
        self.optimizer.step()
        for m in self.masters:
            m.grad = None
        if not self._state_in_pool:
            self._move_state_to_pool()

    def upload(self) -> None:
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m, non_blocking=True)

    # --- checkpoints ---------------------------------------------------------------------

    def current(self) -> dict[str, torch.Tensor]:
        """Up-to-date values of the block's parameters (the masters when on the host)."""
        source = self.masters if self.optim == "host" else self.params
        return {n: t.detach() for n, t in zip(self.names, source)}

    def load(self, values: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for n, p, m in zip(self.names, self.params, self.masters or [None] * len(self.params)):
                if m is not None:
                    m.copy_(values[n])
                if self.weights == "resident":
                    p.copy_(values[n])

    def _prefill_state(self, template: StateTemplate) -> None:
        """Create the optimizer's state in the host tier before its first step.

        [Note: optimizer state born in the host tier] Left to itself the optimizer makes its
        state at the first step in private memory (twice the weights for AdamW) and only then
        could it move: a one-off spike that a memory cap would not survive. Where a state of
        zeros is exactly what the optimizer would make (checked once by
        zero_state_template), it is made in the host tier up front instead.
        """
        for m in self.masters:
            self.optimizer.state[m] = _zero_state(
                template, lambda dtype, m=m: self._pool.empty(m.shape, dtype).zero_())
        self._state_in_pool = True

    def optimizer_state(self) -> dict | None:
        """The optimizer's state_dict (None: no optimizer)."""
        return None if self.optimizer is None else self.optimizer.state_dict()

    def load_optimizer_state(self, sd: dict) -> None:
        self.optimizer.load_state_dict(sd)
        self.reset_state_placement()

    def reset_state_placement(self) -> None:
        """After loading optimizer state: move it into the host tier at the next host step."""
        self._state_in_pool = False

    def _move_state_to_pool(self) -> None:
        """After the first step, optimizer state tensors move into the host tier."""
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.numel() > 1:
                    state[key] = self._pool.copy_of(value)
        self._state_in_pool = True


def _place(p: torch.nn.Parameter, device: torch.device | None, streamed: bool,
           tier: BuildInTier | None = None, pool: HostPool | None = None) -> None:
    """Move a parameter built on the CPU (or in the host tier: host/tier.py, BuildInTier) to the
    compute device; a streamed one gets no bytes there: its fetches fill it."""
    device = device or torch.device("cpu")
    built_in = tier.adopt(p) if tier is not None else None
    if built_in is None and p.device == device:
        return
    if streamed:  # the host master already holds its values; storage of its own, emptied
        p.data = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=device)
    else:
        p.data = p.data.to(device, copy=True)
    if built_in is not None:
        pool.free(built_in)


StateTemplate = dict[str, tuple[bool, torch.dtype]]  # key -> (parameter-shaped?, dtype)
_TEMPLATES: dict[Callable, StateTemplate | None] = {}  # keeps each make_optimizer alive


def zero_state_template(make_optimizer) -> StateTemplate | None:
    """The optimizer's per-parameter state layout, if a state of zeros steps exactly as the
    state it makes itself (checked once per make_optimizer on a small parameter); else None."""
    if make_optimizer not in _TEMPLATES:
        try:
            template = _state_template(make_optimizer)
            p1, s1 = _probe_step(make_optimizer, None)
            p2, s2 = _probe_step(make_optimizer, template)
            exact = torch.equal(p1, p2) and s1.keys() == s2.keys() and all(
                isinstance(v, torch.Tensor) and torch.equal(v, s2[k]) for k, v in s1.items())
        except Exception:  # noqa: BLE001 - any surprise: let the optimizer make its own state
            exact = False
        _TEMPLATES[make_optimizer] = template if exact else None
    return _TEMPLATES[make_optimizer]


def _zero_state(template: StateTemplate, like_param: Callable[[torch.dtype], torch.Tensor]):
    return {key: like_param(dtype) if shaped else torch.zeros((), dtype=dtype)
            for key, (shaped, dtype) in template.items()}


def _probe_step(make_optimizer, template: StateTemplate | None):
    """Two steps on a small parameter, from the optimizer's own state or from zeros."""
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5, 3, generator=g))
    opt = make_optimizer([p])
    if template is not None:
        opt.state[p] = _zero_state(template, lambda dtype: torch.zeros(p.shape, dtype=dtype))
    for step in range(2):
        p.grad = torch.randn(5, 3, generator=g) + step
        opt.step()
    return p.detach(), opt.state[p]


def _state_template(make_optimizer) -> StateTemplate:
    p = torch.nn.Parameter(torch.zeros(5, 3))
    opt = make_optimizer([p])
    p.grad = torch.zeros(5, 3)
    opt.step()
    return {k: (v.shape == p.shape, v.dtype) for k, v in opt.state[p].items()
            if isinstance(v, torch.Tensor)}
