"""The ILP: the fastest plan that fits, over keep/swap/recompute x weights x optimizer.

    plan = solve_ilp(problem, capacity_bytes, time_limit_s, gap, start=best_baseline)
    need = min_capacity_bytes(problem)      # the smallest budget any plan fits in

The formulation (variables, one function per constraint family, the objective) is
formulation.py's; this module solves it with CBC, checks the answer to the byte, and says
why nothing fits when nothing does. What is done with the ILP's plan after the solve (copies
issued two stages ahead, clipping, the simulator's last word, host state) is passes.py's.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import pulp

from karma.planner.formulation import GIB, Limits, formulate
from karma.planner.host_state import HostUse
from karma.planner.lowering import PLAIN, Choice, Training, fragment
from karma.planner.memory import stage_memory
from karma.planner.pairs import mark_pairs
from karma.planner.plan import InfeasiblePlan, Plan
from karma.planner.problem import Problem
from karma.units import format_bytes


def solve_ilp(problem: Problem, capacity_bytes: int, time_limit_s: float = 60.0,
              gap: float = 1e-2, start: Plan | None = None,
              training: Training = PLAIN) -> Plan:
    """The plan of least predicted step time within `capacity_bytes` of device memory.

    start: a feasible plan to start from (the best baseline): the solver's answer is never
    slower than it. Raises InfeasiblePlan, with the smallest budget that fits, when nothing
    fits.
    """
    if capacity_bytes <= 0:
        raise ValueError(f"capacity_bytes = {capacity_bytes} must be positive")
    # CBC compares memory within its feasibility tolerance (about 1e-7 GiB, a hundred
    # bytes); the answer is checked to the byte and, if over, solved again under a budget
    # lowered by the excess.
    limits = Limits(capacity_bytes, problem.host_mem_bytes, problem.pinned_mem_bytes)
    for _ in range(4):
        solution = _solve(problem, limits, time_limit_s, gap, start, training=training)
        if solution.infeasible:
            raise infeasible(problem, capacity_bytes, time_limit_s, training)
        plan = solution.plan
        if not plan.choices:
            return plan
        over = _excess(problem, plan, Limits(capacity_bytes, problem.host_mem_bytes,
                                             problem.pinned_mem_bytes), training)
        if not any(over):
            return plan
        limits = Limits(*(lim - (x + 1024 if x > 0 else 0) for lim, x in zip(limits, over)))
    raise RuntimeError("the ILP's plans kept exceeding the budget by rounding")  # pragma: no cover


def _excess(problem: Problem, plan: Plan, limits: Limits,
            training: Training) -> tuple[int, int, int]:
    """Bytes by which `plan` exceeds each limit (0 where it fits), counted exactly."""
    frags = [fragment(problem, i, c, training) for i, c in enumerate(plan.choices)]
    host = HostUse.of(problem, frags)
    used = (max(stage_memory(problem, list(plan.choices), training)),
            host.node_host_bytes, host.node_pinned_bytes)
    return tuple(max(0, u - lim) for u, lim in zip(used, limits))


def min_capacity_bytes(problem: Problem, time_limit_s: float = 60.0,
                       training: Training = PLAIN) -> int:
    """The smallest device memory any plan fits in (rounded up to a MiB, or a KiB)."""
    limits = Limits(0, problem.host_mem_bytes, problem.pinned_mem_bytes)
    return _least_device(problem, time_limit_s, training, limits)[0]


def _least_device(problem: Problem, time_limit_s: float, training: Training,
                  limits: Limits | None = None) -> tuple[int, tuple[Choice, ...]]:
    """The smallest device memory a plan fits in, and the plan, within `limits`' host
    memory (None: unlimited, which `infeasible` uses: within a host limit that binds the
    question is a knapsack that CBC may take its whole time limit on)."""
    unlimited = 1 << 62
    solution = _solve(problem, limits or Limits(0, unlimited, unlimited), time_limit_s,
                      gap=1e-6, minimize_capacity=True, training=training)
    choices = solution.plan.choices
    need = max(int(solution.capacity_gib * GIB), max(stage_memory(problem, list(choices),
                                                                  training)))
    unit = 1 << 20 if need >= 64 << 20 else 1 << 10  # round up to a MiB, or a KiB if small
    return -(-need // unit) * unit, choices


def infeasible(problem: Problem, capacity_bytes: int, time_limit_s: float = 60.0,
               training: Training = PLAIN) -> InfeasiblePlan:
    """Why no plan fits: the resource that runs out, with its numbers, and what would fit.

    The plan that needs least device memory (host memory unlimited) decides it: if even it
    needs more than `capacity_bytes`, the device runs out; otherwise the node's host memory
    (or its pinned part) does, and that plan says how much the node would need. Where its
    host memory fits the node, its device memory is also the least within the node's."""
    need, least = _least_device(problem, time_limit_s, training)
    host = HostUse.of(problem, [fragment(problem, i, c, training) for i, c in enumerate(least)])
    state = "sharded" if problem.sharded else "replicated"
    ranks = f"{problem.nproc_per_node} rank(s) a node, {state} host state"
    over = [f"{format_bytes(used)} of {what} a node ({format_bytes(limit)} {has})"
            for what, used, limit, has in (
                ("host memory", host.node_host_bytes, problem.host_mem_bytes, "there"),
                ("pinned memory", host.node_pinned_bytes, problem.pinned_mem_bytes,
                 "pinnable")) if used > limit]
    if need > capacity_bytes:
        return InfeasiblePlan(
            f"no plan fits {format_bytes(capacity_bytes)} of device memory: even with every "
            f"activation swapped or recomputed and every weight streamed it needs "
            f"{format_bytes(need)}"
            + (f", {format_bytes(problem.process_bytes)} of it the process outside its "
               "tensors (measured)" if problem.process_bytes else "")
            + (f" (and then {' and '.join(over)}, with {ranks})" if over else ""), need)
    host_need = max(host.node_host_bytes,
                    -(-host.node_pinned_bytes * problem.host_mem_bytes
                      // problem.pinned_mem_bytes))
    fixes = [f"give the node more host memory if it has it (--host-mem {_ceil_size(host_need)})"]
    if not problem.sharded and problem.world_size > 1:
        fixes.append("shard the host state across the ranks (--host-state sharded)")
    elif problem.sharded:
        fixes.append("shard it over more ranks (--world-size)")
    if problem.nproc_per_node > 1:
        fixes.append(f"run fewer ranks a node (--nproc-per-node {problem.nproc_per_node // 2})")
    return InfeasiblePlan(
        f"no plan fits the node's host memory with {format_bytes(capacity_bytes)} of device "
        f"memory ({ranks}): the plan that needs least device memory "
        f"({format_bytes(need)}) needs {' and '.join(over)}; "
        + ", ".join(fixes[:-1]) + (" or " if len(fixes) > 1 else "") + fixes[-1],
        need, resource="host")


def _ceil_size(nbytes: int) -> str:
    """A size argument at least nbytes: 400G, 1.2T."""
    gib = nbytes / 2**30
    return f"{math.ceil(gib)}G" if gib < 1024 else f"{math.ceil(gib / 102.4) / 10:g}T"


@dataclass(frozen=True)
class _Solution:
    plan: Plan
    infeasible: bool = False
    capacity_gib: float = 0.0  # the budget the plan needs, when it was minimised


def _solve(problem: Problem, limits: Limits, time_limit_s: float, gap: float,
           start: Plan | None = None, minimize_capacity: bool = False,
           training: Training = PLAIN) -> _Solution:
    """The formulation solved by CBC, with an explicit time limit and gap, its status
    checked and its solution turned into a Plan."""
    started = time.perf_counter()
    f = formulate(problem, limits, training, minimize_capacity)
    if start is not None:  # the options leave a pair's second unmarked (pairs.mark_pairs)
        unmarked = [replace(c, with_prev=False) for c in start.choices]
        for (i, c), var in f.x.items():
            var.setInitialValue(1 if unmarked[i] == c else 0)
    solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, gapRel=gap, threads=1,
                               warmStart=start is not None,
                               options=["randomSeed 1", "randomCbcSeed 1", "preprocess off"])
    f.lp.solve(solver)
    solve_s = time.perf_counter() - started

    if f.lp.status == pulp.LpStatusInfeasible:
        return _Solution(Plan("ilp", (), status="infeasible", solve_s=solve_s), infeasible=True)
    if f.lp.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return _Solution(Plan("ilp", (), status="no-solution", solve_s=solve_s,
                              note=f"CBC found no solution in {time_limit_s:g} s "
                                   f"({pulp.LpStatus[f.lp.status]})"))
    choices = mark_pairs(tuple(next(c for c in options if (f.x[i, c].value() or 0) > 0.5)
                               for i, options in f.options.items()))
    status = "optimal" if f.lp.sol_status == pulp.LpSolutionOptimal else "time-limit"
    plan = Plan("ilp", choices, status=status, solve_s=solve_s,
                note=f"CBC {status}, objective {pulp.value(f.step):.6f} s")
    return _Solution(plan, capacity_gib=float(pulp.value(f.cap)))
