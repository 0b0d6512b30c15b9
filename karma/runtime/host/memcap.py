"""The CPU backend's hard cap, from the plan: this process's data segment held to what the
schedule needs (karma-run --cap-memory).

    cap = DataCap(baseline_bytes, threads_bytes, schedule.predicted.peak_device_bytes)
    limit, restore = apply(cap)   # setrlimit(RLIMIT_DATA), what `prlimit --data` sets
    restore()                     # the limit the process had before

[Note: the hard cap from the plan] RLIMIT_DATA caps a process's private writable mappings
(its VmData: the heap, anonymous mappings, thread stacks), so PyTorch's CPU allocator fails
with a clear out-of-memory error past it; shared file mappings, the host tier's, do not
count. What a schedule needs of it, all measured in this process but the peak:
- its fixed cost: VmData before the model is built (the interpreter, torch, karma, the
  model file's first optimizer, the compute thread's OpenMP team), bring-up's
  baseline_data_bytes;
- karma's threads: VmData that starting the four stream workers and their OpenMP teams
  added. A thread's stack is mapped whole (8 MiB with the usual `ulimit -s`) and counts in
  full, touched or not: on 16 cores the teams come to about 70 threads, over 500 MiB. A team
  starts at its thread's first parallel op, and under a cap that leaves no room for its
  stacks libgomp ends the process ("libgomp: Thread creation failed") where plain PyTorch,
  with one team, survives. So bring-up starts every team, at its full size,
  before the cap (threads.start_thread_pool), and measures what they took;
- the schedule's predicted peak of private memory above the baseline (what --gpu-mem
  budgets), the process's own share outside its tensors included where it was measured;
- SLACK_BYTES: what VmData holds beyond resident private memory and beyond what the plan
  counts (glibc's per-thread malloc arenas, tensors and Python objects that checkpoints,
  evaluation and the first step make, a watchdog thread's stack); the 128 MiB with which
  `make demo` and bench/out_of_core.py have run every plan under `prlimit --data`.
The host tier's bytes are a file in /dev/shm by default: RAM that the cap does not count
(storage.py, [Note: the CPU tier lives in memory where it can]); KARMA_TIER_DIR puts it on
a disk.
"""

from __future__ import annotations

import resource
from collections.abc import Callable
from dataclasses import dataclass

from karma.units import format_bytes

SLACK_BYTES = 128 << 20


@dataclass(frozen=True)
class DataCap:
    """What this process's data segment is capped at, part by part ([Note: the hard cap
    from the plan])."""

    baseline_bytes: int  # VmData before the model: the process's fixed cost
    threads_bytes: int  # VmData karma's stream workers and their OpenMP teams added
    peak_bytes: int  # the schedule's predicted peak of private memory above the baseline
    slack_bytes: int = SLACK_BYTES

    @property
    def limit_bytes(self) -> int:
        return self.baseline_bytes + self.threads_bytes + self.peak_bytes + self.slack_bytes

    def text(self, tier_bytes: int, tier_dir: str, tier_in_memory: bool) -> str:
        """The one line karma-run prints: the limit, its parts, and where the host tier's
        `tier_bytes` are."""
        where = (f"RAM in {tier_dir} (a tmpfs), which the cap does not count; "
                 "KARMA_TIER_DIR=/path/on/disk puts it on a disk" if tier_in_memory
                 else f"a file on disk in {tier_dir}, outside the cap")
        return (f"capping this process's data at {format_bytes(self.limit_bytes)} "
                f"(RLIMIT_DATA, as prlimit --data={self.limit_bytes}): its fixed cost "
                f"{format_bytes(self.baseline_bytes)} + karma's threads "
                f"{format_bytes(self.threads_bytes)} + the plan's peak "
                f"{format_bytes(self.peak_bytes)} + slack {format_bytes(self.slack_bytes)}; "
                f"the host tier, {format_bytes(tier_bytes)}, is {where}")


def apply(cap: DataCap) -> tuple[int, Callable[[], None]]:
    """Cap this process's data segment at `cap.limit_bytes` (the soft limit, never above the
    hard one: where that is already lower, it stays the cap); returns the limit set and what
    restores the one the process had."""
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = cap.limit_bytes if hard == resource.RLIM_INFINITY else min(cap.limit_bytes, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    return limit, lambda: resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
