"""karma-plan --sweep: every point of a budget or batch-size range, planned from one trace."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from karma.cli.capacity import parse_sweep
from karma.cli.plan import main
from karma.errors import KarmaError
from karma.schedule_load import load_schedule
from tests.conftest import EXAMPLES

GPT = str(EXAMPLES / "gpt.py")
KEYS = {"gpu_mem_bytes", "batch_size", "feasible", "step_s", "samples_per_s", "baselines"}


def sweep_cli(capsys, monkeypatch, *argv: str) -> tuple[int, str, str]:
    monkeypatch.setenv("KARMA_GPT", "tiny")
    code = main([GPT, "--hardware", "v100-16g", "--no-measure", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_budget_sweep_plans_every_point_and_says_what_ran_out(capsys, monkeypatch):
    code, out, err = sweep_cli(capsys, monkeypatch, "--sweep", "gpu-mem=200K:1M:200K",
                               "--json")
    assert code == 0, err
    points = json.loads(out)
    assert [p["gpu_mem_bytes"] for p in points] == [k * 200 * 1024 for k in range(1, 6)]
    assert all(KEYS <= p.keys() and p["batch_size"] == 4 for p in points)
    short = [p for p in points if not p["feasible"]]
    assert short and all(p["resource"] == "device" and p["step_s"] is None
                         for p in short)
    fits = [p for p in points if p["feasible"]]
    assert len(fits) >= 2 and fits[-1]["gpu_mem_bytes"] == 1000 * 1024
    # more memory never makes the chosen plan slower, and samples/s is batch / step
    times = [p["step_s"] for p in fits]
    assert times == sorted(times, reverse=True)
    for p in fits:
        assert p["samples_per_s"] == pytest.approx(p["batch_size"] / p["step_s"])
        assert p["peak_device_bytes"] <= p["gpu_mem_bytes"]
        assert set(p["baselines"]) == {"keep_all", "recompute_all", "selective_all", "swap_all",
                                       "offload_all", "greedy"}
        assert all(t is None or t >= p["step_s"] * (1 - 1e-9)
                   for t in p["baselines"].values())


def test_the_table_has_a_row_a_point(capsys, monkeypatch):
    code, out, err = sweep_cli(capsys, monkeypatch, "--sweep", "gpu-mem=400K,1M")
    assert code == 0, err
    lines = out.strip().splitlines()
    assert lines[0].startswith("sweep on v100-16g") and len(lines) == 4
    assert "no plan fits: device memory runs out" in lines[2]
    assert "keep_all" in lines[1] and "1.00 MiB" in lines[3]


def test_a_batch_size_sweep_doubles_and_plans_each_batch(capsys, monkeypatch):
    code, out, err = sweep_cli(capsys, monkeypatch, "--gpu-mem", "2M", "--sweep",
                               "batch-size=1:8", "--json")
    assert code == 0, err
    points = json.loads(out)
    assert [p["batch_size"] for p in points] == [1, 2, 4, 8]
    assert all(p["gpu_mem_bytes"] == 2 << 20 for p in points)


@pytest.mark.parametrize("spec,values", [
    ("gpu-mem=4G:8G:2G", ("gpu-mem", [4 << 30, 6 << 30, 8 << 30])),
    ("gpu-mem=8G,16G", ("gpu-mem", [8 << 30, 16 << 30])),
    ("batch-size=1:64", ("batch-size", [1, 2, 4, 8, 16, 32, 64])),
    ("batch-size=8:32:8", ("batch-size", [8, 16, 24, 32])),
    ("batch-size=3,5", ("batch-size", [3, 5])),
])
def test_ranges_and_lists(spec, values):
    assert parse_sweep(spec) == values


BAD = [
    (["--sweep", "gpu-mem=4G:2G:1G"], "is not a range or a list"),
    (["--sweep", "gpu-mem=4G:x:1G"], "is not a range or a list"),
    (["--sweep", "gpu-mem=4G:8G"], "a budget range needs its step"),
    (["--sweep", "batch-size=0:8"], "is not a range or a list"),
    (["--sweep", "layers=1:4"], "karma sweeps gpu-mem or batch-size"),
    (["--sweep", "gpu-mem=1G:2G:1G", "--sweep", "batch-size=1:2"], "sweep one quantity"),
    (["--sweep", "gpu-mem=1G:2G:1G", "-o", "s.yaml"], "writes no schedule"),
    (["--sweep", "gpu-mem=1G:2G:1G", "--gpu-mem", "1G"], "contradict each other"),
    (["--sweep", "batch-size=1:2"], "give --gpu-mem"),
]


@pytest.mark.parametrize("argv,expected", BAD, ids=[e for _, e in BAD])
def test_a_bad_sweep_is_one_line(capsys, monkeypatch, argv, expected):
    code, out, err = sweep_cli(capsys, monkeypatch, *argv)
    assert code == 2, err
    assert err.startswith("karma-plan: error: ") and expected in err, err
    assert "Traceback" not in err and out == ""


def test_parse_sweep_errors_are_karma_errors():
    with pytest.raises(KarmaError, match="from:to:step"):
        parse_sweep("gpu-mem=oops")


# --- --batch-size max | best ------------------------------------------------------------------

@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """karma-plan --batch-size max and best for the tiny GPT at 2 MiB: their JSON."""
    from tests.conftest import environment

    out = {}
    with environment({"KARMA_GPT": "tiny"}):
        for how in ("max", "best"):
            path = tmp_path_factory.mktemp(how) / "s.yaml"
            buffer = io.StringIO()
            with contextlib.redirect_stdout(buffer):
                code = main([GPT, "--hardware", "v100-16g", "--no-measure", "--gpu-mem", "2M",
                             "--batch-size", how, "--json", "-o", str(path)])
            assert code == 0
            out[how] = (json.loads(buffer.getvalue()), path)
    return out


def test_batch_size_max_is_the_largest_that_fits(searched):
    doc, path = searched["max"]
    fits = {p["batch_size"] for p in doc["batch_search"] if p["feasible"]}
    short = {p["batch_size"] for p in doc["batch_search"] if not p["feasible"]}
    assert doc["batch_size"] == max(fits) and doc["batch_size"] + 1 in short
    assert len(doc["batch_search"]) < max(fits)  # searched, not every batch tried
    assert load_schedule(path).config.batch_size == doc["batch_size"]


def test_batch_size_best_has_the_most_samples_per_second_of_those_searched(searched):
    doc, path = searched["best"]
    fits = [p for p in doc["batch_search"] if p["feasible"]]
    assert doc["batch_size"] == max(fits, key=lambda p: p["samples_per_s"])["batch_size"]
    best = next(p for p in fits if p["batch_size"] == doc["batch_size"])
    assert doc["step_s"] == pytest.approx(best["step_s"])
    # refined around the doubling's best: its neighbours were tried
    tried = {p["batch_size"] for p in doc["batch_search"]}
    assert {doc["batch_size"] - 1, doc["batch_size"] + 1} & tried


def test_batch_size_search_needs_a_budget(capsys, monkeypatch):
    code, out, err = sweep_cli(capsys, monkeypatch, "--batch-size", "best")
    assert code == 2 and "give --gpu-mem" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as exc:
        main([GPT, "--gpu-mem", "1G", "--batch-size", "most"])
    assert exc.value.code == 2


# --- what-if hardware: --hardware A,B,C -------------------------------------------------------

def test_the_same_model_on_several_profiles_is_one_table(capsys, monkeypatch):
    monkeypatch.setenv("KARMA_GPT", "tiny")
    code = main([GPT, "--no-measure", "--hardware", "v100-16g,h100-80g", "--world-size", "4",
                 "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    rows = json.loads(out)
    assert [r["hardware"] for r in rows] == ["v100-16g", "h100-80g"]
    # each at its own device memory, its own node's ranks
    assert rows[0]["gpu_mem_bytes"] < rows[1]["gpu_mem_bytes"]
    assert all(r["feasible"] and r["world_size"] == 4 and r["nproc_per_node"] == 4
               and 0 < r["scaling_efficiency"] for r in rows)
    assert rows[1]["step_s"] < rows[0]["step_s"]  # the H100 is faster
    code = main([GPT, "--no-measure", "--hardware", "v100-16g,h100-80g", "--gpu-mem", "200K"])
    out, err = capsys.readouterr()
    assert code == 0 and out.count("does not fit: no plan fits 200 KiB") == 2, out


@pytest.mark.parametrize("argv,expected", [
    (["--hardware", "v100-16g,h100-80g", "-o", "s.yaml"], "writes no schedule"),
    (["--hardware", "v100-16g,nonesuch"], "unknown hardware 'nonesuch'"),
])
def test_a_bad_hardware_comparison_is_one_line(capsys, monkeypatch, argv, expected):
    monkeypatch.setenv("KARMA_GPT", "tiny")
    code = main([GPT, "--no-measure", "--gpu-mem", "1G", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and expected in err and "Traceback" not in err, err


def test_a_sweep_draws_its_curves(capsys, monkeypatch, tmp_path):
    pytest.importorskip("matplotlib")
    code, out, err = sweep_cli(capsys, monkeypatch, "--sweep", "gpu-mem=400K:1M:200K",
                               "--plot", str(tmp_path / "sweep.png"))
    assert code == 0, err
    assert (tmp_path / "sweep.png").read_bytes().startswith(b"\x89PNG")
    assert f"wrote {tmp_path / 'sweep.png'}" in out
    code, out, err = sweep_cli(capsys, monkeypatch, "--gpu-mem", "1M", "--plot",
                               str(tmp_path / "x.png"))
    assert code == 2 and "--plot draws a sweep: give --sweep too" in err
