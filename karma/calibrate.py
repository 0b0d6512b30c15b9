"""Calibrated planning: when karma plans for this machine, it measures it.

    cal = calibrate(mf, graph, "cpu", load_hardware("cpu"), measure=None)
    cal.hardware        # the profile to plan with: built-in sizes, this machine's rates
    cal.measured_s      # (fwd s, bwd s) per block, or None for the roofline estimate
    cal.measured_step_s # (device s, host s) of each block's optimizer step, or None
    cal.process_bytes   # what the process holds outside its tensors while training (CPU), or 0
    cal.summary         # one line for karma-plan: where the block times came from

Which hardware is "this machine": the built-in `cpu` profile (the CPU backend always runs on
the local CPU), and a built-in GPU profile that names the local GPU (its family, e.g. h100, in
the device's name and its memory within 10%). Planning for any other built-in profile, or for
a karma-profile file (which may describe another machine), uses that profile's numbers and the
roofline estimate; `measure=True` (karma-plan --profile-blocks) still times the blocks on the
local device of the profile's kind, keeping the profile's other numbers.

What is measured, once, then cached as JSON under $XDG_CACHE_HOME/karma (default
~/.cache/karma), each file named by a hash of everything its numbers depend on:
- the machine's rates (`measure_local(quick=True)`: matmul, memory and copy bandwidth, host
  optimizer, and on the CPU how its streams slow each other), measured under the runtime's
  allocator settings ([Note: timing under the runtime's allocator]), keyed by the CPU model, core and thread counts, OMP_WAIT_POLICY, the GPU's name
  and the torch version. The profile's sizes (memory, disk, network) stay the built-in ones:
  the budget is --gpu-mem, and the network is not measured.
- every distinct block's forward and backward, and the model file's optimizer stepping its
  weights (karma.ir.timing, [Note: timing the optimizer step]), keyed by the machine, the
  model file's sha256 and the KARMA_* environment, the block graph's hash, the batch size,
  the dtype and --blocks.
A cache file that cannot be read or does not check out is measured again, never an error.

[Note: a machine whose speed drifts] A shared machine's speed changes under its other
tenants: on the 2-core CI machine the same in-context calibration of the fidelity MLP (2048
wide, 8 deep, batch 512) put its keep_all step at 1.50 s at 07:36 and at 1.04 s at 08:20 the
same morning, and plans calibrated at the first ran 0.68-0.76x their predictions at the
second. The cache keeps the first measurement, so `remeasure` (karma-plan --remeasure)
measures the machine and the blocks again, and karma-run says so when the steps of a
measured plan take outside 0.8-1.25x the predicted time (wider than the fidelity bound: a
demo calibrated a minute before ran 1.16x, the noise of eight steps on this machine).
If timing the blocks fails when measuring was not asked for (measure=None), the plan uses the
roofline estimate and says so: a plan that worked before calibration keeps working.

[Note: timing at a smaller batch] Timing every block at the plan's batch can take minutes on
a CPU (GPT-2 small's output layer alone does 1.9 TFLOP per step at batch 8). Blocks are timed
at the largest batch whose roofline estimate from the profile given (not the measured one:
a quick matmul's rate varies threefold between runs on a shared machine), one forward and
backward of each distinct block, stays under _TIMING_BUDGET_S, and their times are scaled by
the plan's batch over that one. A block's work is proportional to its batch, so this is close
once a batch fills the device; what does not grow with the batch (per-call overheads, an
embedding's dense weight gradient) is scaled up too, which errs slow. GPT-2 small (sequence
1024) on the 2-core machine: timed at batch 2, its layers' time per sample is 1.445 s against
1.211 s at batch 4 (1.380 s at batch 1); its output layer's 5.06 s against 4.72 s.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from karma.errors import KarmaError
from karma.fileio import cache_dir, filesystem_type, tier_directory, write_text_atomic
from karma.ir.graph import BlockGraph
from karma.modelfile import ModelFile
from karma.planner.hardware import (
    Hardware,
    builtin_names,
    dump_hardware,
    hardware_from_yaml,
    load_hardware,
)
from karma.planner.problem import build_problem
from karma.schedule import model_env

CACHE_VERSION = 5  # bump when what a cache file holds changes meaning (3: in context; 4: scaled
# to the median step; 5: with the process's bytes outside its tensors)
_TIMING_BUDGET_S = 15.0  # see [Note: timing at a smaller batch]
_IN_CONTEXT_BUDGET_S = 120.0  # the keep_all steps at most this long (roofline): [Note: block
# times in context]
_RATE_FIELDS = ("flops_per_s", "mem_bytes_per_s", "h2d_bytes_per_s", "d2h_bytes_per_s",
                "host_optim_bytes_per_s",
                # how the streams slow each other (hardware.py, [Note: contention between
                # streams]): measured on the CPU, 0 on a GPU
                "compute_slowdown_copy", "copy_slowdown_compute", "compute_slowdown_host",
                "host_slowdown_compute")
# what is measured and how; 2: the contention fractions; 3: under the runtime's allocator;
# 4: with its CPU cache (runtime/cpu_cache.py); 5: contention conserves work
# (measure_hw._conserving, since removed); 6: the tier measured where the runtime keeps it
# (fileio.tier_directory); 7: the fractions recorded as measured (the simulator bounds their
# sum: simulate.Contention.speed)
MACHINE_VERSION = 7


@dataclass(frozen=True)
class Calibration:
    """What to plan with, and where its numbers came from."""

    hardware: Hardware  # the profile given, with this machine's rates when it was measured
    measured_s: tuple[tuple[float, float], ...] | None  # per block; None: roofline estimate
    summary: str  # e.g. "measured on this machine (cached in ~/.cache/karma/blocks-....json)"
    # (device s, host s) of each block's optimizer step; None: from the profile's rates
    measured_step_s: tuple[tuple[float, float], ...] | None = None
    # what the process held outside its tensors while it trained (CPU backend, measured in
    # a keep_all step: [Note: the process's own memory]); 0 when not measured
    process_bytes: int = 0


@dataclass(frozen=True)
class _Timed:
    """What timing a model's blocks measured, and how."""

    fwd_bwd_s: tuple[tuple[float, float], ...]  # per block
    step_s: tuple[tuple[float, float], ...]  # (device s, host s) of each block's optimizer step
    process_bytes: int  # Calibration.process_bytes
    where: str  # "in a keep_all step" or "block by block"


def local_device(hardware: str | Hardware) -> str | None:
    """"cpu" or "cuda" if `hardware` (a built-in profile's name) is this machine, else None."""
    if not isinstance(hardware, str) or hardware not in builtin_names():
        return None
    if hardware == "cpu":
        return "cpu"
    import torch

    if not torch.cuda.is_available():
        return None
    hw = load_hardware(hardware)
    name = torch.cuda.get_device_name().lower()
    total = torch.cuda.get_device_properties(0).total_memory
    family = hardware.split("-")[0]
    same = family in name and abs(total - hw.device_mem_bytes) <= 0.1 * hw.device_mem_bytes
    return "cuda" if same else None


def calibrate(mf: ModelFile, graph: BlockGraph, hardware: str | Hardware, hw: Hardware,
              measure: bool | None = None, blocks_regex: str | None = None,
              log: Callable[[str], None] | None = None, remeasure: bool = False) -> Calibration:
    """The profile and block times to plan `graph` with on `hw` (loaded from `hardware`).

    measure: None (default) measures when `hardware` is this machine (see `local_device`);
    False never does; True times the blocks on the local device of hw's kind in any case.
    remeasure: measure again what the cache holds (the machine and the blocks), and cache
    that ([Note: a machine whose speed drifts]).
    """
    say = log or (lambda line: None)
    if measure is False:
        return Calibration(hw, None, "roofline estimate (--no-measure)")
    device = local_device(hardware)
    if device is None and not measure:
        return Calibration(hw, None, f"roofline estimate from the {hw.name} profile "
                                     "(not this machine)")
    profile = hw  # its rates size the timing (see [Note: timing at a smaller batch])
    local = device is not None
    if not local:
        device = _device_for(hw)
    if local:
        with _allocating_as_the_runtime_does(device):
            hw = _measured_machine(device, hw, say, remeasure)
    start = time.perf_counter()
    try:
        timed, path, fresh = _block_times(
            mf, graph, profile, device, blocks_regex, say,
            in_context_hw=hw if local and device == "cpu" and blocks_regex is None else None,
            remeasure=remeasure)
    except KarmaError as e:
        if measure:  # asked for: the error is the answer
            raise
        say(f"could not time the blocks ({e}); planning with the roofline estimate "
            "(--no-measure skips trying)")
        return Calibration(hw, None, "roofline estimate (timing the blocks failed)")
    how = (f"measured now in {time.perf_counter() - start:.0f} s" if fresh
           else "measured on this machine")
    return Calibration(hw, timed.fwd_bwd_s, f"{how}, {timed.where} (cached in {path})",
                       timed.step_s, timed.process_bytes)


@contextlib.contextmanager
def _allocating_as_the_runtime_does(device: str):
    """[Note: timing under the runtime's allocator] On the CPU backend the runtime returns
    freed memory to the system promptly (runtime/host.py, [Note: glibc keeps freed memory])
    and keeps the tensors a step frees for the next step in its own cache ([Note: a caching
    allocator for the CPU backend], runtime/cpu_cache.py). Timed under glibc's defaults, the
    blocks of GPT-2 small (sequence 64, batch 2) predicted 1.65 s for a keep_all step that
    took 2.44 s under the prompt return alone. So the machine and the blocks are measured as
    the runtime allocates: the glibc setting is process-wide and the one a karma.Runtime in
    this process would make anyway; the cache runs (unbounded) while measuring only."""
    if device != "cpu":
        yield
        return
    from karma.runtime import cpu_cache
    from karma.runtime.host import return_freed_memory_promptly

    return_freed_memory_promptly()
    cache = cpu_cache.load()
    if cache is not None:
        cache.start(1 << 62)
    try:
        yield
    finally:
        if cache is not None:
            cache.stop()


def _device_for(hw: Hardware) -> str:
    import torch

    if hw.device_kind == "cuda" and not torch.cuda.is_available():
        raise KarmaError(f"measuring times blocks on this machine, which has no GPU, so it "
                         f"cannot stand for --hardware {hw.name}; plan without "
                         "--profile-blocks (measure=True) or for --hardware cpu")
    return hw.device_kind


# ---------------------------------------------------------------------------------------------
# The machine


def _machine_key(device: str) -> dict:
    import torch

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


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _measured_machine(device: str, hw: Hardware, say: Callable[[str], None],
                      remeasure: bool = False) -> Hardware:
    """`hw` with this machine's measured rates (cached)."""
    key = _machine_key(device)
    path = _cache_path("machine", key)
    measured = None if remeasure else _read_machine(path)
    if measured is None:
        from karma.planner.measure_hw import measure_local

        say(f"measuring this machine ({device}; {'again' if remeasure else 'once'}, cached in "
            f"{path})")
        measured = measure_local(device, quick=True)
        _write(path, {"key": key, "hardware": dump_hardware(measured)}, say)
    return replace(hw, **{f: getattr(measured, f) for f in _RATE_FIELDS})


def _read_machine(path: Path) -> Hardware | None:
    data = _read(path)
    try:
        return hardware_from_yaml(data["hardware"], str(path))
    except (KarmaError, KeyError, TypeError):
        return None


# ---------------------------------------------------------------------------------------------
# The blocks


def _block_times(mf: ModelFile, graph: BlockGraph, hw: Hardware, device: str,
                 blocks_regex: str | None, say: Callable[[str], None],
                 in_context_hw: Hardware | None = None, remeasure: bool = False
                 ) -> tuple[_Timed, Path, bool]:
    """Every block's (fwd s, bwd s) at the graph's batch and (device s, host s) of its
    optimizer step, where they were timed, and whether now (else from the cache). With
    `in_context_hw` (this machine's CPU profile), in a whole training step if one fits
    ([Note: block times in context]), else block by block."""
    key = {
        "machine": _machine_key(device),
        "model_sha256": mf.sha256,
        "env": [list(kv) for kv in model_env()],
        "graph_sha256": hashlib.sha256(graph.to_json().encode()).hexdigest(),
        "batch_size": graph.batch_size,
        "dtype": graph.dtype,
        "blocks": blocks_regex,
    }
    key["in_context"] = in_context_hw is not None
    path = _cache_path("blocks", key)
    cached = None if remeasure else _read_times(path, len(graph.blocks))
    if cached is not None:
        return cached, path, False
    if in_context_hw is not None:
        timed = _timed_in_context(mf, graph, in_context_hw, path, say, remeasure)
        if timed is not None:
            _write(path, {"key": key, **vars(timed)}, say)
            return timed, path, True
    from karma.ir.timing import time_blocks

    batch = timing_batch(graph, hw)
    say(f"timing the blocks of {graph.model} on this machine ({device}, batch {batch}"
        + (f", scaled to {graph.batch_size}" if batch != graph.batch_size else "")
        + f"; {'again' if remeasure else 'once'}, cached in {path})")
    with _allocating_as_the_runtime_does(device):
        timed = time_blocks(mf, batch, blocks_regex, device, graph.dtype, log=say)
    if timed.names != tuple(b.name for b in graph.blocks):
        raise KarmaError(f"timing {graph.model} at batch {batch} found the blocks "
                         f"{', '.join(timed.names)}, not the plan's; plan with --no-measure")
    scale = graph.batch_size / batch
    times = tuple((fwd * scale, bwd * scale) for fwd, bwd in timed.fwd_bwd_s)
    steps = tuple(_owned_share(b.param_bytes, stepped, step)
                  for b, stepped, step in zip(graph.blocks, timed.stepped_bytes, timed.step_s))
    measured = _Timed(times, steps, 0, "block by block")
    _write(path, {"key": key, "timed_batch_size": batch, "distinct_blocks": timed.distinct,
                  **vars(measured)}, say)
    return measured, path, True


def _timed_in_context(mf: ModelFile, graph: BlockGraph, hw: Hardware, path: Path,
                      say: Callable[[str], None], remeasure: bool = False) -> _Timed | None:
    """[Note: block times in context] Timed alone, a block runs with its weights and inputs
    warm in the caches and its allocations served at once; inside a training step it runs
    after the others evicted them, under the runtime's bounded CPU cache, and the tied
    weight's two gradients meet in its backward. On GPT-2 small (sequence 64, batch 2) the
    keep_all step ran 1.16x what the blocks timed alone predicted: forwards 1.27x, the
    embedding's backward 5.9x, its optimizer step 2.2x. So on the CPU backend, where a
    keep_all step fits in RAM (its planned peak within half of MemAvailable) and takes
    seconds (three steps within _IN_CONTEXT_BUDGET_S by the roofline), the runtime itself
    trains keep_all steps (as many as fit the budget, three to six) and the third one's trace
    gives every block's forward, backward and optimizer step (the host optimizer's too: the
    same step on the same CPU).

    One step is one sample of a noisy machine, and the third an early one: on GPT-2 small
    (sequence 64, batch 2) two runs of eight keep_all steps took 1.74 and 1.99 s in their
    third step against medians of 2.16 and 2.15 s over steps 2-8, and plans calibrated on the
    third step alone ran 0.82-1.21x their predictions. So the trace's times are scaled by the
    median of the steps after the first over the third's own time.
    Otherwise, or if that fails, the blocks are timed alone (karma.ir.timing).

    [Note: the process's own memory] On the CPU backend the measured peak is the process's
    private memory above its baseline, and the process holds more than its tensors while it
    trains: the stream workers' thread pools and malloc arenas, tensors under the CPU cache's
    64 KiB, the autograd graph's nodes, Python objects. The demo's plan (GPT-2 small) held
    24-25 MiB of it at every step's start after the first, and its memory through a step was
    the schedule's live buffers plus 25-28 MiB; planned at 797 MiB of an 800 MiB budget
    without it, it peaked at 804-807 MiB. The keep_all steps measure it
    (RunReport.outside_private_bytes, the most at a step's start after the first), and the
    planner counts it in every stage (Problem.process_bytes). Blocks timed alone do not
    measure it (0).

    The steps run in a process of their own, `karma-run` as a user runs it: the private
    memory of a process that has done other work is no measure of a run's (in a test
    process, pages its earlier work had freed served the run's first 3.8 MiB, and the
    outside came to -3.8 MiB), and its step times are not those of a fresh karma-run."""
    import subprocess
    import sys
    import tempfile

    import karma
    from karma.ir.optimizer import optimizer_profile
    from karma.planner.measure_hw import _mem_available_bytes
    from karma.planner.pipeline import PlanRequest, make_schedule
    from karma.schedule import ModelRef

    model = ModelRef.now(str(Path(mf.path).resolve()), mf.sha256, graph.to_json())
    report = make_schedule(graph, model, PlanRequest(
        capacity_bytes=1 << 62, hardware=hw, batch_size=graph.batch_size, dtype=graph.dtype,
        strategy="keep_all", optimizer=optimizer_profile(mf)))
    schedule = report.schedule
    need, free = schedule.predicted.peak_device_bytes, _mem_available_bytes()
    n_steps = min(6, int(_IN_CONTEXT_BUDGET_S // max(schedule.predicted.iteration_s, 1e-9)))
    if need > free // 2 or n_steps < 3:
        say(f"a keep_all step of {graph.model} needs {need / 2**30:.1f} GiB of the "
            f"{free / 2**30:.1f} GiB free and about {schedule.predicted.iteration_s:.0f} s: "
            "timing its blocks one by one instead")
        return None
    say(f"timing the blocks of {graph.model} in {n_steps} keep_all steps on this machine (cpu, "
        f"batch {graph.batch_size}; {'again' if remeasure else 'once'}, cached in {path})")
    # the karma this process runs, wherever it was imported from
    source = str(Path(karma.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [source, *filter(None, [os.environ.get("PYTHONPATH")])])}
    try:
        with tempfile.TemporaryDirectory(prefix="karma-calibrate-") as directory:
            d = Path(directory)
            schedule.save(d / "keep_all.yaml")
            ran = subprocess.run(
                [sys.executable, "-m", "karma.cli.run", str(d / "keep_all.yaml"),
                 "--steps", str(n_steps), "--trace", str(d / "trace.json"), "--trace-step", "3",
                 "--report", str(d / "report.json")],
                env=env, capture_output=True, text=True, timeout=10 * _IN_CONTEXT_BUDGET_S)
            if ran.returncode != 0:
                raise KarmaError((ran.stderr.strip().splitlines() or ["no message"])[-1])
            ops = json.loads((d / "trace.json").read_text())["ops"]
            run = json.loads((d / "report.json").read_text())
    except (OSError, ValueError, KeyError, KarmaError, subprocess.SubprocessError) as e:
        say(f"timing a keep_all step failed ({type(e).__name__}: {str(e)[:200]}); timing "
            "the blocks one by one instead")
        return None
    scale = _median_over_traced(run["step_s"])
    took = {(op["kind"], op["block"]): (op["end_s"] - op["start_s"]) * scale for op in ops}
    n = len(graph.blocks)
    times = tuple((took[("forward", i)], took[("backward", i)]) for i in range(n))
    steps = tuple((took.get(("device_step", i), 0.0),) * 2 for i in range(n))
    return _Timed(times, steps, int(run["outside_private_bytes"]), "in a keep_all step")


def _median_over_traced(step_s: list[float]) -> float:
    """The median of the steps after the first over the third's time (the traced step):
    what scales its trace to a typical step ([Note: block times in context])."""
    return statistics.median(step_s[1:]) / step_s[2]


def _owned_share(param_bytes: int, stepped_bytes: int, step_s: tuple[float, float]
                 ) -> tuple[float, float]:
    """A block's optimizer step for the weights it owns (`param_bytes`), from the step timed
    over every weight it uses (`stepped_bytes`, a tied weight's owner's too). The step does
    not grow with the batch: it is not scaled by it."""
    if stepped_bytes <= 0 or param_bytes <= 0:
        return 0.0, 0.0
    share = min(param_bytes / stepped_bytes, 1.0)
    return step_s[0] * share, step_s[1] * share


def timing_batch(graph: BlockGraph, hw: Hardware) -> int:
    """The batch to time blocks at (see [Note: timing at a smaller batch])."""
    problem = build_problem(graph, hw, graph.dtype)
    distinct = {}
    for b, cost in zip(graph.blocks, problem.blocks):
        shape = (b.param_bytes, b.act_bytes, b.out_bytes, b.fwd_flops, b.bwd_flops)
        distinct[shape] = cost.fwd_s + cost.bwd_s
    estimate_s = sum(distinct.values())
    if estimate_s <= _TIMING_BUDGET_S:
        return graph.batch_size
    return max(1, math.floor(graph.batch_size * _TIMING_BUDGET_S / estimate_s))


def _read_times(path: Path, n_blocks: int) -> _Timed | None:
    data = _read(path)
    try:
        times = tuple((float(f), float(b)) for f, b in data["fwd_bwd_s"])
        steps = tuple((float(d), float(h)) for d, h in data["step_s"])
        process_bytes = data["process_bytes"]
        where = str(data["where"])
    except (KeyError, TypeError, ValueError):
        return None
    ok = (len(times) == len(steps) == n_blocks
          and all(math.isfinite(t) and t >= 0 for p in (*times, *steps) for t in p)
          and isinstance(process_bytes, int) and process_bytes >= 0)
    return _Timed(times, steps, process_bytes, where) if ok else None


# ---------------------------------------------------------------------------------------------
# The cache


def _cache_path(kind: str, key: dict) -> Path:
    text = json.dumps({"version": CACHE_VERSION, **key}, sort_keys=True)
    return cache_dir() / f"{kind}-{hashlib.sha256(text.encode()).hexdigest()[:20]}.json"


def _read(path: Path) -> dict:
    """The cache file's JSON object, or {} when it is missing or unreadable."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write(path: Path, data: dict, say: Callable[[str], None]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps({"version": CACHE_VERSION, **data}, indent=1) + "\n")
    except (OSError, KarmaError) as e:
        say(f"could not cache the measurement in {path} ({e}); it is measured again next time")


__all__ = ["Calibration", "cache_dir", "calibrate", "local_device", "timing_batch"]
