"""The measured timeline: karma-run --trace records every op of one step in the schedule's
order on each stream; karma-inspect --trace compares, plots and exports it; bad input is
refused with exit 2."""

from __future__ import annotations

import json
import os
import threading
from collections import defaultdict

import pytest

from karma.cli.inspect import main as inspect_main
from karma.cli.run import main as run_main
from karma.planner.simulate import simulate
from karma.runtime.host import cpu_cache
from karma.runtime.replay.streams import wait_for
from karma.schedule import STREAMS, dump_schedule, schedule_sha256
from karma.schedule_load import load_schedule
from karma.testing.exactness import plan, run
from karma.timeline import (
    MEMORY_ROWS,
    StepTrace,
    compare,
    load_trace,
    planned_spans,
    planned_waits,
    wait_s_by_stream,
    write_trace,
)
from tests.matrix import first_fast
from tests.runtime_helpers import load_small
from tests.schedule_fixtures import tiny_schedule

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# (strategy, fraction of keep_all's peak, clip_grad_norm): with clipping the host steps and
# uploads of the traced step run on after it (runtime/replay/update.py, [Note: updates
# overlapped with the next forward]) and must be in its trace all the same
CASES = {"keep_all": ("keep_all", 1.0, None), "swap_all": ("swap_all", 1.0, None),
         "offload_all": ("offload_all", 1.0, None),
         "offload_all_clipped": ("offload_all", 1.0, 1.0)}


def by_stream(ids_and_streams) -> dict[str, list[int]]:
    lanes = defaultdict(list)
    for op_id, stream in ids_and_streams:
        lanes[stream].append(op_id)
    return dict(lanes)


@pytest.mark.parametrize("case", first_fast(CASES))
def test_traced_op_order_equals_the_schedules(case, tmp_path):
    strategy, fraction, clip = CASES[case]
    mf = load_small("gpt")
    schedule = plan(mf, strategy, fraction, clip_grad_norm=clip)
    if clip is not None:
        assert any(op.kind == "host_step" for op in schedule.ops)  # deferred ops exist
    report = run(schedule, mf, 2, trace_path=tmp_path / "t.json")
    trace = load_trace(tmp_path / "t.json")

    assert (trace.step, report.traced_step, trace.backend) == (2, 2, "cpu")
    assert trace.schedule_sha256 == schedule_sha256(schedule)
    assert sorted(s.op for s in trace.ops) == [op.id for op in schedule.ops]  # every op once
    for s in trace.ops:
        op = schedule.ops[s.op]
        assert (s.kind, s.block, s.stream) == (op.kind, op.block, op.stream)
        assert 0 <= s.start_s <= s.end_s
    measured = by_stream((s.op, s.stream) for s in sorted(trace.ops, key=lambda s: s.start_s))
    assert measured == by_stream((op.id, op.stream) for op in schedule.ops)
    for w in trace.waits:
        assert w.stream in STREAMS and 0 <= w.start_s <= w.end_s
    # the report's waits per stream: one dict a step, the traced one's equal to the trace's
    assert len(report.wait_s) == 2
    traced = wait_s_by_stream(trace.waits)
    assert report.wait_s[1].keys() == traced.keys()
    assert all(report.wait_s[1][s] == pytest.approx(t) for s, t in traced.items())


def test_a_wait_is_blamed_on_the_last_dependency_to_finish():
    """wait_for returns the last dependency it found running: the one that finished last,
    whatever the order of the list."""
    events = {k: threading.Event() for k in "abc"}
    events["c"].set()
    threading.Timer(0.02, events["a"].set).start()
    threading.Timer(0.08, events["b"].set).start()
    assert wait_for(events, ["b", "a", "c"], []) == "b"  # a was done when the wait reached it
    for e in events.values():
        e.clear()
    events["c"].set()
    threading.Timer(0.02, events["a"].set).start()
    threading.Timer(0.08, events["b"].set).start()
    assert wait_for(events, ["a", "b", "c"], []) == "b"
    assert wait_for(events, ["a", "c"], []) is None  # nothing blocked


def test_a_trace_that_ran_as_planned_compares_equal():
    """A trace made of the simulated spans and waits measures what was planned."""
    s = tiny_schedule()
    sim = simulate(s.ops, s.buffers)
    waits = planned_waits(s, sim)
    assert waits  # the tiny ILP schedule waits for a copy somewhere
    compute_starts = {sim.start_s[op.id] for op in s.ops if op.stream == "compute"}
    assert all(w.end_s in compute_starts and w.stream != "compute" for w in waits)
    trace = StepTrace(schedule_sha256(s), s.model.path, "cpu", 1, sim.replay_s,
                      tuple(planned_spans(s, sim)), tuple(waits))
    info = compare(s, sim, trace)
    for v in info["streams"].values():
        assert v["busy_s"] == pytest.approx(v["planned_busy_s"])
        assert v["wait_s"] == pytest.approx(v["planned_wait_s"])
    assert info["ops_traced"] == info["ops"] == len(s.ops)


# --- the commands ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """gpt tiny's ILP schedule, run for 3 steps under karma-run --trace: (dir, schedule path,
    trace path)."""
    d = tmp_path_factory.mktemp("trace")
    (d / "S.yaml").write_text(dump_schedule(plan(load_small("gpt"), "ilp", 0.6)))
    saved = dict(os.environ)  # karma-run sets the schedule's KARMA_* variables
    try:
        code = run_main([str(d / "S.yaml"), "--steps", "3", "--trace", str(d / "t.json"),
                         "--report", str(d / "R.json")])
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert code == 0
    return d, d / "S.yaml", d / "t.json"


def test_run_traces_the_second_step_by_default(traced):
    d, _, trace_path = traced
    report = json.loads((d / "R.json").read_text())
    assert load_trace(trace_path).step == report["traced_step"] == 2
    assert len(report["wait_s"]) == 3


def test_run_traces_consecutive_steps_each_into_a_file_of_its_own(traced, tmp_path, capsys):
    """--trace-steps K: steps N..N+K-1, each into FILE with its step in the name, each a
    trace karma-inspect compares with the plan."""
    _, schedule_path, _ = traced
    saved = dict(os.environ)
    try:
        code = run_main([str(schedule_path), "--steps", "4", "--trace", str(tmp_path / "t.json"),
                         "--trace-step", "2", "--trace-steps", "3", "--report",
                         str(tmp_path / "R.json")])
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert code == 0
    assert sorted(p.name for p in tmp_path.glob("t*.json")) == \
        ["t.step2.json", "t.step3.json", "t.step4.json"]
    assert [load_trace(tmp_path / f"t.step{s}.json").step for s in (2, 3, 4)] == [2, 3, 4]
    assert json.loads((tmp_path / "R.json").read_text())["traced_step"] == 4
    capsys.readouterr()
    for s in (2, 3, 4):
        assert inspect_main([str(schedule_path), "--trace", str(tmp_path / f"t.step{s}.json"),
                             "--json"]) == 0
        info = json.loads(capsys.readouterr().out)["trace"]
        assert info["step"] == s and info["ops_traced"] == info["ops"]


def test_inspect_compares_plots_and_exports_a_trace(traced, capsys):
    d, schedule_path, trace_path = traced
    schedule = load_schedule(schedule_path)
    code = inspect_main([str(schedule_path), "--trace", str(trace_path), "--plot",
                         str(d / "t.png"), "--chrome", str(d / "t.chrome.json")])
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    assert "trace       step 2 (cpu backend)" in out
    assert "compute waited for it" in out
    assert (d / "t.png").read_bytes().startswith(PNG_SIGNATURE)

    events = json.loads((d / "t.chrome.json").read_text())["traceEvents"]
    n_ops = len(load_trace(trace_path).ops)
    spans = [e for e in events if e["ph"] == "X"]
    for pid in (1, 2):  # planned, measured: one event per op on its stream's thread
        ops = [e for e in spans if e["pid"] == pid and e["cat"] != "wait"]
        assert len(ops) == n_ops
        assert all(e["dur"] >= 0 for e in ops)
        assert all(e["tid"] == STREAMS.index(schedule.ops[e["args"]["op"]].stream)
                   for e in ops)
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert set(STREAMS) <= names

    code = inspect_main([str(schedule_path), "--trace", str(trace_path), "--json"])
    info = json.loads(capsys.readouterr().out)
    assert code == 0 and info["trace"]["ops_traced"] == n_ops


def test_the_trace_holds_the_measured_memory_beside_the_plan(traced, capsys):
    """On the CPU backend the peak meter's samples of the traced step go into the trace:
    the curve the reported peak is the maximum of, and per compute op what was measured
    beside what was planned."""
    d, schedule_path, trace_path = traced
    trace = load_trace(trace_path)
    report = json.loads((d / "R.json").read_text())
    assert len(trace.memory) >= 2
    times = [t for t, _ in trace.memory]
    # on the step's clock, from its start; the sampler runs at SCHED_IDLE, so on a loaded
    # machine its first sample of an 80 ms step came 0.10 s in, after the step
    assert times == sorted(times) and -0.1 < times[0] < trace.step_s + 1.0
    assert all(b >= 0 for _, b in trace.memory)
    assert max(b for _, b in trace.memory) <= report["peak_device_bytes"]

    code = inspect_main([str(schedule_path), "--trace", str(trace_path), "--json"])
    memory = json.loads(capsys.readouterr().out)["trace"]["memory"]
    assert code == 0 and memory["samples"] == len(trace.memory)
    assert memory["peak_bytes"] == max(b for _, b in trace.memory)
    rows = memory["most_above_plan"]
    assert all(load_schedule(schedule_path).ops[r["op"]].stream == "compute" for r in rows)
    # a row for each compute op a sample fell in (the tiny model's ops last about a
    # millisecond, the sampler's period: under a loaded machine none may have one)
    spans = [(s.start_s, s.end_s) for s in trace.ops if s.stream == "compute"]
    sampled = {k for k, (a, b) in enumerate(spans) if any(a <= t <= b for t, _ in trace.memory)}
    assert len(rows) == min(len(sampled), MEMORY_ROWS)


def test_memory_in_use_is_the_measured_less_what_the_cpu_cache_kept(tmp_path):
    """The CPU cache keeps freed tensors, which private memory counts and the plan does not:
    each sample less the bytes kept at the latest compute op's end before it."""
    trace = StepTrace("sha", "m.py", "cpu", 2, 1.0, (), (),
                      memory=((0.0, 100), (0.1, 300), (0.25, 500), (0.4, 450)),
                      kept=((0.05, 50), (0.3, 200)))
    assert trace.in_use() == ((0.0, 100), (0.1, 250), (0.25, 450), (0.4, 250))
    path = tmp_path / "t.json"
    write_trace(path, trace)
    assert load_trace(path) == trace
    assert StepTrace("sha", "m.py", "cpu", 2, 1.0, (), (), memory=((0.0, 7),)).in_use() == \
        ((0.0, 7),)


def test_a_cpu_trace_records_what_the_cache_kept(traced):
    _, _, trace_path = traced
    trace = load_trace(trace_path)
    if cpu_cache.load() is None:
        pytest.skip("no C++ compiler: no CPU cache")
    assert trace.kept, "each compute op's end records the bytes the CPU cache keeps"
    assert all(b >= 0 for _, b in trace.kept)
    assert [t for t, _ in trace.kept] == sorted(t for t, _ in trace.kept)


def assert_refused(code: int, err: str, prog: str, fragment: str) -> None:
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err
    assert "Traceback" not in err and fragment in err, err


def test_inspect_refuses_a_trace_of_another_schedule(traced, tmp_path, capsys):
    _, _, trace_path = traced
    other = tmp_path / "other.yaml"
    other.write_text(dump_schedule(tiny_schedule()))
    code = inspect_main([str(other), "--trace", str(trace_path)])
    assert_refused(code, capsys.readouterr().err, "karma-inspect", "traced another schedule")


def test_inspect_refuses_what_is_not_a_trace(traced, tmp_path, capsys):
    _, schedule_path, _ = traced
    bad = tmp_path / "bad.json"
    bad.write_text('{"karma_trace": 1, "ops": []}')
    code = inspect_main([str(schedule_path), "--trace", str(bad)])
    assert_refused(code, capsys.readouterr().err, "karma-inspect", "is not a karma trace")
    bad.write_text("[1, 2]")
    code = inspect_main([str(schedule_path), "--trace", str(bad)])
    assert_refused(code, capsys.readouterr().err, "karma-inspect",
                   "is not a karma trace (ValueError: it holds a JSON list, not a trace's "
                   "object); write one with karma-run SCHEDULE --trace FILE")
    code = inspect_main([str(schedule_path), "--chrome", str(tmp_path / "c.json")])
    assert_refused(code, capsys.readouterr().err, "karma-inspect", "--chrome needs --trace")


@pytest.mark.parametrize("argv, fragment", [
    (["--trace", "{tmp}/missing/t.json"], "does not exist"),
    (["--trace", "{tmp}"], "is a directory"),
    (["--trace", "{tmp}/t.json", "--trace-step", "5"], "is after the last step"),
    (["--trace-step", "1"], "--trace-step needs --trace"),
    (["--trace-steps", "2"], "--trace-steps needs --trace"),
    (["--trace", "{tmp}/t.json", "--trace-steps", "2"], "goes past the last step"),
])
def test_run_refuses_a_bad_trace_before_training(argv, fragment, traced, tmp_path, capsys):
    _, schedule_path, _ = traced
    argv = [a.format(tmp=tmp_path) for a in argv]
    code = run_main([str(schedule_path), "--steps", "2", *argv])
    out, err = capsys.readouterr()
    assert_refused(code, err, "karma-run", fragment)
    assert "step 1/" not in out
