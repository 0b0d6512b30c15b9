"""Where files go and what to say when a disk is full: the host tier's directory, the
filesystem a path is on, the room left there, and one line for a write that failed.
"""

from __future__ import annotations

import errno
import os
import resource
import tempfile
from pathlib import Path

from karma.units import format_bytes

# the write failed for want of room: on the filesystem, in a quota, or under `ulimit -f`
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)

MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")
SHARED_MEMORY_DIR = "/dev/shm"


def tier_directory(need_bytes: int = 0, memory_bytes: int | None = None,
                   shm: str = SHARED_MEMORY_DIR) -> str:
    """Where the CPU backend's host tier file goes: `$KARMA_TIER_DIR` if set; else `shm`
    when it is a tmpfs or ramfs with room for `need_bytes` (and, if given, `memory_bytes` of
    memory available for them); else the temporary directory.

    [Note: the CPU tier lives in memory where it can] The tier is a shared mapping of a
    file, which does not count as the process's private memory (what `prlimit --data` caps).
    On a disk's filesystem the kernel writes its dirty pages back: the host optimizer
    rewrites the masters and AdamW's state every step, gigabytes of writeback for GPT-2
    medium, and every page it writes again after a writeback faults to be made writable.
    GPT-2 medium (seq 128, batch 4) at 2 GiB took 24.4 s a step with the tier in /tmp
    (ext4), the host steps 10.5 s of it where the same AdamW steps take 1.2 s in RAM; with
    the tier in /dev/shm, 17.8 s. A tmpfs's pages are memory, as a GPU machine's pinned
    host memory is, and are never written back."""
    chosen = os.environ.get("KARMA_TIER_DIR")
    if chosen:
        return chosen
    room = free_bytes(shm) if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
    if (room is not None and room >= need_bytes and filesystem_type(shm) in MEMORY_FILESYSTEMS
            and (memory_bytes is None or memory_bytes >= need_bytes)):
        return shm
    return tempfile.gettempdir()


def filesystem_type(path: str, mounts: str = "/proc/self/mounts") -> str | None:
    """The type of the filesystem `path` is on ("ext4", "tmpfs"), from the longest mount
    point that contains it; None where unknown."""
    real = os.path.realpath(path)
    best, kind = "", None
    try:
        with open(mounts, encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                # mount points escape spaces and the like as octal: "\040"
                point = fields[1].encode().decode("unicode_escape")
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, fields[2]
    except OSError:
        return None
    return kind


def free_bytes(path: str | Path) -> int | None:
    """Bytes an unprivileged process may still write on the filesystem that holds `path` (or
    its nearest existing parent), or None where it cannot be told."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def write_failure(what: str, path: str | Path, e: OSError, need_bytes: int | None,
                  elsewhere: str) -> str:
    """One line for a write of `what` at `path` that failed with `e`: why, and what to free
    or change. `need_bytes`: about how much the write needs; `elsewhere`: the other way out
    ("choose another --checkpoint-dir")."""
    reason = e.strerror or str(e)
    need = f"about {format_bytes(need_bytes)}" if need_bytes else "space"
    if e.errno == errno.EFBIG:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        size = "" if limit == resource.RLIM_INFINITY else f" of {format_bytes(limit)}"
        return (f"cannot write {what} {path}: {reason}: a file would pass this process's "
                f"file-size limit{size} (ulimit -f); raise the limit, or {elsewhere}")
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        free = free_bytes(path)
        has = f" ({format_bytes(free)} free there)" if free is not None else ""
        quota = " or your quota there" if e.errno == errno.EDQUOT else ""
        return (f"cannot write {what} {path}: {reason}{has}; free {need} on its "
                f"filesystem{quota}, or {elsewhere}")
    return f"cannot write {what} {path}: {reason}; {elsewhere}"
