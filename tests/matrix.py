"""The test matrix: the small models, strategies and training options the exactness tests
train, defined once, and the cells no plan fits, each with why.

    @pytest.mark.parametrize("name,strategy,fraction", cells(MODELS, STRATEGIES))
    def test_x(name, strategy, fraction):
        schedule = plan(load_small(name), strategy, fraction)  # InfeasiblePlan: a failure

A cell is (model, strategy, fraction of keep_all's stage peak). `cells` leaves out the cells
listed in INFEASIBLE, and tests/test_matrix.py checks that each of those still raises
InfeasiblePlan, so the list cannot rot; any other InfeasiblePlan fails the test that met it
(a planner that suddenly finds no plan is a regression, not a skip).

Every cell but one representative per model (FAST: the ILP, which mixes decisions) is marked
`slow`: `make test-fast` trains each model once per family, `make test` every cell.
"""

from __future__ import annotations

import pytest

# three small models: dropout (gpt), BatchNorm (resnet), a plain residual stack (mlp); each
# at KARMA_*=tiny (tests/conftest.py SMALL_ENV)
MODELS = ("gpt", "resnet", "mlp")
# every baseline, and the ILP at three budgets (fractions of keep_all's stage peak)
STRATEGIES = (("keep_all", 1.0), ("recompute_all", 1.0), ("selective_all", 1.0),
              ("swap_all", 1.0), ("offload_all", 1.0), ("greedy", 1.0), ("ilp", 0.4),
              ("ilp", 0.6), ("ilp", 0.8))
# every baseline and the ILP at one budget: the families that add a dimension of their own
# (training options, LR schedules, input and output structures)
ONE_BUDGET = tuple(s for s in STRATEGIES if s[0] != "ilp") + (("ilp", 0.6),)
# the training options a model is planned with (karma-plan's flags, as keyword arguments)
OPTIONS = {
    "bf16": {"dtype": "bf16"},
    "accumulate4": {"accumulate": 4},
    "clip": {"clip_grad_norm": 1.0},
    "all": {"dtype": "bf16", "accumulate": 4, "clip_grad_norm": 1.0},
}
FAST = ("ilp", 0.6)  # the cell of each model that `make test-fast` trains

HARDWARE = "cpu"  # the CPU backend's profile (tests/runtime_helpers.py plans for it)

# (model, strategy, fraction, world size, hardware profile) that no plan fits, and why (the
# least any plan needs, against the budget): the exactness matrices leave them out, and
# tests/test_matrix.py checks that they still do not fit. Every other cell fits.
INFEASIBLE = {
    ("gpt", "ilp", 0.4, 1, "cpu"): "needs 560 KiB, over the 482 KiB budget",
    ("gpt", "ilp", 0.4, 2, "cpu"): "needs 578 KiB (the all-reduce's flat buffer), over 482 KiB",
    ("gpt", "ilp", 0.4, 1, "h200-141g"): "needs 528 KiB, over the 482 KiB budget",
    ("mlp", "ilp", 0.4, 1, "cpu"): "needs 205 KiB, over the 194 KiB budget",
    ("mlp", "ilp", 0.4, 2, "cpu"): "needs 221 KiB (the all-reduce's flat buffer), over 189 KiB",
}


def cell_id(name: str, strategy: str, fraction: float) -> str:
    return f"{name}-{strategy}@{fraction:g}" if strategy == "ilp" else f"{name}-{strategy}"


def strategy_id(strategy: str, fraction: float) -> str:
    return f"{strategy}@{fraction:g}" if strategy == "ilp" else strategy


def feasible(name: str, strategy: str, fraction: float, world_size: int = 1,
             hardware: str = HARDWARE) -> bool:
    return (name, strategy, fraction, world_size, hardware) not in INFEASIBLE


def cells(models=MODELS, strategies=STRATEGIES, world_size: int = 1, hardware: str = HARDWARE,
          fast=FAST) -> list:
    """pytest params (name, strategy, fraction) of every feasible cell, all but `fast`'s
    marked slow (fast=None: every one slow)."""
    return [pytest.param(name, strategy, fraction, id=cell_id(name, strategy, fraction),
                         marks=() if (strategy, fraction) == fast else pytest.mark.slow)
            for name in models for strategy, fraction in strategies
            if feasible(name, strategy, fraction, world_size, hardware)]


def first_fast(values) -> list:
    """pytest params of `values`, all but the first marked slow."""
    return [pytest.param(v, marks=() if k == 0 else pytest.mark.slow)
            if not isinstance(v, tuple) else
            pytest.param(*v, marks=() if k == 0 else pytest.mark.slow)
            for k, v in enumerate(values)]


def strategy_cells(strategies=ONE_BUDGET, fast=FAST) -> list:
    """pytest params (strategy, fraction) for one model, all but `fast`'s marked slow."""
    return [pytest.param(strategy, fraction, id=strategy_id(strategy, fraction),
                         marks=() if (strategy, fraction) == fast else pytest.mark.slow)
            for strategy, fraction in strategies]
