"""Writing files so that a reader never sees half of one."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from karma.errors import KarmaError


def cache_dir() -> Path:
    """$XDG_CACHE_HOME/karma, or ~/.cache/karma: measurements and built extensions."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "karma"


@contextlib.contextmanager
def replaced_atomically(path: str | Path) -> Iterator[Path]:
    """A temporary file beside `path` to write, renamed over `path` (its bytes and its
    directory entry synced) when the block ends, removed when it raises: a crash leaves the
    old file or the new one, never a part.

        with replaced_atomically("model.pt") as tmp:
            torch.save(state, tmp)
    """
    path = Path(path)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes the file private (0600)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write `text` to `path` atomically (replaced_atomically); a failure is a KarmaError."""
    path = Path(path)
    try:
        with replaced_atomically(path) as tmp:
            tmp.write_text(text, encoding="utf-8")
    except OSError as e:
        raise KarmaError(f"cannot write {path}: {e.strerror}; choose another path") from e
