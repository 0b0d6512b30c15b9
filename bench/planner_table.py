"""Planner acceptance table: the ILP against every baseline on big models and tight budgets.

    .venv/bin/python bench/planner_table.py

For GPT-2 XL (batch 8) and ResNet-152 (batch 32), fp32, one rank, on the v100-16g and h100-80g
profiles, at 30%, 50% and 70% of the keep_all plan's stage peak (the memory in-core training
needs): the pipeline's steps (build the block graph once per model, build the problem,
evaluate every baseline, solve the ILP from the best feasible baseline at the default gap,
0.01, then the passes after the solve) and one markdown row each. "lower bound" is the ILP plan's own bound: its busiest
stream's busy time, which no schedule of its operations can beat.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from karma.ir.build import build_block_graph  # noqa: E402
from karma.ir.optimizer import optimizer_profile  # noqa: E402
from karma.modelfile import load_model_file  # noqa: E402
from karma.planner.options import PlanOptions  # noqa: E402
from karma.planner.passes import PASSES, Planning  # noqa: E402
from karma.planner.pipeline import first_choice  # noqa: E402
from karma.planner.plan import InfeasiblePlan  # noqa: E402
from karma.planner.problem import ESTIMATED  # noqa: E402

COMMAND = ".venv/bin/python bench/planner_table.py"
GIB = 2**30
HUGE = 2**60  # bytes: a budget nothing reaches
# (label, model file, environment the file reads at import, batch size)
MODELS = (
    ("gpt2-xl", "examples/gpt.py", {"KARMA_GPT": "xl"}, 8),
    ("resnet-152", "examples/resnet.py", {"KARMA_RESNET": "152"}, 32),
)
HARDWARE = ("v100-16g", "h100-80g")
BUDGET_FRACTIONS = (0.3, 0.5, 0.7)
COLUMNS = ("model", "hardware", "budget", "ILP step s", "status", "solve s",
           "lower bound s", "ILP/LB", "best baseline", "ILP/best", "keep/swap/recompute/selective/"
           "streamed/host-opt", "feasible baselines")


def row(label: str, p: Planning, fraction: float) -> list[str]:
    """One table row: the baselines, and the plan the pipeline chooses (the ILP, then the
    passes after the solve: karma/planner/passes.py), at `p`'s budget, `fraction` of
    keep_all's stage peak."""
    cap, hw_name = p.capacity_bytes, p.options.profile.name
    budget = f"{fraction:.0%} ({cap / GIB:.1f} GiB)"
    feasible = {name: ev for name, ev in p.baselines.items() if ev.feasible}
    best = p.best_baseline
    fits = ", ".join(feasible) or "none"
    best_text = f"{best.plan.strategy} {best.step_s:.3f}" if best else "none"
    try:
        ev = first_choice(p)
    except InfeasiblePlan as e:
        return [label, hw_name, budget, f"infeasible (needs {e.min_capacity_bytes / GIB:.1f} "
                "GiB)", "infeasible", "", "", "", best_text, "", "", fits]
    for improve in PASSES:
        ev = improve(p, ev)
    plan = ev.plan
    c = plan.counts()
    counts = "/".join(str(c[k]) for k in ("keep", "swap", "recompute", "selective",
                                           "streamed_weights", "host_optimizer"))
    lb = ev.sim.lower_bound_s
    return [
        label, hw_name, budget, f"{ev.step_s:.3f}", plan.status + ("" if ev.feasible
                                                                          else " (over budget)"),
        f"{plan.solve_s:.2f}", f"{lb:.3f}", f"{ev.step_s / lb:.3f}", best_text,
        f"{ev.step_s / best.step_s:.3f}" if best else "", counts, fits,
    ]


def main() -> None:
    print(f"    {COMMAND}\n")
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + " --- |" * len(COLUMNS))
    for label, path, env, batch_size in MODELS:
        os.environ.update(env)  # the example files read their size at import
        mf = load_model_file(ROOT / path)
        graph = build_block_graph(mf, batch_size)
        optimizer = optimizer_profile(mf)
        for hw_name in HARDWARE:
            unlimited = Planning(graph, PlanOptions(gpu_mem=HUGE, hardware=hw_name,
                                                    batch_size=batch_size), ESTIMATED, optimizer)
            peak = unlimited.baselines["keep_all"].stage_peak_bytes
            name = f"{label} ({len(graph.blocks)} blocks, batch {batch_size})"
            for fraction in BUDGET_FRACTIONS:
                p = dataclasses.replace(unlimited, options=dataclasses.replace(
                    unlimited.options, gpu_mem=int(fraction * peak)))
                print("| " + " | ".join(row(name, p, fraction)) + " |", flush=True)


if __name__ == "__main__":
    main()
