"""Calibrated planning (karma/calibrate, karma/ir/timing.py): blocks timed on this machine,
same-shaped blocks once, cached; the roofline for other hardware and with --no-measure."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch

import karma
from karma.api import plan_report
from karma.calibrate.blocks import _owned_share, timing_batch
from karma.calibrate.cache import CACHE_VERSION
from karma.calibrate.in_context import median_over_traced
from karma.calibrate.machine import local_device
from karma.cli.plan import main as plan_main
from karma.errors import KarmaError
from karma.fileio import cache_dir
from karma.ir.build import build_block_graph
from karma.ir.timing import time_blocks
from karma.modelfile import load_model_file
from karma.planner.hardware import hardware_from_yaml, load_hardware
from karma.planner.options import PlanOptions
from karma.planner.problem import build_problem
from tests.conftest import EXAMPLES, environment

GPT = str(EXAMPLES / "gpt.py")
TINY = {"KARMA_GPT": "tiny"}
# room for the tiny GPT (keep_all: under 1 MiB) and what its process holds outside its tensors
# (measured 1.2-5.1 MiB, more under load: [Note: the process's own memory])
BUDGET = "8M"


def planned(budget: str, hardware: str, log=None, **options):
    """The tiny GPT planned at batch 2, as karma-plan does (karma.api.plan_report)."""
    return plan_report(GPT, PlanOptions(gpu_mem=budget, hardware=hardware, batch_size=2,
                                        **options), log)


@pytest.fixture(scope="module")
def machine_files():
    """This machine's measured rates, in the session's cache (measured once a session)."""
    from karma.calibrate.machine import measured_machine

    measured_machine("cpu", load_hardware("cpu"), lambda line: None)
    return list(cache_dir().glob("machine-*.json"))


@pytest.fixture
def own_cache(tmp_path, monkeypatch, machine_files):
    """A cache of the test's own that knows this machine's rates and no block times."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    (tmp_path / "xdg" / "karma").mkdir(parents=True)
    for path in machine_files:
        shutil.copy(path, tmp_path / "xdg" / "karma")
    return tmp_path / "xdg" / "karma"


@pytest.mark.slow
@pytest.mark.parametrize("name, env", [
    ("gpt", {}), ("resnet", {}), ("mlp", {}), ("hf_gpt2", {}),
    # rotary tables and cache positions made with device=x.device inside forward
    ("hf_llama", {"KARMA_HF": "tiny", "KARMA_SEQ": "16"}),
    # traced on meta, transformers' experts take the GPU's branch: histc of integers
    ("hf_mixtral", {"KARMA_HF": "tiny", "KARMA_SEQ": "16"}),
])
def test_blocks_of_every_kind_of_example_are_timed(example, name, env):
    mf = example(name, **env)
    graph = build_block_graph(mf, 2)
    times = time_blocks(mf, 2, repeats=1)
    assert times.names == tuple(b.name for b in graph.blocks)
    assert all(f > 0 and b > 0 for f, b in times.fwd_bwd_s)


def test_same_shaped_blocks_are_timed_once(example):
    mf = example("gpt")  # tiny: head, h.0, h.1, tail
    seen = []
    times = time_blocks(mf, 2, repeats=1, log=seen.append)
    assert times.distinct == 3 and len(times.fwd_bwd_s) == 4
    assert times.fwd_bwd_s[1] == times.fwd_bwd_s[2]
    assert seen == ["timing block head", "timing block h.0 (and 1 alike)", "timing block tail"]


def test_the_model_files_own_optimizer_is_timed_stepping_each_blocks_weights(example, tmp_path):
    # [Note: timing the optimizer step]: an optimizer that takes 100 ms a step is seen as one
    # (plain AdamW on these blocks: a few ms, 37 ms on the 2-core machine under load)
    mf = example("mlp")
    plain = time_blocks(mf, 2, repeats=1)
    slow_file = tmp_path / "slow_optimizer.py"
    slow_file.write_text(mf.path.read_text() + SLOW_OPTIMIZER)
    slow = time_blocks(load_model_file(slow_file), 2, repeats=2)
    graph = build_block_graph(mf, 2)
    for b, stepped, (device_s, host_s), (plain_s, _) in zip(
            graph.blocks, slow.stepped_bytes, slow.step_s, plain.step_s):
        assert stepped == b.param_bytes  # no tied weight in the MLP
        assert host_s == device_s  # on the CPU the host optimizer is the same step
        if b.param_bytes:
            assert device_s >= 0.1 > plain_s
        else:
            assert device_s == 0.0


SLOW_OPTIMIZER = """

import time as _time


class _SlowAdamW(torch.optim.AdamW):
    def step(self, closure=None):
        _time.sleep(0.1)
        return super().step(closure)


def make_optimizer(params):
    return _SlowAdamW(params, lr=1e-3)
"""


def test_a_blocks_step_is_its_own_weights_share_and_not_scaled_by_the_batch():
    # the tail of a tied LM steps the embedding weight when timed alone, which its owner steps
    assert _owned_share(100, 400, (0.8, 0.4)) == (0.2, 0.1)
    assert _owned_share(400, 400, (0.8, 0.4)) == (0.8, 0.4)
    assert _owned_share(0, 400, (0.8, 0.4)) == (0.0, 0.0)


def test_the_traced_step_is_scaled_to_the_median_step():
    # [Note: block times in context]: steps 2-6's median (1.92 s) over the third's 1.74 s
    assert median_over_traced([3.10, 2.41, 1.74, 1.92, 1.88, 2.18]) == \
        pytest.approx(1.92 / 1.74)
    assert median_over_traced([3.0, 2.0, 2.0]) == 1.0  # the fewest steps: 2 and 3 alike


@pytest.mark.slow
def test_blocks_are_timed_in_a_keep_all_step_where_one_fits(own_cache, monkeypatch):
    # [Note: block times in context]: the runtime's own trace of a keep_all step
    monkeypatch.setattr("karma.calibrate.in_context.MIN_SIDE_OP_S", 0.0)  # the probe runs
    notes = []
    with environment(TINY):
        report = planned(BUDGET, "cpu", log=notes.append)
    (blocks,) = own_cache.glob("blocks-*.json")
    data = json.loads(blocks.read_text())
    assert data["where"] == "in a keep_all step" and "in a keep_all step" in report.block_times
    assert any(n.startswith("timing the blocks of") and "keep_all steps" in n
               for n in notes)
    n = len(report.problem.blocks)
    assert len(data["fwd_bwd_s"]) == n and all(f > 0 and b > 0 for f, b in data["fwd_bwd_s"])
    assert [(b.fwd_s, b.bwd_s) for b in report.problem.blocks] == \
        [tuple(t) for t in data["fwd_bwd_s"]]
    # the loss too: the trace's, not the roofline's three passes over what it saves
    assert data["loss_s"] > 0 and report.problem.loss_s == data["loss_s"]
    # each block's selective recompute: its forward in context times the ratio timed alone
    # ([Note: the selective recompute in context])
    assert any(n.startswith("timing the forwards and selective recomputes") for n in notes)
    assert len(data["selective_s"]) == n
    assert all(s > 0 for by in data["selective_s"] for s in by.values())
    assert [{s.policy: s.recompute_s for s in b.selective} for b in report.problem.blocks] \
        == data["selective_s"]
    loss_op = next(op for op in report.schedule.ops if op.kind == "loss")
    assert loss_op.dur_s == pytest.approx(data["loss_s"], rel=1e-5)
    # and the side streams beside compute, in an out-of-core probe's traced steps: planned with
    side = data["side_streams"]
    assert set(side) == {"copy_slowdown_compute", "d2h_slowdown_compute",
                         "host_slowdown_compute", "side_wait_s"}
    assert all(0.0 <= v <= 0.95 for v in side.values())
    hw = dict(report.schedule.hardware)
    assert {f: hw.get(f, 0.0) for f in side} == side  # a fraction of 0 is left out
    assert any(n.startswith("side streams beside compute, fitted to the probe's steps")
               for n in notes)


@pytest.mark.slow
def test_a_probe_whose_side_ops_are_too_short_to_time_is_not_run(own_cache, monkeypatch):
    # [Note: side streams timed in context]: the tiny GPT's side ops are planned at about
    # 0.3 ms, but at over 1 ms where a loaded machine's copy rates were measured low; held
    # against a second, they are too short whatever the machine's mood
    monkeypatch.setattr("karma.calibrate.in_context.MIN_SIDE_OP_S", 1.0)
    notes = []
    with environment(TINY):
        report = planned(BUDGET, "cpu", log=notes.append)
    (blocks,) = own_cache.glob("blocks-*.json")
    assert json.loads(blocks.read_text())["side_streams"] is None
    assert any(n.startswith("not timing the side streams in context: the probe's side ops are "
                            "planned at ") for n in notes), notes
    assert "side streams" not in report.block_times


def test_a_keep_all_step_too_big_for_memory_times_the_blocks_alone(own_cache, monkeypatch):
    monkeypatch.setattr("karma.calibrate.in_context.mem_available_bytes", lambda: 1 << 20)
    notes = []
    with environment(TINY):
        report = planned(BUDGET, "cpu", log=notes.append)
    assert "block by block" in report.block_times
    assert any("timing its blocks one by one instead" in n for n in notes)
    # each block's selective recompute, timed with the rest
    (blocks,) = own_cache.glob("blocks-*.json")
    selective_s = json.loads(blocks.read_text())["selective_s"]
    assert any(selective_s) and all(s > 0 for by in selective_s for s in by.values())
    assert [{s.policy: s.recompute_s for s in b.selective} for b in report.problem.blocks] \
        == selective_s
    # timed alone, the loss keeps the roofline's estimate
    problem = report.problem
    mem_bytes_per_s = float(dict(report.schedule.hardware)["mem_bytes_per_s"])
    assert problem.loss_s == pytest.approx(3 * problem.loss_act_bytes / mem_bytes_per_s)


@pytest.mark.slow
def test_measured_steps_replace_the_estimate_in_the_plan(own_cache):
    """Device steps from the blocks' timing, host steps as the host stream runs them
    (calibrate/host_step.py), each from its own cache file."""
    with environment(TINY):
        report = planned(BUDGET, "cpu", log=lambda note: None)
        (blocks,) = own_cache.glob("blocks-*.json")
        (host,) = own_cache.glob("host-steps-*.json")
    steps = json.loads(blocks.read_text())["step_s"]
    host_s = json.loads(host.read_text())["host_step_s"]
    assert [(b.device_step_s, b.host_step_s) for b in report.problem.blocks] == \
        [(d, h) for (d, _), h in zip(steps, host_s, strict=True)]
    assert any(d > 0 for d, _ in steps) and any(h > 0 for h in host_s)


@pytest.mark.slow
def test_the_process_outside_its_tensors_is_measured_and_planned_in_every_stage(own_cache):
    # [Note: the process's own memory]: the keep_all steps measure it, the cache keeps it,
    # and the plan counts it all step; the roofline (nothing measured) does not
    with environment(TINY):
        measured = planned(BUDGET, "cpu", strategy="keep_all",
                               log=lambda note: None)
        roofline = planned(BUDGET, "cpu", strategy="keep_all", measure="estimate")
    (blocks,) = own_cache.glob("blocks-*.json")
    process = json.loads(blocks.read_text())["process_bytes"]
    assert 0 < process < 64 << 20
    assert measured.problem.process_bytes == measured.schedule.process_bytes == process
    assert roofline.problem.process_bytes == roofline.schedule.process_bytes == 0
    # the same plan's memory, less only the process (the stage bound does not depend on time)
    assert measured.schedule.predicted.stage_peak_bytes == \
        roofline.schedule.predicted.stage_peak_bytes + process
    assert measured.chosen.peak_device_bytes == roofline.chosen.peak_device_bytes + process


@pytest.mark.slow
def test_a_budget_below_the_process_says_how_much_of_the_need_it_is(own_cache):
    with environment(TINY), pytest.raises(karma.InfeasiblePlan,
                                          match="of it the process outside its tensors"):
        planned("400K", "cpu", log=lambda note: None)


def test_bf16_blocks_are_timed_under_autocast(example):
    # the trace asserts fp32 where autocast makes bf16 (an RMSNorm's .to(float32))
    mf = example("hf_llama", KARMA_HF="tiny", KARMA_SEQ="16")
    times = time_blocks(mf, 2, dtype="bf16", repeats=1)
    assert all(f > 0 and b > 0 for f, b in times.fwd_bwd_s)


@pytest.mark.slow
def test_plan_for_cpu_measures_once_then_reads_the_cache(tmp_path, monkeypatch):
    cache = tmp_path / "xdg" / "karma"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    notes = []
    with environment(TINY):
        first = planned(BUDGET, "cpu", log=notes.append)
        again = planned(BUDGET, "cpu", log=notes.append)
    assert first.block_times.startswith("measured now in ")
    # (and the side streams in a probe's steps where its side ops are planned long enough to
    # time: the tiny GPT's are not, unless the machine was slow when its rates were measured)
    assert again.block_times.startswith("measured on this machine, in a keep_all step")
    assert "(cached in " in again.block_times
    assert sum(n.startswith("measuring this machine") for n in notes) == 1
    assert sum(n.startswith("timing the blocks") for n in notes) == 1  # the second: cached
    assert sorted(p.name.rsplit("-", 1)[0] for p in cache.glob("*.json")) == [
        "blocks", "host-steps", "machine"]
    assert first.problem.blocks == again.problem.blocks
    assert first.schedule.predicted.calibration == "measured"
    first.schedule.save(tmp_path / "s.yaml")
    assert "calibration: measured" in (tmp_path / "s.yaml").read_text()
    assert karma.load_schedule(tmp_path / "s.yaml").predicted.calibration == "measured"
    # the machine's measured rates replace the built-in guesses; its sizes stay
    hw, builtin = dict(first.schedule.hardware), load_hardware("cpu")
    assert hw["name"] == "cpu" and hw["device_mem_bytes"] == builtin.device_mem_bytes
    (machine,) = cache.glob("machine-*.json")
    rates = hardware_from_yaml(json.loads(machine.read_text())["hardware"])
    scalar_rates = ("mem_bytes_per_s", "h2d_bytes_per_s", "d2h_bytes_per_s",
                    "host_optim_bytes_per_s")
    assert all(float(hw[f]) == getattr(rates, f) for f in scalar_rates)
    # (one measured to 3 digits may equal its guess: 10.0 GB/s of memory once did)
    assert any(getattr(rates, f) != getattr(builtin, f) for f in scalar_rates)
    # and so does how its streams slow each other (measured on the CPU: never negative)
    measured = {f: float(hw.get(f, 0.0)) for f in ("compute_slowdown_copy",
                                                   "copy_slowdown_compute",
                                                   "compute_slowdown_host",
                                                   "host_slowdown_compute")}
    assert measured != {f: getattr(builtin, f) for f in measured}
    assert all(0.0 <= v < 1.0 for v in measured.values())


def test_no_measure_and_other_hardware_use_the_roofline(own_cache, tmp_path):
    with environment(TINY):
        off = planned(BUDGET, "cpu", measure="estimate")
        v100 = planned(BUDGET, "v100-16g")
    assert off.block_times == "roofline estimate (--no-measure)"
    assert v100.block_times == "roofline estimate from the v100-16g profile (not this machine)"
    assert off.schedule.predicted.calibration is None
    off.schedule.save(tmp_path / "s.yaml")
    assert "calibration" not in (tmp_path / "s.yaml").read_text()  # as before: goldens unchanged
    assert not list(own_cache.glob("blocks-*"))  # nothing timed


@pytest.mark.slow
def test_a_corrupt_cache_file_is_measured_again(own_cache):
    from karma.calibrate.machine import read_machine

    with environment(TINY):
        planned(BUDGET, "cpu", log=lambda note: None)
        (blocks,) = own_cache.glob("blocks-*.json")
        blocks.write_text("{not json")
        again = planned(BUDGET, "cpu", log=lambda note: None)
    assert again.block_times.startswith("measured now in ")
    assert json.loads(blocks.read_text())["version"] == CACHE_VERSION
    for text in ("", "[]", json.dumps({"hardware": "version: 99"}), json.dumps({"x": 1})):
        blocks.write_text(text)
        assert read_machine(blocks) is None


def test_a_block_that_fails_to_run_falls_back_to_the_roofline_unless_asked(own_cache,
                                                                          monkeypatch):
    from karma.errors import IRError

    def fail(*args, **kwargs):
        raise IRError("timing block h.0 on cpu failed: RuntimeError: boom")

    monkeypatch.setattr("karma.calibrate.blocks.time_blocks", fail)
    monkeypatch.setattr("karma.calibrate.timed_in_context", lambda *args: None)
    notes = []
    with environment(TINY):
        report = planned(BUDGET, "cpu", log=notes.append)
        assert report.block_times == "roofline estimate (timing the blocks failed)"
        assert any("boom" in n and "--no-measure" in n for n in notes)
        with pytest.raises(IRError, match="boom"):  # asked to measure afresh: it fails
            planned(BUDGET, "cpu", measure="fresh", log=notes.append)


@pytest.mark.slow
def test_the_cache_is_keyed_by_the_model_environment(own_cache):
    with environment(TINY):
        planned(BUDGET, "cpu", log=lambda note: None)
    with environment({**TINY, "KARMA_SEQ": "16"}):
        other = planned(BUDGET, "cpu", log=lambda note: None)
    assert other.block_times.startswith("measured now in ")
    assert sum(p.name.startswith("blocks") for p in own_cache.iterdir()) == 2


def test_the_cache_lives_under_xdg_cache_home(own_cache):
    assert cache_dir() == own_cache


def test_only_cpu_and_the_local_gpu_are_this_machine():
    assert local_device("cpu") == "cpu"
    assert local_device(load_hardware("cpu")) is None  # a Hardware or a file: someone's machine
    if not torch.cuda.is_available():
        assert local_device("h100-80g") is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_measuring_another_machine_afresh_says_what_to_do(own_cache):
    with environment(TINY), pytest.raises(KarmaError, match="--remeasure.*measures this "
                                                            "machine.*v100-16g.*--hardware cpu"):
        planned(BUDGET, "v100-16g", measure="fresh")


def test_a_slow_estimate_times_blocks_at_a_smaller_batch(example):
    graph = build_block_graph(example("gpt"), 8)
    cpu = load_hardware("cpu")

    def roofline_s(hw):
        return [b.fwd_s + b.bwd_s for b in build_problem(graph, hw).blocks]

    assert timing_batch(graph, roofline_s(cpu)) == 8  # tiny: cheap enough at the plan's batch
    slow = replace(cpu, flops_per_s={"fp32": 1e3, "bf16": 1e3}, mem_bytes_per_s=1e3)
    assert timing_batch(graph, roofline_s(slow)) == 1


@pytest.mark.slow
def test_karma_plan_says_where_block_times_came_from(own_cache, capsys):
    with environment(TINY):
        args = [GPT, "--gpu-mem", BUDGET, "--hardware", "cpu", "--batch-size", "2"]
        assert plan_main([*args, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["block_times"] == "measured"
        assert plan_main([*args, "--no-measure", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["block_times"] == "roofline"
        assert plan_main(args) == 0
        assert "block times: measured on this machine, " in capsys.readouterr().out
        with pytest.raises(SystemExit) as exit_:  # argparse: one way to measure
            plan_main([*args, "--no-measure", "--remeasure"])
        assert exit_.value.code == 2
    assert "not allowed with argument --no-measure" in capsys.readouterr().err


@pytest.mark.slow
def test_remeasure_measures_the_machine_and_the_blocks_again(own_cache):
    # [Note: a machine whose speed drifts]: the cache keeps the first measurement
    notes = []
    with environment(TINY):
        planned(BUDGET, "cpu", log=notes.append)
        cached = planned(BUDGET, "cpu", log=notes.append)
        again = planned(BUDGET, "cpu", measure="fresh", log=notes.append)
        with pytest.raises(KarmaError, match="measure 'again' is not a way to measure; use "
                                             "one of cached, fresh, estimate"):
            planned(BUDGET, "cpu", measure="again")
    assert cached.block_times.startswith("measured on this machine")
    assert again.block_times.startswith("measured now in ")
    assert sum(n.startswith("measuring this machine") for n in notes) == 1  # own_cache had it
    assert sum(n.startswith("timing the blocks") for n in notes) == 2
    timing = [n for n in notes if n.startswith("timing the blocks")]
    assert "; once, cached in " in timing[0] and "; again, cached in " in timing[1]
