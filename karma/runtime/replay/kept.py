"""What a selective block keeps, out to the host tier and back.

[Note: what a selective block keeps, on the host] A selective block (selective.py) keeps
the outputs of its policy's ops from its forward to its recompute, in the storage its
selective checkpoint contexts share: the forward's caching dispatch mode fills it, the
recompute's cached mode hands each output back in place of running its op again. With
`kept: host` (BlockEntry.kept) the schedule's swap-out copies those outputs to the host
tier during the next block's forward and drops them on the device; its swap-in copies them
back into fresh device tensors during the next block's backward, before the recompute.
Nothing else changes: the recompute receives the same values, so the gradients are
bitwise those of keeping them on the device.

PyTorch's policies name this (`CheckpointPolicy.MUST_CPU_OFFLOAD`), but in eager mode its
caching mode recomputes such an output instead (torch 2.13, torch/utils/checkpoint.py).

The contexts are torch.utils.checkpoint's own (`_CachingTorchDispatchMode`,
`_CachedTorchDispatchMode`), built over storage this store owns, as
`create_selective_checkpoint_contexts` builds them over a storage of its own: private
classes of torch 2.13, whose storage maps (op, overload) -> call index -> the op's output
as a tree of `_VersionWrapper`s (val: the tensor, version: its version counter when it
was stored). The swap replaces each wrapper's `val`; a kept output changed in place before
its swap-out (or, one the block returns, before its swap-in: the next block holds it) gets a
version that no longer matches, so the recompute still refuses it (selective.py's error), as
it would on the device.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode

from karma.runtime.host.tier import HostPool
from karma.runtime.replay.swap import dense, empty_like_saved
from karma.runtime.replay.tables import DivergedError


@dataclass(eq=False)
class _Kept:
    """One kept device tensor of a selective block (the wrappers of every stored view of
    it), wherever it is now."""

    wrappers: list  # the _VersionWrappers whose val is this tensor
    shape: torch.Size
    dtype: torch.dtype
    stride: tuple[int, ...] | None  # the tensor's where dense, to restore; else None
    mutated: bool = False  # changed in place before its swap-out
    # the block returned it: the next block holds it and may change it in place, which the
    # swap-in then checks (the tensor is alive anyway)
    returned: torch.Tensor | None = None
    host: torch.Tensor | None = None  # in the host tier: from swap-out to swap-in


class _Returning(_CachedTorchDispatchMode):
    """The recompute's cached mode, first making the compute stream wait for the swap-in
    (the recompute may start before the backward op the schedule orders it after)."""

    def __init__(self, store: KeptSwap, policy_fn, storage):
        super().__init__(policy_fn, storage, False)  # no kept output changed in place
        self._store = store

    def __enter__(self):
        self._store.wait_ready()
        return super().__enter__()


class KeptSwap:
    """What one selective block keeps, swapped out to the host tier and back."""

    def __init__(self, block: str, pool: HostPool, device: torch.device | None = None):
        self.block = block
        self.device = device or torch.device("cpu")
        self._pool = pool
        self._storages: list[dict] = []  # one per checkpointed call this replay
        self._outputs: set[int] = set()  # data_ptr of the storages the block returned
        self._kept: list[_Kept] = []
        self._away = False  # between the swap-out and the swap-in
        self._ready: Callable[[], None] | None = None  # the swap-in's marker (CUDA)

    def contexts(self, policy_fn) -> tuple[_CachingTorchDispatchMode, _CachedTorchDispatchMode]:
        """The selective contexts of one checkpointed call of the block in a training replay,
        over storage this store swaps (create_selective_checkpoint_contexts's, with the
        storage ours)."""
        storage: dict = defaultdict(dict)
        if torch.is_grad_enabled():  # else checkpoint runs the forward without the contexts
            self._storages.append(storage)
        return (_CachingTorchDispatchMode(policy_fn, storage),
                _Returning(self, policy_fn, storage))

    def returned(self, output) -> None:
        """What the block's call returned. A kept output that is (a view of) it is held by
        the next block, which may change it in place while the swap-out copies it: the
        recompute must then refuse it, as it would on the device, not be handed a copy
        taken before or after the change depending on when the copy ran."""
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor):
                self._outputs.add(t.untyped_storage().data_ptr())

    def prepare_swap_out(self) -> Callable[[], Callable[[], None]]:
        """The swap-out, as the compute thread issues it (the block's forward has ended):
        what it copies is known from here on, so the swap-in can allocate for it even before
        the copy stream has run the swap-out."""
        self._kept = self._collect()
        # the storages live on in their checkpoints' contexts as long as those need them
        # (an output the recompute never asks for, since it stops early, goes with them)
        self._storages.clear()
        self._outputs.clear()
        return self.swap_out

    def swap_out(self):
        """Copy every kept device tensor to the host tier; the device copies are dropped once
        the copy has finished (the returned release)."""
        leaving = []
        for k in self._kept:
            t = k.wrappers[0].val
            k.mutated = any(w.val._version != w.version for w in k.wrappers)
            k.host = self._pool.empty(k.shape, k.dtype, k.stride)
            k.host.copy_(t, non_blocking=True)
            leaving.append(t)
            for w in k.wrappers:
                w.val = None
        self._away = True
        return leaving.clear

    def allocate(self) -> list[torch.Tensor]:
        """Empty device tensors for the swap-in, made on the compute thread when it issues
        the swap-in."""
        return [empty_like_saved(k, self.device) for k in self._kept]

    def swap_in(self, fresh: list[torch.Tensor], backend):
        """Copy the kept tensors back into `fresh`, ready for the recompute; the host slots
        are freed once the copy has finished (the returned release)."""
        for k, t in zip(self._kept, fresh):
            t.copy_(k.host, non_blocking=True)
        self._ready = backend.marker()
        hosts, filling = [], list(fresh)  # held until the copies have finished (CUDA)
        for k, t in zip(self._kept, fresh):
            if k.returned is not None:  # changed in place since it was kept?
                k.mutated |= k.returned._version != k.wrappers[0].version
                k.returned = None
            for w in k.wrappers:  # each its own tensor object, as the forward stored them
                w.val = t.detach()
                # changed in place before the swap-out: a version that cannot match
                w.version = t._version - 1 if k.mutated else t._version
            hosts.append(k.host)
        # the wrappers now hold the only references: each tensor goes once the recompute
        # has taken it from the storage (its buffer is freed after the block's backward)
        self._kept = []
        self._away = False

        def release():
            for h in hosts:
                self._pool.free(h)
            filling.clear()

        return release

    def wait_ready(self) -> None:
        """Make the recompute's stream wait for the swap-in, if one ran this replay."""
        if self._away:
            raise DivergedError(f"block {self.block}: its kept outputs were needed before "
                                "their swap-in; execution diverged from the schedule")
        if self._ready is not None:
            self._ready()

    def reset(self) -> None:
        """End of the replay: forget the storages (the recomputes have consumed them), and
        free the host slots of a swap-out that was not swapped back in (a failed step)."""
        for k in self._kept:
            if k.host is not None:
                self._pool.free(k.host)
        self._storages.clear()
        self._outputs.clear()
        self._kept = []
        self._away = False
        self._ready = None

    def _collect(self) -> list[_Kept]:
        """The device tensors the storages hold, one entry per tensor however many stored
        outputs are it (an op that returns its input, say)."""
        by_tensor: dict[tuple, _Kept] = {}
        for storage in self._storages:
            for calls in storage.values():
                # call index -> output (torch 2.13); a list of outputs in some earlier torch
                for entry in (calls.values() if isinstance(calls, dict) else calls):
                    for w in tree_leaves(entry):
                        t = getattr(w, "val", None)
                        if not isinstance(t, torch.Tensor) or t.device != self.device:
                            continue
                        key = (t.untyped_storage().data_ptr(), t.storage_offset(),
                               tuple(t.shape), t.stride(), t.dtype)
                        k = by_tensor.get(key)
                        if k is None:
                            returned = t.untyped_storage().data_ptr() in self._outputs
                            k = by_tensor[key] = _Kept([], t.shape, t.dtype,
                                                       t.stride() if dense(t) else None,
                                                       returned=t if returned else None)
                        k.wrappers.append(w)
        return list(by_tensor.values())
