"""The host tier: where swapped activations, host master weights, host gradients and host
optimizer state live.

On the CPU backend the tier is file-backed (`torch.from_file(..., shared=True)` in a temporary
directory): shared file mappings do not count against the process's private memory, so a
hard cap on private memory (`prlimit --data`) caps only what the schedule calls device memory.
On CUDA the tier is pinned host memory. Either way it is a pool carved out of a few large
arenas sized from the schedule, so that nothing is allocated per tensor.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import os
import sys
import tempfile
import threading
from pathlib import Path

import torch

from karma.errors import KarmaError
from karma.storage import write_failure

ALIGN = 64  # bytes


def pool_bytes(host_bytes: int) -> int:
    """The host tier a schedule's `host_bytes` start with: 10% and 64 MiB to spare."""
    return int(host_bytes * 1.1) + (64 << 20)


class HostPool:
    """A first-fit allocator over large host arenas (file-backed or pinned). Thread-safe:
    the copy streams and the host optimizer allocate and free from their own threads."""

    def __init__(self, initial_bytes: int, kind: str = "file", directory: str | None = None):
        if kind not in ("file", "pinned", "plain"):
            raise ValueError(f"host pool kind {kind!r}")
        self.kind = kind
        self._dir = (directory or tempfile.gettempdir()) if kind == "file" else None
        self._arenas: list[torch.Tensor] = []
        self._free: list[list[tuple[int, int]]] = []  # per arena: sorted (offset, size)
        self.used_bytes = 0
        self.peak_bytes = 0
        self._lock = threading.Lock()
        self._grow(max(initial_bytes, 1 << 20))

    @property
    def directory(self) -> str | None:
        """Where a file-backed pool makes its arenas' files (each in a directory of its own,
        gone with the file's name once it is mapped)."""
        return self._dir

    @property
    def capacity_bytes(self) -> int:
        return sum(a.numel() for a in self._arenas)

    def empty(self, shape, dtype: torch.dtype, stride=None) -> torch.Tensor:
        """A host tensor of `shape` and `dtype` (uninitialised), contiguous or with `stride`
        (which must be dense: a permutation of the contiguous strides)."""
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        with self._lock:
            arena, offset = self._alloc(max(nbytes, 1))
        t = torch.empty(0 if nbytes else shape, dtype=dtype)  # no bytes of its own
        if nbytes:
            # [Note: a version counter of its own] set_ makes a tensor over the arena's bytes
            # that is not a view of the arena: a view would share the arena's version
            # counter, so that writing any slot (a host gradient, a master) would look to
            # autograd like an in-place change of every other, weights built in the tier
            # (BuildInTier) included.
            t.set_(self._arenas[arena].untyped_storage(), offset // t.element_size(), shape,
                   stride if stride is not None else _contiguous_strides(shape))
        t._karma_slot = (arena, offset, _aligned(max(nbytes, 1)))  # noqa: SLF001
        return t

    def reset_peak(self) -> int:
        """Start counting the peak again from what is held now; the peak until now."""
        with self._lock:
            peak, self.peak_bytes = self.peak_bytes, self.used_bytes
        return peak

    def copy_of(self, t: torch.Tensor) -> torch.Tensor:
        out = self.empty(t.shape, t.dtype)
        out.copy_(t)
        return out

    def free(self, t: torch.Tensor) -> None:
        arena, offset, size = t._karma_slot  # noqa: SLF001
        del t._karma_slot  # noqa: SLF001
        with self._lock:
            self._release(arena, offset, size)

    def _release(self, arena: int, offset: int, size: int) -> None:
        self.used_bytes -= size
        free = self._free[arena]
        pos = bisect.bisect(free, (offset, size))
        free.insert(pos, (offset, size))
        # merge with neighbours
        if pos + 1 < len(free) and free[pos][0] + free[pos][1] == free[pos + 1][0]:
            free[pos] = (offset, free[pos][1] + free[pos + 1][1])
            del free[pos + 1]
        if pos > 0 and free[pos - 1][0] + free[pos - 1][1] == free[pos][0]:
            free[pos - 1] = (free[pos - 1][0], free[pos - 1][1] + free[pos][1])
            del free[pos]

    def close(self) -> None:
        self._arenas.clear()
        self._free.clear()

    def _alloc(self, nbytes: int) -> tuple[int, int]:
        size = _aligned(nbytes)
        for arena, free in enumerate(self._free):
            for k, (offset, room) in enumerate(free):
                if room >= size:
                    if room == size:
                        del free[k]
                    else:
                        free[k] = (offset + size, room - size)
                    self.used_bytes += size
                    self.peak_bytes = max(self.peak_bytes, self.used_bytes)
                    return arena, offset
        self._grow(max(size, self.capacity_bytes // 2), request=size)
        return self._alloc(nbytes)

    def _grow(self, nbytes: int, request: int = 0) -> None:
        nbytes = _aligned(nbytes)
        if self.kind == "file":
            arena = unnamed_file_mapping(self._dir, nbytes, f"arena{len(self._arenas)}.bin",
                                         reserve="the host tier's file")
        elif self.kind == "pinned":
            for size in pinned_arena_sizes(nbytes, request):
                self._arenas.append(torch.empty(size, dtype=torch.uint8, pin_memory=True))
                self._free.append([(0, size)])
            return
        else:
            arena = torch.empty(nbytes, dtype=torch.uint8)
        self._arenas.append(arena)
        self._free.append([(0, nbytes)])


# [Note: the tier's disk is taken when it grows] A shared mapping of a sparse file takes a
# block of disk only when a page is first written, and a write fault that finds the disk full
# (or the file past `ulimit -f`) kills the process with SIGBUS, in the middle of a step, on
# whichever thread touched the page. posix_fallocate takes the arena's blocks when it is made
# (on ext4 and xfs without writing them: unwritten extents), so a full disk is an ENOSPC (or
# EDQUOT, EFBIG) here, which stops the run with the path and what to free. The tier then
# holds its whole size on disk, not only the pages written: the pool's size is the schedule's
# host_bytes plus 10%, which the planner meant to use anyway.

def unnamed_file_mapping(directory: str, nbytes: int, name: str,
                         prefix: str = "karma-tier-", reserve: str | None = None) -> torch.Tensor:
    """A shared mapping (uint8) of a new file `name` of `nbytes`, in a directory of its own
    (`prefix`) in `directory`. The file's name and its directory go as soon as it is mapped,
    so its memory goes with the tensor, even if the process is killed (a file left in
    /dev/shm would hold its RAM until a reboot). `reserve`: take the file's blocks first
    ([Note: the tier's disk is taken when it grows]), naming it so in a failure."""
    with tempfile.TemporaryDirectory(prefix=prefix, dir=directory) as made:
        path = Path(made) / name
        if reserve is not None:
            reserve_file(path, nbytes, reserve)
        mapping = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
        os.unlink(path)
    return mapping


def reserve_file(path: Path, nbytes: int, what: str, mode: str = "wb") -> None:
    """Create `path` with `nbytes` of disk taken ([Note: the tier's disk is taken when it
    grows]); a full disk is a KarmaError naming `what`, the path and the fix, and leaves no
    file behind. mode "xb": the file must not exist yet."""
    try:
        with open(path, mode) as f:
            os.posix_fallocate(f.fileno(), 0, nbytes)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise KarmaError(write_failure(
            what, path, e, nbytes,
            "set KARMA_TIER_DIR to a directory on a filesystem with more room")) from e


PINNED_ARENA_BYTES = 1 << 30


def pinned_arena_sizes(nbytes: int, request: int = 0) -> list[int]:
    """Pinned arenas to grow by `nbytes` so that a slot of `request` bytes fits.

    PyTorch's pinned allocator rounds every allocation up to a power of two, so the pool pins
    powers of two: arenas of 1 GiB (a smaller power of two when less is needed), or one arena
    of the next power of two for a request beyond 1 GiB, instead of paying for up to twice
    what it asked.
    """
    if request > PINNED_ARENA_BYTES:
        return [_power_of_two(request)]
    if nbytes <= PINNED_ARENA_BYTES:
        return [_power_of_two(max(nbytes, 1))]
    return [PINNED_ARENA_BYTES] * -(-nbytes // PINNED_ARENA_BYTES)


def _power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(tuple(shape)):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def return_freed_memory_promptly() -> None:
    """[Note: glibc keeps freed memory] glibc raises its mmap threshold as large blocks are
    freed, after which big tensors come from the heap and their memory stays with the process
    when freed: the process's private memory then tracks its past peak, not what it holds.
    Pinning the threshold (64 KiB) and the trim threshold (128 KiB) makes freed tensors go
    back to the system, so that a memory cap holds what the schedule planned. Each such
    tensor is then faulted in afresh: see [Note: huge pages for large tensors] in
    karma/cli/common.py for what keeps that cheap."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return  # not glibc: nothing to tune
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 64 << 10)
    libc.mallopt(m_trim_threshold, 128 << 10)


def private_bytes() -> int:
    """This process's private (anonymous) resident memory, from /proc/self/status."""
    return _status_kib("RssAnon:") * 1024


def data_bytes() -> int:
    """This process's data segment (VmData): what `prlimit --data` caps."""
    return _status_kib("VmData:") * 1024


def _status_kib(key: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class BuildInTier(torch.overrides.TorchFunctionMode):
    """While the model is built: large CPU tensors from factory functions go to the host tier.

    [Note: building a model larger than memory] The reference order builds the whole model on
    the CPU (so that its initial weights do not depend on the device), and a model's weights
    may not fit in the memory the schedule allows. Under this mode `torch.empty`, `zeros`,
    `ones`, `rand`, `randn` and `full` of at least `min_bytes` on the CPU fill a slot of the
    host tier through their `out=` form: the same kernel and the same draws from the RNG, so
    the values are bit for bit those of a plain build. The engine then moves each weight where
    its block's decisions put it (`adopt`), and frees the slot.
    """

    FACTORIES = ("empty", "zeros", "ones", "rand", "randn", "full")

    def __init__(self, pool: HostPool, min_bytes: int = 1 << 20):
        super().__init__()
        self.pool = pool
        self.min_bytes = min_bytes
        self.slots: dict[int, torch.Tensor] = {}  # data_ptr -> the pool tensor that owns it
        self._factories = {getattr(torch, name) for name in self.FACTORIES}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func not in self._factories or not args or not self._eligible(kwargs):
            return func(*args, **kwargs)  # (sizes given as size=...: left as they are)
        sizes = args[:-1] if func is torch.full else args
        fill = args[-1:] if func is torch.full else ()
        shape = tuple(sizes[0]) if len(sizes) == 1 and not isinstance(sizes[0], int) \
            else tuple(sizes)
        dtype = kwargs.pop("dtype", None) or (torch.get_default_dtype() if func is not torch.full
                                              or isinstance(fill[0], float) else None)
        numel = 1
        for s in shape:
            numel *= s
        if dtype is None or numel * torch.empty((), dtype=dtype).element_size() < self.min_bytes:
            return func(*args, **({"dtype": dtype} if dtype else {}), **kwargs)
        requires_grad = kwargs.pop("requires_grad", False)
        kwargs.pop("device", None)
        out = self.pool.empty(shape, dtype)
        func(shape, *fill, out=out, **kwargs)
        self.slots[out.data_ptr()] = out
        return out.requires_grad_(requires_grad)

    @staticmethod
    def _eligible(kwargs: dict) -> bool:
        device = kwargs.get("device")
        return (device is None or torch.device(device).type == "cpu") and kwargs.get(
            "layout", torch.strided) == torch.strided and not kwargs.get("pin_memory") and \
            kwargs.get("memory_format") in (None, torch.contiguous_format) and "out" not in kwargs

    def release_unused(self) -> int:
        """Free the slots of tensors built here that nothing holds any more (a weight the
        model replaced while it was built: an output layer's own weight before it is tied to
        the embedding's); their bytes."""
        freed = 0
        for ptr in list(self.slots):
            owner = self.slots[ptr]
            if sys.getrefcount(owner) <= 3:  # this dict, `owner`, getrefcount's argument
                del self.slots[ptr]
                freed += owner.numel() * owner.element_size()
                self.pool.free(owner)
        return freed

    def adopt(self, t: torch.Tensor) -> torch.Tensor | None:
        """The pool tensor `t` was built in (and is a view of), or None; forgotten here."""
        owner = self.slots.pop(t.data_ptr(), None)
        if owner is not None and (owner.shape != t.shape or owner.dtype != t.dtype):
            self.slots[t.data_ptr()] = owner  # a view of part of it: not a weight of its own
            return None
        return owner
