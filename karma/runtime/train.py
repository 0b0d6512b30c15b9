"""The training loop: rebuild the model from the schedule's model file and replay the schedule.

Initialisation follows the reference order exactly, so that runs are reproducible and equal
to plain PyTorch: torch.manual_seed(seed), build_model() on the CPU, the optimizer, then the
data; nothing else draws from the global RNG before training starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from karma.errors import KarmaError
from karma.modelfile import ModelFile, load_model_file
from karma.runtime import distributed
from karma.runtime.backend import make_backend
from karma.runtime.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from karma.runtime.distributed import GradientExchange, Ranks
from karma.runtime.engine import Engine
from karma.runtime.host import (
    BuildInTier,
    HostPool,
    data_bytes,
    private_bytes,
    return_freed_memory_promptly,
)
from karma.runtime.streams import OpFailed
from karma.schedule import Schedule, schedule_sha256
from karma.units import format_bytes, format_seconds

# On the CPU backend, factory tensors of at least this size are built in the host tier.
TIER_MIN_BYTES = 1 << 20

# --cap-device-memory leaves the allocator this much beyond the budget: cuBLAS workspaces and
# the allocator's rounding, which the planner does not count.
DEVICE_SLACK_BYTES = 256 << 20


@dataclass(frozen=True)
class RunOptions:
    steps: int = 10
    seed: int | None = None  # default: the schedule's
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0  # 0: only the final step
    resume: bool = False
    timeout_s: float = 60.0  # how long a collective waits for the other ranks
    cap_device_memory: bool = False  # CUDA: let the allocator have only the schedule's budget
    log: Callable[[str], None] = field(default=print)  # rank 0's progress lines


@dataclass(frozen=True)
class RunReport:
    steps: list[int]
    losses: list[float]
    step_s: list[float]
    peak_device_bytes: int
    predicted_step_s: float
    predicted_peak_device_bytes: int
    capacity_bytes: int
    host_tier_peak_bytes: int
    batch_size: int
    baseline_private_bytes: int  # before the model was built: what the peak is measured above
    baseline_data_bytes: int  # VmData then: the process's fixed cost under prlimit --data
    rank: int = 0
    world_size: int = 1
    allreduce_s: list[float] = field(default_factory=list)  # per step: all-reduces' wall time
    allreduce_hidden_s: list[float] = field(default_factory=list)  # the part compute hid
    predicted_allreduce_s: float = 0.0  # the schedule's busy time on the net stream

    def to_json(self) -> dict:
        median = statistics.median(self.step_s) if self.step_s else None
        return {**dataclasses.asdict(self), "step_s_median": median}


def open_model_file(schedule: Schedule, schedule_path: Path | None) -> ModelFile:
    """The schedule's model file, with its environment, checked against its fingerprint."""
    for key, value in schedule.model.env:
        os.environ[key] = value
    path = Path(schedule.model.path)
    if not path.is_absolute() and not path.exists() and schedule_path is not None:
        beside = schedule_path.resolve().parent / path
        path = beside if beside.exists() else path
    mf = load_model_file(path)
    if mf.sha256 != schedule.model.sha256:
        raise KarmaError(
            f"model file {path} has changed since the schedule was planned (fingerprint "
            f"{mf.sha256[:12]}, schedule has {schedule.model.sha256[:12]}); re-plan it with "
            f"karma-plan {schedule.model.path} ... -o SCHEDULE.yaml")
    return mf


def train(schedule: Schedule, mf: ModelFile, options: RunOptions) -> RunReport:
    """Train by replaying `schedule`: on one rank, or on each of the schedule's ranks."""
    backend = make_backend(dict(schedule.hardware).get("device_kind", "cpu"))
    if backend.name == "cuda" and schedule.config.world_size > 1:
        raise KarmaError("data parallelism on the CUDA backend (NCCL) is not built yet: plan "
                         "with --world-size 1, or with --hardware cpu to train several ranks "
                         "on the CPU backend")
    ranks = distributed.join(schedule.config.world_size, schedule_sha256(schedule), {
        "seed": options.seed, "steps": options.steps, "resume": options.resume,
        "checkpoints": options.checkpoint_dir is not None,
        "checkpoint_every": options.checkpoint_every}, options.timeout_s)
    try:
        return _train(schedule, mf, options, ranks, backend)
    finally:  # also after a failure: a process group left to the interpreter's exit aborts
        distributed.leave(ranks)


def _train(schedule: Schedule, mf: ModelFile, options: RunOptions, ranks: Ranks,
           backend) -> RunReport:
    log = options.log if ranks.main else _quiet
    return_freed_memory_promptly()
    seed = schedule.config.seed if options.seed is None else options.seed
    # The first optimizer a process makes imports torch._dynamo (about 70 MiB): a one-time
    # cost of PyTorch, not of the schedule, so it happens before the baseline is taken.
    mf.make_optimizer([torch.nn.Parameter(torch.zeros(1))])
    gc.collect()  # what an earlier model in this process left is not this run's baseline
    baseline = private_bytes()
    baseline_data = data_bytes()
    log(f"baseline before the model: {format_bytes(baseline)} private, "
        f"{format_bytes(baseline_data)} data segment (what prlimit --data caps)")
    meter = _PeakSampler(baseline) if backend.name == "cpu" else _DevicePeak(backend)
    if options.cap_device_memory:
        total = backend.cap(schedule.config.capacity_bytes + DEVICE_SLACK_BYTES)
        log(f"device memory capped at {format_bytes(schedule.config.capacity_bytes)} + "
            f"{format_bytes(DEVICE_SLACK_BYTES)} slack of {format_bytes(total)}")

    built = time.perf_counter()
    pool = HostPool(int(schedule.predicted.host_bytes * 1.1) + (64 << 20),
                    kind=backend.pool_kind)
    # on the CPU backend the model is built in the host tier (host.BuildInTier): its weights
    # need not fit in the memory the schedule allows
    tier = BuildInTier(pool, TIER_MIN_BYTES) if backend.name == "cpu" else None
    torch.manual_seed(seed)
    with tier or contextlib.nullcontext():
        model = mf.build_model()  # on the CPU: initial weights do not depend on the device
    model.train()
    exchange = GradientExchange(ranks) if ranks.world_size > 1 else None
    engine = Engine(schedule, model, mf.make_optimizer, pool, backend, exchange, tier)
    data = mf.batches(schedule.config.batch_size, ranks.rank, ranks.world_size)
    # every rank has built its model (ranks that build slower than --timeout get that long)
    distributed.barrier(ranks, "before the first step",
                        options.timeout_s + time.perf_counter() - built)

    start_step = 0
    if options.resume:
        found = latest_checkpoint(options.checkpoint_dir) if options.checkpoint_dir else None
        distributed.agree(ranks, "checkpoint to resume from", found.name if found else "none",
                          "all ranks must see the same --checkpoint-dir (a shared file system)")
        if found is None:
            log("resume: no complete checkpoint found; starting from step 0")
        else:
            start_step = load_checkpoint(found, model, engine)
            for _ in range(start_step):  # the data stream continues where it stopped
                next(data)
            log(f"resumed from {found} (step {start_step})")

    steps: list[int] = []
    losses: list[float] = []
    times: list[float] = []
    allreduce_s: list[float] = []
    hidden_s: list[float] = []
    predicted = schedule.predicted
    failed = True
    try:
        for step in range(start_step + 1, options.steps + 1):
            inputs, targets = next(data)
            inputs = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
            inputs = tuple(backend.to_device(x) if isinstance(x, torch.Tensor) else x
                           for x in inputs)
            if isinstance(targets, torch.Tensor):
                targets = backend.to_device(targets)
            meter.start()
            t0 = time.perf_counter()
            try:
                engine.begin_iteration()
                output = model(*inputs)
                engine.before_loss()
                loss = mf.loss_fn(output, targets)
                del output
                loss.backward()
                engine.end_iteration()
            except OpFailed as e:
                if isinstance(e.__cause__, distributed.RankLost):  # not, say, out of memory
                    raise distributed.lost(ranks, f"in step {step}'s gradient exchange",
                                           e.__cause__.__cause__) from e
                raise
            elapsed = time.perf_counter() - t0
            peak = meter.stop()
            steps.append(step)
            losses.append(loss.item())
            times.append(elapsed)
            line = _progress(step, options.steps, losses[-1], elapsed,
                             schedule.config.batch_size * ranks.world_size, peak,
                             predicted.peak_device_bytes, predicted.iteration_s)
            if exchange is not None:
                calls = exchange.take_intervals()
                allreduce_s.append(sum(end - begin for begin, end in calls))
                hidden_s.append(distributed.hidden_s(calls, engine.blocked))
                line += (f"  all-reduce {format_seconds(allreduce_s[-1])} "
                         f"({format_seconds(hidden_s[-1])} hidden; predicted "
                         f"{format_seconds(dict(predicted.busy_s).get('net', 0.0))})")
            log(line)
            final = step == options.steps
            every = options.checkpoint_every
            if options.checkpoint_dir is not None and (final or (every and step % every == 0)):
                if ranks.main:  # the ranks hold the same weights: one writes them
                    path = save_checkpoint(options.checkpoint_dir, step, model, engine,
                                           schedule, seed)
                    log(f"checkpoint {path}")
                distributed.barrier(ranks, f"after the checkpoint of step {step}",
                                    options.timeout_s, distributed.CHECKPOINT_WAIT_S)
        # the ranks stepped the same averaged gradients: their weights must be equal
        if ranks.world_size > 1:
            distributed.agree(ranks, "parameters after the last step", _digest(engine),
                              "this is a bug in karma: please report it with the schedule")
        failed = False
    finally:
        engine.close(failed)
        pool_peak = pool.peak_bytes
        pool.close()
    return RunReport(
        steps=steps, losses=losses, step_s=times, peak_device_bytes=meter.peak,
        predicted_step_s=predicted.iteration_s,
        predicted_peak_device_bytes=predicted.peak_device_bytes,
        capacity_bytes=schedule.config.capacity_bytes, host_tier_peak_bytes=pool_peak,
        batch_size=schedule.config.batch_size, baseline_private_bytes=baseline,
        baseline_data_bytes=baseline_data, rank=ranks.rank, world_size=ranks.world_size,
        allreduce_s=allreduce_s, allreduce_hidden_s=hidden_s,
        predicted_allreduce_s=dict(predicted.busy_s).get("net", 0.0),
    )


def _digest(engine: Engine) -> str:
    """A fingerprint of the current parameters (the host masters where the host steps)."""
    h = hashlib.sha256()
    for w in engine.weights:
        for name, t in w.current().items():
            h.update(name.encode())
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _quiet(line: str) -> None:
    """Ranks other than 0 print no progress lines (their errors still reach stderr)."""


class _DevicePeak:
    """Peak device memory above what was allocated before the model was placed."""

    def __init__(self, backend):
        self._backend = backend
        backend.warm_up()  # cuBLAS's workspace: a one-time cost of CUDA, not of the schedule
        self.baseline = backend.memory_baseline()
        self.peak = 0

    def start(self) -> None:
        self._backend.reset_peak()

    def stop(self) -> int:
        step_peak = max(0, self._backend.peak_bytes() - self.baseline)
        self.peak = max(self.peak, step_peak)
        return step_peak


class _PeakSampler:
    """Peak private memory above a baseline, sampled every millisecond on a thread."""

    def __init__(self, baseline: int):
        self.baseline = baseline
        self.peak = 0  # over the whole run
        self.step_peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start sampling a new step (stop() returns that step's peak)."""
        self.step_peak = 0
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> int:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
        return self.step_peak

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self._sample()

    def _sample(self) -> None:
        now = private_bytes() - self.baseline
        self.step_peak = max(self.step_peak, now)
        self.peak = max(self.peak, now)


def _progress(step: int, total: int, loss: float, step_s: float, batch: int, peak: int,
              predicted_peak: int, predicted_s: float) -> str:
    return (f"step {step}/{total}  loss {loss:.4f}  {format_seconds(step_s)}/step "
            f"(predicted {format_seconds(predicted_s)})  {batch / step_s:.1f} samples/s  "
            f"peak {format_bytes(peak)} (predicted {format_bytes(predicted_peak)})")


