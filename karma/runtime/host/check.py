"""Host memory checked at the runtime's start: what the schedule needs of the host against
what this machine has, before anything is allocated.

    need = measure_host_memory(schedule, backend.name)
    problem = host_memory_problem(need)   # a message naming the numbers, or None

[Note: where the host tier's bytes live] The planner sizes the host tier
(`predicted.host_bytes`, `pinned_bytes` of it to be pinned) against a hardware profile, which
may describe another machine than the one running the schedule. What each backend asks of
this machine differs:
- CUDA: the tier is pinned memory (HostPool kind "pinned"), all of it, not only the part the
  plan calls pinned. Pinned pages cannot be swapped or reclaimed, so the larger of host_bytes
  and pinned_bytes must fit in MemAvailable. RLIMIT_MEMLOCK (`ulimit -l`) is not checked:
  cudaHostAlloc pins through the NVIDIA driver, which does not charge it, and containers
  commonly run with a 64 KiB or 8 MiB limit while pinning gigabytes, so checking it would
  refuse working setups.
- CPU: the tier is a shared mapping of a file in /dev/shm where that is a tmpfs with room,
  else in the temporary directory ([Note: the CPU tier lives in memory where it can] in
  storage.py; `KARMA_TIER_DIR` chooses), whose blocks are taken as it grows (tier.py,
  [Note: the tier's disk is taken when it grows]). On a disk its pages are page cache that
  the kernel writes back and evicts, so they need room on that filesystem (statvfs), not
  memory; in a tmpfs or ramfs its pages are memory (shmem, not counted in MemAvailable once
  taken). The schedule's device
  memory is this machine's RAM on the CPU backend: private memory, checked against
  MemAvailable, together with the tier when the tier is in memory.
The numbers are the schedule's own (the pool's 10% slack is left out): the check refuses
what certainly does not fit, instead of an out-of-memory kill in the middle of a step; it
cannot promise that what passes fits, as other processes come and go. Several ranks started
on one machine (torchrun's LOCAL_WORLD_SIZE) each need all of it.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

from karma.runtime.host.tier import pool_bytes
from karma.schedule import Schedule
from karma.storage import MEMORY_FILESYSTEMS, filesystem_type, free_bytes, tier_directory
from karma.units import format_bytes


@dataclass(frozen=True)
class HostMemory:
    """What a schedule needs of this machine's host memory, and what the machine has."""

    backend: str  # "cpu" (the tier is a file) or "cuda" (the tier is pinned memory)
    host_bytes: int  # the schedule's host tier (predicted.host_bytes)
    pinned_bytes: int  # what the plan pins (predicted.pinned_bytes)
    device_bytes: int  # the schedule's device memory (predicted.peak_device_bytes)
    ranks_here: int  # processes on this machine, each needing all of the above
    available_bytes: int | None  # /proc/meminfo MemAvailable (None: unknown, not checked)
    tier_dir: str  # where the CPU backend's tier file goes
    tier_free_bytes: int | None  # free space of tier_dir's filesystem (None: unknown)
    tier_in_memory: bool  # tier_dir is on a tmpfs or ramfs: its bytes are memory


def host_memory_problem(m: HostMemory) -> str | None:
    """Why `m`'s schedule cannot run on this machine (one line naming the numbers), or None.
    See [Note: where the host tier's bytes live]."""
    ranks = f" for each of {m.ranks_here} ranks on this machine" if m.ranks_here > 1 else ""
    avail = (f"this machine has {format_bytes(m.available_bytes or 0)} available "
             "(/proc/meminfo MemAvailable)")
    if m.backend != "cpu":
        need = max(m.host_bytes, m.pinned_bytes)
        if m.available_bytes is not None and need * m.ranks_here > m.available_bytes:
            return (f"the schedule needs {format_bytes(need)} of pinned host memory{ranks} "
                    f"(host tier {format_bytes(m.host_bytes)}, pinned "
                    f"{format_bytes(m.pinned_bytes)}; on CUDA the whole tier is pinned), but "
                    f"{avail}; plan with a smaller model or batch, or free memory")
        return None
    if m.tier_free_bytes is not None and m.host_bytes * m.ranks_here > m.tier_free_bytes:
        where = "memory (tmpfs)" if m.tier_in_memory else "disk"
        return (f"the schedule's host tier needs {format_bytes(m.host_bytes)} of {where}{ranks}, "
                f"but {m.tier_dir}, where the CPU backend keeps it as a file, has "
                f"{format_bytes(m.tier_free_bytes)} free; plan with a smaller model or batch, "
                "or set KARMA_TIER_DIR to a directory with more room")
    in_memory = m.host_bytes if m.tier_in_memory else 0
    need = m.device_bytes + in_memory
    if m.available_bytes is not None and need * m.ranks_here > m.available_bytes:
        parts = f"device memory {format_bytes(m.device_bytes)}, which is RAM on the CPU backend"
        if in_memory:
            parts += f", + host tier {format_bytes(in_memory)} in tmpfs at {m.tier_dir}"
        return (f"the schedule needs {format_bytes(need)} of host memory{ranks} ({parts}), but "
                f"{avail}; plan with a smaller --gpu-mem, model or batch, or free memory")
    return None


def measure_host_memory(schedule: Schedule, backend: str,
                        tier_dir: str | None = None) -> HostMemory:
    """`schedule`'s needs and this machine's memory and tier space, for host_memory_problem.
    `tier_dir`: where the tier file goes (default: storage.tier_directory's choice for this
    schedule: [Note: the CPU tier lives in memory where it can]); HostPool is given the
    same (HostMemory.tier_dir)."""
    p = schedule.predicted
    try:
        ranks_here = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        ranks_here = 1
    available = mem_available_bytes()
    if tier_dir is None:
        if backend == "cpu":
            memory = None if available is None else available - p.peak_device_bytes * ranks_here
            tier_dir = tier_directory(pool_bytes(p.host_bytes) * ranks_here, memory)
        else:
            tier_dir = tempfile.gettempdir()  # not used: the tier is pinned memory
    return HostMemory(backend=backend, host_bytes=p.host_bytes, pinned_bytes=p.pinned_bytes,
                      device_bytes=p.peak_device_bytes, ranks_here=ranks_here,
                      available_bytes=available, tier_dir=tier_dir,
                      tier_free_bytes=free_bytes(tier_dir),
                      tier_in_memory=filesystem_type(tier_dir) in MEMORY_FILESYSTEMS)


def mem_available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """MemAvailable from /proc/meminfo, or None where there is none (not Linux)."""
    try:
        with open(meminfo, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
