"""Swapped activations: one block's saved tensors, out to the host tier and back.

While a swap block runs its forward, a saved-tensors hook packs every tensor autograd saves
into a `Saved` entry instead of the tensor (parameters and views of parameters pass through:
weights are not activations). The schedule's swap-out copies the entries to the host tier and
drops the device tensors; its swap-in copies them back into fresh device tensors before the
block's backward, which unpacks them.

[Note: one entry per saved storage view] A tensor saved twice (by two ops of the block) is one
entry with a reference count, so it is copied once each way and freed after its last unpack.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from karma.runtime.host.tier import HostPool
from karma.runtime.replay.tables import DivergedError


@dataclass(eq=False)
class Saved:
    """One saved tensor of a swap block, wherever it is now."""

    device: torch.Tensor | None  # on the device: from pack to swap-out, swap-in to last unpack
    host: torch.Tensor | None  # in the host tier: from swap-out to swap-in
    refs: int  # unpacks still to come
    shape: torch.Size
    dtype: torch.dtype
    stride: tuple[int, ...] | None  # the saved tensor's where dense, to restore; else None
    ready: Callable[[], None] | None = None  # makes the unpacking stream wait for the swap-in


class SwapStore:
    """The saved tensors of one swap block."""

    def __init__(self, block: str, pool: HostPool, param_storages: set[int],
                 device: torch.device | None = None):
        self.block = block
        self.device = device or torch.device("cpu")
        self._pool = pool
        self._param_storages = param_storages  # _cdata of every parameter's storage
        self._entries: list[Saved] = []
        self._by_view: dict[tuple, Saved] = {}

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor):
        if t.untyped_storage()._cdata in self._param_storages:
            return t  # a parameter or a view of one: stays where the weights are
        if t.device != self.device:
            return t  # not device memory (the CPU RNG seeds a CUDA kernel saves, say)
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
               tuple(t.stride()), t.dtype)
        entry = self._by_view.get(key)
        if entry is None:
            entry = Saved(device=t, host=None, refs=0, shape=t.shape, dtype=t.dtype,
                          stride=t.stride() if dense(t) else None)
            self._by_view[key] = entry
            self._entries.append(entry)
        entry.refs += 1
        return entry

    def unpack(self, entry):
        if isinstance(entry, torch.Tensor):
            return entry
        t = entry.device
        if t is None:
            raise DivergedError(f"block {self.block}: a swapped activation was needed before "
                                "its swap-in; execution diverged from the schedule")
        if entry.ready is not None:
            entry.ready()  # a node of the block may run before the block's backward starts
        entry.refs -= 1
        if entry.refs == 0:
            entry.device = None
        return t

    def prepare_swap_out(self) -> Callable[[], Callable[[], None]]:
        """The swap-out, as the compute thread issues it (every saved tensor was packed by
        the block's forward)."""
        return self.swap_out

    def swap_out(self):
        """Copy every saved tensor to the host tier; the device copies are dropped once the
        copy has finished (the returned release)."""
        self._by_view.clear()  # storages may be reused once dropped
        leaving = []
        for e in self._entries:
            # same strides on the host: the copy is one memcpy, with no temporary
            e.host = self._pool.empty(e.shape, e.dtype, e.stride)
            e.host.copy_(e.device, non_blocking=True)
            leaving.append(e.device)
            e.device = None
        return leaving.clear

    def allocate(self) -> list[torch.Tensor]:
        """Empty device tensors for the swap-in, made on the compute thread when it issues
        the swap-in (with the saved tensors' strides where they are dense)."""
        return [empty_like_saved(e, self.device) for e in self._entries]

    def swap_in(self, fresh: list[torch.Tensor], backend):
        """Copy the saved tensors back into `fresh`, ready for the block's backward; the host
        slots are freed once the copy has finished (the returned release)."""
        for e, t in zip(self._entries, fresh):
            t.copy_(e.host, non_blocking=True)
        ready = backend.marker()
        hosts = []
        for e, t in zip(self._entries, fresh):
            e.device, e.ready = t, ready
            hosts.append(e.host)
            e.host = None

        def release():
            for h in hosts:
                self._pool.free(h)

        return release

    def reset(self) -> None:
        """End of the replay: forget every entry (all have been unpacked)."""
        for e in self._entries:
            if e.host is not None:
                self._pool.free(e.host)
        self._entries.clear()
        self._by_view.clear()


def dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill a block of memory exactly once (any order of dimensions)."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def empty_like_saved(e, device: torch.device) -> torch.Tensor:
    """An empty device tensor for the values of `e` (a Saved, or anything with its shape,
    dtype and stride), with the saved tensor's strides where they are dense: the backward then sees the layout the forward saved (a transposed weight
    gradient picks the same kernel, and on CUDA the same result bits)."""
    if e.stride is None:
        return torch.empty(e.shape, dtype=e.dtype, device=device)
    return torch.empty_strided(e.shape, e.stride, dtype=e.dtype, device=device)
