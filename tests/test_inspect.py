"""karma-inspect: the summary of a valid schedule, refusal of an edited one, --json, --plot."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys

import pytest

from karma.cli.inspect import main
from karma.schedule import dump_schedule, schedule_sha256
from karma.schedule_load import load_schedule
from karma.selective_policy import SELECTIVE_POLICY
from karma.units import format_bytes
from tests.conftest import ROOT
from tests.schedule_fixtures import tiny_schedule

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def text() -> str:
    return dump_schedule(tiny_schedule())


@pytest.fixture
def path(tmp_path, text):
    p = tmp_path / "tiny.yaml"
    p.write_text(text)
    return p


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_refused(code: int, out: str, err: str, *fragments: str) -> None:
    assert code == 2
    assert out == ""
    assert err.startswith("karma-inspect: error: ") and err.count("\n") == 1
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err


def test_summary_of_a_valid_schedule(capsys, path):
    code, out, err = run(capsys, path)
    assert (code, err) == (0, "")
    s = load_schedule(path)
    assert f"sha256 {schedule_sha256(s)[:12]}" in out
    assert f"examples/gpt.py  sha256 {s.model.sha256[:12]}  ir {s.model.ir_sha256[:12]}" in out
    assert "ilp (optimal)" in out
    assert "batch 2, fp32, 1 rank, seed 0, capacity 480 KiB, hardware v100-16g" in out
    assert re.search(r"decisions\s+4 blocks: 2 keep, 1 swap, 1 recompute, 0 selective; "
                     r"2 streamed weights, 3 host optimizer", out)
    peak = s.predicted.peak_device_bytes
    assert peak <= s.config.capacity_bytes
    assert re.search(rf"peak\s+{re.escape(format_bytes(peak))} of 480 KiB capacity "
                     rf"\({100 * peak / s.config.capacity_bytes:.1f}%\)", out)
    assert re.search(r"busy\s+compute \S+ us, h2d \S+ us, d2h \S+ us, net 0 s, host \S+ us", out)
    table = out[out.index("#  block"):].splitlines()
    assert table[0].split() == ["#", "block", "act", "weights", "optim", "param", "MiB", "act",
                                "MiB"]
    assert [row.split()[:5] for row in table[1:]] == [
        [str(b.index), b.name, b.act, b.weights, b.optim] for b in s.blocks]


def test_selective_blocks_are_counted_and_listed(capsys, tmp_path):
    """The tiny schedule's recompute block made selective: the same ops, another act."""
    s = tiny_schedule()
    blocks = tuple(dataclasses.replace(b, act="selective", policy=SELECTIVE_POLICY)
                   if b.act == "recompute" else b for b in s.blocks)
    p = tmp_path / "selective.yaml"
    p.write_text(dump_schedule(dataclasses.replace(s, blocks=blocks)))
    code, out, _ = run(capsys, p)
    assert code == 0
    assert re.search(r"decisions\s+4 blocks: 2 keep, 1 swap, 0 recompute, 1 selective;", out)
    table = out[out.index("#  block"):].splitlines()
    assert [row.split()[2] for row in table[1:]] == [b.act for b in blocks]
    info = json.loads(run(capsys, p, "--json")[1])
    assert (info["decisions"]["recompute"], info["decisions"]["selective"]) == (0, 1)
    assert [b["policy"] for b in info["blocks"]] == [b.policy for b in blocks]
    assert {b["policy"] for b in info["blocks"]} == {"", SELECTIVE_POLICY}


def test_over_capacity_is_refused(capsys, tmp_path):
    p = tmp_path / "swap.yaml"
    p.write_text(dump_schedule(tiny_schedule("swap_all", world_size=2)))  # does not fit 480 KiB
    assert_refused(*run(capsys, p), "over config.capacity_bytes 491520 (480 KiB)",
                   "(rule: peak within capacity")


def test_several_ranks(capsys, tmp_path):
    p = tmp_path / "swap.yaml"
    p.write_text(dump_schedule(tiny_schedule("swap_all", 1 << 30, world_size=2)))
    code, out, _ = run(capsys, p)
    assert code == 0
    assert "2 ranks" in out and "scaling" in out


def test_json(capsys, path):
    code, out, _ = run(capsys, path, "--json")
    assert code == 0
    info = json.loads(out)
    assert set(info) == {"schedule", "schedule_sha256", "model", "strategy", "status", "solve_s",
                         "config", "hardware", "decisions", "predicted", "busy_s", "check",
                         "blocks"}
    s = load_schedule(path)
    assert info["schedule_sha256"] == schedule_sha256(s)
    assert info["decisions"] == {"blocks": 4, "keep": 2, "swap": 1, "recompute": 1,
                                 "selective": 0, "kept_on_host": 0, "pairs": 0,
                                 "streamed_weights": 2, "host_optimizer": 3}
    assert info["predicted"]["peak_device_bytes"] == s.predicted.peak_device_bytes
    assert info["predicted"]["peak_fraction_of_capacity"] == pytest.approx(
        s.predicted.peak_device_bytes / 491520)
    assert info["check"]["matches"] is True
    assert list(info["busy_s"]) == ["compute", "h2d", "d2h", "net", "host"]
    assert [b["name"] for b in info["blocks"]] == ["head", "h.0", "h.1", "tail"]


def _edited(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, old
    return text.replace(old, new)


@pytest.mark.parametrize("edit, says", [
    # a longer backward: the step ends later than predicted
    (lambda t: re.sub(r"(kind: backward, block: 1, .*?dur_s: )[^,]+", r"\g<1>0.001", t),
     "predicted.step_s is"),
    # a duration off the critical path: only the stream's busy time gives it away
    (lambda t: re.sub(r"(kind: fetch, block: 3, .*?dur_s: )[^,]+", r"\g<1>3.0e-08", t),
     "predicted.busy_s.h2d is"),
    (lambda t: re.sub(r"(\n  peak_device_bytes: )\d+", r"\g<1>400000", t),
     "but predicted.peak_device_bytes is 400000 (391 KiB)"),
    # a buffer made larger (still within capacity) changes the simulated peak
    (lambda t: re.sub(r"(name: act\.3, block: 3, bytes: )\d+", r"\g<1>20000", t),
     "re-simulating its 23 ops gives 470436 (459 KiB)"),
])
def test_edited_schedule_is_refused(capsys, tmp_path, text, edit, says):
    p = tmp_path / "edited.yaml"
    edited = edit(text)
    assert edited != text
    p.write_text(edited)
    assert_refused(*run(capsys, p), says, "the schedule was edited or is corrupt")


def test_schedule_that_cannot_run_is_refused(capsys, tmp_path, text):
    # act.3 filled by op 19 (block 0's backward) but used by op 7 (block 3's backward)
    edited = re.sub(r"(name: act\.3, block: 3, bytes: \d+, alloc: )\d+", r"\g<1>19", text)
    assert edited != text
    p = tmp_path / "broken.yaml"
    p.write_text(edited)
    assert_refused(*run(capsys, p), "buffer act.3 (buffers[13]) is freed by op 8 (backward of "
                   "block 3 (tail)), which may end before op 19", "(rule: buffer lifetime")


@pytest.mark.parametrize("content, says", [
    ("karma_schedule: 1\nmodel: {a: 1}}\n", "is not valid YAML"),
    ("- a list\n", "a schedule is a YAML mapping"),
    ("karma_schedule: 9\n", "karma_schedule: 9 is not supported by this karma"),
])
def test_bad_files_exit_2_without_traceback(capsys, tmp_path, content, says):
    p = tmp_path / "bad.yaml"
    p.write_text(content)
    assert_refused(*run(capsys, p), f"{p}", says)


def test_a_binary_file_is_not_a_schedule(capsys, tmp_path):
    p = tmp_path / "model.pt"
    p.write_bytes(b"PK\x03\x04\xd0\xcf\x11\xe0" * 8)
    assert_refused(*run(capsys, p), f"schedule file '{p}' is not text",
                   "give the path of a schedule written by karma-plan")


def test_check_validates_each_file(capsys, tmp_path, path, text):
    code, out, err = run(capsys, "--check", path, path)
    assert (code, err) == (0, "")
    assert out == f"ok: {path}\nok: {path}\n"
    edited = tmp_path / "edited.yaml"
    edited.write_text(text.replace("name: head, act: swap", "name: head, act: keep"))
    code, out, err = run(capsys, "--check", path, edited, tmp_path / "none.yaml")
    assert code == 2
    assert out == f"ok: {path}\n"  # and no summary
    lines = err.splitlines()
    assert len(lines) == 2 and "Traceback" not in err
    assert lines[0].startswith(f"karma-inspect: error: {edited}: op ")
    assert "(rule: ops match decisions: blocks[0].act is keep" in lines[0]
    assert lines[1].startswith("karma-inspect: error: schedule file ") and "does not exist" \
        in lines[1]


def test_check_skips_the_resimulation(capsys, tmp_path, text):
    # predicted figures edited: the ops still run as planned, so --check lets it through
    p = tmp_path / "edited.yaml"
    p.write_text(re.sub(r"(\n  peak_device_bytes: )\d+", r"\g<1>400000", text))
    assert run(capsys, "--check", p)[0] == 0
    assert_refused(*run(capsys, p), "but predicted.peak_device_bytes is 400000")


@pytest.mark.parametrize("argv, says", [
    (["--check", "P", "--plot", "x.png"], "--check only validates"),
    (["P", "P"], "karma-inspect summarizes one schedule, got 2; give one, or add --check"),
])
def test_check_misuse(capsys, path, argv, says):
    assert_refused(*run(capsys, *[path if a == "P" else a for a in argv]), says)


def test_missing_file(capsys, tmp_path):
    assert_refused(*run(capsys, tmp_path / "nope.yaml"), "does not exist")


def test_plot_writes_a_png(capsys, tmp_path, path):
    png = tmp_path / "out" / "tiny.png"
    png.parent.mkdir()
    code, out, err = run(capsys, path, "--plot", png)
    assert (code, err) == (0, "")
    assert png.read_bytes().startswith(PNG_SIGNATURE)
    assert png.stat().st_size > 20_000  # a drawn figure, not an empty canvas
    assert sorted(p.name for p in png.parent.iterdir()) == ["tiny.png"]  # no temporary left
    assert f"wrote {png}" in out


def test_plot_into_a_missing_directory(capsys, tmp_path, path):
    assert_refused(*run(capsys, path, "--plot", tmp_path / "no" / "x.png"),
                   "directory", "does not exist")


def test_plot_without_matplotlib(capsys, monkeypatch, tmp_path, path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    png = tmp_path / "x.png"
    assert_refused(*run(capsys, path, "--plot", png),
                   "--plot needs matplotlib: pip install 'karma[plot]'")
    assert not png.exists()


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_a_reader_that_stops_early_ends_it_quietly(json_flag):
    """`karma-inspect s.yaml | head -1`: once the pipe's reader has gone, karma-inspect stops
    with SIGPIPE's status and prints nothing (it printed an internal error)."""
    golden = sorted((ROOT / "schedules").glob("*.yaml"))[0]
    proc = subprocess.Popen([sys.executable, "-m", "karma.cli.inspect", str(golden),
                             *json_flag], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=ROOT)
    proc.stdout.close()  # the reader goes before anything is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141 and err == "", (proc.returncode, err)
