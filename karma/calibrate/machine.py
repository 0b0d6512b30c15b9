"""This machine: which built-in profile it is, and its rates, measured once and cached.

    local_device("h200-141g")     # "cuda" where that profile is this machine, else None
    this_machine()                # what karma plans for when no --hardware is given

The rates (`measure_hw.measure_local(quick=True)`: matmul, memory and copy bandwidth, host
optimizer, and on the CPU how its streams slow each other) are measured under the runtime's
allocator settings ([Note: timing under the runtime's allocator]) and cached, keyed by the
CPU model, core and thread counts, OMP_WAIT_POLICY, the tier's file system, the GPU's name
and the torch version. The profile's sizes (memory, disk, network) stay the built-in ones:
the budget is --gpu-mem, and the network is not measured.
"""

from __future__ import annotations

import contextlib
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from karma.calibrate.cache import cache_path, read, write
from karma.calibrate.measure_hw import measure_local
from karma.errors import KarmaError
from karma.planner.hardware import (
    Hardware,
    builtin_names,
    dump_hardware,
    hardware_from_yaml,
    load_hardware,
)
from karma.runtime.host import cpu_cache
from karma.runtime.host.tier import return_freed_memory_promptly
from karma.storage import filesystem_type, tier_directory
from karma.units import format_bytes

_RATE_FIELDS = ("flops_per_s", "mem_bytes_per_s", "h2d_bytes_per_s", "d2h_bytes_per_s",
                "host_optim_bytes_per_s",
                # how the streams slow each other (hardware.py, [Note: contention between
                # streams]): measured on the CPU, 0 on a GPU
                "compute_slowdown_copy", "copy_slowdown_compute", "compute_slowdown_host",
                "host_slowdown_compute")
# part of the machine's cache key: bump it when what is measured, or how, changes, so that a
# machine measured the old way is measured again
MACHINE_VERSION = 8


def local_device(hardware: str | Hardware) -> str | None:
    """"cpu" or "cuda" if `hardware` is this machine, else None: the built-in `cpu` profile
    (the CPU backend always runs on the local CPU); the built-in GPU profile of the local GPU
    (gpu_profile); and this machine's measured profile, the one `this_machine` plans with
    where no built-in profile is the local GPU. Any other Hardware, or a profile file, may
    describe another machine."""
    if isinstance(hardware, Hardware):
        return _measured_here(hardware)
    if hardware not in builtin_names():
        return None
    if hardware == "cpu":
        return "cpu"
    if not torch.cuda.is_available():
        return None
    gpu = torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory
    return "cuda" if gpu_profile(*gpu) == hardware else None


def gpu_profile(gpu_name: str, total_bytes: int) -> str | None:
    """The built-in profile of a GPU named `gpu_name` with `total_bytes` of memory (as
    torch.cuda reports them): the one whose family (h100 of h100-80g) is in the name and
    whose memory is within 10% of the GPU's; None where no built-in profile is that GPU."""
    for name in builtin_names():
        hw = load_hardware(name)
        if hw.device_kind == "cuda" and name.split("-")[0] in gpu_name.lower() \
                and abs(total_bytes - hw.device_mem_bytes) <= 0.1 * hw.device_mem_bytes:
            return name
    return None


@dataclass(frozen=True)
class ThisMachine:
    """What to plan for when no hardware is named (PlanOptions(hardware=None)), and what to
    say about it."""

    hardware: str | Hardware  # a built-in profile's name, or this GPU's measured profile
    chosen: str  # the profile and why, e.g. "cpu (no GPU found)"
    guess: str | None = None  # what of the profile is a guess, where something is


def this_machine(gpu: tuple[str, int] | None = None,
                 measure: Callable[[], Hardware] | None = None) -> ThisMachine:
    """The hardware of this machine: the built-in `cpu` profile where there is no GPU; the
    local GPU's built-in profile (gpu_profile) where there is one; else this GPU measured,
    as karma-profile does (once, cached), its node's sizes a guess. `gpu`: the GPU's name and
    memory (default torch.cuda's, None where there is no GPU); `measure`: how to measure it
    (default local_profile)."""
    if gpu is None and torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory
    if gpu is None:
        return ThisMachine("cpu", "cpu (no GPU found)")
    name, total_bytes = gpu
    builtin = gpu_profile(name, total_bytes)
    if builtin is not None:
        return ThisMachine(builtin, f"{builtin} (the {name})")
    hw = measure() if measure is not None else local_profile("cuda", lambda line: None)
    return ThisMachine(hw, f"{hw.name}, the {name} measured (no built-in profile is a GPU "
                           f"of its name and {format_bytes(total_bytes)})",
                       guess=f"the sizes of {hw.name}'s node are a guess: one GPU, "
                             f"{format_bytes(hw.host_mem_bytes)} of host memory (what is free "
                             "now) and the network not measured; karma-profile -o FILE writes "
                             "them to a file to edit and give as --hardware FILE")


def _measured_here(hw: Hardware) -> str | None:
    """hw's device kind, if hw is this machine's measured profile (in the cache), else None."""
    if hw.device_kind == "cuda" and not torch.cuda.is_available():
        return None
    cached = read_machine(cache_path("machine", machine_key(hw.device_kind)))
    return hw.device_kind if cached == hw else None


@contextlib.contextmanager
def allocating_as_the_runtime_does(device: str):
    """[Note: timing under the runtime's allocator] On the CPU backend the runtime returns
    freed memory to the system promptly (runtime/host/tier.py, [Note: glibc keeps freed memory])
    and keeps the tensors a step frees for the next step in its own cache ([Note: a caching
    allocator for the CPU backend], runtime/host/cpu_cache.py). Timed under glibc's defaults, the
    blocks of GPT-2 small (sequence 64, batch 2) predicted 1.65 s for a keep_all step that
    took 2.44 s under the prompt return alone. So the machine and the blocks are measured as
    the runtime allocates: the glibc setting is process-wide and the one a karma.Runtime in
    this process would make anyway; the cache runs (unbounded) while measuring only."""
    if device != "cpu":
        yield
        return
    return_freed_memory_promptly()
    allocator = cpu_cache.load()
    if allocator is not None:
        allocator.start(1 << 62)
    try:
        yield
    finally:
        if allocator is not None:
            allocator.stop()


def machine_key(device: str) -> dict:
    """Everything the machine's measured rates depend on."""
    return {
        "version": MACHINE_VERSION,
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
        "tier": filesystem_type(tier_directory()) if device == "cpu" else None,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
    }


def measured_machine(device: str, hw: Hardware, say: Callable[[str], None],
                     remeasure: bool = False) -> Hardware:
    """`hw` with this machine's measured rates (cached; `remeasure`: measured again)."""
    measured = local_profile(device, say, remeasure)
    return replace(hw, **{f: getattr(measured, f) for f in _RATE_FIELDS})


def local_profile(device: str, say: Callable[[str], None], remeasure: bool = False) -> Hardware:
    """This machine's profile as `measure_local(device, quick=True)` measures it (cached;
    `remeasure`: measured again): its rates, and its sizes as this machine reports them."""
    key = machine_key(device)
    path = cache_path("machine", key)
    measured = None if remeasure else read_machine(path)
    if measured is None:
        say(f"measuring this machine ({device}; {'again' if remeasure else 'once'}, cached in "
            f"{path})")
        measured = measure_local(device, quick=True)
        write(path, {"key": key, "hardware": dump_hardware(measured)}, say)
    return measured


def read_machine(path: Path) -> Hardware | None:
    """The machine's profile cached in `path`, or None when it does not check out."""
    data = read(path)
    try:
        return hardware_from_yaml(data["hardware"], str(path))
    except (KarmaError, KeyError, TypeError):
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
