"""karma's runtime as a library: one object that trains a model by replaying its schedule.

    import karma
    schedule = karma.plan("examples/gpt.py", gpu_mem="600M", hardware="cpu", batch_size=2)
    with karma.Runtime(schedule, seed=0) as rt:
        for inputs, targets in my_data:
            loss = rt.step(inputs, targets)      # one planned training iteration
        eval_loss = rt.evaluate(inputs, targets)  # forward only, under the same budget
        torch.save(rt.state_dict(), "state.pt")

`karma-run` is a loop over this object (train.py). Initialisation follows the reference
order exactly, so that runs are reproducible and equal to plain PyTorch:
torch.manual_seed(seed), build_model() on the CPU, the optimizer, the model file's LR
scheduler; the caller's data comes after. Inside torchrun the object joins the process group
as karma-run does.
"""

from __future__ import annotations

import contextlib
import gc
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from karma.errors import KarmaError, ModelFileError
from karma.modelfile import (
    ModelFile,
    ModelInputs,
    check_batch,
    check_signature,
    load_model_file,
    map_targets,
    output_tensors,
)
from karma.runtime import cpu_cache, distributed
from karma.runtime.backend import make_backend
from karma.runtime.checkpoint import load_runtime_state, runtime_state
from karma.runtime.distributed import Ranks
from karma.runtime.engine import Engine
from karma.runtime.exchange import GradientExchange
from karma.runtime.host import (
    BuildInTier,
    HostPool,
    data_bytes,
    pool_bytes,
    private_bytes,
    return_freed_memory_promptly,
)
from karma.runtime.hostmem import host_memory_problem, measure_host_memory
from karma.runtime.lr import LRSchedule
from karma.runtime.peak import DevicePeak, PrivatePeak
from karma.runtime.streams import OpFailed
from karma.runtime.tracing import TraceRecorder
from karma.runtime.training import Accumulation, GradClip, MixedPrecision
from karma.schedule import Schedule, load_schedule, schedule_sha256
from karma.timeline import StepTrace
from karma.units import format_bytes

# On the CPU backend, factory tensors of at least this size are built in the host tier.
TIER_MIN_BYTES = 1 << 20
FIRST_STEP_RESERVE_BYTES = 64 << 20  # [Note: the first step's reserve]
STEP_RESERVE_BYTES = 8 << 20  # and in every later step, at most 1% of the plan's peak


@dataclass(frozen=True)
class StepStats:
    """What one optimizer step (all its micro-batches) measured."""

    loss: float  # the mean of its micro-batches' losses
    step_s: float
    lr: float | None  # param group 0's learning rate in this step (None: no optimizer)
    peak_bytes: int  # above the baseline: private memory (CPU) or device memory (CUDA)
    allreduce_intervals: tuple[tuple[float, float], ...]  # (start, end) of each all-reduce
    blocked: tuple[tuple[float, float], ...]  # when the compute thread waited for a stream
    grad_norm: float | None = None  # the global gradient norm before clipping (with clipping)
    blocked_on: tuple[str, ...] = ()  # the stream each of `blocked` is blamed on
    trace: StepTrace | None = None  # this step's timeline, if trace_next_step() asked for it
    # when compute waited while an all-reduce ran, on the clock of `allreduce_intervals`: the
    # compute thread's waits on the CPU backend, the compute stream's waits for the net
    # stream on CUDA (backend.py, CudaBackend.order_after)
    allreduce_blocked: tuple[tuple[float, float], ...] = ()

    def wait_s_by_stream(self) -> dict[str, float]:
        """Seconds the compute thread waited, per stream blamed (engine.py, [Note: which
        stream a wait is blamed on])."""
        total: dict[str, float] = {}
        for (start, end), stream in zip(self.blocked, self.blocked_on):
            total[stream] = total.get(stream, 0.0) + (end - start)
        return total


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


class Runtime:
    """Trains the schedule's model: `step`, `evaluate`, `state_dict`, `close`.

    With gradient accumulation (the schedule's config.accumulate N), each `step` call is one
    micro-batch and every N-th call ends an optimizer step (`stepped` tells which)."""

    def __init__(self, schedule: Schedule | str | Path, seed: int | None = None, *,
                 model_file: ModelFile | None = None, timeout_s: float = 60.0,
                 cap_device_memory: bool | int = False, log: Callable[[str], None] = print,
                 agree: dict[str, Any] | None = None, dist_backend: str | None = None):
        """`schedule`: a Schedule or a schedule file's path. `seed`: default the schedule's.
        `timeout_s`: on several ranks, how long to wait for a rank that stops answering.
        `cap_device_memory`: on CUDA, emulate a GPU of this many bytes (True: of the
        schedule's budget). `agree`: further options every rank must share (karma-run's
        steps, checkpoints). `dist_backend`: the all-reduces' backend on several ranks, nccl
        or gloo (default nccl on CUDA, gloo on the CPU)."""
        path = None
        if not isinstance(schedule, Schedule):
            path = Path(schedule)
            schedule = load_schedule(path)
        self.schedule = schedule
        self.model_file = model_file or open_model_file(schedule, path)
        self.seed = schedule.config.seed if seed is None else seed
        self.timeout_s = timeout_s
        device_kind = dict(schedule.hardware).get("device_kind", "cpu")
        dist_backend = distributed.choose_backend(dist_backend, device_kind)
        self.backend = make_backend(device_kind)  # on CUDA: LOCAL_RANK's GPU, set first
        self.ranks: Ranks = distributed.join(
            schedule.config.world_size, schedule_sha256(schedule),
            {"seed": self.seed, **(agree or {})}, timeout_s, dist_backend,
            self.backend.device_id())
        self.log = log if self.ranks.main else _quiet
        self._closed = False
        self._failed = False
        self._checked_output = False
        self._accepted_calls: set[tuple[int, tuple[str, ...]]] = set()  # (positional, keys)
        self.last: StepStats | None = None  # the latest step's measurements
        self.iterations = 0  # steps taken by this object (a resumed run counts from its start)
        self.last_eval_peak_bytes = 0  # the latest evaluate()'s peak, as StepStats.peak_bytes
        self.accumulation = Accumulation(schedule.config.accumulate)
        self.stepped = False  # whether the latest step() call ended an optimizer step
        self._micro: list[tuple[float, float, int]] = []  # this step's (loss, s, peak) so far
        self._step_lr: float | None = None
        self._blocked: list[tuple[float, float]] = []
        self._blocked_on: list[str] = []
        self._trace_next = False
        try:
            self._build(cap_device_memory)
        except BaseException:
            if hasattr(self, "engine"):  # its streams are running
                self.engine.close(failed=True)
            if hasattr(self, "pool"):
                self.pool.close()
            if hasattr(self, "meter"):
                self.meter.close()
            if getattr(self, "cpu_cache", None) is not None:
                self.cpu_cache.stop()
            distributed.leave(self.ranks)
            raise

    def _build(self, cap_device_memory: bool) -> None:
        schedule, mf, backend = self.schedule, self.model_file, self.backend
        # before anything is allocated: [Note: where the host tier's bytes live]
        host_memory = measure_host_memory(schedule, backend.name)
        problem = host_memory_problem(host_memory)
        if problem is not None:
            raise KarmaError(problem)
        return_freed_memory_promptly()
        self.cpu_cache = cpu_cache.load(self.log) if backend.name == "cpu" else None
        if self.cpu_cache is not None:  # [Note: a caching allocator for the CPU backend]
            self.cpu_cache.start(1 << 62)  # bounded below, once the baseline is known
        # The first optimizer a process makes imports torch._dynamo (about 70 MiB): a one-time
        # cost of PyTorch, not of the schedule, so it happens before the baseline is taken.
        mf.make_optimizer([torch.nn.Parameter(torch.zeros(1))])
        gc.collect()  # what an earlier model in this process left is not this run's baseline
        self.baseline_private_bytes = private_bytes()
        # tensors of this process older than the run (others' models, say) that the CPU
        # cache gave out: in the baseline, so not in what the cache may keep for this run
        self._cache_baseline_bytes = (self.cpu_cache.stats().live_bytes
                                      if self.cpu_cache is not None else 0)
        # the most the process held outside its tensors at a step's start after the first
        # (CPU backend, with the CPU cache; [Note: the first step's reserve]): the plan
        # counts what calibration measured of it (Schedule.process_bytes)
        self.outside_bytes = 0
        self.baseline_data_bytes = data_bytes()
        self.log(f"training: {schedule.config.training_text()}")
        self.log(f"baseline before the model: {format_bytes(self.baseline_private_bytes)} "
                 f"private, {format_bytes(self.baseline_data_bytes)} data segment (what "
                 "prlimit --data caps)")
        self.meter = PrivatePeak(self.baseline_private_bytes) if backend.name == "cpu" \
            else DevicePeak(backend)
        if cap_device_memory:
            size = schedule.config.capacity_bytes if cap_device_memory is True \
                else int(cap_device_memory)
            cap = backend.cap(size)
            self.log(f"device memory capped as on a GPU of {format_bytes(size)}: PyTorch's "
                     f"allocator may hold {format_bytes(cap.allocator_bytes)}, the "
                     f"{format_bytes(cap.outside_bytes)} in use outside it (the CUDA context) "
                     f"counted in (the card has {format_bytes(cap.total_bytes)})")

        built = time.perf_counter()
        self.pool = HostPool(pool_bytes(schedule.predicted.host_bytes),
                             kind=backend.pool_kind, directory=host_memory.tier_dir)
        if backend.name == "cpu" and schedule.predicted.host_bytes:
            self.log(f"host tier: {format_bytes(schedule.predicted.host_bytes)} in "
                     f"{self.pool.directory} " + (
                         "(memory: a tmpfs)" if host_memory.tier_in_memory else
                         "(a file on disk, whose pages the kernel writes back: slower than a "
                         "tmpfs; set KARMA_TIER_DIR to one with room)"))
        # on the CPU backend the model is built in the host tier (host.BuildInTier): its
        # weights need not fit in the memory the schedule allows
        tier = BuildInTier(self.pool, TIER_MIN_BYTES) if backend.name == "cpu" else None
        torch.manual_seed(self.seed)
        with tier or contextlib.nullcontext():
            self.model = mf.build(self.log)  # on the CPU: initial values do not depend on it
        self.model.train()
        self.exchange = GradientExchange(self.ranks, backend) \
            if self.ranks.world_size > 1 else None
        self.precision = MixedPrecision.of(schedule, backend.device.type)
        clip = schedule.config.clip_grad_norm
        self.engine = Engine(schedule, self.model, mf.make_optimizer, self.pool, backend,
                             self.exchange, tier, self.precision,
                             GradClip(clip) if clip is not None else None)
        self.optimizer = BlockOptimizers([w.optimizer for w in self.engine.weights
                                          if w.optimizer is not None])
        # the model file's make_scheduler, if any (lr.py: one scheduler drives every block)
        self._host_optimizers = [w.optimizer for w in self.engine.weights
                                 if w.optim == "host" and w.optimizer is not None]
        self.lr_schedule = None if mf.make_scheduler is None else LRSchedule(
            mf.make_optimizer, mf.make_scheduler, list(self.model.parameters()),
            self.optimizer.optimizers, mf.path)
        self._bound_cpu_cache()
        # every rank has built its model (ranks that build slower than the timeout get longer)
        distributed.barrier(self.ranks, "before the first step",
                            self.timeout_s + time.perf_counter() - built)

    # --- training and evaluation -----------------------------------------------------------

    @property
    def batch_size(self) -> int:
        return self.schedule.config.batch_size

    @property
    def lr(self) -> float | None:
        """The learning rate (param group 0's) that the next step uses."""
        if self.lr_schedule is not None:
            return self.lr_schedule.lr
        groups = self.optimizer.param_groups
        return float(groups[0]["lr"]) if groups and "lr" in groups[0] else None

    @property
    def accumulate(self) -> int:
        """Micro-batches (step calls) per optimizer step."""
        return self.accumulation.micro_batches

    def trace_next_step(self) -> None:
        """Record the timeline of the next optimizer step (its last micro-batch, the one
        that steps): `last.trace` holds it after that step. With clipping, that step also
        waits for the updates it leaves running, so that every op of it is in the trace."""
        self._trace_next = True

    def step(self, inputs: Any, targets: Any = None) -> float:
        """One planned training iteration on this batch (inputs as in the model-file
        protocol: a Tensor, a tuple, or a dict of keyword arguments); returns its loss.

        As the plain loop: under autocast with bf16, loss_fn(model(x), y) / N backward, and
        after the N-th micro-batch of a step (N = accumulate) the gradients clipped (with
        clipping), every optimizer stepped and the LR scheduler stepped."""
        self._check_usable()
        model_inputs, targets = self._batch(inputs, targets, "Runtime.step")
        acc = self.accumulation
        if acc.first:
            self._micro = []
            self._step_lr = self.lr
            self._bound_cpu_cache()
            self.backend.clock.restart()  # the origin of this step's all-reduce times
        recorder = None
        if self._trace_next and acc.last:
            recorder = TraceRecorder(self.schedule, self.backend, None if self.cpu_cache is None
                                     else lambda: self.cpu_cache.stats().idle_bytes)
            self.engine.trace(recorder)
        self.meter.start(record=recorder is not None)
        t0 = time.perf_counter()
        try:
            self.engine.begin_iteration(update=acc.last, first=acc.first)
            with self.precision.autocast():
                output = model_inputs.call(self.model)
                self._check_output(output)
                self.engine.before_loss()
                loss = self._loss(output, targets)
                scaled = loss / acc.micro_batches
            del output
            scaled.backward()
            self.engine.end_iteration()  # in the last micro-batch, every optimizer stepped
            if acc.last and self.lr_schedule is not None:
                self.lr_schedule.step(self._host_optimizers, self.engine.after_host_updates)
        except BaseException as e:
            self._failed = True  # streams may hold half an iteration: no step after this one
            self.engine.trace(None)
            self.engine.abandon()
            self.meter.stop()
            if isinstance(e, OpFailed) and isinstance(e.__cause__, distributed.RankLost):
                raise distributed.lost(  # not, say, out of memory
                    self.ranks, f"in iteration {self.iterations + 1}'s gradient exchange",
                    e.__cause__.__cause__) from e
            if isinstance(e, OpFailed) and isinstance(e.__cause__, KarmaError):
                # a stream's failure the user can fix (a full disk under the host tier): its
                # own message, whichever stream met it
                raise KarmaError(str(e.__cause__)) from e
            raise
        elapsed = time.perf_counter() - t0
        self._micro.append((loss.item(), elapsed, self.meter.stop()))
        self._blocked = ([] if acc.first else self._blocked) + self.engine.blocked
        self._blocked_on = ([] if acc.first else self._blocked_on) + self.engine.blocked_on
        trace = None
        if recorder is not None:
            waits = list(self.engine.blocked), list(self.engine.blocked_on)  # not settle's
            self.engine.settle()  # the updates it left running: their ops are in the trace
            self.engine.trace(None)
            self._trace_next = False
            trace = recorder.finish(self.iterations + 1, elapsed, *waits,
                                    memory=self.meter.samples())
        self.stepped = acc.last
        if acc.last:
            calls, calls_blocked = (), ()
            if self.exchange is not None:
                calls = tuple(self.exchange.take_intervals())
                net_waits = self.backend.take_net_waits()
                calls_blocked = tuple(self._blocked if net_waits is None else net_waits)
            losses, times, peaks = zip(*self._micro)
            self.last = StepStats(sum(losses) / len(losses), sum(times), self._step_lr,
                                  max(peaks), calls, tuple(self._blocked),
                                  self.engine.grad_norm, tuple(self._blocked_on), trace,
                                  calls_blocked)
            self.iterations += 1
        acc.advance()
        return self._micro[-1][0]

    @torch.no_grad()
    def evaluate(self, inputs: Any, targets: Any = None) -> float:
        """The loss of a forward pass in evaluation mode (`model.eval()`, no gradients),
        under the same budget: weights the schedule streams are fetched block by block.

        [Note: evaluation fits in the training budget] Without gradients nothing is saved
        for backward, so at block j an evaluation holds the resident weights, the device
        optimizer state, block j's weights, inputs, outputs and temporaries: a subset of
        what the training forward holds at block j (which also holds the saved activations
        of blocks before j and block j+1's prefetched weights). The schedule's training
        peak, which the planner fits in the budget, bounds it.
        """
        self._check_usable()
        model_inputs, targets = self._batch(inputs, targets, "Runtime.evaluate")
        training = {m: m.training for m in self.model.modules()}
        self.model.eval()
        self.meter.start()
        try:
            self.engine.begin_eval()
            with self.precision.autocast():
                output = model_inputs.call(self.model)
                loss = self._loss(output, targets).item()
        finally:
            self.engine.end_eval()
            for module, mode in training.items():  # as they were, frozen BatchNorms too
                module.training = mode
            self.last_eval_peak_bytes = self.meter.stop()
        return loss

    def _bound_cpu_cache(self) -> None:
        """What the CPU cache keeps, with what the process holds outside it (small tensors,
        the data, Python objects: measured now), stays within the planned peak, so that
        keeping freed tensors never takes the measured peak above the prediction ([Note: a
        caching allocator for the CPU backend])."""
        if self.cpu_cache is None:
            return
        held = self.cpu_cache.stats()
        base = self._cache_baseline_bytes
        outside = (private_bytes() - self.baseline_private_bytes
                   - (held.live_bytes - base) - held.idle_bytes)
        # [Note: the first step's reserve] The first step grows what the process holds
        # outside the cache after its start (the stream workers' first kernels make their
        # OpenMP pools, malloc arenas and stacks; first calls fill PyTorch's and Python's
        # caches): 17-30 MiB measured (GPT-2 small's 861 MiB plan peaked at 870 MiB in step
        # 1, 851 from step 2 on). From step 2 on it is measured at the step's start; in step 1
        # the cache keeps FIRST_STEP_RESERVE_BYTES less. In every later step it keeps
        # STEP_RESERVE_BYTES (at most 1% of the peak) less: small tensors and Python objects made during the step
        # still grow the outside a little (the demo's plan, 797 MiB of an 800 MiB budget,
        # peaked at 798 MiB without it).
        if self.iterations > 0:  # step 1's start is before the stream workers' first ops
            self.outside_bytes = max(self.outside_bytes, outside)
        peak = self.schedule.predicted.peak_device_bytes
        reserve = FIRST_STEP_RESERVE_BYTES if self.iterations == 0 else \
            min(STEP_RESERVE_BYTES, peak // 100)
        self.cpu_cache.limit(max(base + peak - max(outside, 0) - reserve, base))

    def _check_between_steps(self, what: str) -> None:
        if not self.accumulation.first:
            raise KarmaError(
                f"{what}() was called after {self.accumulation.done} of the "
                f"{self.accumulate} micro-batches of an optimizer step (accumulate "
                f"{self.accumulate}): their gradients are in no state; call it after a step "
                "ends (Runtime.stepped is True)")

    def _check_usable(self) -> None:
        if self._closed:
            raise KarmaError("this Runtime is closed; build a new one")
        if self._failed:
            raise KarmaError("this Runtime stopped after a failed step (its streams may hold "
                             "part of that iteration); close it and build a new one, and "
                             "load_state_dict a state saved before the failure to continue")

    def _batch(self, inputs: Any, targets: Any, where: str) -> tuple[ModelInputs, Any]:
        model_inputs, targets = check_batch((inputs, targets), where)
        call = (len(model_inputs.args), tuple(model_inputs.kwargs))
        if call not in self._accepted_calls:  # once per way of calling, not once per step
            check_signature(self.model, model_inputs, where)
            self._accepted_calls.add(call)
        to_device = self.backend.to_device
        return model_inputs.map(to_device), map_targets(targets, to_device)

    def _loss(self, output: Any, targets: Any) -> torch.Tensor:
        loss = self.model_file.loss_fn(output, targets)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ModelFileError(f"{self.model_file.path}: loss_fn(output, targets) returned "
                                 f"{type(loss).__name__}; return a scalar tensor")
        return loss

    def _check_output(self, output: Any) -> None:
        if self._checked_output:
            return
        if not any(t.requires_grad for t in output_tensors(output)):
            raise ModelFileError(
                f"{self.model_file.path}: the forward of build_model()'s model returned no "
                f"tensor that requires grad ({type(output).__name__}); return its output "
                "without .detach() or torch.no_grad(), and leave parameters trainable")
        self._checked_output = True

    # --- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """{"model": the model's state_dict (current values), "optimizer": each block's
        optimizer state, the LR schedule's and the RNG state}: what karma-run's checkpoints
        hold. A snapshot: its tensors are copies (file-backed, so they take no private
        memory). Between optimizer steps only (not halfway through an accumulation)."""
        self._check_between_steps("state_dict")
        with tempfile.TemporaryDirectory(prefix="karma-state-") as scratch:
            return runtime_state(self.model, self.engine, Path(scratch), snapshot=True,
                                 lr_schedule=self.lr_schedule)

    def load_state_dict(self, state: dict) -> None:
        self._check_between_steps("load_state_dict")
        load_runtime_state(state, self.model, self.engine, "the state", self.lr_schedule)

    # --- the end ---------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the streams, free the host tier, leave the process group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.engine.close(self._failed)
            if hasattr(self, "meter"):
                self.meter.close()
            self.pool_peak_bytes = self.pool.peak_bytes
            self.pool.close()
            if getattr(self, "cpu_cache", None) is not None:
                self.log(self.cpu_cache.stats().text())
                self.cpu_cache.stop()
        finally:  # also after a failure: a process group left to the interpreter's exit aborts
            distributed.leave(self.ranks)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self._failed = True
        self.close()


class BlockOptimizers:
    """The per-block optimizers as one: their param_groups (the model file's make_scheduler,
    through lr.LRSchedule, sets `lr` in each), zero_grad, and their states."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> list[dict]:
        return [opt.state_dict() for opt in self.optimizers]


def _quiet(line: str) -> None:
    """Ranks other than 0 print no progress lines (their errors still reach stderr)."""
