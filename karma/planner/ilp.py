"""The ILP: the fastest plan that fits, over keep/swap/recompute x weights x optimizer.

One binary per (block, choice) picks each block's fragment (karma/planner/lowering.py); the
constraints sum those fragments stage by stage exactly as the simulator runs them, so the
optimum's objective is the simulated step time of the schedule it lowers to (on independent
streams; see [Note: contention in the ILP] for shared cores).

[Note: contention in the ILP] Where streams share cores (Problem.contention, the CPU), a
stage's compute (W s of work) and a copy (D s) that start together at its barrier slow each
other down (simulate.py's [Note: processor sharing]): compute at 1 - a of its speed while
the copy runs, the copy at 1 - b while compute does. If the copy ends first, after D / (1 - b),
the stage lasts W + a D / (1 - b); if compute does, D + b W / (1 - a). When a + b <= 1 (no
worse than running them one after the other) the stage lasts the larger of the two, so both
are linear constraints beside "as long as its busiest stream". h2d and d2h copies start
together and compute loses a while either runs, so each copy stream has its pair; and as the
simulator's streams conserve work ([Note: every stream on shared cores conserves work]), a
stage lasts at least the sum of its compute and copies. Host steps
are not charged here (when they run against which stage is not a stage sum): the
simulator charges them when the pipeline compares the ILP's plan with the baselines.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from typing import NamedTuple

import pulp

from karma.planner.host_state import HostUse
from karma.planner.lowering import (
    PLAIN,
    Choice,
    Stages,
    Training,
    buffer_spans,
    common_fragment,
    fragment,
    host_temp_bytes,
    host_temp_first_stage,
    stage_memory,
    valid_choices,
)
from karma.planner.plan import InfeasiblePlan, Plan
from karma.planner.prefetch import refine_prefetch
from karma.planner.problem import Problem
from karma.schedule import LAST_MICRO_BATCH_KINDS, is_barrier
from karma.units import format_bytes

GIB = float(1 << 30)


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
            return refine_prefetch(problem, plan, capacity_bytes, training)
        limits = Limits(*(lim - (x + 1024 if x > 0 else 0) for lim, x in zip(limits, over)))
    raise RuntimeError("the ILP's plans kept exceeding the budget by rounding")  # pragma: no cover


class Limits(NamedTuple):
    """Memory limits the ILP plans under, in bytes: a rank's device, its node's host."""

    device_bytes: int
    host_bytes: int  # the node's
    pinned_bytes: int  # the node's


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
    """Formulate and solve: the fastest plan within `limits`, or with minimize_capacity the
    plan that needs the least device memory (limits.device_bytes is then ignored).

    The time is one optimizer step as simulate() predicts it: accumulate-1 micro-batches
    that do not step (their stages t1, without the ops of LAST_MICRO_BATCH_KINDS) and one that does.
    """
    # --- inputs -------------------------------------------------------------------------
    minimize = "capacity" if minimize_capacity else "time"
    n = len(problem.blocks)
    st = Stages(n, problem.world_size)
    # copies one stage ahead here; refine_prefetch considers two (see karma/planner/prefetch.py)
    options = {i: [c for c in valid_choices(problem, i) if c.ahead == 1] for i in range(n)}
    frags = {(i, c): fragment(problem, i, c, training) for i in range(n) for c in options[i]}
    micro = training.accumulate > 1
    common = common_fragment(problem)
    started = time.perf_counter()

    # --- variables ------------------------------------------------------------------------
    lp = pulp.LpProblem("karma_plan", pulp.LpMinimize)
    # x[i, c] = 1 when block i takes choice c                                       (binary)
    x = {(i, c): lp.add_variable(f"x_{i}_{_tag(c)}", cat="Binary")
         for i in range(n) for c in options[i]}
    # t[k]: duration of stage k, as long as its busiest barrier stream                 (s)
    t = [lp.add_variable(f"t_{k}", lowBound=0) for k in range(st.update)]
    # t1[k]: the same in a micro-batch that does not step (accumulate > 1 only)         (s)
    t1 = [lp.add_variable(f"t1_{k}", lowBound=0) for k in range(st.update)] if micro else []
    # s[k]: start of stage k; s[update] is when the last barrier stage ends            (s)
    s = [lp.add_variable(f"s_{k}", lowBound=0) for k in range(st.update + 1)]
    # h[i]: when block i's host step ends; u[i]: when its upload ends                  (s)
    h = {i: lp.add_variable(f"h_{i}", lowBound=0) for i in range(n)}
    u = {i: lp.add_variable(f"u_{i}", lowBound=0) for i in range(n)}
    # m[k]: device memory live in stage k                                            (GiB)
    m = [lp.add_variable(f"m_{k}", lowBound=0) for k in range(st.count)]
    # host_temp[k]: host step temporaries counted in stage k (host_temp_by_stage)       (GiB)
    temps = any(host_temp_bytes(f) > 0 for f in frags.values())
    if temps:
        host_temp = [lp.add_variable(f"host_temp_{k}", lowBound=0) for k in range(st.count)]
    else:  # none (a GPU): the one column the ILP has always had, at 0, where it always was;
        # CBC's search, which decides the golden schedules, depends on the columns
        none = lp.add_variable("host_temp", lowBound=0)
        host_temp = [none if training.clip or k >= st.to_host(n - 1) else 0
                     for k in range(st.count)]
    # iteration: the replay that steps; with accumulate > 1 the objective adds the others (s)
    iteration = lp.add_variable("iteration_s", lowBound=0)
    # cap: device memory budget, a variable only when minimising it                   (GiB)
    cap = lp.add_variable("cap", lowBound=0) if minimize == "capacity" \
        else limits.device_bytes / GIB

    def chosen(value) -> pulp.LpAffineExpression:
        """Sum over blocks and choices of x[i, c] * value(fragment of (i, c))."""
        return pulp.lpSum(v * x[key] for key, f in frags.items() if (v := value(f)) != 0)

    # [Constraint] every block takes exactly one choice
    for i in range(n):
        lp += pulp.lpSum(x[i, c] for c in options[i]) == 1, f"one_choice_{i}"

    # [Constraint] a stage lasts as long as the work on its busiest barrier stream (in a
    # micro-batch that does not step, without the step's ops)
    load: dict[tuple[int, str], list] = {}
    for key, f in list(frags.items()) + [(None, common)]:
        for o in f.ops:
            if is_barrier(o.stream, o.kind) and o.stage < st.update:
                load.setdefault((o.stage, o.stream), []).append((o.dur_s, key, o.kind))
    for (k, stream), terms in sorted(load.items()):
        lp += t[k] >= pulp.lpSum(d if key is None else d * x[key] for d, key, _ in terms), \
            f"stage_{k}_{stream}"
        if micro:
            lp += t1[k] >= pulp.lpSum(d if key is None else d * x[key]
                                      for d, key, kind in terms if kind not in LAST_MICRO_BATCH_KINDS), \
                f"micro_stage_{k}_{stream}"
    # [Constraint] on shared cores (the CPU) a stage's compute and copies slow each other down
    # (see [Note: contention in the ILP])
    slow = problem.contention
    pair = {"compute", "h2d"}  # the speeds the simulator gives the two beside each other
    a, b = 1.0 - slow.speed("compute", pair), 1.0 - slow.speed("h2d", pair)

    def work(k: int, stream: str, stepping: bool) -> pulp.LpAffineExpression:
        """Seconds of work on `stream` in stage k (stepping: in the replay that steps)."""
        return pulp.lpSum(d if key is None else d * x[key]
                          for d, key, kind in load.get((k, stream), [])
                          if stepping or kind not in LAST_MICRO_BATCH_KINDS)

    for durations, stepping in ([(t, True), (t1, False)] if micro else [(t, True)]) \
            if a or b else []:
        name = "stage" if stepping else "micro_stage"
        for k, copy in itertools.product(range(st.update), ("h2d", "d2h")):
            if (k, copy) in load and (k, "compute") in load:
                compute, moved = work(k, "compute", stepping), work(k, copy, stepping)
                lp += durations[k] >= compute + a / (1 - b) * moved, \
                    f"{name}_{k}_compute_beside_{copy}"
                lp += durations[k] >= moved + b / (1 - a) * compute, \
                    f"{name}_{k}_{copy}_beside_compute"
        for k in range(st.update):  # no set of streams on shared cores beats one alone
            if sum((k, stream) in load for stream in ("compute", "h2d", "d2h")) > 1:
                lp += durations[k] >= pulp.lpSum(work(k, stream, stepping) for stream in
                                                 ("compute", "h2d", "d2h")), \
                    f"{name}_{k}_conserves_work"
    # [Constraint] stages run one after another
    lp += s[0] == 0, "start"
    for k in range(st.update):
        lp += s[k + 1] == s[k] + t[k], f"stage_{k}_end"

    # [Constraint] host steps run one at a time, each after the stage that brought its
    # gradients to the host, from the last block to the first; with clipping all after the
    # last gradients, from the first block to the last (see [Note: clipping])
    order = list(range(n)) if training.clip else list(reversed(range(n)))
    prev_h = None
    for i in order:
        step_s = pulp.lpSum(o.dur_s * x[i, c] for c in options[i]
                            for o in frags[i, c].ops if o.kind == "host_step")
        ready = st.update if training.clip else st.to_host(i) + 1
        lp += h[i] >= s[ready] + step_s, f"host_after_grads_{i}"
        if prev_h is not None:
            lp += h[i] >= prev_h + step_s, f"host_in_order_{i}"
        prev_h = h[i]
    # [Constraint] uploads of host-stepped resident weights follow their step, one at a time
    prev_u = s[st.update]
    for i in order:
        up_s = pulp.lpSum(o.dur_s * x[i, c] for c in options[i]
                          for o in frags[i, c].ops if o.kind == "upload")
        lp += u[i] >= prev_u + up_s, f"upload_in_order_{i}"
        lp += u[i] >= h[i] + up_s, f"upload_after_step_{i}"
        prev_u = u[i]
    # [Constraint] the iteration ends when every stream is done (with clipping, the device
    # steps run in the update stage, one after another)
    device_steps_s = chosen(lambda f: sum(o.dur_s for o in f.ops if o.kind == "device_step")) \
        if training.clip else 0
    lp += iteration >= s[st.update] + device_steps_s, "end_of_stages"
    lp += iteration >= h[order[-1]], "end_of_host_steps"
    lp += iteration >= u[order[-1]], "end_of_uploads"
    if slow.shared:  # the whole step, host steps too: [Note: every stream on shared cores
        # conserves work]; without it the ILP overlapped host steps it did not pay for, and
        # the simulator's fallback took a baseline instead
        def cores_s(f) -> float:
            return sum(o.dur_s for o in f.ops if o.stream != "net")

        lp += iteration >= chosen(cores_s) + cores_s(common), "streams_conserve_work"
    # step: the replay that steps and accumulate-1 that do not (they end with their stages)
    step = iteration + (training.accumulate - 1) * pulp.lpSum(t1) if micro else iteration

    # [Constraint] device memory in every stage stays under capacity (buffers counted from
    # the stage that allocates them to the stage that frees them)
    delta: list[list] = [[] for _ in range(st.count + 1)]
    for key, f in list(frags.items()) + [(None, common)]:
        for first, last, nbytes in buffer_spans(problem, f):
            delta[first].append((nbytes / GIB, key))
            delta[last + 1].append((-nbytes / GIB, key))
    # (host step temporaries, as host_temp_by_stage counts them: in each stage the largest
    # of those whose host step may have started by then, so they never shrink)
    for k in range(1, st.count if temps else 0):
        lp += host_temp[k] >= host_temp[k - 1], f"host_temp_grows_{k}"
    for (i, c), f in frags.items():
        if (nbytes := host_temp_bytes(f)) > 0:
            first = host_temp_first_stage(problem, i, training)
            lp += host_temp[first] >= nbytes / GIB * x[i, c], f"host_temp_{i}_{_tag(c)}"
    for k in range(st.count):
        change = pulp.lpSum(v if key is None else v * x[key] for v, key in delta[k])
        lp += m[k] == (m[k - 1] if k else 0) + change, f"memory_{k}"
        lp += m[k] + host_temp[k] <= cap, f"capacity_{k}"

    # [Constraint] host memory and pinned host memory, of the node: its ranks' own, plus
    # what they share once ([Note: host state per rank and per node] in host_state.py)
    k = problem.nproc_per_node
    lp += chosen(lambda f: (k * f.host_bytes + f.node_host_bytes) / GIB) \
        <= limits.host_bytes / GIB, "host_memory"
    lp += chosen(lambda f: (k * f.pinned_bytes + f.node_pinned_bytes) / GIB) \
        <= limits.pinned_bytes / GIB, "pinned"

    # --- objective --------------------------------------------------------------------------
    if minimize == "time":
        lp += step
    else:  # the smallest budget; among those, the fastest (time is far below 1e3 GiB-s)
        lp += cap + 1e-6 * step

    # --- solve ----------------------------------------------------------------------------------
    if start is not None:
        for (i, c), var in x.items():
            var.setInitialValue(1 if start.choices[i] == c else 0)
    solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, gapRel=gap, threads=1,
                               warmStart=start is not None,
                               options=["randomSeed 1", "randomCbcSeed 1", "preprocess off"])
    lp.solve(solver)
    solve_s = time.perf_counter() - started

    # --- status -------------------------------------------------------------------------------
    if lp.status == pulp.LpStatusInfeasible:
        return _Solution(Plan("ilp", (), status="infeasible", solve_s=solve_s), infeasible=True)
    if lp.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return _Solution(Plan("ilp", (), status="no-solution", solve_s=solve_s,
                              note=f"CBC found no solution in {time_limit_s:g} s "
                                   f"({pulp.LpStatus[lp.status]})"))
    choices = tuple(
        next(c for c in options[i] if (x[i, c].value() or 0) > 0.5) for i in range(n)
    )
    status = "optimal" if lp.sol_status == pulp.LpSolutionOptimal else "time-limit"
    plan = Plan("ilp", choices, status=status, solve_s=solve_s,
                note=f"CBC {status}, objective {pulp.value(step):.6f} s")
    return _Solution(plan, capacity_gib=float(pulp.value(cap)))


def _tag(c: Choice) -> str:
    return f"{c.act[0]}{c.weights[0]}{c.optim[0]}{c.ahead}"
