"""bench/selective.py's accounting on a tiny ResNet planned for a V100 at 100 MiB: what a plan
holds at its fullest stage adds up to the ILP's memory model there, and its --bounds plans
(some copies made free, a prototype choice offered) are no slower than the ILP's.

The numbers themselves are the benchmark's business (bench/RESULTS.md, "Selective
recompute"); the paper's models take minutes, a tiny one seconds.
"""

from __future__ import annotations

import importlib.util

import pytest

from karma.planner.memory import stage_memory
from tests.conftest import ROOT, environment

TINY = ("examples/resnet.py", {"KARMA_RESNET": "tiny"}, 1024)


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("selective_bench",
                                                  ROOT / "bench" / "selective.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.BUDGET = "100M"  # the tiny ResNet's activations do not fit: selective blocks
    return module


def test_what_a_plan_holds_at_its_peak_adds_up_to_the_ilps_memory(bench):
    with environment(TINY[1]):
        report = bench.plan_one(*TINY, selective=True)
        held = bench.peak_held(report)
        with bench.held_outputs_free():
            offloaded = bench.peak_held(bench.plan_one(*TINY, selective=True))
    ev = report.chosen
    assert sum(held.values()) == max(stage_memory(report.problem, list(ev.plan.choices),
                                                  ev.training))
    assert held["saved by several blocks"] > 0 and held["kept by selective blocks"] > 0
    assert ev.plan.counts()["selective"] > 0
    # sent to the host, the outputs that blocks hold for the next one leave the peak
    assert offloaded["saved by several blocks"] < held["saved by several blocks"]


def test_the_bounds_are_no_slower_than_the_ilps_plan(bench):
    with environment(TINY[1]):
        b = bench.bounds(*TINY)
        plain_s, _, none = bench.exact_objective(bench.plan_one(*TINY, selective=True))
    assert b["exact_s"] <= b["ilp_s"] * 1.01  # a zero gap
    assert b["kept_free_s"] <= b["ilp_s"] * 1.01 and b["held_free_s"] <= b["kept_free_s"] * 1.01
    # more choices, the same objective solved to a zero gap: no worse (within CBC's
    # tolerances, microseconds here)
    assert none == 0 and b["offered_s"] <= plain_s * 1.01
    row = bench.bounds_row("tiny", TINY[2], b)
    assert row.startswith("| tiny | 1024 | ") and row.count(" | ") == 6
