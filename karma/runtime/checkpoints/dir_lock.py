"""One run writes a checkpoint directory at a time.

    lock = DirectoryLock(directory)     # rank 0, before the run's first checkpoint or resume
    problem = lock.acquire()            # None, or why another run holds it (the run stops)
    ...
    lock.release()

[Note: one writer a checkpoint directory] Two runs writing step_N into one directory
replace each other's checkpoints (a rerun of a step replaces it, checkpoint.py), and one
started at the same moment removed the other's half-written .step_N.tmp. The first run
takes an exclusive flock on DIR/.karma-run.lock; a second finds it held and stops before it
trains. The kernel lets go of a flock when its process ends, however it ends (SIGKILL
included), so a killed run never leaves the directory locked. Holding the lock, the run
removes what a killed run's checkpoint write left hidden (.step_N.tmp, .step_N.old<pid>):
whole-checkpoint-sized copies that nothing else would remove.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

LOCK_NAME = ".karma-run.lock"
LEFT_BY_A_KILLED_WRITE = (".step_*.tmp", ".step_*.old*")


class DirectoryLock:
    """The exclusive lock of one checkpoint directory, for one run."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._file = None

    def acquire(self) -> str | None:
        """Take the lock and clear what killed writes left; or, where another run holds
        it, why this run cannot go on (and the lock is not taken)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        f = open(self.directory / LOCK_NAME, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            return (f"another karma-run ({holder}) is writing checkpoints in {self.directory}; "
                    "wait for it to end, or choose another --checkpoint-dir")
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()}\n")
        f.flush()
        self._file = f
        for pattern in LEFT_BY_A_KILLED_WRITE:
            for stale in self.directory.glob(pattern):
                shutil.rmtree(stale, ignore_errors=True)
        return None

    def release(self) -> None:
        if self._file is not None:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None
