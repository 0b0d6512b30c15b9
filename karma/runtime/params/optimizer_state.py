"""The optimizer's state made in the host tier before its first step.

[Note: optimizer state born in the host tier] Left to itself an optimizer makes its state at
the first step in private memory (twice the weights for AdamW) and only then could it move: a
one-off spike that a memory cap would not survive. Where a state of zeros is exactly what the
optimizer would make, it is made in the host tier up front instead (BlockWeights in
weights.py). Whether it is exact is checked once per make_optimizer, on a small parameter:
two steps from the optimizer's own state and two from zeros must agree to the bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

StateTemplate = dict[str, tuple[bool, torch.dtype]]  # key -> (parameter-shaped?, dtype)
_TEMPLATES: dict[Callable, StateTemplate | None] = {}  # keeps each make_optimizer alive


def zero_state_template(make_optimizer) -> StateTemplate | None:
    """The optimizer's per-parameter state layout, if a state of zeros steps exactly as the
    state it makes itself (checked once per make_optimizer on a small parameter); else None."""
    if make_optimizer not in _TEMPLATES:
        try:
            template = _state_template(make_optimizer)
            p1, s1 = _probe_step(make_optimizer, None)
            p2, s2 = _probe_step(make_optimizer, template)
            exact = torch.equal(p1, p2) and s1.keys() == s2.keys() and all(
                isinstance(v, torch.Tensor) and torch.equal(v, s2[k]) for k, v in s1.items())
        except Exception:  # noqa: BLE001 - any surprise: let the optimizer make its own state
            exact = False
        _TEMPLATES[make_optimizer] = template if exact else None
    return _TEMPLATES[make_optimizer]


def zero_state(template: StateTemplate, like_param: Callable[[torch.dtype], torch.Tensor]):
    """A state of zeros laid out as `template`: `like_param(dtype)` for each entry shaped as
    the parameter, a 0-dim zero for the others."""
    return {key: like_param(dtype) if shaped else torch.zeros((), dtype=dtype)
            for key, (shaped, dtype) in template.items()}


def _probe_step(make_optimizer, template: StateTemplate | None):
    """Two steps on a small parameter, from the optimizer's own state or from zeros."""
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5, 3, generator=g))
    opt = make_optimizer([p])
    if template is not None:
        opt.state[p] = zero_state(template, lambda dtype: torch.zeros(p.shape, dtype=dtype))
    for step in range(2):
        p.grad = torch.randn(5, 3, generator=g) + step
        opt.step()
    return p.detach(), opt.state[p]


def _state_template(make_optimizer) -> StateTemplate:
    p = torch.nn.Parameter(torch.zeros(5, 3))
    opt = make_optimizer([p])
    p.grad = torch.zeros(5, 3)
    opt.step()
    return {k: (v.shape == p.shape, v.dtype) for k, v in opt.state[p].items()
            if isinstance(v, torch.Tensor)}
