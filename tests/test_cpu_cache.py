"""The CPU backend's caching allocator (karma/runtime/host/cpu_cache.py): reuse, its limit,
forks."""

from __future__ import annotations

import os
import re
import shutil

import pytest
import torch

from karma.runtime.host import cpu_cache

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler to build the allocator with")

MIB = 1 << 20


@pytest.fixture
def cache():
    c = cpu_cache.load()
    assert c is not None, "a compiler is here, so the allocator must build"
    yield c
    c.stop()


def test_a_freed_tensor_is_handed_to_the_next_request_of_its_size(cache):
    cache.start(1 << 40)
    before = cache.stats()
    a = torch.empty(MIB // 4)  # 1 MiB of fp32
    address = a.data_ptr()
    del a
    kept = cache.stats()
    assert kept.idle_bytes - before.idle_bytes == MIB
    b = torch.empty(MIB // 4)
    after = cache.stats()
    assert b.data_ptr() == address
    assert after.hits == kept.hits + 1 and after.misses == kept.misses
    assert after.live_bytes - kept.live_bytes == MIB


def test_a_smaller_request_takes_the_first_part_of_a_larger_kept_block(cache):
    """[Note: reshaping kept memory]: no fresh pages, the rest stays kept."""
    cache.start(1 << 40)
    a = torch.empty(3 * MIB // 4)  # 3 MiB: no kept block of 1 MiB to take
    address = a.data_ptr()
    del a
    kept = cache.stats()
    b = torch.full((MIB // 4,), 5.0)
    after = cache.stats()
    assert b.data_ptr() == address
    assert after.fresh_bytes == kept.fresh_bytes and after.reshaped == kept.reshaped + 1
    assert after.idle_bytes == kept.idle_bytes - MIB
    c = torch.full((2 * MIB // 4,), 6.0)  # the rest: just after b
    assert c.data_ptr() == address + MIB and cache.stats().fresh_bytes == kept.fresh_bytes
    assert torch.equal(b, torch.full((MIB // 4,), 5.0))


def test_a_larger_request_is_made_of_kept_blocks_moved_side_by_side(cache):
    cache.start(1 << 40)
    parts = [torch.empty(MIB // 4) for _ in range(3)]
    other = torch.full((2 * MIB // 4,), 7.0)  # live: must not be touched
    del parts
    kept = cache.stats()
    assert kept.idle_bytes >= 3 * MIB
    big = torch.empty(3 * MIB // 4 - 10)  # 3 MiB less 40 bytes: rounded to pages
    after = cache.stats()
    assert after.fresh_bytes == kept.fresh_bytes  # three 1 MiB blocks, no fresh page
    assert after.reshaped == kept.reshaped + 1 and after.idle_bytes == kept.idle_bytes - 3 * MIB
    big.fill_(3.0)  # every page is writable (checks below make no tensor of 64 KiB)
    assert big.sum().item() == 3.0 * big.numel()
    assert other.min().item() == other.max().item() == 7.0
    del big
    again = torch.empty(4 * MIB // 4)  # 3 MiB kept, 1 MiB fresh
    assert cache.stats().fresh_bytes == after.fresh_bytes + MIB
    again.fill_(1.0)
    assert again.sum().item() == MIB


def test_what_the_system_refuses_is_out_of_memory(cache):
    cache.start(1 << 40)
    with pytest.raises(torch.OutOfMemoryError, match="can't allocate memory"):
        torch.empty(1 << 46, dtype=torch.uint8)  # 64 TiB


def test_small_tensors_are_left_to_glibc(cache):
    cache.start(1 << 40)
    before = cache.stats()
    small = [torch.empty(1000) for _ in range(10)]  # 4000 bytes each
    del small
    after = cache.stats()
    assert (after.hits, after.misses, after.idle_bytes) == (before.hits, before.misses,
                                                             before.idle_bytes)


def test_what_is_kept_stays_within_the_limit(cache):
    cache.start(1 << 40)
    older = cache.stats().live_bytes  # tensors earlier tests of this process still hold
    cache.limit(older + 3 * MIB)
    held = [torch.empty(MIB // 4) for _ in range(5)]  # 5 MiB live: more than the limit
    del held
    s = cache.stats()
    assert s.live_bytes + s.idle_bytes <= older + 3 * MIB
    assert s.idle_bytes > 0
    released = s.released
    cache.limit(older + MIB)  # a lower limit gives back at once what it no longer allows
    s = cache.stats()
    assert s.idle_bytes <= MIB and s.released > released


def test_stop_gives_everything_back_and_live_tensors_stay_valid(cache):
    cache.start(1 << 40)
    live = torch.full((MIB // 4,), 7.0)
    kept = torch.empty(MIB // 4)
    del kept
    cache.stop()
    s = cache.stats()
    assert s.idle_bytes == 0
    assert torch.equal(live, torch.full((MIB // 4,), 7.0))
    del live  # freed after stop: straight back to the system
    assert cache.stats().idle_bytes == 0


def test_numbers_are_the_same_under_the_cache(cache):
    torch.manual_seed(0)
    x = torch.randn(256, 512)
    w = torch.randn(512, 512, requires_grad=True)
    cache.stop()
    plain = torch.tanh(x @ w).sum()
    plain.backward()
    plain_grad = w.grad.clone()
    w.grad = None
    cache.start(1 << 40)
    for _ in range(3):  # later rounds run on reused memory
        cached = torch.tanh(x @ w).sum()
        cached.backward()
        assert torch.equal(cached, plain) and torch.equal(w.grad, plain_grad)
        w.grad = None


def test_a_forked_child_can_allocate(cache):
    cache.start(1 << 40)
    kept = torch.empty(MIB // 4)
    del kept
    pid = os.fork()
    if pid == 0:  # the child: the lock must not be held, the kept block is its own copy
        try:
            torch.set_num_threads(1)  # GNU OpenMP's pool does not survive a fork
            t = torch.empty(MIB // 4)
            t[-1] = 3.0
            os._exit(0 if t[-1].item() == 3.0 else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0


def test_without_a_compiler_it_says_so_and_runs_without(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing built there
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setattr(cpu_cache, "_loaded", [])
    said: list[str] = []
    assert cpu_cache.load(said.append) is None
    assert len(said) == 1 and "no C++ compiler (no-such-compiler)" in said[0], said
    assert "KARMA_CPU_CACHE=0" in said[0]


def test_karma_cpu_cache_0_turns_it_off(monkeypatch):
    monkeypatch.setenv("KARMA_CPU_CACHE", "0")
    assert cpu_cache.load() is None


def test_the_runtime_reuses_memory_step_after_step_within_its_plan():
    from karma.testing.exactness import load_with_env, plan, run
    from tests.conftest import EXAMPLES

    # wide enough that its activations and weights are tensors of 64 KiB or more
    mf = load_with_env(EXAMPLES / "mlp.py", {"KARMA_MLP_WIDTH": "512", "KARMA_MLP_DEPTH": "4",
                                             "KARMA_MLP_IN": "256"})
    schedule = plan(mf, "keep_all", 1.1)
    lines: list[str] = []
    cache = cpu_cache.load()
    cache.start(1 << 40)
    older = torch.ones(4 * MIB)  # 16 MiB an earlier user of the process still holds
    report = run(schedule, mf, 3, log=lines.append)
    del older
    said = [line for line in lines if line.startswith("CPU cache:")]
    assert len(said) == 1, lines
    reused = int(re.match(r"CPU cache: (\d+)% of (\d+) tensors", said[0]).group(1))
    assert reused >= 30, said[0]  # steps 2 and 3 allocate what step 1 freed
    assert report.peak_device_bytes <= report.capacity_bytes


def test_the_first_step_keeps_a_reserve_for_what_the_process_grows():
    """[Note: the first step's reserve]: in step 1 the cache may keep FIRST_STEP_RESERVE_BYTES
    less than the plan's peak leaves it; from step 2 on (what grew is measured at the step's
    start) only STEP_RESERVE_BYTES less."""
    from types import SimpleNamespace

    from karma.runtime.host.cpu_cache import (
        FIRST_STEP_RESERVE_BYTES,
        STEP_RESERVE_BYTES,
        PlannedBound,
    )

    limits = []
    stats = SimpleNamespace(live_bytes=0, idle_bytes=0)
    cache = SimpleNamespace(stats=lambda: stats, limit=limits.append)
    bound = PlannedBound(cache, 100 * MIB, 800 * MIB, private=lambda: 130 * MIB)  # 30 outside
    bound.bound(0)
    bound.bound(1)
    assert limits == [770 * MIB - FIRST_STEP_RESERVE_BYTES, 770 * MIB - STEP_RESERVE_BYTES]
    assert bound.outside_bytes == 30 * MIB  # what step 2 found outside at its start
    bound.peak_bytes = 100 * MIB  # later steps: 1% of a small plan
    bound.bound(1)
    assert limits[-1] == 70 * MIB - MIB
    bound.peak_bytes = 10 * MIB  # a reserve larger than the plan
    bound.bound(0)
    assert limits[-1] == 0
