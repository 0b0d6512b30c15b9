"""The host tier: its pool's first-fit slots, and swapped activations going through it."""

from __future__ import annotations

import torch

from karma.runtime.backends.backend import CpuBackend
from karma.runtime.host.tier import ALIGN, BuildInTier, HostPool
from karma.runtime.replay.swap import SwapStore


def slot(t: torch.Tensor) -> tuple[int, int, int]:
    return t._karma_slot  # noqa: SLF001


def test_freed_slots_merge_and_are_reused():
    pool = HostPool(1 << 20, kind="plain")
    a, b, c = (pool.empty((1000,), torch.float32) for _ in range(3))
    assert pool.used_bytes == 3 * slot(a)[2] and slot(a)[2] % ALIGN == 0
    pool.free(a)
    pool.free(b)  # a and b merge into one free run at offset 0
    d = pool.empty((2000,), torch.float32)
    assert slot(d)[1] == 0 and slot(c)[1] == 2 * slot(c)[2]
    d.fill_(1.0)
    c.fill_(2.0)
    assert d.sum().item() == 2000 and c.sum().item() == 2000  # no overlap
    pool.close()


def test_a_swapped_activation_comes_back_with_its_values_and_strides():
    pool = HostPool(1 << 20, kind="file")
    store = SwapStore("b", pool, param_storages=set())
    base = torch.randn(6, 4)
    saved = [base.t(), base[:, :2], torch.randn(3, 1).expand(3, 5)]  # dense, strided, expanded
    entries = [store.pack(t) for t in saved]
    store.swap_out()()  # the copy, then its release
    assert all(e.device is None for e in entries) and pool.used_bytes > 0
    store.swap_in(store.allocate(), CpuBackend())()
    back = [store.unpack(e) for e in entries]
    for t, b in zip(saved, back):
        assert torch.equal(t, b)
    assert back[0].stride() == saved[0].stride()  # a transposed view stays transposed
    assert back[1].is_contiguous() and back[2].is_contiguous()  # the others come back dense
    assert pool.used_bytes == 0
    pool.close()


def test_writing_one_slot_is_not_an_inplace_change_of_another():
    """Each slot has a version counter of its own (not a view of the arena's): a weight built
    in the tier stays valid for backward while host gradients and masters are written."""
    pool = HostPool(1 << 20, kind="file")
    weight = torch.nn.Parameter(pool.empty((4, 4), torch.float32).fill_(1.0))
    other = pool.empty((4, 4), torch.float32)
    loss = (weight * torch.ones(4, 4, requires_grad=True)).sum()  # saves weight
    other.fill_(2.0)
    loss.backward()  # would raise "modified by an inplace operation" with a shared counter
    assert torch.equal(weight.grad, torch.ones(4, 4))
    pool.close()


def test_a_model_built_in_the_tier_has_the_values_of_a_plain_build():
    pool = HostPool(1 << 20, kind="file")

    def build():
        torch.manual_seed(0)
        return [torch.nn.Linear(64, 32), torch.randn(8, 16), torch.zeros(4, 4, dtype=torch.int64),
                torch.full((3, 3), 2.5), torch.full((2,), 7), torch.ones(size=(5,)),
                torch.rand(6, generator=torch.Generator().manual_seed(1))]

    plain = build()
    with BuildInTier(pool, min_bytes=1) as tier:
        tiered = build()
    for a, b in zip(plain, tiered):
        for x, y in ([(a.weight, b.weight), (a.bias, b.bias)] if isinstance(a, torch.nn.Module)
                     else [(a, b)]):
            assert x.dtype == y.dtype and torch.equal(x, y)
    assert tiered[0].weight.requires_grad
    assert tier.adopt(tiered[0].weight) is not None  # built in the tier
    assert tier.adopt(tiered[5]) is None  # sizes as size=...: built as usual
    pool.close()
