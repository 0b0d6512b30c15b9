"""A caching allocator for the CPU backend's tensors, bounded by the schedule's planned peak.

[Note: a caching allocator for the CPU backend]
A memory cap only holds what the schedule planned if freed tensors go back to the system,
so the runtime pins glibc's mmap threshold ([Note: glibc keeps freed memory] in tier.py).
Then every tensor of 64 KiB or more is a fresh mapping, faulted in page by page, every step:
measured on GPT-2 small, a keep_all schedule ran 1.32x the plain loop's step, all of it in
the allocator. A step allocates the same sizes in the same order as the one before, which is
what CUDA's caching allocator exploits; this is the same idea for the CPU: freed tensors of
64 KiB or more are kept by size (rounded to pages) and handed to the next request of that
size, while the bytes held, live and kept, stay within a limit. The runtime sets the limit
to the schedule's predicted peak, so what is kept never takes the process past the memory
the plan predicts: when a request would, kept blocks go back to the system, largest first.
Kept memory serves requests of any size ([Note: reshaping kept memory]).
PyTorch has no Python hook for its CPU allocator (`c10::SetCPUAllocator` is C++ only), so
cpu_cache.cpp is built once per PyTorch version with torch.utils.cpp_extension (about 3 s)
into karma's cache folder and driven through ctypes. Where it cannot be built (no C++
compiler), or with KARMA_CPU_CACHE=0, the runtime says so and runs on glibc alone.

[Note: reshaping kept memory]
Under a tight budget, kept blocks of one size do not serve the next step's requests of
another: a step of the 8-layer GPT (width 512, vocabulary 8192) under 400 MiB asks for three
64 MiB tensors at the loss while the cache keeps 4 and 16 MiB ones, and for 4 MiB ones in the
forward while it keeps 64 MiB ones. Giving those back and faulting fresh pages in (3 GB/s on
the reference box, against 12-16 GB/s into pages already there) cost about 370 MiB of faults
a step: the loss took 171 ms against keep_all's 22 ms. So the allocator maps its blocks itself
(mmap) and a request takes kept pages before fresh ones: a kept block of its size; else the
first part of the smallest larger one (the rest stays kept); else the largest kept blocks,
whose pages mremap moves side by side into one new address range (page tables move, the bytes
do not), with fresh pages only for what they lack. Measured: no fresh pages after the first
step, and the plan's step from 2.83-2.92 s to 2.61 s (keep_all's from 2.49-2.54 to 2.37 s).
A block remembers the kernel mappings it is made of (mremap moves one at a time); a request
gathers kept blocks only up to 64 of them, and takes fresh pages for the rest. With
THP_MEM_ALLOC_ENABLE (see [Note: huge pages for large tensors] in karma/cli/common.py) blocks
of 2 MiB or more are aligned to 2 MiB and asked for huge pages, as PyTorch's own allocator
does.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from karma.fileio import cache_dir, write_text_atomic
from karma.runtime.host.tier import private_bytes
from karma.units import format_bytes

_SOURCE = Path(__file__).with_name("cpu_cache.cpp")
_NAME = "karma_cpu_cache"
_STATS = 9


@dataclass(frozen=True)
class CacheStats:
    live_bytes: int  # tensors the cache gave out and PyTorch still holds
    idle_bytes: int  # freed tensors kept for reuse
    peak_bytes: int  # of live + idle since the last start
    limit_bytes: int
    hits: int  # requests served from kept memory alone
    misses: int  # requests that took fresh memory
    released: int  # kept blocks given back to the system
    reshaped: int  # requests served from kept blocks of another size
    fresh_bytes: int  # taken fresh from the system, faulted in page by page

    def text(self) -> str:
        asked = self.hits + self.misses
        share = f"{self.hits / asked:.0%}" if asked else "none"
        return (f"CPU cache: {share} of {asked} tensors of 64 KiB or more reused "
                f"({self.reshaped} from kept tensors of another size); "
                f"{format_bytes(self.fresh_bytes)} fresh; {self.released} given back to stay "
                f"within {format_bytes(self.limit_bytes)}")


class CPUCache:
    """The loaded allocator: start(limit) turns caching on, stop() gives back what is kept."""

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib
        lib.karma_cache_install.argtypes = [ctypes.c_uint64]
        lib.karma_cache_limit.argtypes = [ctypes.c_uint64]
        lib.karma_cache_stats.argtypes = [ctypes.POINTER(ctypes.c_uint64)]

    def start(self, limit_bytes: int) -> None:
        """Caching on, within `limit_bytes` (live and kept); the counts start from zero."""
        self._lib.karma_cache_install(max(int(limit_bytes), 0))

    def limit(self, limit_bytes: int) -> None:
        """A new limit; what it no longer allows goes back to the system now."""
        self._lib.karma_cache_limit(max(int(limit_bytes), 0))

    def stop(self) -> None:
        self._lib.karma_cache_stop()

    def stats(self) -> CacheStats:
        out = (ctypes.c_uint64 * _STATS)()
        self._lib.karma_cache_stats(out)
        return CacheStats(*(int(v) for v in out))


# On the CPU backend, what the cache keeps stays this much under the planned peak: in the
# first step ([Note: the first step's reserve]), and in every later step at most 1% of it.
FIRST_STEP_RESERVE_BYTES = 64 << 20
STEP_RESERVE_BYTES = 8 << 20


class PlannedBound:
    """Keeps what the cache holds, with what the process holds outside it (small tensors,
    the data, Python objects: measured at each step's start), within the schedule's planned
    peak, so that keeping freed tensors never takes the measured peak above the prediction
    ([Note: a caching allocator for the CPU backend])."""

    def __init__(self, cache: CPUCache, baseline_private_bytes: int, peak_bytes: int,
                 private: Callable[[], int] = private_bytes):
        self.cache = cache
        self.baseline_private_bytes = baseline_private_bytes
        self.peak_bytes = peak_bytes  # the schedule's predicted peak above the baseline
        self._private = private
        # tensors of this process older than the run (others' models, say) that the cache
        # gave out: in the baseline, so not in what the cache may keep for this run
        self.cache_baseline_bytes = cache.stats().live_bytes
        # the most the process held outside its tensors at a step's start after the first:
        # the plan counts what calibration measured of it (Schedule.process_bytes)
        self.outside_bytes = 0

    def bound(self, steps_done: int) -> None:
        """Set the cache's limit at the start of a step, `steps_done` steps into the run.

        [Note: the first step's reserve] The first step grows what the process holds outside
        the cache after its start (the stream workers' first kernels make their OpenMP pools,
        malloc arenas and stacks; first calls fill PyTorch's and Python's caches): 17-30 MiB
        measured (GPT-2 small's 861 MiB plan peaked at 870 MiB in step 1, 851 from step 2
        on). From step 2 on it is measured at the step's start; in step 1 the cache keeps
        FIRST_STEP_RESERVE_BYTES less. In every later step it keeps STEP_RESERVE_BYTES (at
        most 1% of the peak) less: small tensors and Python objects made during the step
        still grow the outside a little (the demo's plan, 797 MiB of an 800 MiB budget,
        peaked at 798 MiB without it)."""
        held = self.cache.stats()
        base = self.cache_baseline_bytes
        outside = (self._private() - self.baseline_private_bytes
                   - (held.live_bytes - base) - held.idle_bytes)
        if steps_done > 0:  # step 1's start is before the stream workers' first ops
            self.outside_bytes = max(self.outside_bytes, outside)
        peak = self.peak_bytes
        reserve = FIRST_STEP_RESERVE_BYTES if steps_done == 0 else \
            min(STEP_RESERVE_BYTES, peak // 100)
        self.cache.limit(max(base + peak - max(outside, 0) - reserve, base))


_loaded: list[CPUCache | str] = []  # one load per process: the cache, or why there is none


def load(log: Callable[[str], None] = lambda _: None) -> CPUCache | None:
    """The CPU cache, built on first use; None (and a logged reason) where it cannot be."""
    if os.environ.get("KARMA_CPU_CACHE", "1") == "0":
        return None
    if not _loaded:
        _loaded.append(_build(log))
    if isinstance(_loaded[0], str):
        return None
    return _loaded[0]


def _build(log: Callable[[str], None]) -> CPUCache | str:
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + torch.__version__.encode()).hexdigest()[:16]
    folder = cache_dir() / "ext" / f"cpu_cache-{key}"
    library, built = folder / f"{_NAME}.so", folder / "built"
    try:
        if not built.exists():  # else importing cpp_extension (0.2 s) is all load() would do
            compiler = os.environ.get("CXX", "c++")
            if shutil.which(compiler) is None:  # before cpp_extension: it warns at length
                raise RuntimeError(f"no C++ compiler ({compiler}) on PATH")
            log(f"building karma's CPU caching allocator into {folder} (once per PyTorch "
                "version)")
            folder.mkdir(parents=True, exist_ok=True)
            from torch.utils import cpp_extension

            # it holds a lock while it builds (torchrun's ranks start together)
            with _ninja_on_path():
                cpp_extension.load(_NAME, [str(_SOURCE)], build_directory=str(folder),
                                   extra_cflags=["-O2"], is_python_module=False,
                                   verbose=False)
            write_text_atomic(built, f"{library.name}\n")
        return CPUCache(ctypes.CDLL(str(library)))
    except Exception as e:  # noqa: BLE001 - any build failure means: run without it
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        log(f"karma's CPU caching allocator could not be built ({reason}); tensors come "
            "from glibc, fresh each step (slower, same numbers). Install a C++ compiler "
            "(g++) and ninja to build it, or set KARMA_CPU_CACHE=0 to silence this.")
        return reason


@contextlib.contextmanager
def _ninja_on_path():
    """cpp_extension runs `ninja` from PATH; the ninja package's own binary (a dependency)
    where none is there, as when the virtual environment is not activated."""
    saved = os.environ.get("PATH", "")
    if shutil.which("ninja") is None:
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + saved
        except ImportError:
            pass  # cpp_extension then says what is missing
    try:
        yield
    finally:
        os.environ["PATH"] = saved


__all__ = ["CPUCache", "CacheStats", "PlannedBound", "load"]
