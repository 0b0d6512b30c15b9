"""The model file's learning-rate schedule, driving every block's optimizer.

[Note: one scheduler for many optimizers] The plain loop has one optimizer over all the
parameters and one scheduler stepping it; karma has one optimizer per block. A "driver"
optimizer, made by the model file's make_optimizer over all the model's parameters exactly as
the plain loop makes its own, is handed to make_scheduler and never stepped (optimizers such
as SGD and AdamW make their state at the first step, so it holds none). After each step
the scheduler steps the driver, and every hyperparameter of the driver's param group k (lr,
and e.g. momentum or betas for OneCycleLR) is copied into param group k of each block's
optimizer: they all see the values the plain loop's optimizer would, computed by the same
code from the same numbers (but `foreach` and `fused`: a host-stepped block keeps its
kernel, host_optimizer.py). The copy happens between steps, when no host step of
theirs runs: for optimizers whose host steps may still be running into the next step
(replay/update.py, [Note: updates overlapped with the next forward]) it is queued behind them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from karma.errors import KarmaError, ModelFileError
from karma.runtime.params.host_optimizer import hyperparameters


class LRSchedule:
    """The model file's scheduler over a driver optimizer, copied into the block optimizers."""

    def __init__(self, make_optimizer: Callable, make_scheduler: Callable,
                 params: list[torch.nn.Parameter], block_optimizers: list[torch.optim.Optimizer],
                 path: Path):
        self.path = path
        try:
            self.driver = make_optimizer(params)
        except Exception as e:  # noqa: BLE001 - user code; report where it failed
            raise ModelFileError(f"{path}: make_optimizer(params) over all the model's "
                                 f"parameters raised {type(e).__name__}: {e}; the LR schedule "
                                 "needs the optimizer the plain loop would make") from e
        try:
            self.scheduler = make_scheduler(self.driver)
        except Exception as e:  # noqa: BLE001 - user code; report where it failed
            raise ModelFileError(f"{path}: make_scheduler(optimizer) raised "
                                 f"{type(e).__name__}: {e}; make it return a "
                                 "torch.optim.lr_scheduler object over its argument") from e
        self._check()
        # the driver is never stepped: its scheduler's "step before optimizer.step()" warning
        # is about a mistake that does not happen here (the block optimizers step first)
        self.driver._opt_called = True
        self.blocks = block_optimizers
        groups = len(self.driver.param_groups)
        for opt in self.blocks:
            if len(opt.param_groups) != groups:
                raise ModelFileError(
                    f"{path}: make_optimizer(params) made {groups} param group(s) over all the "
                    f"model's parameters but {len(opt.param_groups)} over one block's; an LR "
                    "schedule needs the same groups in each: make the groups by a rule that "
                    "gives every block the same number (empty groups are fine)")
        self._copy()  # schedulers set the first step's values when they are made

    def _check(self) -> None:
        s = self.scheduler
        fix = ("return a torch.optim.lr_scheduler object over the optimizer it is given, e.g. "
               "torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: ...)")
        missing = [m for m in ("step", "state_dict", "load_state_dict")
                   if not callable(getattr(s, m, None))]
        if missing:
            raise ModelFileError(f"{self.path}: make_scheduler(optimizer) returned "
                                 f"{type(s).__name__}, which has no {missing[0]}(); {fix}")
        if isinstance(s, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise ModelFileError(f"{self.path}: make_scheduler(optimizer) returned "
                                 "ReduceLROnPlateau, whose step needs a metric karma does not "
                                 f"have; use a schedule over steps: {fix}")
        if getattr(s, "optimizer", self.driver) is not self.driver:
            raise ModelFileError(f"{self.path}: make_scheduler(optimizer) returned a scheduler "
                                 f"of another optimizer; {fix}")

    @property
    def lr(self) -> float:
        """The learning rate of param group 0 that the next step uses."""
        return _scalar(self.driver.param_groups[0]["lr"])

    def step(self, later: list[torch.optim.Optimizer] = (),
             defer: Callable[[Callable[[], None]], None] | None = None) -> None:
        """After an optimizer step: step the schedule and copy its values into the block
        optimizers; those in `later` (host steps that may still be running) get them through
        `defer`, which runs the copy once their steps are done."""
        try:
            self.scheduler.step()
        except Exception as e:  # noqa: BLE001 - user code; report where it failed
            raise ModelFileError(
                f"{self.path}: the scheduler that make_scheduler(optimizer) made raised "
                f"{type(e).__name__}: {e}; make its schedule "
                "cover every step of the run (e.g. OneCycleLR's total_steps >= --steps)") from e
        later_ids = {id(opt) for opt in later}
        self._copy([opt for opt in self.blocks if id(opt) not in later_ids])
        if later:
            values = [{k: v.clone() if isinstance(v, torch.Tensor) else v
                       for k, v in g.items() if k != "params"} for g in self.driver.param_groups]
            defer(lambda: self._copy(list(later), values))

    def _copy(self, optimizers: list[torch.optim.Optimizer] | None = None,
              groups: list[dict] | None = None) -> None:
        """Copy the driver's param groups (or `groups`, a snapshot of them) into each of
        `optimizers` (default: every block optimizer)."""
        optimizers = self.blocks if optimizers is None else optimizers
        for k, source in enumerate(groups or self.driver.param_groups):
            for opt in optimizers:
                target = opt.param_groups[k]
                for key, value in hyperparameters(source).items():  # not the kernel
                    if isinstance(value, torch.Tensor) and isinstance(target.get(key),
                                                                      torch.Tensor):
                        target[key].copy_(value)  # a tensor lr stays the block's own tensor
                    elif isinstance(value, torch.Tensor):
                        target[key] = value.clone()
                    else:
                        target[key] = value

    # --- checkpoints -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's state and the driver's param groups (chainable schedulers compute
        the next value from the current one)."""
        return {"scheduler": self.scheduler.state_dict(), "driver": self.driver.state_dict()}

    def load_state_dict(self, state: dict[str, Any], source: str) -> None:
        try:
            self.driver.load_state_dict(state["driver"])
            self.scheduler.load_state_dict(state["scheduler"])
        except (KeyError, TypeError, ValueError) as e:
            raise KarmaError(f"{source}: its LR schedule does not fit this model file's "
                             f"make_scheduler ({e}); resume with the model file that wrote "
                             "it") from e
        self.driver._opt_called = True
        self._copy()


def _scalar(value: Any) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)
