"""The training options a schedule's config asks for, as small roles the engine calls.

- `MixedPrecision` (config.dtype bf16): the forward and the loss under `torch.autocast`;
  parameters, gradients and optimizer state stay fp32.
- `GradClip` (config.clip_grad_norm X): the gradients scaled by `torch.nn.utils.clip_grad_norm_`
  itself, over the parameters that hold the final gradients, in `model.parameters()` order.
- `Accumulation` (config.accumulate N): which micro-batch of the optimizer step runs now; the
  update operations run only in the last one.

[Note: the autocast cache between blocks] Under autocast, the bf16 copy of a weight is cached
until the outermost autocast region ends, and it is what the matmul saves for backward. One
region over the whole forward would keep every block's bf16 weights alive until the loss:
swapping or recomputing a block would free nothing of them and a streamed weight's copy would
outlive its release. So the engine clears the cache whenever a block's forward ends
(`MixedPrecision.block_done`). The numbers stay those of one region wherever each weight is
cast in one block only; a weight cast to bf16 in two blocks (a linear layer's weight shared
between blocks; tied input embeddings are not cast, embedding is not an autocast op) is cast
once per block, so its two gradients meet in fp32 rather than in bf16: more exact than the
plain loop, not bitwise equal to it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from karma.errors import KarmaError
from karma.schedule import Schedule

_DTYPES = {"fp32": None, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class MixedPrecision:
    """Autocast for the forward and the loss (dtype None: plain fp32)."""

    device_type: str
    dtype: torch.dtype | None

    @classmethod
    def of(cls, schedule: Schedule, device_type: str) -> MixedPrecision:
        dtype = schedule.config.dtype
        if dtype not in _DTYPES:
            raise KarmaError(f"the schedule asks for dtype {dtype!r}, which this runtime cannot "
                             f"train in; re-plan with --dtype fp32 or bf16")
        return cls(device_type, _DTYPES[dtype])

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def block_done(self) -> None:
        """See [Note: the autocast cache between blocks]."""
        if self.dtype is not None and torch.is_autocast_enabled(self.device_type):
            torch.clear_autocast_cache()


@dataclass(frozen=True)
class GradClip:
    """Clip to `max_norm` exactly as `clip_grad_norm_(model.parameters(), max_norm)` does.

    [Note: clipping from per-parameter norms] clip_grad_norm_ takes each gradient's norm,
    then the norm of those norms (stacked in the parameters' order), then scales every
    gradient by min(1, max_norm / (total + 1e-6)). Each gradient's norm is taken here as
    soon as the gradient is final (`norm`, on the stream that makes it final), and the
    total once all are in (`clip`), with PyTorch's own get_total_norm and
    clip_grads_with_norm_: the norm of one tensor's norm is that norm (an absolute value),
    so the total is bitwise clip_grad_norm_'s."""

    max_norm: float

    @staticmethod
    def norm(grad: torch.Tensor) -> torch.Tensor:
        return torch.nn.utils.get_total_norm([grad])

    def clip(self, holders: list[torch.Tensor], norms: list[torch.Tensor]) -> float:
        """Scale the gradients of `holders` in place (each a tensor whose `.grad` is the final
        gradient of one model parameter, or None, in `model.parameters()` order; `norms`,
        those gradients' norms in the same order); return the total norm before clipping."""
        total = torch.nn.utils.get_total_norm(norms)
        torch.nn.utils.clip_grads_with_norm_(holders, self.max_norm, total)
        return float(total)


@dataclass
class Accumulation:
    """Micro-batches per optimizer step, and where the current step is."""

    micro_batches: int
    done: int = 0  # micro-batches of the current step already run

    @property
    def first(self) -> bool:
        return self.done == 0

    @property
    def last(self) -> bool:
        """The running micro-batch ends the step: the update operations run."""
        return self.done == self.micro_batches - 1

    def advance(self) -> None:
        self.done = 0 if self.last else self.done + 1

