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

from karma.runtime.host import HostPool


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

    def fetch(self, params: list[torch.nn.Parameter]) -> None:
        for p in params:
            with self._lock:
                self._refs[id(p)] += 1
                if self._refs[id(p)] > 1:
                    continue
                storage = p.untyped_storage()
                storage.resize_(p.numel() * p.element_size())
            # the refill must not look like an in-place change to the views autograd saved
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(p):
                p.copy_(self._masters[id(p)])

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
                 optim: str, make_optimizer: Callable, pool: HostPool, shared: SharedStorage):
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
            self.optimizer = make_optimizer(self.masters) if self.params else None
            if weights == "streamed":
                for p, m in zip(self.params, self.masters):
                    shared.register(p, m)
        else:
            self.masters, self.host_grads = [], []
            self.optimizer = make_optimizer(self.params) if self.params else None

    # --- the schedule's operations ---------------------------------------------------------

    def device_step(self) -> None:
        if self.optimizer is not None:
            self.optimizer.step()
            for p in self.params:
                p.grad = None

    def grads_to_host(self) -> None:
        for p, g in zip(self.params, self.host_grads):
            if p.grad is None:
                g.zero_()  # a parameter the loss does not depend on
            else:
                g.copy_(p.grad)
            p.grad = None

    def host_step(self) -> None:
        if self.optimizer is None:
            return
        for m, g in zip(self.masters, self.host_grads):
            m.grad = g
        self.optimizer.step()
        for m in self.masters:
            m.grad = None
        if not self._state_in_pool:
            self._move_state_to_pool()

    def upload(self) -> None:
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m)

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
