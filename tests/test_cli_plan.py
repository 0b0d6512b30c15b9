"""karma-plan --print-ir: output formats and bad input (exit 2, a short message, no traceback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from karma.cli.plan import main
from tests.conftest import EXAMPLES, MODELS, ROOT


def run_plan(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_print_ir_table_and_json(capsys, monkeypatch):
    monkeypatch.setenv("KARMA_GPT", "tiny")
    code, out, _ = run_plan(capsys, str(EXAMPLES / "gpt.py"), "--print-ir", "--batch-size", "2")
    assert code == 0
    assert "h.1" in out and "tail" in out and "batch 2" in out
    code, out, _ = run_plan(capsys, str(EXAMPLES / "gpt.py"), "--print-ir", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["batch_size"] == 4  # the model file's BATCH_SIZE for tiny
    assert [b["name"] for b in doc["blocks"]] == ["head", "h.0", "h.1", "tail"]


BAD_INPUT = [
    (["does_not_exist.py"], "does not exist"),
    ([str(MODELS / "syntax_error.py")], "syntax error"),
    ([str(MODELS / "no_build_model.py")], "does not define build_model()"),
    ([str(MODELS / "bad_batch.py")], "return (inputs, targets)"),
    ([str(MODELS / "datadep.py")], "datadep.py:13: `if (y < 0).any():`"),
    ([str(EXAMPLES / "mlp.py"), "--blocks", "nothing\\.here"], "matches no module path"),
    ([str(EXAMPLES / "mlp.py"), "--blocks", "("], "is not a regular expression"),
]


@pytest.mark.parametrize("argv, expected", BAD_INPUT, ids=[e for _, e in BAD_INPUT])
def test_bad_input_exits_2_with_a_message(capsys, argv, expected):
    code, out, err = run_plan(capsys, *argv, "--print-ir")
    assert code == 2
    assert expected in err
    assert err.startswith("karma-plan: error: ")
    assert "Traceback" not in err and out == ""


def test_bad_batch_size_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main([str(EXAMPLES / "mlp.py"), "--print-ir", "--batch-size", "0"])
    assert exc.value.code == 2
    assert "not a positive integer" in capsys.readouterr().err


@pytest.mark.slow
def test_untraceable_model_in_a_fresh_process_prints_no_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "karma.cli.plan", str(MODELS / "datadep.py"), "--print-ir"],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONWARNINGS": ""},
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "def forward" not in proc.stderr
    assert proc.stderr.count("\n") == 1  # one line
    assert "torch.where" in proc.stderr  # the fix


def test_debug_shows_the_traceback(capsys):
    with pytest.raises(Exception, match="does not exist"):
        main(["does_not_exist.py", "--print-ir", "--debug"])
