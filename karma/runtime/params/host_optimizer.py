"""The kernel a host-stepped block's optimizer runs: PyTorch's fused CPU kernel by default.

    make = host_make_optimizer(mf.make_optimizer, "fused")   # or "as-given"
    opt = make(masters)            # the model file's optimizer, its hyperparameters and groups,
                                   # stepping through torch's fused CPU kernel where it has one
    keep_implementation(opt, lambda: opt.load_state_dict(sd))   # a restore keeps the kernel

[Note: the host optimizer's kernel] Given a CPU tensor and no `foreach`/`fused` argument,
torch's Adam, AdamW, SGD and Adagrad take their single-tensor path: a Python loop over the
tensors, about 20 parameter-sized passes over memory and two fresh parameter-sized
temporaries per tensor (Adam's `exp_avg_sq.sqrt() / bc2`). Their `fused=True` path (torch
2.4 and later on the CPU) reads and writes each element once in one vectorized, threaded
loop: several times the single-tensor rate (bench/RESULTS.md, "The host optimizer"). Its
rounding differs: after one step some elements differ by an ulp, how many depending on the
values (3.6% of the demo GPT's parameters; torch's own test asks allclose at rtol 1.3e-6
for fp32), and training carries the difference on (bench/fused_vs_plain.py). So:
- "fused" (the default): a block stepped on the host steps through the fused kernel when the
  model file's optimizer is exactly one of FUSED_ON_CPU and asks for no implementation
  (every group's `foreach` and `fused` None, not differentiable, not capturable, real
  floating parameters). The optimizer is made again, of the same class over the same param
  groups (every hyperparameter kept), with `fused=True`. Anything else is used as given.
- "as-given": the model file's optimizer exactly as it makes it, for a run that must equal
  the user's own loop to the bit.
karma.reference steps the parameters of host-stepped blocks with the same kernel, so every
exactness check compares like with like (reference.py, HostStepped). An LR schedule's copy
(lr.py) and a restored state_dict (weights.py) carry param-group values and would carry
`fused`/`foreach` with them: they copy only `hyperparameters`, and a restore keeps them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from karma.schedule import HOST_OPTIMIZERS

FUSED_ON_CPU = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)
IMPLEMENTATION_KEYS = ("foreach", "fused")  # param-group keys that choose the kernel


def host_make_optimizer(make_optimizer: Callable, choice: str) -> Callable:
    """`make_optimizer` as host-stepped blocks call it under `choice` (HOST_OPTIMIZERS)."""
    if choice not in HOST_OPTIMIZERS:
        raise ValueError(f"host optimizer {choice!r}: choose one of {', '.join(HOST_OPTIMIZERS)}")
    if choice == "as-given":
        return make_optimizer
    return _Fused(make_optimizer)


class _Fused:
    """make_optimizer, its optimizers moved onto the fused CPU kernel where that is the same
    optimizer ([Note: the host optimizer's kernel]). One per make_optimizer, so that caches
    keyed by the factory (optimizer_state.zero_state_template) hold it once."""

    _made: dict[Callable, _Fused] = {}

    def __new__(cls, make_optimizer: Callable):
        if make_optimizer not in cls._made:
            made = super().__new__(cls)
            made.make_optimizer = make_optimizer
            cls._made[make_optimizer] = made
        return cls._made[make_optimizer]

    def __call__(self, params: Iterable) -> torch.optim.Optimizer:
        return fused_version(self.make_optimizer(params))


def fused_version(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """`opt` made again with fused=True if it can step through torch's fused CPU kernel as
    the same optimizer; else `opt` itself."""
    if not can_fuse(opt):
        return opt
    groups = [{**g, "foreach": None, "fused": True} for g in opt.param_groups]
    fused = type(opt)(groups, fused=True)
    fused.defaults.update({k: v for k, v in opt.defaults.items()
                           if k not in IMPLEMENTATION_KEYS})
    return fused


def can_fuse(opt: torch.optim.Optimizer) -> bool:
    """Whether `opt` is one of FUSED_ON_CPU exactly, asks for no implementation, and steps
    real floating-point parameters that the fused kernel takes."""
    if type(opt) not in FUSED_ON_CPU:
        return False  # a subclass may step otherwise
    for g in opt.param_groups:
        if any(g.get(k) is not None for k in IMPLEMENTATION_KEYS):
            return False
        if g.get("differentiable") or g.get("capturable"):
            return False
        if not all(p.is_floating_point() and not p.is_complex() for p in g["params"]):
            return False
    return True


def is_fused(opt: torch.optim.Optimizer) -> bool:
    """Whether `opt` steps through a fused kernel."""
    return any(g.get("fused") for g in opt.param_groups)


def hyperparameters(group: dict) -> dict:
    """A param group's values that carry over to another optimizer's group (an LR
    schedule's copy, a checkpoint's restore): all but its params and IMPLEMENTATION_KEYS."""
    return {k: v for k, v in group.items() if k != "params" and k not in IMPLEMENTATION_KEYS}


def keep_implementation(opt: torch.optim.Optimizer, restore: Callable[[], None]) -> None:
    """Run `restore` (which rewrites opt's param groups, e.g. load_state_dict) and keep each
    group's IMPLEMENTATION_KEYS as they were before it."""
    before = [{k: g.get(k) for k in IMPLEMENTATION_KEYS} for g in opt.param_groups]
    restore()
    for g, keys in zip(opt.param_groups, before):
        g.update(keys)
