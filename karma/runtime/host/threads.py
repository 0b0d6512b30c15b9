"""The intra-op threads of the host stream, which runs the host optimizer's steps.

    n = host_stream_threads("cpu")      # on the stream's own thread, before its first op:
    use_threads_here(n)                 # this thread's parallel regions get n threads
    start_thread_pool()                 # this thread's OpenMP team started now, at its size

[Note: the host stream's threads] PyTorch's CPU kernels run their parallel regions on an
OpenMP team that belongs to the thread calling them, sized by that thread's own setting
(`omp_set_num_threads` is per thread; torch.set_num_threads also changes the default that
threads made later start with, so it is not used here). On the CPU backend the compute thread
and the host stream share the same cores: each with a team as large as the machine, the
cores are oversubscribed whenever a host step runs beside compute, and a team member that
loses its core stalls the whole team at the next barrier. libgomp also spins less between
regions once there are more team threads than cores (its throttled spin count), which slows
a kernel of many small regions such as the fused optimizer's. Measured on the 2-core test
machine (bench/RESULTS.md, "The host optimizer"), an offload_all GPT's host steps all
together ran at 2.0-2.2 GB/s of fp32 parameters with two threads and 3.2-3.9 GB/s with one,
those with no compute beside them at 4.7-6.2 and 5.4-5.5, and the steps took as long (3.10-
3.22 s and 3.09-3.25 s): so the host stream takes half the cores on the CPU backend (one on
two).
On CUDA the compute thread only launches kernels: the host stream takes every core but the
compute thread's (not yet measured on a GPU host).
"""

from __future__ import annotations

import ctypes
import os

import torch

# at::internal::GRAIN_SIZE: the fewest elements PyTorch's parallel loops give one thread
GRAIN_ELEMENTS = 32768


def host_stream_threads(device_kind: str, cores: int | None = None) -> int:
    """The intra-op threads of the host stream on a `device_kind` backend ("cpu" or "cuda"),
    on a process that may use `cores` (default: torch's intra-op thread count, which
    torchrun sets to 1 a rank with OMP_NUM_THREADS)."""
    cores = torch.get_num_threads() if cores is None else cores
    if device_kind == "cpu":
        return max(1, cores // 2)
    return max(1, cores - 1)


def use_threads_here(n: int) -> None:
    """Give this thread's parallel regions `n` threads (OpenMP's per-thread setting), leaving
    every other thread's as it is."""
    torch.get_num_threads()  # PyTorch sets a thread's count at its first use: let it go first
    if n == torch.get_num_threads():
        return
    omp = _openmp()
    if omp is not None:
        omp.omp_set_num_threads(n)


def _openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch runs on, loaded in this process (None: not found)."""
    process = ctypes.CDLL(None)
    if hasattr(process, "omp_set_num_threads"):
        return process
    for name in os.listdir(os.path.join(os.path.dirname(torch.__file__), "lib")):
        if name.startswith(("libgomp", "libiomp", "libomp")):
            return ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", name))
    return None


def start_thread_pool() -> None:
    """Start the calling thread's OpenMP team at its full size (its intra-op thread count),
    with one parallel op over enough elements that every thread of the team takes part: a
    thread's team otherwise starts at its first large op ([Note: the hard cap from the
    plan], host/memcap.py)."""
    torch.empty(torch.get_num_threads() * GRAIN_ELEMENTS, dtype=torch.uint8).fill_(1)
