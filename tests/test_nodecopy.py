"""The node's copy of the weights (runtime/host/nodecopy.py) on CUDA, with the driver faked: pinned
where it pins, unpinned with one warning where it refuses (as it refuses a shared mapping of a
file on a disk's filesystem: [Note: the node's copy of the weights])."""

from __future__ import annotations

import pytest
import torch

from karma.runtime.distributed.process_group import SINGLE
from karma.runtime.host import nodecopy
from karma.runtime.host.nodecopy import NodeCopy


class FakeDriver:
    """torch.cuda.cudart() as far as NodeCopy uses it, answering `error` to every register."""

    def __init__(self, error: int):
        self.error = error
        self.registered: list[int] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        if self.error == 0:
            self.registered.append(ptr)
        return self.error

    def cudaHostUnregister(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        return 0


@pytest.fixture
def node_copy(tmp_path, monkeypatch):
    """NodeCopy on one rank (no process group: the name's broadcast is a no-op there)."""
    monkeypatch.setattr(nodecopy.dist, "broadcast_object_list", lambda objects, src: None)

    def make(driver: FakeDriver, notes: list[str]) -> NodeCopy:
        monkeypatch.setattr(torch.cuda, "cudart", lambda: driver)
        return NodeCopy(1 << 16, SINGLE, str(tmp_path), pinned=True, timeout_s=10.0,
                        log=notes.append)

    return make


def test_the_node_copy_is_pinned_where_the_driver_pins_it(node_copy, tmp_path):
    driver, notes = FakeDriver(0), []
    node = node_copy(driver, notes)
    weights = node.empty((16, 16), torch.float32)
    weights.fill_(2.0)
    assert driver.registered and not notes
    assert not list(tmp_path.iterdir())  # unlinked once mapped: the mapping stays
    node.close()
    assert driver.unregistered == driver.registered


def test_the_node_copy_runs_unpinned_where_the_driver_refuses(node_copy):
    driver, notes = FakeDriver(1), []  # cudaErrorInvalidValue, as for a file in /tmp on ext4
    node = node_copy(driver, notes)
    weights = node.empty((16, 16), torch.float32)
    weights.fill_(2.0)
    assert weights.sum().item() == 512.0
    assert len(notes) == 1 and notes[0].startswith(
        "warning: the driver does not pin the node's copy of the weights in ")
    assert "(CUDA error 1)" in notes[0] and "KARMA_TIER_DIR" in notes[0]
    node.close()
    assert driver.unregistered == []  # nothing was registered
