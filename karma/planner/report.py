"""A plan and what karma-plan prints of it: `PlanReport` (text and JSON), and the tables of
the capacity questions (a sweep, a batch search, several profiles: karma.api's records).
"""

from __future__ import annotations

from dataclasses import dataclass

from karma.planner.plan import Evaluation
from karma.planner.problem import Problem
from karma.schedule import Schedule
from karma.units import format_bytes, format_seconds


@dataclass(frozen=True)
class PlanReport:
    """A plan made: its schedule, its evaluation beside every baseline's, and where its
    numbers came from."""

    problem: Problem
    chosen: Evaluation
    baselines: dict[str, Evaluation]
    schedule: Schedule
    single_rank_step_s: float  # the chosen plan on one rank (for scaling efficiency)
    hardware_name: str  # the profile planned for
    block_times: str = "roofline estimate"  # where the block times came from, for the summary
    # the batches tried where the batch was searched (--batch-size max|best), by batch
    batch_search: tuple[dict, ...] = ()

    def to_json(self) -> dict:
        """The plan's figures, as karma-plan --json prints them."""
        ev, s = self.chosen, self.schedule
        doc = {
            "feasible": True,
            "strategy": ev.plan.strategy,
            "status": ev.plan.status,
            "step_s": ev.step_s,
            "peak_device_bytes": ev.peak_device_bytes,
            "stage_peak_bytes": ev.stage_peak_bytes,
            "capacity_bytes": ev.capacity_bytes,
            "lower_bound_s": ev.sim.lower_bound_s,
            "ideal_s": s.predicted.ideal_s,
            "price_of_budget": s.predicted.price_of_budget,
            "solve_s": ev.plan.solve_s,
            "block_times": "measured" if s.predicted.calibration == "measured" else "roofline",
            "process_bytes": self.problem.process_bytes,
            "scaling_efficiency": s.predicted.scaling_efficiency,
            "batch_size": s.config.batch_size,
            "world_size": s.config.world_size,
            "nproc_per_node": s.config.nproc_per_node,
            "host_state": s.config.host_state,
            "host_bytes": s.predicted.host_bytes,
            "pinned_bytes": s.predicted.pinned_bytes,
            "node_host_bytes": s.predicted.node_host_bytes,
            "node_pinned_bytes": s.predicted.node_pinned_bytes,
            "host_mem_bytes": ev.host_mem_bytes,
            "decisions": ev.plan.counts(),
            "baselines": {
                name: {"feasible": b.feasible, "step_s": b.step_s,
                       "peak_device_bytes": b.peak_device_bytes,
                       "stage_peak_bytes": b.stage_peak_bytes}
                for name, b in self.baselines.items()
            },
        }
        if self.batch_search:
            doc["batch_search"] = list(self.batch_search)
        return doc

    def text(self, output: str | None = None) -> str:
        """The plan's summary, as karma-plan prints it: the model, the plan, its predictions,
        and each baseline beside it (output: the schedule file written, if any)."""
        ev, s, hardware_name = self.chosen, self.schedule, self.hardware_name
        c = ev.plan.counts()
        cap = ev.capacity_bytes
        lines = [
            f"model {s.model.path}: {len(s.blocks)} blocks, batch {s.config.batch_size}, "
            f"{s.config.training_text()}, {s.config.world_size} rank(s) on {hardware_name}, "
            f"budget {format_bytes(cap)}",
            f"plan: {ev.plan.strategy} ({ev.plan.status}"
            + (f", solved in {ev.plan.solve_s:.2f} s" if ev.plan.strategy == "ilp" else "") + ")"
            + (f"; {ev.plan.note}" if ev.plan.status == "fallback" else ""),
            f"decisions: {c['keep']} keep, {c['swap']} swap, {c['recompute']} recompute"
            + (f", {c['selective']} selective" if c['selective'] else "")
            + (f" ({c['kept_on_host']} with their kept outputs on the host)"
               if c['kept_on_host'] else "")
            + (f", {c['pairs']} pair(s) recomputed under one checkpoint" if c['pairs'] else "")
            + f"; {c['streamed_weights']} streamed weights; {c['host_optimizer']} on the host "
            "optimizer",
            f"block times: {self.block_times}",
            f"predicted step {format_seconds(ev.step_s)}: "
            f"{s.predicted.price_of_budget:.2f}x the ideal {format_seconds(s.predicted.ideal_s)} "
            f"(keep_all with unlimited memory: the price of the budget); stream bound "
            f"{format_seconds(ev.sim.lower_bound_s)}"
            + ("; host updates overlapped with the next forward" if s.config.clip_grad_norm
               is not None else ""),
            f"predicted peak {format_bytes(ev.peak_device_bytes)} of {format_bytes(cap)} "
            f"({100 * ev.peak_device_bytes / cap:.0f}%)"
            + (f", {format_bytes(self.problem.process_bytes)} of it the process outside its "
               "tensors (measured while timing the blocks)" if self.problem.process_bytes else "")
            + f"; stage bound {format_bytes(ev.stage_peak_bytes)} (what the budget is "
              "checked against)",
        ]
        p = s.predicted
        lines.append(
            f"host memory ({s.config.host_state} state): {format_bytes(p.host_bytes)} a rank "
            f"({format_bytes(p.pinned_bytes)} pinned); {format_bytes(p.node_host_bytes)} a node of "
            f"{s.config.nproc_per_node} rank(s) ({format_bytes(p.node_pinned_bytes)} pinned), of "
            f"{format_bytes(ev.host_mem_bytes)} ({format_bytes(ev.pinned_mem_bytes)} pinnable)")
        if s.config.world_size > 1:
            lines.append(f"scaling efficiency against one rank: "
                         f"{100 * s.predicted.scaling_efficiency:.1f}%")
        lines += ["", *self.strategy_table()]
        if output:
            lines += ["", f"wrote {output} ({len(s.ops)} operations); inspect it with "
                          f"karma-inspect {output}"]
        if self.batch_search:
            lines = [sweep_table(list(self.batch_search), "batches searched"),
                     "", *lines]
        return "\n".join(lines)

    def strategy_table(self) -> list[str]:
        """The chosen plan beside every baseline: fits, step, the stage bound that the budget
        is checked against, and the simulated peak, which can be lower ([Note: the stage
        bound and the simulated peak])."""
        ev = self.chosen
        lines = [f"{'strategy':<15} {'fits':<5} {'step':>10} {'bound':>11} {'peak':>11}"]
        rows = [("ilp", ev)] if ev.plan.strategy == "ilp" or ev.plan.status == "fallback" else []
        rows += list(self.baselines.items())
        for name, e in rows:
            mark = " *" if e.plan.choices == ev.plan.choices and name == ev.plan.strategy else ""
            lines.append(f"{name + mark:<15} {'yes' if e.feasible else 'no':<5} "
                         f"{format_seconds(e.step_s):>10} {format_bytes(e.stage_peak_bytes):>11} "
                         f"{format_bytes(e.peak_device_bytes):>11}")
        return lines + [
            f"fits: bound within the budget, {format_bytes(ev.capacity_bytes)} (and host "
            "memory within the node's)",
            "bound: device memory stage by stage, each buffer through every stage it is live "
            "in; peak: the simulated step's, at most the bound"]


# [Note: the stage bound and the simulated peak] A plan fits when its stage bound
# (Evaluation.stage_peak_bytes, memory.stage_memory: the ILP's memory constraint and what the
# schedule checker walks) is within the budget. The bound counts each buffer in the whole of
# every stage from the one of the op that allocates it to the one of the op that frees it,
# and a host step's temporaries in every stage the step may run in; the simulator holds each
# buffer only from its op's start to its freeing op's end, so its peak is never above the
# bound and can be well below it. offload_all on examples/mlp.py (batch 64, the CPU):
# a 27.8 MiB simulated peak, a 32.1 MiB bound, whose busiest stage counts two blocks' streamed
# weights and two blocks' gradients at once (4 MiB each) and 8 MiB of host step temporaries,
# which the simulated step never holds together. Both include the process's own bytes where
# they were measured. The runtime's memory follows the simulation; the bound is the guarantee.


def hardware_table(rows: list[dict]) -> str:
    """One plan on each of several profiles (a sweep of hardware), a row each."""
    ranks = rows[0]["world_size"] > 1
    lines = [f"{'hardware':<12} {'budget':>9} {'step':>10} {'samples/s':>10} "
             f"{'peak':>9} {'host a node':>11} {'strategy':<13}"
             + (f" {'ranks':>6} {'scaling':>7}" if ranks else "")]
    for r in rows:
        cells = f"{r['hardware']:<12} {format_bytes(r['gpu_mem_bytes']):>9} "
        if not r["feasible"]:
            lines.append(cells + f"does not fit: {r['reason']}")
            continue
        lines.append(cells + f"{format_seconds(r['step_s']):>10} "
                     f"{r['samples_per_s']:>10.2f} {format_bytes(r['peak_device_bytes']):>9} "
                     f"{format_bytes(r['node_host_bytes']):>11} {r['strategy']:<13}"
                     + (f" {r['world_size']:>6} {100 * r['scaling_efficiency']:>6.1f}%"
                        if ranks else ""))
    return "\n".join(lines)


def sweep_table(points: list[dict], what: str = "sweep") -> str:
    """A sweep's points (karma.api.sweep's records, on one profile), a row each."""
    hardware_name = points[0]["hardware"]
    names = sorted({n for p in points for n in p["baselines"]})
    head = f"{'gpu-mem':>9} {'batch':>5} {'ilp':>9} {'samples/s':>9} {'peak':>9} {'host':>9}"
    lines = [f"{what} on {hardware_name}: step time of the chosen plan, and of each baseline "
             "(- does not fit)", head + "".join(f" {n:>13}" for n in names)]
    for p in points:
        cells = f"{format_bytes(p['gpu_mem_bytes']):>9} {p['batch_size']:>5} "
        if not p["feasible"]:
            lines.append(cells + f"no plan fits: {p['resource']} memory runs out")
            continue
        cells += (f"{format_seconds(p['step_s']):>9} {p['samples_per_s']:>9.2f} "
                  f"{format_bytes(p['peak_device_bytes']):>9} {format_bytes(p['host_bytes']):>9}")
        lines.append(cells + "".join(
            f" {format_seconds(p['baselines'][n]) if p['baselines'].get(n) else '-':>13}"
            for n in names))
    return "\n".join(lines)
