"""One copy of the whole weights per node, shared by the node's ranks (sharded host state).

[Note: the node's copy of the weights] With sharded host state each rank keeps 1/N of the
masters, gradients and optimizer state, but every rank's device copies are filled from the
whole weights (params/layout.py). The ranks of one node would hold that copy once each, 4 bytes a
parameter times the ranks of the node; instead they map one file together (the planner
counts it once a node: planner/host_state.py, [Note: host state per rank and per node]). The node's
first rank (LOCAL_RANK 0; torchrun sets LOCAL_RANK, LOCAL_WORLD_SIZE and GROUP_RANK, the
node's number) creates it in the host tier's directory, under a name every rank agrees on,
and takes its blocks (posix_fallocate, as the tier does: tier.py, [Note: the tier's disk is
taken when it grows]); the others map it once it exists, and it is unlinked once all have
(the mappings stay). On CUDA the mapping is registered as pinned memory (cudaHostRegister),
so that copies from it are asynchronous, as the tier's pinned arenas are. The driver pins
shared memory (a file in a tmpfs, /dev/shm) but refuses a writable mapping of a file on a
disk's filesystem (CUDA error 1, invalid value, seen on an H200 machine with the file in
/tmp), so on CUDA the file goes to /dev/shm unless KARMA_TIER_DIR says otherwise
(bringup.py). Where the driver refuses, the run goes on with the copy unpinned (its copies
to the device then wait for the host) and says so.

Every rank of the node writes the same values into it: each all-gathers every shard into
the whole copy itself, so none depends on another's write having landed, and what they
write at once is bit for bit the same. No rank reads a block's weights while another writes
them: a block's all-gather completes on no rank before every rank has entered it, after
its last read of the block's weights in the replay (the backward of the block, and of
any block sharing its weights, comes first), and a rank's next read waits for its own
all-gather (engine: fetch_waits, forward_waits).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from karma.errors import KarmaError
from karma.runtime.distributed import process_group
from karma.runtime.distributed.process_group import Ranks
from karma.runtime.host.tier import ALIGN, _contiguous_strides, reserve_file


class NodeCopy:
    """An arena of `nbytes` shared by the node's ranks; `empty` carves it in call order (the
    same on every rank)."""

    def __init__(self, nbytes: int, ranks: Ranks, directory: str, pinned: bool,
                 timeout_s: float, log: Callable[[str], None]):
        local_rank = _env_int("LOCAL_RANK", 0)
        node = os.environ.get("GROUP_RANK", "0")
        key = [uuid.uuid4().hex if ranks.main else None]
        dist.broadcast_object_list(key, src=0)  # every rank of every node: one name a run
        path = Path(directory) / f"karma-weights-{key[0]}-node{node}.bin"
        self.nbytes = max(nbytes, ALIGN)
        if local_rank == 0:
            reserve_file(path, self.nbytes, "the node's copy of the weights", mode="xb")
        process_group.barrier(ranks, "creating the node's copy of the weights", timeout_s)
        try:
            self._arena = torch.from_file(str(path), shared=True, size=self.nbytes,
                                          dtype=torch.uint8)
        except RuntimeError as e:
            raise KarmaError(f"cannot map the node's copy of the weights {path}: {e}; every "
                             "rank of a node must see the same KARMA_TIER_DIR") from e
        process_group.barrier(ranks, "mapping the node's copy of the weights", timeout_s)
        if local_rank == 0:
            with contextlib.suppress(OSError):
                os.unlink(path)
        self._pinned = False
        if pinned:
            err = int(torch.cuda.cudart().cudaHostRegister(self._arena.data_ptr(),
                                                           self.nbytes, 0))
            if err == 0:
                self._pinned = True
            elif ranks.main:
                log(f"warning: the driver does not pin the node's copy of the weights in "
                    f"{directory} (CUDA error {err}); its copies to the GPU will wait for the "
                    "host. Set KARMA_TIER_DIR to a tmpfs such as /dev/shm")
        self._offset = 0
        self.ranks_here = max(1, _env_int("LOCAL_WORLD_SIZE", 1))

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of `shape` in the arena, at the next aligned offset."""
        numel = 1
        for s in shape:
            numel *= s
        t = torch.empty(0, dtype=dtype)
        nbytes = numel * t.element_size()
        if self._offset + nbytes > self.nbytes:
            raise RuntimeError(f"the node's copy of the weights holds {self.nbytes} bytes, "
                               f"not {self._offset + nbytes}")  # sized by whole_bytes
        t.set_(self._arena.untyped_storage(), self._offset // t.element_size(), shape,
               _contiguous_strides(shape))
        self._offset += -(-nbytes // ALIGN) * ALIGN
        return t

    @property
    def share_bytes(self) -> int:
        """This rank's share of the arena (the node's ranks hold it together)."""
        return self.nbytes // self.ranks_here

    def close(self) -> None:
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self._arena.data_ptr())
            self._pinned = False
        self._arena = None


def whole_bytes(shapes: list[tuple[torch.Size, torch.dtype]], world_size: int) -> int:
    """What NodeCopy.empty takes for the whole weights of parameters of these shapes, each
    padded to world_size equal parts of dim 0 (distributed/cut.py)."""
    total = 0
    for shape, dtype in shapes:
        dim0 = shape[0] if len(shape) else 1
        rows = max(1, -(-dim0 // world_size))
        row = 1
        for s in shape[1:]:
            row *= s
        nbytes = rows * world_size * row * torch.empty(0, dtype=dtype).element_size()
        total += -(-nbytes // ALIGN) * ALIGN
    return total


def _env_int(key: str, default: int) -> int:
    try:
        return int(os.environ.get(key, default))
    except ValueError:
        raise KarmaError(f"{key}={os.environ[key]!r} is not a whole number; launch with "
                         "torchrun, which sets it") from None
