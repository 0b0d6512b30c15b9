"""karma's runtime as a library: one object that trains a model by replaying its schedule.

    import karma
    schedule = karma.plan("examples/gpt.py", gpu_mem="600M", hardware="cpu", batch_size=2)
    with karma.Runtime(schedule, seed=0) as rt:
        for inputs, targets in my_data:
            loss = rt.step(inputs, targets)      # one planned optimizer step
        eval_loss = rt.evaluate(inputs, targets)  # forward only, under the same budget
        torch.save(rt.state_dict(), "state.pt")

`karma-run` is a loop over this object (loop.py). Initialisation follows the reference
order exactly, so that runs are reproducible and equal to plain PyTorch:
torch.manual_seed(seed), build_model() on the CPU, the optimizer, the model file's LR
scheduler (bringup.py); the caller's data comes after. Inside torchrun the object joins the
process group as karma-run does.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from karma.errors import KarmaError, ModelFileError
from karma.model_object import missing_entry
from karma.modelfile import (
    ModelFile,
    ModelInputs,
    check_batch,
    check_signature,
    load_model_file,
    map_targets,
    output_tensors,
)
from karma.runtime.bringup import bring_up, make_backend
from karma.runtime.checkpoints.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    load_runtime_state,
    model_state,
    runtime_state,
    save_checkpoint,
)
from karma.runtime.distributed import process_group
from karma.runtime.distributed.process_group import Ranks
from karma.runtime.replay.streams import OpFailed
from karma.runtime.replay.tracing import TraceRecorder
from karma.runtime.replay.training_options import Accumulation
from karma.runtime.stats import StepStats, StepTally
from karma.schedule import HOST_OPTIMIZERS, Schedule, schedule_sha256
from karma.schedule_load import load_schedule

__all__ = ["Runtime", "StepStats", "open_model_file"]


def open_model_file(schedule: Schedule, schedule_path: Path | None,
                    log: Callable[[str], None] | None = None) -> ModelFile:
    """The schedule's model file, with its environment, checked against the model the
    schedule was planned for (karma/fingerprint.py, check_model: `log` gets its note that
    the file changed but not the model; default: the karma logger)."""
    from karma.fingerprint import check_model, model_file_path

    for key, value in schedule.model.env:
        os.environ[key] = value
    path = model_file_path(schedule, schedule_path)
    entry = schedule.model.entry
    if entry is not None and missing_entry(entry):
        raise KarmaError(
            f"this schedule was planned for a model object whose "
            f"{', '.join(missing_entry(entry))} cannot be imported again (a module instance, "
            "a lambda or a function defined inside another); train it with "
            "karma.Runtime(schedule, model=karma.model(...)), or plan it from functions "
            "defined at the top level of a file")
    mf = load_model_file(path, entry)
    check_model(schedule, mf, schedule_path, log)
    return mf


class Runtime:
    """Trains the schedule's model: `step` (or `micro_step`), `evaluate`, `state_dict`,
    `close`.

    A step is one optimizer update. With gradient accumulation (the schedule's
    config.accumulate N) it takes N micro-batches: each `micro_step` call is one, and every
    N-th call ends a step (`stepped` tells which)."""

    def __init__(self, schedule: Schedule | str | Path, seed: int | None = None, *,
                 model: ModelFile | str | Path | None = None,
                 model_file: ModelFile | None = None, timeout_s: float = 60.0,
                 cap_device_memory: bool | int = False,
                 log: Callable[[str], None] | None = None,
                 agree: dict[str, Any] | None = None, dist_backend: str | None = None,
                 host_optimizer: str | None = None):
        """`schedule`: a Schedule or a schedule file's path. `seed`: default the schedule's.
        `model`: what the schedule was planned for, `karma.model(...)` or a model file's path
        (default: the schedule's model file; `model_file` is the same, loaded). `log`: where
        progress lines go (default: the "karma" logger, at INFO).
        `timeout_s`: on several ranks, how long to wait for a rank that stops answering.
        `cap_device_memory`: on CUDA, emulate a GPU of this many bytes (True: the budget); on
        the CPU backend, True caps the process's data from the plan (host/memcap.py).
        `agree`: further options every rank must share (karma-run's steps, checkpoints).
        `dist_backend`: nccl or gloo on several ranks (default nccl on CUDA, else gloo).
        `host_optimizer`: host-stepped blocks' kernel, "fused" or "as-given" (default: the
        schedule's config.host_optimizer; params/host_optimizer.py)."""
        given = _given_model(model, model_file)
        path = None
        if not isinstance(schedule, Schedule):
            path = Path(schedule)
            schedule = load_schedule(path)
        if host_optimizer is not None and host_optimizer != schedule.config.host_optimizer:
            schedule = _with_host_optimizer(schedule, host_optimizer)
        self.schedule = schedule
        self.model_file = _checked_model(schedule, given, path, log)
        self.seed = schedule.config.seed if seed is None else seed
        self.timeout_s = timeout_s
        device_kind = dict(schedule.hardware).get("device_kind", "cpu")
        dist_backend = process_group.choose_backend(dist_backend, device_kind)
        self.backend = make_backend(device_kind)  # on CUDA: LOCAL_RANK's GPU, set first
        self.ranks: Ranks = process_group.join(
            schedule.config.world_size, schedule_sha256(schedule),
            {"seed": self.seed, **(agree or {})}, timeout_s, dist_backend,
            self.backend.device_id())
        self.log = (log or logging.getLogger("karma").info) if self.ranks.main else _quiet
        self._closed = False
        self._failed = False
        self._checked_output = False
        self._accepted_calls: set[tuple[int, tuple[str, ...]]] = set()  # (positional, keys)
        self.last: StepStats | None = None  # the latest step's measurements
        self.steps = 0  # optimizer steps taken by this object (a resumed run: from its start)
        self.start_step = 0  # the step of the checkpoint it loaded: save() counts on from it
        self.last_eval_peak_bytes = 0  # the latest evaluate()'s peak, as StepStats.peak_bytes
        self.accumulation = Accumulation(schedule.config.accumulate)
        self.stepped = False  # whether the latest micro_step() call ended an optimizer step
        self._tally = StepTally()
        self._trace_next = False
        try:
            self.parts = bring_up(schedule, self.model_file, self.backend, self.ranks,
                                  self.seed, self.log, cap_device_memory, timeout_s)
        except BaseException:
            process_group.leave(self.ranks)
            raise
        parts = self.parts
        self.model, self.engine, self.meter = parts.model, parts.engine, parts.meter
        self.exchange, self.precision = parts.exchange, parts.precision
        self.optimizer, self.lr_schedule = parts.optimizer, parts.lr_schedule
        self.baseline_private_bytes = parts.baseline_private_bytes
        self.baseline_data_bytes = parts.baseline_data_bytes

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
        """Micro-batches (micro_step calls) per optimizer step."""
        return self.accumulation.micro_batches

    @property
    def outside_bytes(self) -> int:
        """The most the process held outside its tensors at a step's start after the first
        (CPU backend, with its cache; cpu_cache.PlannedBound), else 0."""
        bound = self.parts.cache_bound
        return 0 if bound is None else bound.outside_bytes

    @property
    def pool_peak_bytes(self) -> int:
        """The most the host tier held."""
        return self.parts.pool.peak_bytes

    @property
    def host_bytes(self) -> int:
        """This rank's host memory at its peak: its host tier's, and its share of the node's
        copy of the weights (sharded host state)."""
        return self.parts.host_bytes

    def trace_next_step(self) -> None:
        """Record the timeline of the next optimizer step (its last micro-batch, the one
        that steps): `last.trace` holds it after that step. With clipping, that step also
        waits for the updates it leaves running, so that every op of it is in the trace."""
        self._trace_next = True

    def step(self, inputs: Any, targets: Any = None) -> float:
        """One planned optimizer step on this batch (inputs as in the model-file protocol: a
        Tensor, a tuple, or a dict of keyword arguments); returns its loss. A schedule that
        accumulates micro-batches takes them through `micro_step`."""
        if self.accumulate > 1:
            raise KarmaError(
                f"this schedule accumulates {self.accumulate} micro-batches per optimizer step "
                "(config.accumulate): call Runtime.micro_step once per micro-batch; every "
                f"{self.accumulate}th call ends a step (Runtime.stepped)")
        return self._micro_step(inputs, targets, "Runtime.step")

    def micro_step(self, inputs: Any, targets: Any = None) -> float:
        """One micro-batch of the planned step (inputs as in `step`); returns its loss.

        As the plain loop: under autocast with bf16, loss_fn(model(x), y) / N backward, and
        after the N-th micro-batch of a step (N = accumulate) the gradients clipped (with
        clipping), every optimizer stepped and the LR scheduler stepped."""
        return self._micro_step(inputs, targets, "Runtime.micro_step")

    def _micro_step(self, inputs: Any, targets: Any, where: str) -> float:
        self._check_usable()
        model_inputs, targets = self._batch(inputs, targets, where)
        acc = self.accumulation
        if acc.first:
            self._tally.begin(self.lr)
            if self.parts.cache_bound is not None:
                self.parts.cache_bound.bound(self.steps)
            self.backend.clock.restart()  # the origin of this step's all-reduce times
        recorder = self._recorder() if self._trace_next and acc.last else None
        self.meter.start(record=recorder is not None)
        t0 = time.perf_counter()
        try:
            loss = self._replay(model_inputs, targets).item()
        except BaseException as e:
            self._failed = True  # streams may hold half a replay: no step after this one
            self.engine.trace(None)
            self.engine.abandon()
            self.meter.stop()
            reported = self._reported(e)
            if reported is None:
                raise
            raise reported from e
        elapsed = time.perf_counter() - t0
        self._tally.add(loss, elapsed, self.meter.stop(), self.engine.blocked,
                        self.engine.blocked_on)
        trace = None if recorder is None else self._finish_trace(recorder, elapsed)
        self.stepped = acc.last
        if acc.last:
            self.last = self._finish_step(trace)
            self.steps += 1
        acc.advance()
        return loss

    def _replay(self, model_inputs: ModelInputs, targets: Any) -> torch.Tensor:
        """One micro-batch through the engine, one replay of the schedule's ops; its loss
        (before the 1/N of accumulation)."""
        acc = self.accumulation
        self.engine.begin_replay(update=acc.last, first=acc.first)
        with self.precision.autocast():
            output = model_inputs.call(self.model)
            self._check_output(output)
            self.engine.before_loss()
            loss = self._loss(output, targets)
            scaled = loss / acc.micro_batches
        del output
        scaled.backward()
        self.engine.end_replay()  # in the last micro-batch, every optimizer stepped
        if acc.last and self.lr_schedule is not None:
            self.lr_schedule.step(self.parts.host_optimizers, self.engine.after_host_updates)
        return loss

    def _reported(self, e: BaseException) -> BaseException | None:
        """What a failed step raises instead of `e`: a rank lost in the gradient exchange
        (not, say, out of memory), or a stream's failure the user can fix (a full disk under
        the host tier) with its own message, whichever stream met it; None: `e` itself."""
        if isinstance(e, OpFailed) and isinstance(e.__cause__, process_group.RankLost):
            return process_group.lost(self.ranks,
                                      f"in step {self.steps + 1}'s gradient exchange",
                                      e.__cause__.__cause__)
        if isinstance(e, OpFailed) and isinstance(e.__cause__, KarmaError):
            return KarmaError(str(e.__cause__))
        return None

    def _recorder(self) -> TraceRecorder:
        """A recorder of this step's timeline, handed to the engine's streams."""
        bound = self.parts.cache_bound
        recorder = TraceRecorder(self.schedule, self.backend, None if bound is None
                                 else lambda: bound.cache.stats().idle_bytes)
        self.engine.trace(recorder)
        return recorder

    def _finish_trace(self, recorder: TraceRecorder, elapsed: float):
        waits = list(self.engine.blocked), list(self.engine.blocked_on)  # not settle's
        self.engine.settle()  # the updates it left running: their ops are in the trace
        self.engine.trace(None)
        self._trace_next = False
        return recorder.finish(self.steps + 1, elapsed, *waits,
                               memory=self.meter.samples())

    def _finish_step(self, trace) -> StepStats:
        """The step's figures, once its last micro-batch has run."""
        calls, calls_blocked = (), ()
        if self.exchange is not None:
            calls = tuple(self.exchange.take_intervals())
            net_waits = self.backend.take_net_waits()
            calls_blocked = tuple(self._tally.blocked if net_waits is None else net_waits)
        return self._tally.finish(self.engine.grad_norm, trace, calls, calls_blocked)

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
            with self.engine.evaluating(), self.precision.autocast():
                output = model_inputs.call(self.model)
                loss = self._loss(output, targets).item()
        finally:
            for module, mode in training.items():  # as they were, frozen BatchNorms too
                module.training = mode
            self.last_eval_peak_bytes = self.meter.stop()
        return loss

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
                             "part of that step); close it and build a new one, and "
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

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state_dict with its current values: state_dict()["model"], without
        copying the optimizer state. A snapshot; between optimizer steps only."""
        self._check_between_steps("model_state_dict")
        self.engine.settle()  # the last step's updates, if still running
        with tempfile.TemporaryDirectory(prefix="karma-state-") as scratch:
            return model_state(self.model, self.engine, Path(scratch), snapshot=True)

    def load_state_dict(self, state: dict) -> None:
        self._check_between_steps("load_state_dict")
        load_runtime_state(state, self.model, self.engine, "the state", self.lr_schedule)

    def save(self, directory: str | Path) -> Path:
        """Write a checkpoint of the training so far into `directory` (every rank calls
        it), as karma-run's --checkpoint-dir holds them: `karma-export` and `karma-run
        --resume` read it. Its folder, step_N (N: the steps so far, a loaded checkpoint's
        included), is put in place whole or not at all. Between optimizer steps only."""
        self._check_usable()
        self._check_between_steps("save")
        return save_checkpoint(Path(directory), self.start_step + self.steps, self.model,
                               self.engine, self.schedule, self.seed, self.lr_schedule,
                               self.ranks, self.timeout_s)

    def load(self, path: str | Path) -> int:
        """Continue from a checkpoint: `path` is one (a step_N folder, from `save` or
        karma-run) or a folder of them (the newest complete one). Restores the model, the
        optimizers, the LR schedule and the RNG; returns the step it was taken after."""
        self._check_usable()
        self._check_between_steps("load")
        path = Path(path)
        found = path if (path / "meta.json").is_file() else latest_checkpoint(path)
        if found is None:
            raise KarmaError(f"{path} holds no complete checkpoint; give a step_N folder "
                             "written by Runtime.save or karma-run --checkpoint-dir, or the "
                             "folder that holds them")
        self.start_step = load_checkpoint(found, self.model, self.engine, self.lr_schedule,
                                          self.ranks, self.schedule) - self.steps
        return self.start_step + self.steps

    # --- the end ---------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the streams, free the host tier, leave the process group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.parts.close()
        finally:  # also after a failure: a process group left to the interpreter's exit aborts
            process_group.leave(self.ranks)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self._failed = True
        self.close()


def _given_model(model: ModelFile | str | Path | None,
                 model_file: ModelFile | None) -> ModelFile | None:
    """The model a Runtime was given (`model` or `model_file`), None if neither."""
    if model is not None and model_file is not None:
        raise KarmaError("Runtime(model=..., model_file=...): give one of them")
    if model is None or isinstance(model, ModelFile):
        return model or model_file
    if isinstance(model, (str, Path)):
        return load_model_file(model)
    raise KarmaError(f"Runtime(model=...) is a {type(model).__name__}; give the "
                     "karma.model(...) the schedule was planned for (it carries the loss and "
                     "the optimizer), or a model file's path")


def _checked_model(schedule: Schedule, given: ModelFile | None, path: Path | None,
                   log: Callable[[str], None] | None) -> ModelFile:
    """The model to train: the one given, if the schedule was planned for it (else
    StaleSchedule), or the schedule's model file."""
    if given is None:
        return open_model_file(schedule, path, log)
    from karma.fingerprint import check_model

    check_model(schedule, given, path, log)
    return given


def _quiet(line: str) -> None:
    """Ranks other than 0 print no progress lines (their errors still reach stderr)."""


def _with_host_optimizer(schedule: Schedule, choice: str) -> Schedule:
    """`schedule`, its host-stepped blocks stepping with kernel `choice` (HOST_OPTIMIZERS)."""
    if choice not in HOST_OPTIMIZERS:
        raise KarmaError(f"host_optimizer {choice!r} (--host-optimizer) is not one karma "
                         f"knows; use {' or '.join(HOST_OPTIMIZERS)}")
    return replace(schedule, config=replace(schedule.config, host_optimizer=choice))
