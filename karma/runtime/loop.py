"""karma-run's training loop: a loop over `Runtime` (runtime.py) with the model file's data,
progress lines, evaluation, checkpoints, resume and the report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from karma.errors import KarmaError
from karma.modelfile import ModelFile
from karma.runtime.checkpoints.checkpoint import (
    latest_checkpoint,
)
from karma.runtime.checkpoints.dir_lock import DirectoryLock
from karma.runtime.distributed import process_group
from karma.runtime.distributed.exchange import hidden_s
from karma.runtime.replay.engine import Engine
from karma.runtime.runtime import Runtime, open_model_file
from karma.schedule import Schedule
from karma.timeline import write_trace
from karma.units import format_bytes, format_seconds

__all__ = ["RunOptions", "RunReport", "open_model_file", "train"]


@dataclass(frozen=True)
class RunOptions:
    steps: int = 10
    seed: int | None = None  # default: the schedule's
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0  # 0: only the final step
    resume: bool = False
    timeout_s: float = 60.0  # how long a collective waits for the other ranks
    # CUDA: emulate a GPU of the schedule's budget (True) or of this many bytes; the CPU
    # backend: True caps the process's data segment from the plan (--cap-memory, memcap.py)
    cap_device_memory: bool | int = False
    dist_backend: str | None = None  # several ranks: nccl or gloo (None: nccl on CUDA, else gloo)
    eval_every: int = 0  # evaluate on the model file's eval_batches every N steps (0: never)
    trace_path: Path | None = None  # write the timeline of one step here (timeline.py)
    trace_step: int | None = None  # the step traced; None: the second this run trains
    trace_steps: int = 1  # how many steps traced from trace_step on (trace_file: their files)
    host_optimizer: str | None = None  # the host steps' kernel; None: the schedule's
    # rank 0's progress lines
    log: Callable[[str], None] = field(default=logging.getLogger("karma").info)


@dataclass(frozen=True)
class RunReport:
    steps: list[int]
    losses: list[float]
    step_s: list[float]
    lrs: list[float | None]  # per step: the learning rate it used (param group 0's)
    grad_norms: list[float | None]  # per step: the gradient norm before clipping (if clipped)
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
    dist_backend: str | None = None  # the all-reduces' backend on several ranks (nccl, gloo)
    # CUDA, absolute (not above the baseline), over the run: the caching allocator's peak
    # allocated and reserved bytes, and what was in use outside it at the start (the context)
    device_peak_allocated_bytes: int = 0
    device_peak_reserved_bytes: int = 0
    device_outside_allocator_bytes: int = 0
    evals: list[dict] = field(default_factory=list)  # {"step", "loss", "peak_bytes"} each eval
    # CPU backend with its cache: the most the process held outside its tensors (thread
    # pools, small tensors, Python objects) at a step's start after the first; in the
    # measured peak, and in the plan's as planned_outside_bytes (measured when calibrating)
    outside_private_bytes: int = 0
    planned_outside_bytes: int = 0
    predicted_ideal_s: float | None = None  # the schedule's ideal_s (unlimited memory)
    # per step: seconds the compute thread waited, per stream blamed (the traced step's
    # intervals are in the trace file)
    wait_s: list[dict[str, float]] = field(default_factory=list)
    traced_step: int | None = None  # the last step written to RunOptions.trace_path
    # each rank's host memory at its peak (its tier's, and its share of the node's copy of
    # the weights), in rank order, beside the schedule's per-rank prediction
    rank_host_bytes: list[int] = field(default_factory=list)
    predicted_host_bytes: int = 0

    def to_json(self) -> dict:
        median = statistics.median(self.step_s) if self.step_s else None
        return {**dataclasses.asdict(self), "step_s_median": median}


def train(schedule: Schedule, mf: ModelFile, options: RunOptions) -> RunReport:
    """Train by replaying `schedule`: on one rank, or on each of the schedule's ranks."""
    agree = {"steps": options.steps, "resume": options.resume,
             "checkpoints": options.checkpoint_dir is not None,
             "checkpoint_every": options.checkpoint_every, "eval_every": options.eval_every}
    evals = mf.checked_eval_batches(schedule.config.batch_size) if options.eval_every else []
    with Runtime(schedule, options.seed, model_file=mf, timeout_s=options.timeout_s,
                 cap_device_memory=options.cap_device_memory, log=options.log,
                 agree=agree, dist_backend=options.dist_backend,
                 host_optimizer=options.host_optimizer) as rt, _sole_writer(rt, options):
        report = _train(rt, options, evals)
    return dataclasses.replace(report, host_tier_peak_bytes=rt.pool_peak_bytes,
                               outside_private_bytes=rt.outside_bytes)


def _train(rt: Runtime, options: RunOptions, evals: list) -> RunReport:
    schedule, ranks, log = rt.schedule, rt.ranks, rt.log
    data = rt.model_file.checked_batches(schedule.config.batch_size, ranks.rank,
                                          ranks.world_size)
    start_step = _resume(rt, options, data) if options.resume else 0
    first = traced_step(options, start_step)
    traced = range(first, first + options.trace_steps) if first is not None else range(0)
    report = RunReport(
        steps=[], losses=[], step_s=[], lrs=[], grad_norms=[], peak_device_bytes=0,
        predicted_step_s=schedule.predicted.step_s,
        predicted_ideal_s=schedule.predicted.ideal_s,
        predicted_peak_device_bytes=schedule.predicted.peak_device_bytes,
        planned_outside_bytes=schedule.process_bytes,
        capacity_bytes=schedule.config.capacity_bytes, host_tier_peak_bytes=0,
        batch_size=schedule.config.batch_size, baseline_private_bytes=rt.baseline_private_bytes,
        baseline_data_bytes=rt.baseline_data_bytes, rank=ranks.rank,
        world_size=ranks.world_size, dist_backend=ranks.dist_backend,
        predicted_allreduce_s=dict(schedule.predicted.busy_s).get("net", 0.0),
        predicted_host_bytes=schedule.predicted.host_bytes)
    for step in range(start_step + 1, options.steps + 1):
        if step in traced:
            rt.trace_next_step()
        for _ in range(rt.accumulate):  # one micro-batch each
            inputs, targets = next(data)
            rt.micro_step(inputs, targets)
        log(_record(report, step, options.steps, rt))
        if rt.last.trace is not None and options.trace_path is not None:
            path = trace_file(options.trace_path, step, options.trace_steps)
            if ranks.main:  # the ranks run the same schedule: one writes its timeline
                write_trace(path, rt.last.trace)
            report = dataclasses.replace(report, traced_step=step)
            waits = ", ".join(f"{s} {format_seconds(t)}" for s, t in report.wait_s[-1].items())
            log(f"trace of step {step} written to {path} (compute waited for: "
                f"{waits or 'nothing'})")
        if options.eval_every and step % options.eval_every == 0:
            report.evals.append(_evaluate(rt, evals, step))
        every = options.checkpoint_every
        if options.checkpoint_dir is not None and (
                step == options.steps or (every and step % every == 0)):
            _checkpoint(rt, options, step)
    # the ranks stepped the same averaged gradients: their weights must be equal
    if ranks.world_size > 1:
        process_group.agree(ranks, "parameters after the last step", _digest(rt.engine),
                            "this is a bug in karma: please report it with the schedule")
    rank_host = process_group.gather(ranks, rt.host_bytes, "comparing their host memory")
    return dataclasses.replace(report, peak_device_bytes=rt.meter.peak, rank_host_bytes=rank_host,
                               **rt.meter.absolute())


@contextlib.contextmanager
def _sole_writer(rt: Runtime, options: RunOptions):
    """The run's hold on its checkpoint directory, rank 0's for all ([Note: one writer a
    checkpoint directory]); every rank stops if another run holds it."""
    lock = DirectoryLock(options.checkpoint_dir) \
        if options.checkpoint_dir is not None and rt.ranks.main else None
    problem = lock.acquire() if lock is not None else None
    problem = process_group.gather(rt.ranks, problem, "locking the checkpoint directory")[0]
    if problem is not None:
        raise KarmaError(problem)
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def _resume(rt: Runtime, options: RunOptions, data) -> int:
    """Load the newest complete checkpoint, if any, and move the data on to where it
    stopped; the step it was taken after (0: none found)."""
    found = latest_checkpoint(options.checkpoint_dir) if options.checkpoint_dir else None
    process_group.agree(rt.ranks, "checkpoint to resume from",
                        found.name if found else "none",
                        "all ranks must see the same --checkpoint-dir (a shared file system)")
    if found is None:
        rt.log("resume: no complete checkpoint found; starting from step 0")
        return 0
    start_step = rt.load(found)
    if start_step >= options.steps:
        raise KarmaError(f"{found} was taken after step {start_step}, and --steps "
                         f"{options.steps} ends there: nothing is left to train; give --steps "
                         f"more than {start_step}")
    for _ in range(start_step * rt.accumulate):  # the data continues where it stopped
        next(data)
    rt.log(f"resumed from {found} (step {start_step})")
    return start_step


def _record(report: RunReport, step: int, steps: int, rt: Runtime) -> str:
    """Add the step's figures to `report`; its progress line."""
    stats, predicted = rt.last, rt.schedule.predicted
    report.steps.append(step)
    report.losses.append(stats.loss)
    report.step_s.append(stats.step_s)
    report.lrs.append(stats.lr)
    report.grad_norms.append(stats.grad_norm)
    report.wait_s.append(stats.wait_s_by_stream())
    samples = rt.batch_size * rt.ranks.world_size * rt.accumulate
    line = _progress(step, steps, stats.loss, stats.lr, stats.step_s, samples,
                     stats.peak_bytes, predicted.peak_device_bytes, predicted.step_s)
    if stats.grad_norm is not None:
        line += f"  grad norm {stats.grad_norm:.4g}"
    if rt.exchange is not None:
        calls = stats.allreduce_intervals
        report.allreduce_s.append(sum(end - begin for begin, end in calls))
        report.allreduce_hidden_s.append(hidden_s(calls, stats.allreduce_blocked))
        line += (f"  all-reduce {format_seconds(report.allreduce_s[-1])} "
                 f"({format_seconds(report.allreduce_hidden_s[-1])} hidden; predicted "
                 f"{format_seconds(report.predicted_allreduce_s)})")
    return line


def _evaluate(rt: Runtime, evals: list, step: int) -> dict:
    """The mean loss over the held-out batches, and the evaluation's peak."""
    losses, peak = [], 0
    for x, y in evals:
        losses.append(rt.evaluate(x, y))
        peak = max(peak, rt.last_eval_peak_bytes)
    mean = sum(losses) / len(losses)
    rt.log(f"eval at step {step}: loss {mean:.4f} (mean of {len(losses)} held-out "
           f"batches)  peak {format_bytes(peak)}")
    return {"step": step, "loss": mean, "peak_bytes": peak}


def _checkpoint(rt: Runtime, options: RunOptions, step: int) -> None:
    """Every rank writes its part (checkpoints/checkpoint.py); rank 0 puts the checkpoint in
    place."""
    path = rt.save(options.checkpoint_dir)  # step_N of the steps so far: `step`
    if rt.ranks.main:
        rt.log(f"checkpoint {path}")
    process_group.barrier(rt.ranks, f"after the checkpoint of step {step}",
                          options.timeout_s, process_group.CHECKPOINT_WAIT_S)


def traced_step(options: RunOptions, start_step: int) -> int | None:
    """The step that --trace records: the one asked for, or the second this run trains
    (the first pays one-time costs: first touches of memory, lazy initialisation)."""
    if options.trace_path is None:
        return None
    if options.trace_step is None:
        return min(start_step + 2, options.steps)
    if not start_step < options.trace_step <= options.steps:
        raise KarmaError(f"--trace-step {options.trace_step} is not a step this run trains "
                         f"(steps {start_step + 1} to {options.steps}); choose one of those")
    return options.trace_step


def trace_file(path: Path, step: int, steps: int = 1) -> Path:
    """Where the trace of `step` goes: `path` itself when one step is traced, else the step
    in its name (trace.json: trace.step2.json, trace.step3.json, ...)."""
    path = Path(path)
    return path if steps == 1 else path.with_name(f"{path.stem}.step{step}{path.suffix}")


def _digest(engine: Engine) -> str:
    """A fingerprint of the current parameters (the host masters where the host steps)."""
    engine.settle()
    h = hashlib.sha256()
    for w in engine.weights:
        for name, t in w.current().items():
            h.update(name.encode())
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _progress(step: int, total: int, loss: float, lr: float | None, step_s: float, batch: int,
              peak: int, predicted_peak: int, predicted_s: float) -> str:
    rate = f"  lr {lr:.4g}" if lr is not None else ""
    return (f"step {step}/{total}  loss {loss:.4f}{rate}  {format_seconds(step_s)}/step "
            f"(predicted {format_seconds(predicted_s)})  {batch / step_s:.1f} samples/s  "
            f"peak {format_bytes(peak)} (predicted {format_bytes(predicted_peak)})")


