"""Fitting the side streams' contention fractions to traced steps (planner/fit_contention.py,
[Note: side streams timed in context])."""

from __future__ import annotations

from dataclasses import replace

import pytest

from karma.planner.fit_contention import fit_side_fractions
from karma.planner.hardware import load_hardware
from karma.planner.pipeline import PlanRequest, probe_schedule
from karma.planner.simulate import Contention, simulate
from karma.schedule import ModelRef
from tests.runtime_helpers import block_graph, load_small

PROFILE = {"compute_slowdown_copy": 0.3, "copy_slowdown_compute": 0.2,
           "compute_slowdown_host": 0.3, "host_slowdown_compute": 0.1}


@pytest.fixture(scope="module")
def probe():
    mf = load_small("gpt")
    graph = block_graph(mf)
    hw = replace(load_hardware("cpu"), **PROFILE)
    model = ModelRef.now(mf.path, mf.sha256, graph.to_json())
    return probe_schedule(graph, model, PlanRequest(capacity_bytes=1 << 40, hardware=hw,
                                                    batch_size=2))


def traced(schedule, contention: Contention) -> list[dict]:
    """A step's ops as a trace has them, run as the simulator runs `schedule` with
    `contention`."""
    sim = simulate(schedule.ops, schedule.buffers, contention=contention)
    return [{"stream": op.stream, "start_s": sim.start_s[op.id], "end_s": sim.end_s[op.id]}
            for op in schedule.ops]


def test_the_probe_keeps_every_side_stream_busy(probe):
    streams = {op.stream for op in probe.ops}
    assert {"compute", "h2d", "d2h", "host"} <= streams
    kinds = {op.kind for op in probe.ops}
    assert {"swap_out", "swap_in", "fetch", "host_step"} <= kinds


def test_the_fractions_the_steps_ran_with_are_found_again(probe):
    ran = replace(Contention(**PROFILE), copy_slowdown_compute=0.8, host_slowdown_compute=0.6)
    steps = [traced(probe, ran)] * 3
    fitted = fit_side_fractions(probe, steps)
    assert fitted == pytest.approx({"copy_slowdown_compute": 0.8,
                                    "host_slowdown_compute": 0.6}, abs=0.002)


def test_the_median_step_sets_them(probe):
    slow = replace(Contention(**PROFILE), copy_slowdown_compute=0.9, host_slowdown_compute=0.9)
    ran = replace(Contention(**PROFILE), copy_slowdown_compute=0.5, host_slowdown_compute=0.4)
    fitted = fit_side_fractions(probe, [traced(probe, ran), traced(probe, slow),
                                        traced(probe, ran)])
    assert fitted == pytest.approx({"copy_slowdown_compute": 0.5,
                                    "host_slowdown_compute": 0.4}, abs=0.002)


def test_a_stream_slower_than_sharing_the_cores_explains_keeps_the_profiles_fraction(probe):
    steps = traced(probe, Contention(**PROFILE))
    slow = [{**op, "end_s": op["start_s"] + 100 * (op["end_s"] - op["start_s"])}
            if op["stream"] == "host" else op for op in steps]
    fitted = fit_side_fractions(probe, [slow])
    assert fitted["host_slowdown_compute"] == PROFILE["host_slowdown_compute"]
    assert fitted["copy_slowdown_compute"] == pytest.approx(0.2, abs=0.002)


def test_streams_that_did_no_work_keep_the_profiles_fraction(probe):
    steps = [[op for op in traced(probe, Contention(**PROFILE)) if op["stream"] != "host"]]
    assert fit_side_fractions(probe, steps)["host_slowdown_compute"] == \
        PROFILE["host_slowdown_compute"]
