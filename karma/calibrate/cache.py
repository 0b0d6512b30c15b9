"""The calibration cache: JSON files under $XDG_CACHE_HOME/karma (default ~/.cache/karma),
each named by a hash of everything its numbers depend on.

A file that cannot be read, or whose contents do not check out, is measured again, never an
error; one that cannot be written is measured again next time.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from karma.errors import KarmaError
from karma.fileio import cache_dir, write_text_atomic

# part of every cache file's key: bump it when what a file holds changes meaning, so that
# files written before are measured again
CACHE_VERSION = 11


def cache_path(kind: str, key: dict) -> Path:
    """The file of `kind` ("machine", "blocks") for `key`."""
    text = json.dumps({"version": CACHE_VERSION, **key}, sort_keys=True)
    return cache_dir() / f"{kind}-{hashlib.sha256(text.encode()).hexdigest()[:20]}.json"


def read(path: Path) -> dict:
    """The cache file's JSON object, or {} when it is missing or unreadable."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write(path: Path, data: dict, say: Callable[[str], None]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps({"version": CACHE_VERSION, **data}, indent=1) + "\n")
    except (OSError, KarmaError) as e:
        say(f"could not cache the measurement in {path} ({e}); it is measured again next time")
