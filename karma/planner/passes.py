"""After the plan is chosen: the passes that may improve or settle it, in one ordered list.

    chosen = first_choice(planning)           # pipeline.py: the ILP's plan, or a baseline's
    for p in PASSES:
        chosen = p(planning, chosen)

Each pass takes the plan chosen so far (an Evaluation: lowered and simulated) and returns it,
or a better one by the simulator's judgement; a pass that does not apply returns it as it
is. The ILP's passes apply when the ILP was asked for (--strategy ilp), also where it fell
back to a baseline (but for the copies two stages ahead, which refine the ILP's own plan); a
baseline asked for by name is what it is, but for its host state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

from karma.ir.graph import BlockGraph, OptimizerProfile
from karma.planner.baselines import BASELINES
from karma.planner.ilp import solve_ilp
from karma.planner.lowering import Training
from karma.planner.options import PlanOptions
from karma.planner.plan import Evaluation, Plan, evaluate
from karma.planner.prefetch import refine_prefetch
from karma.planner.problem import (
    Measurements,
    Problem,
    build_problem,
    without_pairs,
    without_selective,
)


@dataclass(frozen=True)
class Planning:
    """One planning question: the model's graph, the options, what was measured, and the
    problem and baselines made from them."""

    graph: BlockGraph
    options: PlanOptions
    measured: Measurements
    optimizer: OptimizerProfile

    @property
    def training(self) -> Training:
        return Training(self.options.accumulate, self.options.clip_grad_norm is not None)

    @property
    def capacity_bytes(self) -> int:
        return self.options.capacity_bytes

    @property
    def ilp(self) -> bool:
        return self.options.strategy == "ilp"

    @cached_property
    def problem(self) -> Problem:
        """The problem with the host state the options ask for (auto: sharded on several
        ranks; [Note: choosing host state] decides in the end)."""
        state = self.options.host_state
        if state == "auto":
            state = "sharded" if self.options.world_size > 1 else "replicated"
        return self.problem_with(state)

    def problem_with(self, host_state: str) -> Problem:
        """The problem with this host state, on the options' ranks."""
        o = self.options
        return self._choosable(build_problem(
            self.graph, o.profile, o.dtype, o.world_size, self.optimizer, self.measured,
            o.ranks_per_node, host_state, o.host_mem))

    def one_rank(self) -> Problem:
        """The same training on one rank (what the scaling efficiency is against)."""
        o = self.options
        return self._choosable(build_problem(self.graph, o.profile, o.dtype, 1, self.optimizer,
                                             self.measured, 1, "replicated", o.host_mem))

    def _choosable(self, problem: Problem) -> Problem:
        """`problem` with the choices the options allow (--no-selective: none selective;
        --no-pairs: no two blocks under one checkpoint)."""
        problem = problem if self.options.selective else without_selective(problem)
        return problem if self.options.pairs else without_pairs(problem)

    def evaluate(self, plan: Plan, problem: Problem | None = None) -> Evaluation:
        return evaluate(problem or self.problem, plan, self.capacity_bytes, self.training)

    @cached_property
    def baselines(self) -> dict[str, Evaluation]:
        """Every baseline's plan, evaluated: peers of the ILP, and what it starts from."""
        return {name: self.evaluate(fn(self.problem, self.capacity_bytes, self.training))
                for name, fn in BASELINES.items()}

    @cached_property
    def best_baseline(self) -> Evaluation | None:
        feasible = [e for e in self.baselines.values() if e.feasible]
        return min(feasible, key=lambda e: e.step_s) if feasible else None


def prefetch_two_stages_ahead(p: Planning, chosen: Evaluation) -> Evaluation:
    """The ILP issues every copy one stage ahead; some go two where that is faster and fits
    (prefetch.py)."""
    if not p.ilp or chosen.plan.status == "fallback":
        return chosen
    refined = refine_prefetch(p.problem, chosen.plan, p.capacity_bytes, p.training)
    return chosen if refined == chosen.plan else p.evaluate(refined)


def updates_under_the_next_forward(p: Planning, chosen: Evaluation) -> Evaluation:
    """[Note: the ILP under clipping] The ILP's time model has the clipped updates after the
    whole backward; the runtime overlaps them with the next forward (Evaluation.step_s),
    which the ILP cannot express (it spans two steps). So the plan the ILP finds without
    clipping is also evaluated with it, and the faster of the two overlapped wins:
    host-stepped blocks, which the non-overlapped model penalises, cost little once their
    steps run under the next forward."""
    if not (p.ilp and p.training.clip):
        return chosen
    unclipped_training = Training(p.training.accumulate, clip=False)
    unclipped = solve_ilp(p.problem, p.capacity_bytes, p.options.time_limit_s, p.options.gap,
                          training=unclipped_training)
    if not unclipped.choices:
        return chosen
    unclipped = refine_prefetch(p.problem, unclipped, p.capacity_bytes, unclipped_training)
    other = p.evaluate(unclipped)
    return other if other.feasible and other.step_s < chosen.step_s else chosen


def simulator_has_the_last_word(p: Planning, chosen: Evaluation) -> Evaluation:
    """[Note: the simulator has the last word] The ILP's stage sums leave out what only the
    simulator sees (host steps sharing cores with compute, [Note: contention in the ILP]); a
    baseline it times faster is taken instead."""
    best = p.best_baseline
    if not p.ilp or best is None or best.step_s >= chosen.step_s:
        return chosen
    return dataclasses.replace(best, plan=Plan(
        best.plan.strategy, best.plan.choices, status="fallback", solve_s=chosen.plan.solve_s,
        note=f"{chosen.plan.note}; the simulator times the best baseline, "
             f"{best.plan.strategy}, faster"))


def choose_host_state(p: Planning, chosen: Evaluation) -> Evaluation:
    """[Note: choosing host state] On several ranks the plan is made with sharded host
    state, which needs less host memory and steps 1/N of the weights on each rank. Replicated
    state is kept instead where it is asked for, or (auto) where no block is stepped on the
    host (there is nothing to shard), or where the same plan replicated fits and the
    simulator times it faster (the latency of two collectives instead of one, on small
    models)."""
    if not p.problem.sharded or p.options.host_state == "sharded":
        return chosen
    replicated = p.evaluate(chosen.plan, p.problem_with("replicated"))
    if not any(c.optim == "host" for c in chosen.plan.choices) or (
            replicated.feasible and replicated.step_s < chosen.step_s):
        return replicated
    return chosen


Pass = Callable[[Planning, Evaluation], Evaluation]
PASSES: tuple[Pass, ...] = (
    prefetch_two_stages_ahead,
    updates_under_the_next_forward,
    simulator_has_the_last_word,
    choose_host_state,
)
