"""Measure this machine and return its `Hardware` profile (what `karma-profile` runs).

This module imports torch (it is the measuring tool); the solver only reads the numbers it
returns. Each number is the median of a few timed repeats after a warm-up, rounded to three
significant digits; the whole run takes about 10 s on a 2-core machine (quick=True: about 2 s).
CUDA is called only when a CUDA device is asked for, or found when `device` is None.

Timings follow the process's thread settings, as training would: on a small VM, OpenMP's
default passive wait can add a scheduler tick (~4 ms) to every parallel op, which slows
AdamW's single-tensor and foreach paths tenfold or more; OMP_WAIT_POLICY=ACTIVE or one
thread avoids it.

What is and is not measured:
- matmul rate per dtype, at a size that takes long enough to time (PyTorch's defaults: TF32 off);
- device memory bandwidth from a large copy, counting bytes read plus bytes written;
- copy bandwidth: on CUDA pinned host <-> device; on the CPU, RAM <-> a file-backed tensor
  (`torch.from_file(shared=True)`) where the runtime keeps its offload tier (/dev/shm where
  it is a tmpfs, else the temporary directory: storage.tier_directory), fp32 on a worker
  thread ([Note: copies as the streams run them]);
- host optimizer rate: torch.optim.AdamW(fused=True).step() on fp32 parameters, on a worker
  thread with the host stream's threads (the kernel and the thread the runtime steps with);
- on the CPU, contention between streams (see [Note: measuring contention]);
- memory: MemAvailable from /proc/meminfo (on the CPU the file tier's size is the free space
  of the tier's directory);
- not the network: a single machine cannot; net_* get defaults to edit by hand.
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from karma.errors import KarmaError
from karma.planner.hardware import Hardware
from karma.runtime.host.check import mem_available_bytes as meminfo_available_bytes
from karma.runtime.host.threads import host_stream_threads, use_threads_here
from karma.runtime.host.tier import unnamed_file_mapping
from karma.storage import tier_directory

_GiB = 1024**3
_MiB = 1024**2

# Network defaults (not measured): InfiniBand-class for GPU machines, as the built-in GPU
# profiles; a modest Ethernet link for CPU machines.
_NET_DEFAULTS = {"cuda": (12.5e9, 5e-6), "cpu": (1e9, 50e-6)}


class _Sizes(NamedTuple):
    """How big and how often to measure, per device kind and quick flag."""

    matmul_s: float  # grow the matmul until one takes this long ...
    matmul_max_n: int  # ... or reaches this size
    copy_bytes: int  # device-to-device copy
    transfer_bytes: int  # host <-> device (CPU: RAM <-> file tier) copy
    optim_numel: int  # fp32 parameters stepped by AdamW
    repeats: int  # timed runs per measurement; the median is kept
    contention_bytes: int = 0  # copied each way, and stepped by AdamW, beside compute (cpu)
    contention_layers: int = 0  # forwards and backwards of _training_layer: one run of compute


_PLANS = {
    # contention: copies and steps larger than a cache (a training step's are), compute
    # about 0.1 s a layer on 2 cores
    ("cpu", False): _Sizes(0.1, 2048, 256 * _MiB, 256 * _MiB, 32 * _MiB, 5, 64 * _MiB, 2),
    ("cpu", True): _Sizes(0.05, 1024, 64 * _MiB, 64 * _MiB, 4 * _MiB, 5, 64 * _MiB, 1),
    # On CUDA the largest sizes keep an H200 busy for a millisecond or more per repeat.
    ("cuda", False): _Sizes(0.005, 8192, _GiB, 256 * _MiB, 32 * _MiB, 10),
    ("cuda", True): _Sizes(0.005, 4096, 256 * _MiB, 64 * _MiB, 4 * _MiB, 5),
}


def measure_local(
    device: str | None = None,
    quick: bool = False,
    log: Callable[[str], None] | None = None,
) -> Hardware:
    """Measure `device` ("cuda", "cuda:N" or "cpu"; default: CUDA if present) and its host.

    `log`, if given, is called with a short line before each measurement.
    """
    dev = _resolve_device(device)
    plan = _PLANS[dev.type, quick]
    say = log or (lambda line: None)
    flops = {}
    for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        say(f"matmul {dtype_name}")
        rate = _matmul_flops_per_s(dtype, dev, plan.matmul_s, plan.matmul_max_n, plan.repeats)
        flops[dtype_name] = _round3(rate)
    say("device memory bandwidth")
    mem_bytes_per_s = _round3(_copy_bytes_per_s(dev, plan.copy_bytes, plan.repeats))
    host_mem = mem_available_bytes()
    if dev.type == "cuda":
        say("pinned host <-> device copies")
        h2d, d2h = _pinned_copy_bytes_per_s(dev, plan.transfer_bytes, plan.repeats)
        name = "local-" + _slug(torch.cuda.get_device_name(dev))
        device_mem = torch.cuda.get_device_properties(dev).total_memory
        tier_bytes, pinned = host_mem, host_mem // 2
    else:
        say("RAM <-> file tier copies")
        h2d, d2h, tier_bytes = _file_tier_bytes_per_s(plan.transfer_bytes, plan.repeats)
        name, device_mem, pinned = "local-cpu", host_mem, tier_bytes
    say("host optimizer (fused AdamW on the host stream)")
    optim = _round3(_host_optim_bytes_per_s(plan.optim_numel, plan.repeats, dev.type))
    slowdowns = {}
    if dev.type == "cpu":
        say("contention: a training layer beside copies and beside AdamW")
        slowdowns = _contention(plan.contention_bytes, plan.contention_layers, plan.repeats)
    net_bytes_per_s, net_latency_s = _NET_DEFAULTS[dev.type]
    return Hardware(
        name=name,
        device_kind=dev.type,
        device_mem_bytes=device_mem,
        flops_per_s=flops,
        mem_bytes_per_s=mem_bytes_per_s,
        h2d_bytes_per_s=_round3(h2d),
        d2h_bytes_per_s=_round3(d2h),
        host_mem_bytes=tier_bytes,
        pinned_mem_bytes=pinned,
        host_optim_bytes_per_s=optim,
        net_bytes_per_s=net_bytes_per_s,
        net_latency_s=net_latency_s,
        **slowdowns,
    )


def _resolve_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cuda", "cpu"):
        raise KarmaError(f"device {device!r} is not supported; use 'cuda', 'cuda:N' or 'cpu'")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise KarmaError(
            f"device {device!r} was asked for but PyTorch sees no CUDA device "
            f"(torch {torch.__version__}); measure the CPU with device 'cpu' or install a "
            f"CUDA build"
        )
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise KarmaError(
            f"device {device!r} does not exist; this machine has {torch.cuda.device_count()} "
            f"CUDA device(s), cuda:0 to cuda:{torch.cuda.device_count() - 1}"
        )
    return dev


def _median_seconds(fn: Callable[[], object], dev: torch.device, repeats: int) -> float:
    """Median wall time of `fn` over `repeats` runs, after one untimed warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        if dev.type == "cuda":
            # Events on the current stream time the device work, not the Python launch.
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _matmul_flops_per_s(
    dtype: torch.dtype, dev: torch.device, target_s: float, max_n: int, repeats: int
) -> float:
    """FLOP/s of an n x n matmul, n doubled from 256 until one takes `target_s` (or max_n).

    Growing n keeps a slow dtype (bf16 on a CPU without bf16 units) from taking minutes.
    """
    n = 256
    while n < max_n and _matmul_seconds(n, dtype, dev, repeats=1) < target_s:
        n *= 2
    return 2 * n**3 / _matmul_seconds(n, dtype, dev, repeats)


def _matmul_seconds(n: int, dtype: torch.dtype, dev: torch.device, repeats: int) -> float:
    a = torch.randn(n, n, dtype=dtype, device=dev)
    b = torch.randn(n, n, dtype=dtype, device=dev)
    out = torch.empty(n, n, dtype=dtype, device=dev)
    return _median_seconds(lambda: torch.mm(a, b, out=out), dev, repeats)


def _copy_bytes_per_s(dev: torch.device, nbytes: int, repeats: int) -> float:
    """Bytes read plus bytes written per second by a device-to-device copy."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
    dst = torch.zeros_like(src)
    return 2 * nbytes / _median_seconds(lambda: dst.copy_(src), dev, repeats)


def _pinned_copy_bytes_per_s(dev: torch.device, nbytes: int, repeats: int) -> tuple[float, float]:
    """(host -> device, device -> host) bytes per second between pinned memory and `dev`."""
    host = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
    device_buf = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
    h2d = nbytes / _median_seconds(lambda: device_buf.copy_(host, non_blocking=True), dev, repeats)
    d2h = nbytes / _median_seconds(lambda: host.copy_(device_buf, non_blocking=True), dev, repeats)
    return h2d, d2h


def scratch_mapping(numel: int, dtype: torch.dtype, need_bytes: int) -> torch.Tensor:
    """A shared mapping of a new file where the runtime would put the tier ([Note: the CPU
    tier lives in memory where it can]; `need_bytes`: the room it should have), unnamed as the
    tier's arenas are (tier.unnamed_file_mapping)."""
    nbytes = numel * dtype.itemsize
    return unnamed_file_mapping(tier_directory(need_bytes), nbytes, "tier.bin",
                                prefix="karma-profile-").view(dtype)


def _file_tier_bytes_per_s(nbytes: int, repeats: int) -> tuple[float, float, int]:
    """(file -> RAM, RAM -> file) bytes per second, and free bytes, for the CPU offload tier."""
    tier = scratch_mapping(nbytes // 4, torch.float32, 2 * nbytes)
    to_ram, to_file = _file_copy_bytes_per_s(tier, nbytes, repeats)
    return to_ram, to_file, shutil.disk_usage(tier_directory(2 * nbytes)).free


def _file_copy_bytes_per_s(tier: torch.Tensor, nbytes: int,
                           repeats: int) -> tuple[float, float]:
    """(file -> RAM, RAM -> file) bytes per second of fp32 copies on a worker thread, as the
    runtime's h2d and d2h streams copy.

    [Note: copies as the streams run them] A copy on a thread other than the one that set
    up PyTorch's thread pool runs its parallel region on that thread's own OpenMP team: on the
    2-core test machine 64 MiB moved from the tier at 22 GB/s on the calling thread and at 17
    GB/s on a worker. Timed on the calling thread, the profile said 33-35 GB/s, and an 8-layer
    GPT's swaps ran at 4-5 GB/s beside its compute, against 6.6 GB/s from the worker's rate and
    the contention fraction.
    """
    ram = torch.ones(nbytes // 4, dtype=torch.float32)
    cpu = torch.device("cpu")
    to_ram = nbytes / on_worker(lambda: _median_seconds(lambda: ram.copy_(tier), cpu, repeats))
    to_file = nbytes / on_worker(lambda: _median_seconds(lambda: tier.copy_(ram), cpu, repeats))
    return to_ram, to_file


def on_worker(fn: Callable[[], float], threads: int | None = None) -> float:
    """`fn()` run on a thread of its own, as a stream's worker runs its ops; with `threads`,
    that thread's kernels get that many intra-op threads (runtime/host/threads.py). A
    failure is raised here, on the calling thread."""
    out: list[float] = []
    errors: list[BaseException] = []

    def run() -> None:
        if threads is not None:
            use_threads_here(threads)
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - raised on the calling thread
            errors.append(e)

    thread = threading.Thread(target=run, name="karma-profile-worker")
    thread.start()
    thread.join()
    if errors:
        raise KarmaError(f"timing on a worker thread failed: {errors[0]}") from errors[0]
    return out[0]


def _host_optim_bytes_per_s(numel: int, repeats: int, device: str) -> float:
    """fp32 parameter bytes stepped per second by AdamW on the CPU as the host stream runs
    it: torch's fused kernel (host_optimizer.py), on a thread of its own with the host
    stream's intra-op threads for a `device` backend (runtime/host/threads.py).

    The parameters are split into 8 tensors, as a model's are split into layers; the warm-up
    step creates the optimizer state.
    """
    params = [torch.nn.Parameter(torch.randn(numel // 8)) for _ in range(8)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-3, fused=True)
    seconds = on_worker(lambda: _median_seconds(optimizer.step, torch.device("cpu"), repeats),
                        host_stream_threads(device))
    return 4 * (numel // 8) * 8 / seconds


def _contention(nbytes: int, layers: int, repeats: int) -> dict[str, float]:
    """[Note: measuring contention] The Hardware fields of [Note: contention between
    streams], measured as the runtime's CPU backend runs its streams: compute on the calling
    thread, a copy or a host step on a worker thread, each with the process's thread setting.

    Compute is `layers` forwards and backwards of a transformer-like layer (two linears
    around a GELU, a layer norm, a softmax over attention-like scores: `_training_layer`),
    not bare matmuls: a training step's elementwise kernels and reductions read memory as a
    copy does, and a matmul mostly does not. On the 2-core test machine a copy beside 1024 x
    1024 matmuls lost 0.146 of its speed, beside the layer 0.534; the runtime's swaps of an
    8-layer GPT ran beside its compute at 5 GB/s against 17-22 GB/s alone. The copy moves
    `nbytes` from a file-tier mapping (`torch.from_file(shared=True)`) to RAM and back, as a
    swap does; the host step is fused AdamW on `nbytes` of fp32 parameters. Each is
    timed alone, then beside the other running in a loop on a second thread; a slowdown is
    1 - alone / beside, kept between 0 and 0.95. A side that runs faster beside compute (on a
    small VM OpenMP's idle threads sleep less when compute keeps the cores busy) counts as 0.
    A pair is recorded as measured, even where its two speeds add up to more than 1: the
    simulator bounds the sum of all busy streams' speeds (simulate.py, [Note: every stream
    on shared cores conserves work]).
    """
    cpu = torch.device("cpu")
    compute = _training_layer(layers)
    compute_copy, copy_compute = _slowdowns(
        compute, _file_copy(scratch_mapping(nbytes, torch.uint8, 2 * nbytes), nbytes), cpu,
        repeats)
    params = [torch.nn.Parameter(torch.randn(nbytes // 4 // 8)) for _ in range(8)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-3, fused=True)  # the host stream's kernel
    compute_host, host_compute = _slowdowns(compute, optimizer.step, cpu, repeats)
    return {"compute_slowdown_copy": compute_copy, "copy_slowdown_compute": copy_compute,
            "compute_slowdown_host": compute_host, "host_slowdown_compute": host_compute}


def _training_layer(repeats: int, width: int = 512, tokens: int = 2048) -> Callable[[], None]:
    """`repeats` forwards and backwards of a transformer-like layer: what a training step's
    compute does to the cores and to memory ([Note: measuring contention])."""
    with torch.random.fork_rng(devices=[]):  # the caller's random stream stays as it was
        torch.manual_seed(0)
        layer = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                    torch.nn.Linear(4 * width, width), torch.nn.LayerNorm(width))
        x = torch.randn(tokens, width)
    heads = 8

    def compute() -> None:
        for _ in range(repeats):
            y = layer(x).view(heads, tokens // heads, width)
            scores = torch.softmax(y @ y.transpose(1, 2), dim=-1)
            (scores.sum() + y.sum()).backward()
        layer.zero_grad(set_to_none=True)

    return compute


def _file_copy(tier: torch.Tensor, nbytes: int) -> Callable[[], None]:
    """`nbytes` from a file-tier mapping to RAM and back, as a swap moves them."""
    ram = torch.ones(nbytes, dtype=torch.uint8)

    def copy() -> None:
        ram.copy_(tier)
        tier.copy_(ram)

    return copy


def _slowdowns(main: Callable[[], object], side: Callable[[], object], dev: torch.device,
               repeats: int) -> tuple[float, float]:
    """(main's, side's) fraction of speed lost while the other runs on a second thread."""
    main_alone = _median_seconds(main, dev, repeats)
    side_alone = _median_seconds(side, dev, repeats)
    main_beside, side_beside = _beside(main, side, repeats)

    def lost(alone: float, beside: float) -> float:
        return _round3(min(max(1.0 - alone / beside, 0.0), 0.95))

    return lost(main_alone, main_beside), lost(side_alone, side_beside)


def _beside(main: Callable[[], object], side: Callable[[], object], repeats: int,
            max_s: float = 5.0) -> tuple[float, float]:
    """Median seconds of `main` on this thread and of `side` on another, each in a loop,
    until both have `repeats` runs (or `max_s` has passed). The side's first and last runs
    are dropped: they overlap the main loop only in part."""
    stop = threading.Event()
    side_s: list[float] = []

    def loop() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            side()
            side_s.append(time.perf_counter() - t0)

    thread = threading.Thread(target=loop, name="karma-profile-side", daemon=True)
    main_s: list[float] = []
    started = time.perf_counter()
    thread.start()
    try:
        main()  # warm-up, while the side loop gets going
        while (len(main_s) < repeats or len(side_s) < repeats + 1) \
                and time.perf_counter() - started < max_s:
            t0 = time.perf_counter()
            main()
            main_s.append(time.perf_counter() - t0)
    finally:
        stop.set()
        thread.join()
    return statistics.median(main_s), statistics.median(side_s[1:-1] or side_s)


def mem_available_bytes() -> int:
    """The host memory available to a new process (MemAvailable from /proc/meminfo, as the
    runtime's start check reads it, else the free physical pages); a KarmaError where
    neither can be read."""
    available = meminfo_available_bytes()
    if available is not None:
        return available
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError) as e:
        raise KarmaError(
            "cannot tell how much host memory is available (no /proc/meminfo); write "
            "host_mem_bytes into the profile by hand"
        ) from e


def _round3(x: float) -> float:
    """`x` to three significant digits: measurements are not more precise than that."""
    return float(f"{x:.3g}")


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"
