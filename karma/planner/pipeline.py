"""From a block graph to a schedule: costs, every baseline, the ILP, lowering, simulation.

    report = make_schedule(graph, model_ref, request)
    report.schedule      # the Schedule to write as YAML
    report.chosen        # the chosen plan's Evaluation
    report.baselines     # every baseline's Evaluation, for the side-by-side summary
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from karma.ir.graph import ADAMW, BlockGraph, OptimizerProfile
from karma.planner.baselines import BASELINES
from karma.planner.hardware import Hardware, dump_hardware
from karma.planner.ilp import min_capacity_bytes, solve_ilp
from karma.planner.lowering import Choice, Training
from karma.planner.plan import Evaluation, InfeasiblePlan, Plan, evaluate
from karma.planner.problem import Problem, build_problem
from karma.schedule import BlockEntry, ModelRef, Predicted, Schedule, TrainConfig
from karma.units import format_bytes

STRATEGIES = ("ilp", *BASELINES)


@dataclass(frozen=True)
class PlanRequest:
    """What to plan for."""

    capacity_bytes: int  # device memory budget (--gpu-mem)
    hardware: Hardware
    batch_size: int
    dtype: str = "fp32"
    world_size: int = 1
    seed: int = 0
    strategy: str = "ilp"  # "ilp" or a baseline's name
    time_limit_s: float = 60.0
    gap: float = 1e-2  # relative optimality gap at which the ILP stops
    optimizer: OptimizerProfile = ADAMW
    measured_s: Sequence[tuple[float, float]] | None = None  # per-block (fwd, bwd) seconds
    # per-block (device, host) seconds of the optimizer step
    measured_step_s: Sequence[tuple[float, float]] | None = None
    # what the process holds outside its tensors while training, measured (CPU backend:
    # Problem.process_bytes)
    process_bytes: int = 0
    measured_loss_s: float | None = None  # the loss's seconds, measured (else the roofline's)
    accumulate: int = 1  # micro-batches per optimizer step
    clip_grad_norm: float | None = None  # clip gradients to this global norm (None: never)
    nproc_per_node: int = 1  # ranks per node: they share its host memory
    host_state: str = "auto"  # sharded | replicated | auto (see [Note: choosing host state])
    host_mem_bytes: int | None = None  # the node's host memory (None: the profile's)


@dataclass(frozen=True)
class PlanReport:
    problem: Problem
    chosen: Evaluation
    baselines: dict[str, Evaluation]
    schedule: Schedule
    single_rank_iteration_s: float  # the chosen plan on one rank (for scaling efficiency)
    block_times: str = "roofline estimate"  # where the block times came from, for the summary


def make_schedule(graph: BlockGraph, model: ModelRef, request: PlanRequest) -> PlanReport:
    if request.strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {request.strategy!r}")
    state = "replicated" if request.host_state == "auto" and request.world_size == 1 \
        else "sharded" if request.host_state == "auto" else request.host_state
    problem = _problem(graph, request, state)
    cap = request.capacity_bytes
    training = Training(request.accumulate, request.clip_grad_norm is not None)
    baselines = {name: evaluate(problem, fn(problem, cap, training), cap, training)
                 for name, fn in BASELINES.items()}
    feasible = [e for e in baselines.values() if e.feasible]
    best = min(feasible, key=lambda e: e.step_s) if feasible else None

    if request.strategy != "ilp":
        chosen = baselines[request.strategy]
        if not chosen.feasible and chosen.stage_peak_bytes <= cap:  # the host runs out
            h = chosen.host
            raise InfeasiblePlan(
                f"the {request.strategy} plan fits {format_bytes(cap)} of device memory but "
                f"needs {format_bytes(h.node_host_bytes)} of host memory a node "
                f"({format_bytes(problem.host_mem_bytes)} there), "
                f"{format_bytes(h.node_pinned_bytes)} of it pinned "
                f"({format_bytes(problem.pinned_mem_bytes)} pinnable), with "
                f"{problem.nproc_per_node} rank(s) a node; plan with --strategy ilp, give the "
                "node more host memory (--host-mem), or run fewer ranks a node "
                "(--nproc-per-node)", cap, resource="host")
        if not chosen.feasible:
            need = min_capacity_bytes(problem, request.time_limit_s, training)
            raise InfeasiblePlan(
                f"the {request.strategy} plan needs {format_bytes(chosen.stage_peak_bytes)} "
                f"of device memory, over the {format_bytes(cap)} budget (the smallest budget "
                f"any plan fits in is {format_bytes(need)})", need)
    else:
        plan = solve_ilp(problem, cap, request.time_limit_s, request.gap,
                         start=best.plan if best else None, training=training)
        if not plan.choices:  # no incumbent in time: fall back to the best baseline
            if best is None:
                raise InfeasiblePlan(f"the ILP found no plan in {request.time_limit_s:g} s and "
                                     "no baseline fits; raise --time-limit or --gpu-mem", cap)
            plan = Plan(best.plan.strategy, best.plan.choices, status="fallback",
                        solve_s=plan.solve_s, note=f"{plan.note}; using the best baseline, "
                                                   f"{best.plan.strategy}")
        chosen = evaluate(problem, plan, cap, training)
        if training.clip:
            chosen = _overlapped_choice(problem, cap, request, training, chosen)
        if best is not None and best.step_s < chosen.step_s:
            # [Note: the simulator has the last word] The ILP's stage sums leave out what
            # only the simulator sees (host steps sharing cores with compute, [Note:
            # contention in the ILP]); a baseline it times faster is taken instead.
            chosen = dataclasses.replace(best, plan=Plan(
                best.plan.strategy, best.plan.choices, status="fallback", solve_s=plan.solve_s,
                note=f"{plan.note}; the simulator times the best baseline, "
                     f"{best.plan.strategy}, faster"))

    if problem.sharded:
        chosen = _host_state_choice(graph, request, cap, training, chosen)
    single = chosen.step_s
    if request.world_size > 1:
        one = _problem(graph, dataclasses.replace(request, world_size=1, nproc_per_node=1),
                       "replicated")
        single = evaluate(one, chosen.plan, cap, training).step_s
    # the ideal: keep_all's time, its memory unlimited (see Predicted.ideal_s)
    schedule = schedule_from(graph, model, request, chosen, single,
                             ideal_s=baselines["keep_all"].step_s)
    return PlanReport(problem, chosen, baselines, schedule, single)


def probe_schedule(graph: BlockGraph, model: ModelRef, request: PlanRequest) -> Schedule:
    """Every block's activations swapped (the last block's kept: its backward follows at
    once), its weights streamed and its optimizer on the host, on `request`'s profile with
    its memory unlimited: a schedule whose steps keep every side stream busy beside compute,
    which the calibration traces to time them ([Note: side streams timed in context] in
    karma/planner/fit_contention.py)."""
    request = dataclasses.replace(request, capacity_bytes=1 << 62, strategy="ilp")
    problem = _problem(graph, request, "replicated")
    n = len(problem.blocks)
    swap, keep = Choice("swap", "streamed", "host"), Choice("keep", "streamed", "host")
    plan = Plan("probe", (swap,) * (n - 1) + (keep,))
    training = Training(request.accumulate, request.clip_grad_norm is not None)
    ev = evaluate(problem, plan, request.capacity_bytes, training)
    return schedule_from(graph, model, request, ev, ev.step_s)


def _problem(graph: BlockGraph, request: PlanRequest, host_state: str) -> Problem:
    return build_problem(graph, request.hardware, request.dtype, request.world_size,
                         request.optimizer, request.measured_s, request.measured_step_s,
                         request.process_bytes, request.nproc_per_node, host_state,
                         request.host_mem_bytes, request.measured_loss_s)


def _host_state_choice(graph: BlockGraph, request: PlanRequest, cap: int, training: Training,
                       sharded: Evaluation) -> Evaluation:
    """[Note: choosing host state] On several ranks the plan is made with sharded host
    state, which needs less host memory and steps 1/N of the weights on each rank. Replicated
    state is kept instead where it is asked for, or (auto) where no block is stepped on the
    host (there is nothing to shard), or where the same plan replicated fits and the
    simulator times it faster (the latency of two collectives instead of one, on small
    models)."""
    if request.host_state == "sharded":
        return sharded
    replicated = evaluate(_problem(graph, request, "replicated"), sharded.plan, cap, training)
    if not any(c.optim == "host" for c in sharded.plan.choices) or (
            replicated.feasible and replicated.step_s < sharded.step_s):
        return replicated
    return sharded


def _overlapped_choice(problem: Problem, cap: int, request: PlanRequest, training: Training,
                       ilp: Evaluation) -> Evaluation:
    """[Note: the ILP under clipping] The ILP's time model has the clipped updates after the
    whole backward; the runtime overlaps them with the next forward (Evaluation.step_s),
    which the ILP cannot express (it spans two iterations). So the plan the ILP finds
    without clipping is also evaluated with it, and the faster of the two overlapped wins:
    host-stepped blocks, which the non-overlapped model penalises, cost little once their
    steps run under the next forward."""
    unclipped = solve_ilp(problem, cap, request.time_limit_s, request.gap,
                          training=Training(training.accumulate, clip=False))
    if not unclipped.choices:
        return ilp
    other = evaluate(problem, unclipped, cap, training)
    return other if other.feasible and other.step_s < ilp.step_s else ilp


def schedule_from(graph: BlockGraph, model: ModelRef, request: PlanRequest, ev: Evaluation,
                  single_rank_s: float, ideal_s: float | None = None) -> Schedule:
    """The Schedule of an evaluated plan (single_rank_s: the same plan on one rank;
    ideal_s: keep_all's iteration with unlimited memory)."""
    import yaml

    hardware = yaml.safe_load(dump_hardware(request.hardware))
    hardware.pop("version", None)
    blocks = tuple(
        BlockEntry(
            index=b.index, name=b.name, modules=b.modules, params=b.params,
            shared_params=b.shared_params, act=c.act, weights=c.weights, optim=c.optim,
            param_bytes=b.param_bytes, act_bytes=b.act_bytes,
        )
        for b, c in zip(graph.blocks, ev.plan.choices)
    )
    sim = ev.sim
    return Schedule(
        model=model,
        config=TrainConfig(batch_size=request.batch_size, dtype=request.dtype,
                           world_size=request.world_size, seed=request.seed,
                           capacity_bytes=request.capacity_bytes,
                           accumulate=request.accumulate,
                           clip_grad_norm=request.clip_grad_norm,
                           host_state=ev.host_state,
                           nproc_per_node=request.nproc_per_node),
        hardware=tuple(hardware.items()),
        strategy=ev.plan.strategy,
        status=ev.plan.status,
        solve_s=ev.plan.solve_s,
        predicted=Predicted(
            iteration_s=ev.step_s,
            lower_bound_s=sim.lower_bound_s,
            peak_device_bytes=sim.peak_device_bytes,
            stage_peak_bytes=ev.stage_peak_bytes,
            host_bytes=ev.host_bytes,
            pinned_bytes=ev.pinned_bytes,
            node_host_bytes=ev.host.node_host_bytes,
            node_pinned_bytes=ev.host.node_pinned_bytes,
            busy_s=tuple(sim.busy_s.items()),
            scaling_efficiency=single_rank_s / ev.step_s if ev.step_s else 1.0,
            ideal_s=ideal_s,
            calibration="measured" if request.measured_s is not None else None,
        ),
        blocks=blocks,
        ops=ev.ops,
        buffers=ev.buffers,
    )
