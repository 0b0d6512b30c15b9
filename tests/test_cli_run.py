"""karma-run: plan then train end to end, its progress lines and report, and bad input
(each a non-zero exit with a one-line message and no traceback)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from karma.cli.run import main
from karma.runtime.checkpoints.export import model_state_dict
from karma.runtime.loop import open_model_file
from karma.schedule import dump_schedule
from karma.schedule_load import load_schedule
from karma.testing.exactness import assert_bitwise_equal, load_with_env, plan, reference_train
from karma.units import format_bytes
from tests.conftest import EXAMPLES, ROOT
from tests.runtime_helpers import LAYERS_MODEL, load_small
from tests.schedule_fixtures import tiny_schedule

BIN = Path(sys.executable).parent
REPORT_KEYS = {"steps", "losses", "lrs", "step_s_median", "predicted_step_s",
               "peak_device_bytes", "predicted_peak_device_bytes"}
PROGRESS = re.compile(
    r"^step (?P<step>\d+)/(?P<total>\d+)\s+loss (?P<loss>\d+\.\d+)\s+lr (?P<lr>\S+)\s+"
    r"(?P<time>[\d.]+ (?:s|ms|us|µs|ns))/step .*\s(?P<rate>[\d.]+) samples/s\s+"
    r"peak (?P<peak>[\d.]+ (?:B|KiB|MiB|GiB|TiB))")


def command(name: str) -> list[str]:
    """The installed console script, or the module when it is not installed."""
    script = BIN / name
    return [str(script)] if script.exists() else [sys.executable, "-m",
                                                   f"karma.cli.{name.split('-')[1]}"]


def karma(name: str, *argv, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*command(name), *map(str, argv)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})})


@pytest.fixture(autouse=True)
def restore_environment():
    """karma-run sets the schedule's KARMA_* variables in os.environ; undo that."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


# --- end to end ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def end_to_end(tmp_path_factory):
    """karma-plan then karma-run, as a user types them: (tmp dir, plan result, run result)."""
    d = tmp_path_factory.mktemp("e2e")
    planned = karma("karma-plan", "examples/gpt.py", "--hardware", "cpu", "--gpu-mem", "8M",
                    "-o", d / "S.yaml", env={"KARMA_GPT": "tiny"})
    assert planned.returncode == 0, planned.stderr
    ran = karma("karma-run", d / "S.yaml", "--steps", 3, "--report", d / "R.json",
                "--checkpoint-dir", d / "C")
    return d, planned, ran


@pytest.mark.slow
def test_plan_then_run_end_to_end(end_to_end):
    d, planned, ran = end_to_end
    assert ran.returncode == 0, ran.stderr
    assert "Traceback" not in ran.stderr
    report = json.loads((d / "R.json").read_text())
    assert REPORT_KEYS <= report.keys()
    assert report["steps"] == [1, 2, 3]
    assert report["step_s_median"] > 0 and report["predicted_step_s"] > 0
    assert report["peak_device_bytes"] > 0 and report["predicted_peak_device_bytes"] > 0

    progress = [m for line in ran.stdout.splitlines() if (m := PROGRESS.match(line))]
    assert [int(m["step"]) for m in progress] == [1, 2, 3], ran.stdout
    assert all(m["total"] == "3" and float(m["rate"]) > 0 for m in progress)
    assert [m["loss"] for m in progress] == [f"{x:.4f}" for x in report["losses"]]
    assert [float(m["lr"]) for m in progress] == report["lrs"] == [1e-3] * 3  # gpt's AdamW

    # through the command line too, training equals plain PyTorch bit for bit
    mf = load_small("gpt")
    ref_sd, ref_losses = reference_train(mf, 4, 3, schedule=load_schedule(d / "S.yaml"))
    assert report["losses"] == ref_losses
    assert_bitwise_equal(model_state_dict(d / "C" / "step_3"), ref_sd)


@pytest.mark.slow
def test_reported_peak_is_the_schedules_memory_not_one_time_imports(end_to_end):
    d, _, ran = end_to_end
    assert ran.returncode == 0, ran.stderr
    report = json.loads((d / "R.json").read_text())
    assert report["peak_device_bytes"] < report["predicted_peak_device_bytes"] + (16 << 20)


@pytest.mark.slow
def test_the_memory_outside_the_plans_tensors_is_measured_and_said(end_to_end):
    # what the process held outside its tensors at a step's start (thread pools, small
    # tensors, Python objects): measured where the CPU cache runs, and planned from what the
    # calibration's keep_all steps measured of it ([Note: the process's own memory])
    d, _, ran = end_to_end
    report = json.loads((d / "R.json").read_text())
    if "CPU cache:" not in ran.stdout:
        pytest.skip("karma's CPU cache is not built here: nothing separates the tensors")
    assert 0 < report["outside_private_bytes"] < 256 << 20
    planned = load_schedule(d / "S.yaml").process_bytes
    assert 0 < report["planned_outside_bytes"] == planned < 256 << 20
    assert "of the process was outside its tensors at a step's start" in ran.stdout
    assert f"planned as {format_bytes(planned)}" in ran.stdout


# --- bad input -----------------------------------------------------------------------------

@pytest.fixture
def schedule_for(tmp_path):
    """Write gpt tiny's schedule, planned for the model file at `model_path`, to tmp_path.

    The copy has the bytes of examples/gpt.py, so its fingerprint is the one the schedule
    holds: writing the copy's path into it is what planning against the copy writes.
    """
    schedule = plan(load_small("gpt"), "ilp", 0.6)

    def write(model_path: Path | None = None) -> Path:
        s = schedule if model_path is None else replace(
            schedule, model=replace(schedule.model, path=str(model_path)))
        path = tmp_path / "S.yaml"
        path.write_text(dump_schedule(s))
        return path
    return write


def copy_of_gpt(tmp_path) -> Path:
    copy = tmp_path / "gpt_copy.py"
    shutil.copy(EXAMPLES / "gpt.py", copy)
    return copy


def run_main(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, out: str, err: str, expected: str) -> None:
    assert code != 0
    assert "Traceback" not in err and "Traceback" not in out
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("karma-run: error: "), err
    assert expected in lines[0], err
    assert "step 1/" not in out  # nothing trained


def test_malformed_yaml(tmp_path, capsys):
    s = tmp_path / "S.yaml"
    s.write_text("karma_schedule: 1\nmodel: {path: [examples/gpt.py\n")
    assert_one_line_error(*run_main(capsys, s, "--steps", 1), "is not valid YAML")


def test_unknown_schedule_version(schedule_for, capsys):
    s = schedule_for()
    text = s.read_text()
    assert "\nkarma_schedule: 2\n" in text
    s.write_text(text.replace("\nkarma_schedule: 2\n", "\nkarma_schedule: 99\n"))
    assert_one_line_error(*run_main(capsys, s, "--steps", 1), "karma_schedule: 99 is not supported")


def test_unknown_schedule_version_from_the_console_script(schedule_for):
    s = schedule_for()
    s.write_text(s.read_text().replace("\nkarma_schedule: 2\n", "\nkarma_schedule: 99\n"))
    done = karma("karma-run", s, "--steps", 1)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert "karma_schedule: 99 is not supported" in done.stderr


def test_a_keep_block_whose_ops_swap_it_is_refused_before_the_model_is_built(
        tmp_path, capsys, monkeypatch):
    """A failure once met: block 3's act said keep while its ops still swapped it
    out, and karma-run ended in "internal error: KeyError: 3"."""
    import karma.runtime.loop

    def built(*args):
        raise AssertionError("the model file was opened")

    monkeypatch.setattr(karma.runtime.loop, "open_model_file", built)
    text = dump_schedule(tiny_schedule())
    assert text.count("name: head, act: swap") == 1
    s = tmp_path / "S.yaml"
    s.write_text(text.replace("name: head, act: swap", "name: head, act: keep"))
    code, out, err = run_main(capsys, s, "--steps", 1)
    assert code == 2
    assert_one_line_error(code, out, err, "is one swap_out too many for block 0 (head) (rule: "
                                          "ops match decisions: blocks[0].act is keep")
    assert out == ""


def test_a_parameter_the_model_lacks_is_refused(schedule_for, capsys):
    s = schedule_for()
    text = s.read_text()
    name = plan(load_small("gpt"), "ilp", 0.6).blocks[1].params[0]  # as schedule_for writes
    assert text.count(f"params: [{name},") == 1
    s.write_text(text.replace(f"params: [{name},", f"params: [{name}_renamed,"))
    code, out, err = run_main(capsys, s, "--steps", 1)
    assert code == 2
    assert_one_line_error(code, out, err, f"blocks[1].params: '{name}_renamed' is not in the "
                                          "model (rule: parameters named once")


def test_a_host_tier_larger_than_the_machine_is_refused_at_start(tmp_path, capsys,
                                                                 monkeypatch):
    """The numbers, before the model is built, instead of a kill mid-step."""
    import karma.runtime.bringup

    def built(*args, **kwargs):
        raise AssertionError("the host tier was allocated")

    monkeypatch.setattr(karma.runtime.bringup, "HostPool", built)
    monkeypatch.setenv("KARMA_TIER_DIR", str(tmp_path))  # the tier's directory, named in it
    schedule = plan(load_small("gpt"), "ilp", 0.6)
    huge = replace(schedule, predicted=replace(schedule.predicted, host_bytes=10 << 40))
    s = tmp_path / "S.yaml"
    s.write_text(dump_schedule(huge))
    code, out, err = run_main(capsys, s, "--steps", 1)
    assert code == 2
    assert_one_line_error(code, out, err, "the schedule's host tier needs 10.0 TiB of disk, but "
                                          f"{tmp_path}, where the CPU backend keeps it as a "
                                          "file, has ")
    assert out == ""


def test_missing_schedule_file(tmp_path, capsys):
    assert_one_line_error(*run_main(capsys, tmp_path / "none.yaml"), "does not exist")


def test_model_file_changed_since_planning(schedule_for, tmp_path, capsys):
    """A comment keeps the schedule (the model is the same); a wider model is refused with
    the command that plans it again (tests/test_fingerprint.py has the rest)."""
    copy = copy_of_gpt(tmp_path)
    s = schedule_for(copy)

    notes = []
    open_model_file(load_schedule(s), s, notes.append)  # unedited, the copy matches
    with open(copy, "a") as f:
        f.write("# an edit after planning\n")
    open_model_file(load_schedule(s), s, notes.append)
    assert len(notes) == 1 and "but the model it builds has not" in notes[0]
    text = copy.read_text()
    copy.write_text(text.replace('"tiny": (2, 2, 32,', '"tiny": (2, 2, 64,'))
    assert_one_line_error(*run_main(capsys, s, "--steps", 1),
                          "the schedule is stale: model file ")


def test_missing_model_file(schedule_for, tmp_path, capsys):
    copy = copy_of_gpt(tmp_path)
    s = schedule_for(copy)
    copy.unlink()
    assert_one_line_error(*run_main(capsys, s, "--steps", 1), "does not exist")


def test_unwritable_checkpoint_dir(schedule_for, tmp_path, capsys):
    (tmp_path / "file.txt").write_text("a file, not a directory\n")
    assert_one_line_error(*run_main(capsys, schedule_for(), "--steps", 1, "--checkpoint-dir",
                                    tmp_path / "file.txt" / "ckpt"), "is not writable")


def test_resume_without_checkpoint_dir(schedule_for, capsys):
    assert_one_line_error(*run_main(capsys, schedule_for(), "--steps", 1, "--resume"),
                          "--resume needs --checkpoint-dir")


def test_negative_checkpoint_every(schedule_for, capsys):
    assert_one_line_error(*run_main(capsys, schedule_for(), "--checkpoint-every", "-1"),
                          "--checkpoint-every -1")


def test_resume_from_the_command_line(schedule_for, tmp_path, capsys):
    s, ckpt = schedule_for(), tmp_path / "ckpt"
    assert run_main(capsys, s, "--steps", 2, "--checkpoint-dir", ckpt)[0] == 0
    code, out, _ = run_main(capsys, s, "--steps", 3, "--checkpoint-dir", ckpt, "--resume",
                            "--report", tmp_path / "R.json")
    assert code == 0
    assert "resumed from" in out and "step 1/" not in out and "step 3/3" in out
    report = json.loads((tmp_path / "R.json").read_text())
    _, ref_losses = reference_train(load_small("gpt"), 4, 3, schedule=load_schedule(s))
    assert report["steps"] == [3] and report["losses"] == ref_losses[2:]


# --- divergence ----------------------------------------------------------------------------

@pytest.fixture
def layers_schedule(tmp_path):
    model = tmp_path / "layers.py"
    model.write_text(LAYERS_MODEL)
    s = tmp_path / "S.yaml"
    s.write_text(dump_schedule(plan(load_with_env(model), "offload_all")))
    return s


def test_divergence_stops_training_with_a_message(layers_schedule, tmp_path, capsys,
                                                  monkeypatch):
    assert run_main(capsys, layers_schedule, "--steps", 1)[0] == 0  # as planned: trains
    monkeypatch.setenv("LAYER_ORDER", "2,1,0")
    code, out, err = run_main(capsys, layers_schedule, "--steps", 2, "--checkpoint-dir",
                              tmp_path / "ckpt")
    assert code != 0
    assert "Traceback" not in err
    assert "diverged from the schedule" in err
    assert "step 1/" not in out and not (tmp_path / "ckpt" / "step_2").exists()


def test_divergence_is_reported_as_bad_input(layers_schedule, capsys, monkeypatch):
    monkeypatch.setenv("LAYER_ORDER", "2,1,0")
    code, out, err = run_main(capsys, layers_schedule, "--steps", 1)
    assert_one_line_error(code, out, err, "diverged from the schedule")
    assert code == 2 and "bug in karma" not in err


def test_a_cuda_schedule_without_a_gpu(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    path = tmp_path / "cuda.yaml"
    path.write_text(dump_schedule(plan(load_small("gpt"), "keep_all", hardware="v100-16g")))
    assert_one_line_error(*run_main(capsys, path, "--steps", 1),
                          "planned for a CUDA GPU and none is available here")


def test_nccl_on_a_cpu_schedule_is_refused(schedule_for, capsys):
    assert_one_line_error(*run_main(capsys, schedule_for(), "--steps", 1, "--dist-backend",
                                    "nccl"), "--dist-backend nccl all-reduces CUDA tensors")


def test_a_device_cap_that_is_not_a_size_is_refused(schedule_for, capsys):
    assert_one_line_error(*run_main(capsys, schedule_for(), "--steps", 1,
                                    "--cap-device-memory", "16Q"),
                          "--cap-device-memory '16Q' is not a size")


@pytest.mark.parametrize("calibration, ratio, said", [
    ("measured", 1.6, True), ("measured", 0.7, True), ("measured", 1.2, False),
    (None, 1.6, False),  # the roofline: its error is not the machine's drift
])
def test_a_measured_plan_far_off_its_time_suggests_remeasuring(tmp_path, capsys, monkeypatch,
                                                               calibration, ratio, said):
    # [Note: a machine whose speed drifts] (karma/calibrate)
    import karma.runtime.loop
    from karma.runtime.loop import RunReport

    s = tiny_schedule()
    s = replace(s, predicted=replace(s.predicted, calibration=calibration))
    path = tmp_path / "S.yaml"
    path.write_text(dump_schedule(s))
    predicted = s.predicted.step_s

    def trained(schedule, mf, options):
        return RunReport(steps=[1, 2, 3], losses=[1.0] * 3, step_s=[predicted * ratio] * 3,
                         lrs=[None] * 3, grad_norms=[None] * 3, peak_device_bytes=1,
                         predicted_step_s=predicted, predicted_peak_device_bytes=1,
                         capacity_bytes=1, host_tier_peak_bytes=0, batch_size=2,
                         baseline_private_bytes=0, baseline_data_bytes=0)

    monkeypatch.setattr(karma.runtime.loop, "open_model_file", lambda *args: None)
    monkeypatch.setattr(karma.runtime.loop, "train", trained)
    code, out, _ = run_main(capsys, path, "--steps", 3)
    assert code == 0 and out.startswith("done: 3 steps")
    assert (f"note: the steps took {ratio:.2f}x the predicted time" in out) == said
    assert "drifts" in out if said else "note:" not in out
    assert ("karma-plan --remeasure" in out) == said
