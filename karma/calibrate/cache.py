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

CACHE_VERSION = 8  # bump when what a cache file holds changes meaning (3: in context; 4: scaled
# to the median step; 5: with the process's bytes outside its tensors; 6: with the loss's time;
# 7: with the side streams' fractions fitted to a probe; 8: each copy's own, and their wait)


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
