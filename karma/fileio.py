"""Writing files so that a reader never sees half of one."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from karma.errors import KarmaError


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
