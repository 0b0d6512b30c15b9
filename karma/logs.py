"""karma's notes through `logging`: the library logs, the commands print.

The library writes its notes (a Hugging Face KV cache turned off, this machine measured, a
measurement that failed and was worked around) to the `karma` logger and prints nothing
itself. A note is INFO, or WARNING where the plan had to do without something it tried
(a failed measurement, a cache it could not write): what a user may want to act on. So a
program that configures no logging sees only the warnings (Python's last resort prints
them to stderr), and `logging.basicConfig(level=logging.INFO)` shows every note. The
commands print every note to stderr as `PROG: note: MESSAGE` (`printing_notes`), as they
always have.

    from karma.logs import note
    note("measuring this machine")          # INFO on the karma logger

    with printing_notes("karma-plan"):      # what each command's boundary does (cli/common.py)
        ...
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
from collections.abc import Callable, Iterator

LOGGER = logging.getLogger("karma")

# a note that says the plan did without something it tried: a WARNING
_WORKED_AROUND = re.compile(r"\bfailed\b|^could not\b")


def note(message: str) -> None:
    """Log one note on the `karma` logger: WARNING if it says something failed and was
    worked around, else INFO."""
    level = logging.WARNING if _WORKED_AROUND.search(message) else logging.INFO
    LOGGER.log(level, message)


@contextlib.contextmanager
def printing_notes(prog: str) -> Iterator[None]:
    """While inside, every note of the `karma` logger (INFO and up) is printed to stderr as
    `PROG: note: MESSAGE`; the logger's level and handlers are restored after."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{prog}: note: %(message)s"))
    level = LOGGER.level
    LOGGER.addHandler(handler)
    LOGGER.setLevel(logging.INFO)
    try:
        yield
    finally:
        LOGGER.removeHandler(handler)
        LOGGER.setLevel(level)


# numbers, and hashes in cache file names: what tells apart the notes of a search's points
_VARYING = re.compile(r"[0-9a-f]{12,}|\d+(?:\.\d+)?")


class OncePerKind:
    """A log for a search over many plans (a sweep, a batch search): it passes on the first
    note of each kind and counts the rest. Notes that differ only in their numbers (the
    batch, a duration, a cache file's hash) are one kind: "timing the blocks ... (cpu,
    batch 8 ...)" is said for the first batch timed, not for every one."""

    def __init__(self, log: Callable[[str], None]):
        self.log = log
        self.kinds: set[str] = set()
        self.left_out = 0

    def __call__(self, message: str) -> None:
        kind = _VARYING.sub("#", message)
        if kind in self.kinds:
            self.left_out += 1
            return
        self.kinds.add(kind)
        self.log(message)

    def finish(self, points: str = "points") -> None:
        """Say how many notes were left out, if any (`points`: what the search planned)."""
        if self.left_out:
            self.log(f"{self.left_out} more note(s) like those above, for the other {points} "
                     "planned, left out")
