"""bench/host_optimizer.py on a tiny GPT: its table has every row, every rate is positive, and
karma's host steps stepped each of the model's parameters once a traced step.

The rates themselves are the benchmark's business; here the script runs end to end (the
triad, torch's three AdamW kernels, karma-plan, karma-run --trace) and its JSON agrees with
its printed table.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

TINY = ["--layers", "2", "--width", "64", "--heads", "2", "--seq", "32", "--vocab", "128",
        "--batch-size", "2", "--repeats", "2", "--traced-steps", "2"]
MEASURES = ["memory bandwidth (triad)", "AdamW bound: bandwidth x 4/28",
            "torch AdamW single-tensor", "torch AdamW foreach", "torch AdamW fused",
            "karma host steps, all", "karma host steps, no compute op overlapping",
            "karma host steps, a compute op overlapping"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[dict, str]:
    """The JSON and the printed output of one run at the tiny shapes."""
    path = tmp_path_factory.mktemp("host-optimizer") / "rates.json"
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "host_optimizer.py"), *TINY,
                          "--json", str(path)],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(path.read_text()), out.stdout


@pytest.mark.slow
def test_the_table_has_every_row_and_every_rate_is_positive(tiny):
    result, stdout = tiny
    rows = {row["measure"]: row for row in result["rows"]}
    assert list(rows) == MEASURES
    printed = [line for line in stdout.splitlines() if line.startswith("| ")][1:]
    assert [line.split(" | ")[0][2:] for line in printed] == MEASURES
    # whether a tiny model's host steps ever meet a compute op is up to the threads' timing
    beside = rows.pop("karma host steps, a compute op overlapping")
    assert beside["ops"] == 0 or beside["bytes_per_s"] > 0, beside
    for row in rows.values():
        assert row["bytes_per_s"] > 0, row
    bound = result["rows"][1]["bytes_per_s"]
    assert bound == pytest.approx(result["rows"][0]["bytes_per_s"] * 4 / 28)


@pytest.mark.slow
def test_karma_stepped_every_parameter_once_a_step_and_split_its_host_steps_in_two(tiny):
    rows = {row["measure"]: row for row in tiny[0]["rows"]}
    model_bytes = rows["torch AdamW fused"]["nbytes"]
    everything, alone, beside = (rows[m] for m in MEASURES[5:])
    # the tied embedding and head counted once; two traced steps
    assert everything["nbytes"] == 2 * model_bytes
    assert everything["ops"] == 2 * 4  # the tiny GPT's blocks: head, h.0, h.1, tail
    assert alone["ops"] + beside["ops"] == everything["ops"]
    assert alone["nbytes"] + beside["nbytes"] == everything["nbytes"]
    assert alone["seconds"] + beside["seconds"] == pytest.approx(everything["seconds"])
