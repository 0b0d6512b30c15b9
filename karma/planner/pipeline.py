"""From a block graph to a schedule: costs, every baseline, the ILP, the passes, lowering.

    report = make_schedule(graph, model_ref, options, measured, optimizer)
    report.schedule      # the Schedule to write as YAML
    report.chosen        # the chosen plan's Evaluation
    report.baselines     # every baseline's Evaluation, for the side-by-side summary

The chosen plan is decided here and in passes.py, in this order: the strategy asked for (the
ILP's plan, or a baseline's), then each pass of passes.PASSES.
"""

from __future__ import annotations

import dataclasses

from karma.ir.graph import ADAMW, BlockGraph, OptimizerProfile
from karma.planner.hardware import dump_hardware
from karma.planner.ilp import min_capacity_bytes, solve_ilp
from karma.planner.lowering import Choice
from karma.planner.options import PlanOptions
from karma.planner.passes import PASSES, Planning
from karma.planner.plan import Evaluation, InfeasiblePlan, Plan
from karma.planner.problem import ESTIMATED, Measurements
from karma.planner.report import PlanReport
from karma.schedule import BlockEntry, ModelRef, Predicted, Schedule, TrainConfig
from karma.units import format_bytes


def make_schedule(graph: BlockGraph, model: ModelRef, options: PlanOptions,
                  measured: Measurements = ESTIMATED, optimizer: OptimizerProfile = ADAMW
                  ) -> PlanReport:
    """The schedule `options` ask for (options.hardware: the profile, measured where it was),
    with `measured`'s times in place of the roofline's."""
    p = Planning(graph, options, measured, optimizer)
    chosen = first_choice(p)
    for improve in PASSES:
        chosen = improve(p, chosen)
    single = chosen.step_s
    if options.world_size > 1:
        single = p.evaluate(chosen.plan, p.one_rank()).step_s
    # the ideal: keep_all's time, its memory unlimited (see Predicted.ideal_s)
    schedule = schedule_from(graph, model, options, chosen, single,
                             ideal_s=p.baselines["keep_all"].step_s, measured=measured)
    return PlanReport(p.problem, chosen, p.baselines, schedule, single, options.profile.name)


def first_choice(p: Planning) -> Evaluation:
    """The plan of the strategy asked for: the ILP's, started from the best baseline (that
    baseline where the ILP finds none in time), or the named baseline's; InfeasiblePlan,
    naming the resource, where it does not fit."""
    cap, o = p.capacity_bytes, p.options
    best = p.best_baseline
    if not p.ilp:
        chosen = p.baselines[o.strategy]
        if not chosen.feasible and chosen.stage_peak_bytes <= cap:  # the host runs out
            h, problem = chosen.host, p.problem
            raise InfeasiblePlan(
                f"the {o.strategy} plan fits {format_bytes(cap)} of device memory but "
                f"needs {format_bytes(h.node_host_bytes)} of host memory a node "
                f"({format_bytes(problem.host_mem_bytes)} there), "
                f"{format_bytes(h.node_pinned_bytes)} of it pinned "
                f"({format_bytes(problem.pinned_mem_bytes)} pinnable), with "
                f"{problem.nproc_per_node} rank(s) a node; plan with --strategy ilp, give the "
                "node more host memory (--host-mem), or run fewer ranks a node "
                "(--nproc-per-node)", cap, resource="host")
        if not chosen.feasible:
            need = min_capacity_bytes(p.problem, o.time_limit_s, p.training)
            raise InfeasiblePlan(
                f"the {o.strategy} plan needs {format_bytes(chosen.stage_peak_bytes)} "
                f"of device memory, over the {format_bytes(cap)} budget (the smallest budget "
                f"any plan fits in is {format_bytes(need)})", need)
        return chosen
    plan = solve_ilp(p.problem, cap, o.time_limit_s, o.gap, start=best.plan if best else None,
                     training=p.training)
    if not plan.choices:  # no incumbent in time: fall back to the best baseline
        if best is None:
            raise InfeasiblePlan(f"the ILP found no plan in {o.time_limit_s:g} s and "
                                 "no baseline fits; raise --time-limit or --gpu-mem", cap)
        plan = Plan(best.plan.strategy, best.plan.choices, status="fallback",
                    solve_s=plan.solve_s, note=f"{plan.note}; using the best baseline, "
                                               f"{best.plan.strategy}")
    return p.evaluate(plan)


def probe_schedule(graph: BlockGraph, model: ModelRef, options: PlanOptions,
                   measured: Measurements = ESTIMATED, optimizer: OptimizerProfile = ADAMW
                   ) -> Schedule:
    """Every block's activations swapped (the last block's kept: its backward follows at
    once), its weights streamed and its optimizer on the host, on `options`' profile with
    its memory unlimited: a schedule whose steps keep every side stream busy beside compute,
    which the calibration traces to time them ([Note: side streams timed in context] in
    karma/planner/fit_contention.py)."""
    options = dataclasses.replace(options, gpu_mem=1 << 62, strategy="ilp",
                                  host_state="replicated")
    p = Planning(graph, options, measured, optimizer)
    n = len(graph.blocks)
    swap, keep = Choice("swap", "streamed", "host"), Choice("keep", "streamed", "host")
    ev = p.evaluate(Plan("probe", (swap,) * (n - 1) + (keep,)))
    return schedule_from(graph, model, options, ev, ev.step_s, measured=measured)


def schedule_from(graph: BlockGraph, model: ModelRef, options: PlanOptions, ev: Evaluation,
                  single_rank_s: float, ideal_s: float | None = None,
                  measured: Measurements = ESTIMATED) -> Schedule:
    """The Schedule of an evaluated plan (single_rank_s: the same plan on one rank;
    ideal_s: keep_all's step with unlimited memory; measured: what its times came from)."""
    import yaml

    hardware = yaml.safe_load(dump_hardware(options.profile))
    hardware.pop("version", None)
    blocks = tuple(
        BlockEntry(
            index=b.index, name=b.name, modules=b.modules, params=b.params,
            shared_params=b.shared_params, act=c.act, weights=c.weights, optim=c.optim,
            param_bytes=b.param_bytes, act_bytes=b.act_bytes,
            policy=c.policy, kept=c.kept, with_next=c.with_next,
        )
        for b, c in zip(graph.blocks, ev.plan.choices)
    )
    sim = ev.sim
    return Schedule(
        model=model,
        config=TrainConfig(batch_size=graph.batch_size, dtype=options.dtype,
                           world_size=options.world_size, seed=options.seed,
                           capacity_bytes=options.capacity_bytes,
                           accumulate=options.accumulate,
                           clip_grad_norm=options.clip_grad_norm,
                           host_state=ev.host_state,
                           nproc_per_node=options.ranks_per_node,
                           host_optimizer=options.host_optimizer),
        hardware=tuple(hardware.items()),
        strategy=ev.plan.strategy,
        status=ev.plan.status,
        solve_s=ev.plan.solve_s,
        predicted=Predicted(
            step_s=ev.step_s,
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
            calibration="measured" if measured.blocks_measured else None,
        ),
        blocks=blocks,
        ops=ev.ops,
        buffers=ev.buffers,
    )
