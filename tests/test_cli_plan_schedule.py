"""karma-plan planning (not --print-ir): the --json summary, --strategy, bad input (exit 2, one
message naming the value and the fix, no traceback) and budgets too small (exit 3)."""

from __future__ import annotations

import json
import re

import pytest

from karma.cli.plan import main
from karma.planner.baselines import BASELINES
from karma.planner.hardware import dump_hardware, load_hardware
from karma.testing.exactness import SMALL_ENV
from tests.conftest import EXAMPLES

GPT = str(EXAMPLES / "gpt.py")
MLP = str(EXAMPLES / "mlp.py")
GIB = 1 << 30


@pytest.fixture(autouse=True)
def small_examples(monkeypatch):
    for name in ("gpt", "mlp"):
        for key, value in SMALL_ENV[name].items():
            monkeypatch.setenv(key, value)


def run_plan(capsys, *argv: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of karma-plan; argparse's own errors exit by SystemExit.
    On v100-16g unless argv names a --hardware: the numbers here are that profile's."""
    if "--hardware" not in argv:
        argv = (*argv, "--hardware", "v100-16g")
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def plan_json(capsys, *argv: str) -> dict:
    code, out, err = run_plan(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def test_json_summary_has_every_key(capsys):
    doc = plan_json(capsys, GPT, "--gpu-mem", "16G")
    assert {"feasible", "strategy", "step_s", "peak_device_bytes", "capacity_bytes",
            "lower_bound_s", "solve_s", "decisions", "baselines",
            "scaling_efficiency"} <= set(doc)
    assert doc["feasible"] is True
    assert doc["strategy"] == "ilp"
    assert doc["capacity_bytes"] == 16 * GIB
    assert 0 < doc["peak_device_bytes"] <= doc["capacity_bytes"]
    assert 0 < doc["lower_bound_s"] <= doc["step_s"]
    assert doc["solve_s"] >= 0
    assert doc["scaling_efficiency"] == 1.0
    # the ideal: keep_all's time (its memory unlimited); the price of the budget is >= 1
    assert doc["ideal_s"] == doc["baselines"]["keep_all"]["step_s"]
    assert doc["price_of_budget"] == pytest.approx(doc["step_s"] / doc["ideal_s"])
    assert doc["price_of_budget"] >= 1.0
    assert set(doc["decisions"]) >= {"keep", "swap", "recompute", "streamed_weights"}
    # tiny GPT: head, h.0, h.1, tail; with 16 GiB everything stays
    assert sum(doc["decisions"][act] for act in ("keep", "swap", "recompute", "selective")) == 4
    assert set(doc["baselines"]) == set(BASELINES)
    for name, b in doc["baselines"].items():
        assert set(b) >= {"feasible", "step_s", "peak_device_bytes"}, name
        assert b["feasible"] is True, name
        assert doc["step_s"] <= b["step_s"] * (1 + 1e-9), name


def test_a_tight_budget_changes_the_plan(capsys):
    roomy = plan_json(capsys, GPT, "--gpu-mem", "16G")
    keep_all_peak = roomy["baselines"]["keep_all"]["peak_device_bytes"]
    budget = keep_all_peak * 3 // 4
    tight = plan_json(capsys, GPT, "--gpu-mem", str(budget))
    assert tight["capacity_bytes"] == budget
    assert tight["peak_device_bytes"] <= budget
    assert tight["baselines"]["keep_all"]["feasible"] is False
    assert tight["decisions"]["keep"] < 4
    assert tight["step_s"] > roomy["step_s"]
    for name, b in tight["baselines"].items():
        if b["feasible"]:
            assert tight["step_s"] <= b["step_s"] * (1 + 1e-9), name


@pytest.mark.parametrize("name", list(BASELINES))
def test_strategy_flag_plans_with_that_baseline(capsys, name):
    doc = plan_json(capsys, MLP, "--gpu-mem", "16G", "--strategy", name)
    assert doc["strategy"] == name
    assert doc["step_s"] == doc["baselines"][name]["step_s"]
    assert doc["peak_device_bytes"] == doc["baselines"][name]["peak_device_bytes"]


def test_a_baseline_that_does_not_fit_exits_3(capsys):
    code, out, err = run_plan(capsys, GPT, "--gpu-mem", "100K", "--strategy", "keep_all")
    assert code == 3
    assert "keep_all" in err and "Try --gpu-mem" in err
    assert "Traceback" not in err


def test_a_budget_too_small_exits_3_and_names_one_that_fits(capsys):
    code, out, err = run_plan(capsys, GPT, "--gpu-mem", "100K", "--json")
    assert code == 3
    assert err.startswith("karma-plan: error: ") and "Traceback" not in err
    assert "Try --gpu-mem" in err
    doc = json.loads(out)
    assert doc["feasible"] is False and doc["capacity_bytes"] == 100 * 1024
    assert doc["min_capacity_bytes"] > 100 * 1024
    suggested = re.search(r"Try --gpu-mem (\S+)", err)[1]
    code, _, err = run_plan(capsys, GPT, "--gpu-mem", suggested)
    assert code == 0, err


def test_world_size_4_scaling_efficiency(capsys):
    one = plan_json(capsys, GPT, "--gpu-mem", "16G")
    four = plan_json(capsys, GPT, "--gpu-mem", "16G", "--world-size", "4")
    assert 0 < four["scaling_efficiency"] <= 1
    assert four["scaling_efficiency"] < 1  # the all-reduce of the gradients is not free
    assert four["step_s"] >= one["step_s"]


def _bad_yaml(tmp_path) -> str:
    path = tmp_path / "broken.yaml"
    path.write_text("version: 1\nname: [unclosed\n")
    return str(path)


def _bad_value(tmp_path) -> str:
    text = dump_hardware(load_hardware("v100-16g"))
    assert "h2d_bytes_per_s: 1.2e+10" in text
    path = tmp_path / "slow.yaml"
    path.write_text(text.replace("h2d_bytes_per_s: 1.2e+10", "h2d_bytes_per_s: fast"))
    return str(path)


# (arguments after the model file, what the message must contain: the value and the fix)
BAD_INPUT = [
    (lambda tmp: ["--gpu-mem", "16Q"], ["'16Q'", "e.g. 16G"]),
    (lambda tmp: ["--gpu-mem", "0"], ["'0'", "more than zero", "e.g. 16G"]),
    (lambda tmp: ["--gpu-mem=-1G"], ["'-1G'", "e.g. 16G"]),
    (lambda tmp: ["--gpu-mem", "-1G"], ["'-1G'", "e.g. 16G"]),  # not read as an option
    (lambda tmp: ["--gpu-mem", "16G", "--hardware", "nosuch"], ["'nosuch'", "v100-16g"]),
    (lambda tmp: ["--gpu-mem", "16G", "--hardware", _bad_yaml(tmp)],
     ["broken.yaml", "not valid YAML", "karma-profile -o FILE"]),
    (lambda tmp: ["--gpu-mem", "16G", "--hardware", _bad_value(tmp)],
     ["slow.yaml", "h2d_bytes_per_s", "'fast'", "e.g."]),
    (lambda tmp: ["--gpu-mem", "16G", "--strategy", "nosuch"], ["'nosuch'", "keep_all"]),
    (lambda tmp: [], ["--gpu-mem is required", "e.g. --gpu-mem 16G"]),
]
BAD_IDS = ["gpu-mem 16Q", "gpu-mem 0", "gpu-mem=-1G", "gpu-mem -1G", "hardware nosuch", "profile not yaml",
           "profile bad value", "strategy nosuch", "no gpu-mem"]


@pytest.mark.parametrize("args, expected", BAD_INPUT, ids=BAD_IDS)
def test_bad_input_exits_2_naming_the_value_and_the_fix(capsys, tmp_path, args, expected):
    code, out, err = run_plan(capsys, GPT, *args(tmp_path))
    assert code == 2
    assert err.startswith("karma-plan: error: ")
    assert "Traceback" not in err and out == ""
    for text in expected:
        assert text in err

