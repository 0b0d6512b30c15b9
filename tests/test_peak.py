"""The CPU backend's peak meter: private memory sampled from a child process."""

from __future__ import annotations

import time

import torch

from karma.runtime.host.peak import PrivatePeak
from karma.runtime.host.tier import private_bytes

MIB = 1 << 20


def _touch_and_free(nbytes: int, hold_s: float) -> None:
    t = torch.empty(nbytes, dtype=torch.uint8)
    t.fill_(1)  # resident now
    time.sleep(hold_s)
    del t


def test_a_transient_allocation_inside_a_step_is_caught():
    meter = PrivatePeak(private_bytes())
    try:
        assert meter._child is not None  # noqa: SLF001 - on Linux the sampler runs
        meter.start()
        _touch_and_free(256 * MIB, 0.05)  # gone before stop(): only sampling sees it
        peak = meter.stop()
        assert peak >= 200 * MIB, peak
        meter.start()  # a new step starts from what the process holds now
        quiet = meter.stop()
        assert quiet < 64 * MIB, quiet
        assert meter.peak >= peak
    finally:
        meter.close()


def test_the_sampler_exits_with_close_and_is_not_a_zombie():
    meter = PrivatePeak(private_bytes())
    child = meter._child  # noqa: SLF001
    meter.close()
    assert child is not None and child.poll() is not None
    meter.close()  # idempotent
    meter.start()  # without a sampler: step boundaries only, never an error
    assert meter.stop() >= 0
