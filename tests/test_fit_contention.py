"""Fitting the side streams' contention fractions to traced steps (planner/fit_contention.py,
[Note: side streams timed in context])."""

from __future__ import annotations

from dataclasses import replace

import pytest

from karma.planner.fit_contention import fit_side_streams
from karma.planner.hardware import load_hardware
from karma.planner.options import PlanOptions
from karma.planner.pipeline import probe_schedule
from karma.planner.simulate import Contention, simulate
from karma.schedule import ModelRef
from karma.testing.exactness import block_graph
from tests.runtime_helpers import load_small

PROFILE = {"compute_slowdown_copy": 0.3, "copy_slowdown_compute": 0.2,
           "compute_slowdown_host": 0.3, "host_slowdown_compute": 0.1}


@pytest.fixture(scope="module")
def probe():
    """The tiny GPT's probe with every op 1000 times longer: its side ops then take
    milliseconds, as the probe calibration runs does (the tiny one's take microseconds, where
    a wait of a millisecond and a slowdown cannot be told apart)."""
    mf = load_small("gpt")
    graph = block_graph(mf)
    hw = replace(load_hardware("cpu"), **PROFILE)
    model = ModelRef.now(mf.path, mf.sha256, graph.to_json())
    tiny = probe_schedule(graph, model, PlanOptions(gpu_mem=1 << 40, hardware=hw, batch_size=2))
    return replace(tiny, ops=tuple(replace(op, dur_s=op.dur_s * 1000) for op in tiny.ops))


def traced(schedule, contention: Contention) -> list[dict]:
    """A step's ops as a trace has them, run as the simulator runs `schedule` with
    `contention`."""
    sim = simulate(schedule.ops, schedule.buffers, contention=contention)
    return [{"op": op.id, "stream": op.stream, "start_s": sim.start_s[op.id],
             "end_s": sim.end_s[op.id]} for op in schedule.ops]


def assert_fitted(fitted: dict, copy: float, d2h: float, host: float, wait_s: float) -> None:
    """The fractions to their 3 digits (one off: the bisection), the wait to 0.1 ms."""
    assert set(fitted) == {"copy_slowdown_compute", "d2h_slowdown_compute",
                           "host_slowdown_compute", "side_wait_s"}
    assert fitted["copy_slowdown_compute"] == pytest.approx(copy, abs=0.0015)
    assert fitted["d2h_slowdown_compute"] == pytest.approx(d2h, abs=0.0015)
    assert fitted["host_slowdown_compute"] == pytest.approx(host, abs=0.0015)
    assert fitted["side_wait_s"] == pytest.approx(wait_s, abs=1e-4)


def test_the_probe_keeps_every_side_stream_busy(probe):
    streams = {op.stream for op in probe.ops}
    assert {"compute", "h2d", "d2h", "host"} <= streams
    kinds = {op.kind for op in probe.ops}
    assert {"swap_out", "swap_in", "fetch", "host_step"} <= kinds


def test_the_fractions_and_the_wait_the_steps_ran_with_are_found_again(probe):
    """Each copy direction its own fraction, and the wait for a core ([Note: waiting for a
    core]) told apart from them by the small copies."""
    ran = replace(Contention(**PROFILE), copy_slowdown_compute=0.8, d2h_slowdown_compute=0.7,
                  host_slowdown_compute=0.6, side_wait_s=0.002)
    fitted = fit_side_streams(probe, [traced(probe, ran)] * 3)
    assert_fitted(fitted, 0.8, 0.7, 0.6, 0.002)


def test_steps_that_waited_for_no_core_fit_no_wait(probe):
    ran = replace(Contention(**PROFILE), copy_slowdown_compute=0.5, d2h_slowdown_compute=0.3)
    fitted = fit_side_streams(probe, [traced(probe, ran)])
    assert_fitted(fitted, 0.5, 0.3, 0.1, 0.0)


def test_the_median_step_sets_them(probe):
    slow = replace(Contention(**PROFILE), copy_slowdown_compute=0.9, host_slowdown_compute=0.9,
                   side_wait_s=0.004)
    ran = replace(Contention(**PROFILE), copy_slowdown_compute=0.5, host_slowdown_compute=0.4,
                  side_wait_s=0.001)
    fitted = fit_side_streams(probe, [traced(probe, ran), traced(probe, slow),
                                      traced(probe, ran)])
    # d2h ran with h2d's fraction (0: as h2d's), and is fitted on its own to the same
    assert_fitted(fitted, 0.5, 0.5, 0.4, 0.001)


def test_a_stream_slower_than_sharing_the_cores_explains_keeps_the_profiles_fraction(probe):
    steps = traced(probe, Contention(**PROFILE))
    slow = [{**op, "end_s": op["start_s"] + 100 * (op["end_s"] - op["start_s"])}
            if op["stream"] == "host" else op for op in steps]
    fitted = fit_side_streams(probe, [slow])
    assert fitted["host_slowdown_compute"] == PROFILE["host_slowdown_compute"]
    assert fitted["copy_slowdown_compute"] == pytest.approx(0.2, abs=0.0015)
    assert fitted["side_wait_s"] == pytest.approx(0.0, abs=1e-4)


def test_streams_that_did_no_work_keep_the_profiles_fraction(probe):
    steps = [[op for op in traced(probe, Contention(**PROFILE)) if op["stream"] != "host"]]
    assert fit_side_streams(probe, steps)["host_slowdown_compute"] == \
        PROFILE["host_slowdown_compute"]
