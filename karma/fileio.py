"""Writing files so that a reader never sees half of one."""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import tempfile
from pathlib import Path

from karma.errors import KarmaError
from karma.units import format_bytes

# the write failed for want of room: on the filesystem, in a quota, or under `ulimit -f`
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def cache_dir() -> Path:
    """$XDG_CACHE_HOME/karma, or ~/.cache/karma: measurements and built extensions."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "karma"


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write `text` to a temporary file beside `path`, then rename it over `path`: a crash
    leaves the old file or the new one, never a part."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise KarmaError(f"cannot write {path}: {e.strerror}; choose another path") from e
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes the file private (0600)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise KarmaError(f"cannot write {path}: {e.strerror}; choose another path") from e


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
