"""The Hugging Face Trainer training through karma: an existing Trainer script, out of core.

    from karma.integrations.hf_trainer import KarmaTrainer
    trainer = KarmaTrainer(model=model, args=args, train_dataset=train, eval_dataset=held_out,
                           karma={"gpu_mem": "300M", "hardware": "cpu"})
    trainer.train()                # planned at the first batch; every step through karma
    trainer.save_model("out")      # save_pretrained: from_pretrained("out") loads it

`karma` takes karma.plan's options (gpu_mem, hardware, strategy, measure, host_optimizer,
selective, ...); the TrainingArguments give the rest (hf_parts.planning_options).

[Note: the Trainer's loop around karma's step] The Trainer's loop stays the Trainer's: its
data, its gradient-accumulation chunks, callbacks, logging, evaluation and checkpoint
schedule. What happens inside a step moves to karma: `training_step` hands each micro-batch
to `Runtime.micro_step`, which in the step's last micro-batch clips, steps every block's
optimizer (made from the Trainer's optimizer class, kwargs and decay groups) and the
Trainer's LR scheduler (made by `get_scheduler` over karma's driver optimizer, lr.py). So
the Trainer's own `optimizer.step()`, `lr_scheduler.step()` and `model.zero_grad()` find
nothing left to do (hf_parts.KarmaOptimizer, KarmaLRScheduler), and its clipping call
returns karma's gradient norm. The schedule is planned at the first batch (its shape is the
data's; the number of steps is known by then), and the model is karma's from then until
training ends, when its trained values are given back to `trainer.model` as plain tensors.
Evaluation runs `Runtime.evaluate`: during training in the training run, otherwise in a run
opened for the evaluation. Random-number state is the Trainer's: karma's setup and checkpoint
loads run under `torch.random.fork_rng`.

[Note: the loss scaled for accumulation] karma divides each micro-batch's loss by the
accumulation N. The Trainer divides a per-batch mean by N too, but a loss that the model or
`compute_loss_func` already normalised by the step's token count (`num_items_in_batch`) it
leaves alone. For those, the loss karma gets is multiplied by N: the gradient reaching the
model's loss is then fl(fl(1/N) * N), exactly 1 in float32 for every N below 41, so the
gradients equal the Trainer's to the bit (and for every power of two). The loss the Trainer
logs is the one it would compute, taken before the multiplication.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

try:
    from accelerate.utils import convert_to_fp32
    from transformers import Trainer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.optimization import get_scheduler
    from transformers.trainer_pt_utils import nested_detach
    from transformers.trainer_utils import _is_peft_model
except ImportError as e:  # pragma: no cover - the optional dependency
    raise ImportError("karma.integrations.hf_trainer needs Hugging Face transformers and "
                      "accelerate; install them with `pip install karma[hf]`") from e

import karma
from karma.api import plan_options
from karma.errors import KarmaError
from karma.integrations.hf_parts import (
    BatchShape,
    DecayRule,
    KarmaLRScheduler,
    KarmaOptimizer,
    MakeOptimizer,
    planning_options,
    restore_values,
    unsupported,
)
from karma.modelfile import output_tensors
from karma.runtime.runtime import Runtime

# the Trainer methods KarmaTrainer takes over; a transformers without them is too old
_HOOKS = ("training_step", "_clip_grad_norm", "_get_grad_norm", "_save",
          "_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler",
          "_finalize_training", "_get_num_items_in_batch", "create_accelerator_and_postprocess",
          "loss_is_scaled_for_ga")
if not all(hasattr(Trainer, name) for name in _HOOKS):  # pragma: no cover
    raise ImportError("karma.integrations.hf_trainer needs transformers 5 (written against "
                      "5.25); upgrade it with `pip install -U transformers`")

KARMA_CHECKPOINT = "karma"  # the folder in each checkpoint-N that holds karma's checkpoint


@dataclass(frozen=True)
class _Call:
    """One batch as karma takes it: the model's keyword arguments and the loss's targets."""

    inputs: dict[str, Any]
    targets: torch.Tensor | None


@dataclass(frozen=True)
class _LossMode:
    """How the loss of the batch being run is taken ([Note: the loss scaled for
    accumulation])."""

    training: bool = True
    num_items: Any = None  # the Trainer's num_items_in_batch, or None
    scaled_for_ga: bool = False  # normalised over the whole step already
    accumulate: int = 1
    outputs_only: bool = False  # a prediction without labels: no loss, the outputs kept


@dataclass
class _KarmaRun:
    """A karma run over the Trainer's model, and what it was planned for."""

    runtime: Runtime
    shape: BatchShape
    devices: dict[str, torch.device]  # where each parameter and buffer was before karma
    training: bool
    step_starts: bool = True  # whether the next micro-batch begins an optimizer step


class KarmaTrainer(Trainer):
    """`transformers.Trainer`, each step planned and run by karma within a memory budget.

    `karma`: karma.plan's options, e.g. {"gpu_mem": "300M", "hardware": "cpu"}; batch size,
    accumulation, clipping, bf16 and seed come from the TrainingArguments. Everything else is
    the Trainer's signature. After `train()`, `karma_schedule` is the schedule it ran."""

    def __init__(self, *args, karma: Mapping[str, Any] | None = None, **kwargs):
        self.karma_options = dict(karma or {})
        self.karma_schedule = None
        self._karma: _KarmaRun | None = None
        self._karma_resume: Path | None = None  # a checkpoint to load once the run exists
        self._karma_steps: int | None = None  # the Trainer's num_training_steps
        self._karma_mode = _LossMode()
        self._karma_reported: torch.Tensor | None = None  # the loss the Trainer would return
        self._karma_outputs: Any = None  # an evaluation's model outputs, for its logits
        super().__init__(*args, **kwargs)
        self._karma_check()

    def _karma_check(self) -> None:
        """Refuse what karma cannot carry, before anything trains."""
        problem = unsupported(self.args)
        if problem:
            raise KarmaError(f"KarmaTrainer: {problem}")
        if self.optimizer is not None or self.lr_scheduler is not None:
            raise KarmaError(
                "KarmaTrainer: optimizers=(optimizer, scheduler) are made already; karma makes "
                "one optimizer per block, so give the recipe instead: "
                "optimizer_cls_and_kwargs=(torch.optim.AdamW, {'lr': ...}), the schedule by "
                "lr_scheduler_type")
        if type(self).compute_loss is not Trainer.compute_loss:
            raise KarmaError(
                f"KarmaTrainer: {type(self).__name__} overrides compute_loss, which calls the "
                "model itself; karma calls the model: pass "
                "compute_loss_func=fn(outputs, labels, num_items_in_batch) instead")
        plan_options(**planning_options(self.args, self.karma_options, 1, True))  # names
        self._karma_recipe()

    # --- the Trainer's setup ---------------------------------------------------------------

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        self.accelerator.device_placement = False  # karma places the model, block by block
        # bf16: karma runs each forward and loss under autocast itself; accelerate's wrapper
        # of model.forward would hide the model's blocks from karma's trace
        self.accelerator.native_amp = False

    def _move_model_to_device(self, model: torch.nn.Module, device: torch.device) -> None:
        """karma places the model: it stays where it was built (on the CPU, typically)."""

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            rule = self._karma_decay_rule()
            trainable = [p for p in (model or self.model).parameters() if p.requires_grad]
            self.optimizer = KarmaOptimizer(rule.groups(trainable), self.args.learning_rate)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self.lr_scheduler is None:
            self._karma_steps = num_training_steps
            self.lr_scheduler = KarmaLRScheduler(self.args.learning_rate)
            self._created_lr_scheduler = True
        return self.lr_scheduler

    def _karma_decay_rule(self) -> DecayRule:
        """The Trainer's decay groups over the model it holds now."""
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        return DecayRule(named, set(self.get_decay_parameter_names(self.model)),
                         self.args.weight_decay)

    def _karma_recipe(self) -> tuple[type, dict[str, Any]]:
        """The optimizer class and keyword arguments the Trainer would make its optimizer
        with; karma makes one per block from them."""
        cls, kwargs = self.optimizer_cls_and_kwargs or \
            self.get_optimizer_cls_and_kwargs(self.args, self.model)
        taken = [k for k in ("params", "model", "optimizer_dict") if k in kwargs]
        if not isinstance(cls, type) or not issubclass(cls, torch.optim.Optimizer) or taken:
            raise KarmaError(
                f"KarmaTrainer: optim={self.args.optim!r} is built over the whole model; karma "
                "makes one optimizer per block and needs one that steps each parameter on its "
                "own: adamw_torch_fused, adamw_torch, sgd, adafactor, ...")
        return cls, dict(kwargs)

    def _karma_make_scheduler(self, optimizer: torch.optim.Optimizer):
        steps = self._karma_steps
        return get_scheduler(self.args.lr_scheduler_type, optimizer=optimizer,
                             num_warmup_steps=self.args.get_warmup_steps(steps),
                             num_training_steps=steps,
                             scheduler_specific_kwargs=self.args.lr_scheduler_kwargs)

    # --- a step ----------------------------------------------------------------------------

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: Any = None) -> torch.Tensor:
        """One micro-batch through karma ([Note: the Trainer's loop around karma's step]);
        the loss the Trainer's own training_step would return."""
        inputs = self._prepare_inputs(inputs)
        call = self._karma_call(inputs, num_items_in_batch)
        karma_run = self._karma_run(call, training=True)
        rt = karma_run.runtime
        if self.current_gradient_accumulation_steps != rt.accumulate:
            raise KarmaError(
                f"this optimizer step has {self.current_gradient_accumulation_steps} "
                f"micro-batches where karma planned {rt.accumulate} "
                "(gradient_accumulation_steps): the epoch's batches do not divide into whole "
                "steps; use a dataset whose number of batches is a multiple of it, or "
                "dataloader_drop_last=True with max_steps")
        if karma_run.step_starts:
            self.lr_scheduler.last_lr = rt.lr  # the rate this step uses: the Trainer logs it
        self._karma_mode = _LossMode(True, num_items_in_batch,
                                     self._karma_scaled_for_ga(num_items_in_batch),
                                     rt.accumulate)
        rt.micro_step(call.inputs, call.targets)
        karma_run.step_starts = rt.stepped
        if rt.stepped:
            for group in self.optimizer.param_groups:  # (Accelerate's wrapper of karma's)
                group["lr"] = rt.lr  # as the Trainer's after its scheduler's step
        return self._karma_reported.to(self.args.device)

    def _clip_grad_norm(self, model: torch.nn.Module) -> float | None:
        """karma clipped inside the step: the gradient norm before clipping."""
        return self._karma.runtime.last.grad_norm

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm=None):
        """The norm karma's clipping took, or None without clipping: karma then steps each
        block as soon as its gradient is ready and never holds them all to take a norm."""
        return grad_norm

    def _karma_call(self, inputs: dict[str, Any], num_items: Any) -> _Call:
        """The batch as the Trainer's compute_loss would call the model with it: labels kept
        for a label smoother or compute_loss_func, num_items_in_batch passed to a model
        that takes loss arguments."""
        inputs = dict(inputs)
        labels = None
        if (self.label_smoother is not None or self.compute_loss_func is not None) \
                and "labels" in inputs:
            labels = inputs.pop("labels")
        if self.model_accepts_loss_kwargs and num_items is not None:
            inputs["num_items_in_batch"] = num_items
        return _Call(inputs, labels)

    def _karma_scaled_for_ga(self, num_items: Any) -> bool:
        """Whether the loss is normalised over the step already (the Trainer's rule)."""
        if self.loss_is_scaled_for_ga is not None:
            return self.loss_is_scaled_for_ga
        return (self.model_accepts_loss_kwargs and num_items is not None) \
            or self.compute_loss_func is not None

    def _karma_loss(self, outputs: Any, labels: torch.Tensor | None) -> torch.Tensor:
        """karma's loss_fn: the Trainer's loss of the model's outputs, as compute_loss takes
        it after the forward ([Note: the loss scaled for accumulation])."""
        mode = self._karma_mode
        if mode.outputs_only:  # a prediction without labels: the outputs are what it wants;
            # a loss of them all the same, for a plan made at this batch to have a backward
            with _as_the_trainer_outside_the_model(outputs, self.args.bf16) as outputs:
                self._karma_outputs = outputs
            return output_tensors(outputs)[0].float().sum() * 0
        if self.compute_loss_func is not None or labels is not None:
            with _as_the_trainer_outside_the_model(outputs, self.args.bf16) as outputs:
                loss = self._karma_loss_of(outputs, labels, mode.num_items)
        else:
            if isinstance(outputs, dict) and "loss" not in outputs:
                raise KarmaError(f"the model returned no loss, only {', '.join(outputs)}; "
                                 "give it labels, or pass compute_loss_func")
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
        if not mode.training:
            self._karma_reported = loss.detach().mean()
            self._karma_outputs = outputs  # for compute_metrics and predict()
            return loss
        if mode.scaled_for_ga:
            self._karma_reported = loss.detach()
            return loss * mode.accumulate
        self._karma_reported = loss.detach() / mode.accumulate
        return loss

    def _karma_loss_of(self, outputs: Any, labels: torch.Tensor | None,
                       num_items: Any) -> torch.Tensor:
        """compute_loss_func's loss, or the label smoother's."""
        if self.compute_loss_func is not None:
            return self.compute_loss_func(outputs, labels, num_items_in_batch=num_items)
        model = self.accelerator.unwrap_model(self.model)
        if _is_peft_model(model):  # named as Trainer.compute_loss names it
            model = model.base_model.model
        causal = model._get_name() in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
        return self.label_smoother(outputs, labels, shift_labels=causal,
                                   num_items_in_batch=num_items)

    # --- evaluation ------------------------------------------------------------------------

    def evaluation_loop(self, *args, **kwargs):
        """The Trainer's loop; outside training, over a karma run opened for it."""
        opened_here = self._karma is None
        try:
            return super().evaluation_loop(*args, **kwargs)
        finally:
            if opened_here:
                self._karma_release()

    def prediction_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                        prediction_loss_only: bool, ignore_keys: list[str] | None = None):
        """The batch's loss, logits and labels as the Trainer's prediction_step gives them,
        the forward run by `Runtime.evaluate` (the logits for compute_metrics and predict()
        are the outputs its loss_fn saw)."""
        has_labels = bool(self.label_names) and \
            all(inputs.get(k) is not None for k in self.label_names)
        return_loss = inputs.get("return_loss")
        return_loss = self.can_return_loss if return_loss is None else return_loss
        with_loss = has_labels or (not self.label_names and return_loss)
        if not with_loss and prediction_loss_only:
            return (None, None, None)
        inputs = self._prepare_inputs(inputs)
        if ignore_keys is None:
            config = getattr(self.model, "config", None)
            ignore_keys = getattr(config, "keys_to_ignore_at_inference", ["cache"]) \
                if config is not None else []
        labels = nested_detach(tuple(inputs.get(name) for name in self.label_names)) \
            if with_loss else None
        num_items = self._get_num_items_in_batch([inputs], self.args.device) \
            if with_loss else None
        call = self._karma_call(inputs, num_items)
        self._karma_mode = _LossMode(training=False, num_items=num_items,
                                     outputs_only=not with_loss)  # before a plan traces it
        karma_run = self._karma_run(call, training=False)
        karma_run.runtime.evaluate(call.inputs, call.targets)
        loss = self._karma_reported.to(self.args.device) if with_loss else None
        outputs, self._karma_outputs = self._karma_outputs, None
        if prediction_loss_only:
            return (loss, None, None)
        dropped = [*ignore_keys, "loss"] if with_loss else list(ignore_keys)
        logits = nested_detach(tuple(v for k, v in outputs.items() if k not in dropped)
                               if isinstance(outputs, Mapping)
                               else tuple(outputs[1:] if with_loss else outputs))
        if len(logits) == 1:
            logits = logits[0]
        if labels is not None and len(labels) == 1:
            labels = labels[0]
        return (loss, logits, labels)

    # --- the karma run ---------------------------------------------------------------------

    def _karma_run(self, call: _Call, training: bool) -> _KarmaRun:
        """The karma run for this batch: opened at the first batch, and the batch checked
        against the shape it was planned for."""
        if self._karma is None:
            self._karma = self._karma_open(call, training)
        karma_run = self._karma
        problem = karma_run.shape.problem(call.inputs, call.targets)
        if problem:
            fix = "pad every batch to one length (padding='max_length' in the tokenizer)"
            if not training:
                fix += ", with per_device_eval_batch_size at most per_device_train_batch_size"
            raise KarmaError(f"a {'training' if training else 'evaluation'} batch does not "
                             f"fit the shape karma planned for: {problem}; {fix}")
        return karma_run

    def _karma_open(self, call: _Call, training: bool) -> _KarmaRun:
        """Plan the Trainer's model for batches shaped as `call`, and start karma over it
        (restoring a checkpoint to resume from)."""
        batch = self._train_batch_size if training else self.args.eval_batch_size
        shape = BatchShape.of(call.inputs, call.targets, batch)
        rule = self._karma_decay_rule()
        mf = karma.model(self.model, shape.example_batch, loss_fn=self._karma_loss,
                         make_optimizer=MakeOptimizer(*self._karma_recipe(), rule),
                         make_scheduler=self._karma_make_scheduler if training else None,
                         batch_size=batch)
        devices = {n: t.device for n, t in [*self.model.named_parameters(remove_duplicate=False),
                                           *self.model.named_buffers(remove_duplicate=False)]}
        with _trainer_rng():
            schedule = karma.plan(mf, **planning_options(self.args, self.karma_options, batch,
                                                         training))
            rule.know_blocks((b.name, list(b.params)) for b in schedule.blocks)
            runtime = Runtime(schedule, model=mf, seed=self.args.seed)
            try:
                if training and self._karma_resume is not None:
                    runtime.load(self._karma_resume)
                    self._karma_resume = None
            except BaseException:
                runtime.close()
                raise
        self.karma_schedule = schedule
        return _KarmaRun(runtime, shape, devices, training)

    def _karma_release(self, keep_values: bool = True) -> None:
        """Close the karma run and give its model values back to `trainer.model` (not
        after a failure, when karma's state may be half a step)."""
        karma_run, self._karma = self._karma, None
        if karma_run is None:
            return
        try:
            state = karma_run.runtime.model_state_dict() if keep_values else None
        finally:
            karma_run.runtime.close()
        if state is not None:
            restore_values(self.model, state, karma_run.devices)

    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        except BaseException:
            self._karma_release(keep_values=False)  # karma's streams and memory freed
            raise

    def _finalize_training(self, trial, num_train_samples, start_time):
        self._karma_release()  # before the best model is loaded into trainer.model
        return super()._finalize_training(trial, num_train_samples, start_time)

    # --- saving and resuming ---------------------------------------------------------------

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """save_pretrained, of karma's current values while karma holds the model."""
        if state_dict is None and self._karma is not None:
            state_dict = self._karma.runtime.model_state_dict()
        super()._save(output_dir, state_dict=state_dict)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """karma's checkpoint (every block's optimizer state, the LR schedule) in the
        checkpoint folder, KARMA_CHECKPOINT/, in karma-run's format."""
        if self._karma is None or not self._karma.training:
            return
        if self.args.should_save:
            self._karma.runtime.save(Path(output_dir) / KARMA_CHECKPOINT)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Resume karma's state from `checkpoint`/KARMA_CHECKPOINT once the run exists (the
        weights the Trainer loads into the model before)."""
        if checkpoint is None:
            return
        path = Path(checkpoint) / KARMA_CHECKPOINT
        if not path.exists():
            raise KarmaError(
                f"checkpoint {checkpoint} holds no karma state ({KARMA_CHECKPOINT}/): a Trainer "
                "without karma wrote it. Resume it with that Trainer, or start from its "
                "weights (from_pretrained) without resume_from_checkpoint")
        self._karma_resume = path


@contextlib.contextmanager
def _trainer_rng():
    """karma's setup leaves the random-number state as the Trainer had it."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        yield


@contextlib.contextmanager
def _as_the_trainer_outside_the_model(outputs: Any, bf16: bool):
    """`outputs` as a loss computed outside the model sees them in the Trainer: under bf16,
    Accelerate's wrapper of the forward hands them over in float32 and autocast ends with the
    forward (karma runs the loss under its autocast: on the CPU, log_softmax of bf16 logits
    would stay bf16)."""
    tensors = output_tensors(outputs)
    if not bf16 or not tensors:
        yield outputs
        return
    with torch.autocast(tensors[0].device.type, enabled=False):
        yield convert_to_fp32(outputs)

