"""The pieces KarmaTrainer (hf_trainer.py) is made of, each testable alone.

- `planning_options`: karma's plan options from the Trainer's TrainingArguments and the
  user's `karma={...}`; `unsupported`: the Trainer features karma cannot carry, with the fix.
- `BatchShape`: the shape of the batches a schedule is planned for, its `example_batch`, and
  the check that a later batch fits it.
- `DecayRule`: which tensors the Trainer's weight decay applies to, for optimizers karma
  makes per block (over the model's parameters, or over the host copies it steps), and
  `MakeOptimizer`, which makes them.
- `KarmaOptimizer`, `KarmaLRScheduler`: what the Trainer's loop holds as `self.optimizer` and
  `self.lr_scheduler`; karma steps its own inside the step's last micro-batch.
- `restore_values`: the module's parameters and buffers given back plain tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from karma.errors import KarmaError

# karma options the TrainingArguments set: the user sets them there, once
TRAINER_OWNED = {
    "batch_size": "per_device_train_batch_size",
    "accumulate": "gradient_accumulation_steps",
    "clip_grad_norm": "max_grad_norm",
    "dtype": "bf16",
    "seed": "seed",
    "world_size": "the number of processes",
}


def planning_options(args, karma: Mapping[str, Any], batch_size: int,
                     training: bool) -> dict[str, Any]:
    """karma.plan's keyword arguments (but the model) for a run of the Trainer `args`: the
    user's `karma` options, and what TrainingArguments say of the batch, accumulation,
    clipping, precision and seed. An evaluation-only run (`training` False) is planned
    without accumulation or clipping, which it never does."""
    owned = [key for key in karma if key in TRAINER_OWNED]
    if owned:
        key = owned[0]
        raise KarmaError(f"karma={{{key!r}: ...}}: TrainingArguments' {TRAINER_OWNED[key]} "
                         "sets it for karma too; set it there and drop it from karma={...}")
    clip = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None
    return {"host_optimizer": "as-given", **karma, "batch_size": batch_size,
            "accumulate": args.gradient_accumulation_steps if training else 1,
            "clip_grad_norm": clip if training else None,
            "dtype": "bf16" if args.bf16 else "fp32", "seed": args.seed}


def unsupported(args) -> str | None:
    """The first TrainingArguments setting karma cannot carry, with what to do instead; None
    when all can be carried."""
    if args.fp16:
        return ("fp16=True: karma trains in fp32 or bf16 mixed precision (no loss scaler); use "
                "bf16=True")
    if args.world_size > 1:
        return (f"{args.world_size} processes: KarmaTrainer trains in one process; karma's "
                "data parallelism runs under karma-run (see the README)")
    if args.deepspeed or args.fsdp:
        return ("deepspeed/fsdp: karma moves the weights, activations and optimizer state "
                "itself; drop the deepspeed and fsdp arguments")
    if args.activation_checkpointing:
        return ("activation_checkpointing=True: karma's plan decides per block what to "
                "recompute; drop it")
    if args.auto_find_batch_size:
        return ("auto_find_batch_size=True: karma plans for per_device_train_batch_size; "
                "karma-plan --batch-size max finds the largest that fits the budget")
    if args.torch_compile:
        return "torch_compile=True: karma runs the model eagerly; drop it"
    if args.bf16_full_eval or args.fp16_full_eval:
        return ("bf16_full_eval/fp16_full_eval: karma evaluates as it trains (bf16=True "
                "evaluates under autocast); drop it")
    return None


@dataclass(frozen=True)
class TensorShape:
    """One tensor of a batch: its shape past the batch dimension (all of it for a 0-dim
    tensor, which has no batch dimension) and its dtype."""

    trailing: tuple[int, ...]
    dtype: torch.dtype
    batched: bool

    @staticmethod
    def of(t: torch.Tensor) -> TensorShape:
        return TensorShape(tuple(t.shape[1:]) if t.dim() else (), t.dtype, t.dim() > 0)

    def example(self, batch_size: int) -> torch.Tensor:
        """A tensor of this shape made by a factory function (it also works on the meta
        device): ones for integers and booleans (a valid token id, mask and label), zeros for
        floating point."""
        shape = (batch_size, *self.trailing) if self.batched else ()
        if self.dtype.is_floating_point or self.dtype.is_complex:
            return torch.zeros(shape, dtype=self.dtype)
        return torch.ones(shape, dtype=self.dtype)


@dataclass(frozen=True)
class BatchShape:
    """The shape of the batches a schedule is planned for: the model's keyword arguments
    (tensors, and plain constants as they are), the targets (labels the loss takes apart from
    the model's inputs, or None) and the batch size."""

    inputs: tuple[tuple[str, TensorShape | Any], ...]
    targets: TensorShape | None
    batch_size: int

    @staticmethod
    def of(inputs: Mapping[str, Any], targets: torch.Tensor | None,
           batch_size: int) -> BatchShape:
        shaped = tuple((k, TensorShape.of(v) if isinstance(v, torch.Tensor) else v)
                       for k, v in inputs.items())
        return BatchShape(shaped, None if targets is None else TensorShape.of(targets),
                          batch_size)

    def example_batch(self, batch_size: int) -> tuple[dict[str, Any], torch.Tensor | None]:
        """The model-file protocol's example_batch: (keyword arguments, targets)."""
        inputs = {k: v.example(batch_size) if isinstance(v, TensorShape) else v
                  for k, v in self.inputs}
        return inputs, None if self.targets is None else self.targets.example(batch_size)

    def problem(self, inputs: Mapping[str, Any], targets: torch.Tensor | None) -> str | None:
        """Why a batch does not fit this shape (another key, length or dtype, or more
        samples), or None when it fits: karma plans the memory of one shape."""
        other = BatchShape.of(inputs, targets, self.batch_size)
        if [k for k, _ in other.inputs] != [k for k, _ in self.inputs]:
            return (f"its keys {[k for k, _ in other.inputs]} are not the planned "
                    f"{[k for k, _ in self.inputs]}")
        for (key, planned), (_, given) in zip(self.inputs + (("labels", self.targets),),
                                              other.inputs + (("labels", other.targets),)):
            if isinstance(planned, TensorShape) and planned != given:
                return f"its {key} is {_text(given)}, planned {_text(planned)}"
        sizes = {v.shape[0] for v in (*inputs.values(), targets)
                 if isinstance(v, torch.Tensor) and v.dim()}
        if any(size > self.batch_size for size in sizes):
            return f"it has {max(sizes)} samples, planned at most {self.batch_size}"
        return None


def _text(shape: TensorShape | Any) -> str:
    if not isinstance(shape, TensorShape):
        return repr(shape)
    return f"[batch, {', '.join(map(str, shape.trailing))}] {shape.dtype}".replace(", ]", "]")


class DecayRule:
    """Which tensors weight decay applies to, as the Trainer's two param groups say (its
    `get_decay_parameter_names`).

    karma makes an optimizer per block, over the block's parameters, or, for a block it steps
    on the host, over host copies of them (same shapes, same order); while planning it also
    times optimizers over copies of its own. A model parameter is known by identity. A copy
    is known by its shape where every model parameter of that shape decays alike (in a
    transformer, matrices decay and vectors, norms and biases, do not); else by the block it
    copies, found by the shapes of all its tensors once the schedule is known
    (`know_blocks`). A shape no parameter has is a tensor karma tests the optimizer on: any
    group will do. After `know_blocks` (the run), a copy none of these tells apart is refused,
    not guessed; before (planning's timing), it is decayed."""

    def __init__(self, named: Iterable[tuple[str, torch.nn.Parameter]], decay_names: set[str],
                 weight_decay: float):
        named = list(named)
        self.weight_decay = weight_decay
        self._by_id = {id(p): n in decay_names for n, p in named}
        self._by_name = {n: n in decay_names for n, _ in named}
        self._shapes = {n: tuple(p.shape) for n, p in named}
        self._by_shape: dict[tuple[int, ...], set[bool]] = {}
        for n, p in named:
            self._by_shape.setdefault(tuple(p.shape), set()).add(n in decay_names)
        self._by_block: dict[tuple, tuple[bool, ...] | None] = {}  # None: ambiguous
        self._running = False

    def know_blocks(self, blocks: Iterable[tuple[str, list[str]]]) -> None:
        """The schedule's blocks, (name, parameter names) each: the run begins."""
        for _, params in blocks:
            shapes = tuple(self._shapes[n] for n in params)
            pattern = tuple(self._by_name[n] for n in params)
            known = self._by_block.get(shapes, pattern)
            self._by_block[shapes] = pattern if known == pattern else None
        self._running = True

    def groups(self, params: Iterable[torch.Tensor]) -> list[dict[str, Any]]:
        """The Trainer's two param groups over `params`: decayed, then not (either may be
        empty: every block's optimizer has the same groups, as an LR schedule needs)."""
        params = list(params)
        decays = self._decays(params)
        return [{"params": [p for p, d in zip(params, decays) if d],
                 "weight_decay": self.weight_decay},
                {"params": [p for p, d in zip(params, decays) if not d], "weight_decay": 0.0}]

    def _decays(self, params: list[torch.Tensor]) -> list[bool]:
        if self.weight_decay == 0:
            return [True] * len(params)  # the groups differ in nothing
        if all(id(p) in self._by_id for p in params):
            return [self._by_id[id(p)] for p in params]
        by_shape = [self._by_shape.get(tuple(p.shape), {True}) for p in params]
        if all(len(flags) == 1 for flags in by_shape):
            return [next(iter(flags)) for flags in by_shape]
        block = self._by_block.get(tuple(tuple(p.shape) for p in params))
        if block is not None:
            return list(block)
        if not self._running:
            return [True] * len(params)
        raise KarmaError(
            "cannot tell which of a host-stepped block's parameters take weight decay (its "
            "shapes decay differently elsewhere in the model, and blocks of the same shapes "
            "decay different parameters); train with weight_decay=0 or karma={'strategy': "
            "'keep_all'} or 'recompute_all' (no host-stepped blocks)")


class MakeOptimizer:
    """karma's make_optimizer for the Trainer: its optimizer class and keyword arguments
    over its two decay groups. It holds neither the Trainer nor the model (karma keeps each
    make_optimizer it has seen, optimizer_state.zero_state_template)."""

    def __init__(self, cls: type, kwargs: dict[str, Any], rule: DecayRule):
        self.cls, self.kwargs, self.rule = cls, dict(kwargs), rule

    def __call__(self, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
        return self.cls(self.rule.groups(params), **self.kwargs)


class KarmaOptimizer(torch.optim.Optimizer):
    """The Trainer's `self.optimizer` under karma: its two param groups over the model's
    parameters, for callbacks to read (`lr` follows karma's schedule: `KarmaTrainer` sets
    it after each step). karma steps one optimizer per block inside the step's last
    micro-batch, so `step` and `zero_grad` here do nothing."""

    def __init__(self, groups: list[dict[str, Any]], lr: float):
        super().__init__(groups, {"lr": lr})

    def step(self, closure: Callable | None = None):
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None


class KarmaLRScheduler:
    """The Trainer's `self.lr_scheduler` under karma: the learning rate of the latest step
    (what the Trainer logs); karma's own scheduler, the Trainer's made over karma's driver
    optimizer, steps inside the step."""

    def __init__(self, lr: float):
        self.last_lr = lr

    def get_last_lr(self) -> list[float]:
        return [self.last_lr]

    def step(self, *args, **kwargs) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"last_lr": self.last_lr}  # karma's checkpoint holds the schedule itself

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_lr = state.get("last_lr", self.last_lr)


def restore_values(model: torch.nn.Module, state: Mapping[str, torch.Tensor],
                   devices: Mapping[str, torch.device]) -> None:
    """Give every parameter and buffer of `model` its value in `state` (a state_dict), as a
    plain tensor of its own on the device in `devices`: what the module holds once karma has
    let go of it. A tied parameter is set once."""
    done: set[int] = set()
    tensors = [*model.named_parameters(remove_duplicate=False),
               *model.named_buffers(remove_duplicate=False)]
    for name, tensor in tensors:
        if name not in state or id(tensor) in done:
            continue
        done.add(id(tensor))
        value = state[name].detach().to(devices.get(name, state[name].device), copy=True)
        tensor.data = value
