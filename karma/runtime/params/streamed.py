"""The storage of streamed parameters, shared by every block that uses them.

[Note: weights released by storage resize] A streamed block's device weights exist only
between a fetch and its release. Release shrinks the parameter's storage to zero bytes and
fetch regrows and refills it, as FSDP does: the Parameter objects, and the views of them that
autograd saved in the forward, stay valid across the two. A parameter that several fetches
hold at once (weights that blocks share) keeps its storage until the last of them is released.
"""

from __future__ import annotations

import threading

import torch


class SharedStorage:
    """Reference-counted materialisation of streamed parameters (shared by all blocks)."""

    def __init__(self):
        self._refs: dict[int, int] = {}  # id(param) -> fetches not yet released
        self._masters: dict[int, torch.Tensor] = {}  # id(param) -> the host copy fills read
        # claim and release run on the compute thread, release also on the streams' workers
        # (a fetch's weights freed once its op's work is done): they count under this lock
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
