"""A schedule is keyed on the model a file builds, not on the file's bytes
(karma/fingerprint.py): a comment keeps it runnable, a wider layer or another activation
makes it stale, with the karma-plan command that plans it again."""

from __future__ import annotations

import contextlib
import io
import random
import shlex
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml

from karma.cli.inspect import main as inspect_main
from karma.cli.plan import _parser, options_from
from karma.cli.plan import main as plan_main
from karma.errors import ModelFileError
from karma.fingerprint import (
    StaleSchedule,
    check_model,
    code_sha256,
    graph_sha256,
    model_fingerprint,
    model_ref,
    remembering,
)
from karma.modelfile import load_model_file
from karma.planner.options import PlanOptions
from karma.schedule import dump_schedule
from karma.schedule_load import load_schedule
from tests.conftest import MODELS

pytestmark = pytest.mark.usefixtures("restore_environment_and_signals")  # tests/conftest.py

ORIGINAL = (MODELS / "mlp_schedule.py").read_text()
# (what an edit replaces, with what): each leaves the model as it was
COMMENT = ("BATCH_SIZE = 4\n", "# a comment added after planning\nBATCH_SIZE   =   4  # spaced\n")
REFORMAT = ("self.fc = nn.Linear(WIDTH, WIDTH)", "self.fc = nn.Linear(\n            WIDTH,\n"
                                                 "            WIDTH,\n        )")
LEARNING_RATE = ("AdamW(params, lr=1e-2)", "AdamW(params, lr=3e-3)")
BATCH = ("BATCH_SIZE = 4\n", "BATCH_SIZE = 16\n")
# ... and each of these builds another model
WIDER = ("CLASSES = 32,", "CLASSES = 48,")
GELU = ("x = torch.relu(self.inp(x))", "x = torch.nn.functional.gelu(self.inp(x))")
SGD = ("AdamW(params, lr=1e-2)", "SGD(params, lr=1e-2)")
PLAN_FLAGS = ["--hardware", "cpu", "--no-measure", "--gpu-mem", "600M", "--batch-size", "2"]
RECORDED_FLAGS = "--hardware cpu --gpu-mem 600M --batch-size 2 --no-measure"  # as written


def edited(*edits: tuple[str, str]) -> str:
    text = ORIGINAL
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


def write_model(path: Path, *edits: tuple[str, str]):
    path.write_text(edited(*edits))
    return load_model_file(path)


def run_cli(main, *argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


# --- the fingerprint -------------------------------------------------------------------------

def test_the_same_model_has_the_same_fingerprint(tmp_path):
    mf = write_model(tmp_path / "m.py")
    first = model_fingerprint(mf)
    assert model_fingerprint(mf) == first
    assert model_fingerprint(load_model_file(mf.path)).sha256 == first.sha256
    assert len(first.sha256) == 64
    assert any("aten.addmm" in op and "[2, 32]" in op for op in first.ops)  # at batch 2


@pytest.mark.parametrize("edit", [COMMENT, REFORMAT, LEARNING_RATE, BATCH],
                         ids=["comment", "reformat", "learning-rate", "batch-size"])
def test_edits_that_keep_the_model_keep_the_fingerprint(tmp_path, edit):
    planned = model_fingerprint(write_model(tmp_path / "a.py")).sha256
    mf = write_model(tmp_path / "b.py", edit)
    assert mf.sha256 != load_model_file(tmp_path / "a.py").sha256  # the bytes differ
    assert model_fingerprint(mf).sha256 == planned


@pytest.mark.parametrize("edit, part", [(WIDER, "params"), (GELU, "ops"), (SGD, "optimizer")],
                         ids=["width", "activation", "optimizer"])
def test_edits_that_change_the_model_change_the_fingerprint(tmp_path, edit, part):
    planned = model_fingerprint(write_model(tmp_path / "a.py"))
    changed = model_fingerprint(write_model(tmp_path / "b.py", edit))
    assert changed.sha256 != planned.sha256
    assert getattr(changed, part) != getattr(planned, part)


RANDOM_WIDTH = '''
import random

import torch


def build_model():
    return torch.nn.Sequential(torch.nn.Linear(4, random.randrange(8, 10_000)),
                               torch.nn.Dropout(0.5))


def example_batch(batch_size):
    return torch.randn(batch_size, 4), torch.randint(0, 4, (batch_size,))


def loss_fn(output, targets):
    return output.sum()
'''


def test_randomness_neither_changes_it_nor_is_disturbed(tmp_path):
    path = tmp_path / "r.py"
    path.write_text(RANDOM_WIDTH)
    mf = load_model_file(path)
    found = set()
    for seed in (1, 2, 3):
        random.seed(seed)
        torch.manual_seed(seed)
        python_state, torch_state = random.getstate(), torch.get_rng_state()
        found.add(model_fingerprint(mf).sha256)
        assert random.getstate() == python_state
        assert torch.equal(torch.get_rng_state(), torch_state)
    assert len(found) == 1


def test_a_hugging_face_models_mask_checks_read_as_no_padding():
    """Its eager forward reads values (padding_mask.all()), which meta tensors lack
    ([Note: a value read on the meta device])."""
    pytest.importorskip("transformers")
    mf = load_model_file(MODELS / "hf_llama_tiny.py")
    fp = model_fingerprint(mf)
    assert "aten._local_scalar_dense.default -> True" in fp.ops
    assert model_fingerprint(mf) == fp


def test_a_model_whose_forward_needs_real_tensors_is_planned_without_one(tmp_path):
    """The schedule then records no fingerprint, and its file's bytes are checked."""
    path = tmp_path / "m.py"
    path.write_text(RANDOM_WIDTH.replace("def loss_fn(output, targets):\n",
                                         "def loss_fn(output, targets):\n"
                                         "    assert not output.is_meta\n"))
    mf = load_model_file(path)
    with pytest.raises(ModelFileError, match="the forward and loss on the meta device"):
        model_fingerprint(mf)
    assert model_ref(str(path), mf, "{}", ()).graph_sha256 is None


def test_calibrations_are_cached_under_the_code_without_comments(tmp_path):
    """A comment measures nothing again; a constant that changes no model may still change
    its times (the learning rate here; torch.set_num_threads elsewhere), so it does."""
    planned = code_sha256(write_model(tmp_path / "a.py"))
    assert code_sha256(write_model(tmp_path / "b.py", COMMENT, REFORMAT)) == planned
    assert code_sha256(write_model(tmp_path / "c.py", LEARNING_RATE)) != planned


# --- the re-plan command ---------------------------------------------------------------------

def test_the_plan_command_reads_back_as_the_same_options():
    options = PlanOptions(
        gpu_mem="1536M", hardware="h100-80g", batch_size=4, world_size=8, nproc_per_node=4,
        host_mem=(512 << 30) + 1, host_state="sharded", dtype="bf16", accumulate=2,
        clip_grad_norm=0.5, strategy="greedy", seed=3, time_limit_s=9.5, gap=0.02,
        blocks="h\\.\\d+ ", measure="estimate", host_optimizer="as-given", selective=False,
        pairs=False)
    command = options.plan_command("my models/m.py")
    argv = shlex.split(command)
    assert argv[:4] == ["karma-plan", "my models/m.py", "--hardware", "h100-80g"]
    assert "--gpu-mem 1536M" in command and "--no-measure" in command
    assert "--no-selective" in command and "--no-pairs" in command
    assert options_from(_parser().parse_args(argv[1:])) == options
    for measure in ("cached", "fresh"):
        o = replace(options, measure=measure, selective=True, pairs=True)
        assert options_from(_parser().parse_args(shlex.split(o.plan_command("m.py"))[1:])) == o


def test_default_options_write_the_hardware_and_what_was_given():
    assert PlanOptions(hardware="v100-16g").plan_command("m.py") == \
        "karma-plan m.py --hardware v100-16g"
    if not torch.cuda.is_available():  # without --hardware: this machine's, by name
        assert PlanOptions().plan_command("m.py") == "karma-plan m.py --hardware cpu"
    assert PlanOptions(gpu_mem=1000, hardware="cpu").plan_command("m.py") == \
        "karma-plan m.py --hardware cpu --gpu-mem 1000"


# --- planned, edited, run --------------------------------------------------------------------

@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """The MLP planned by karma-plan: (its model file, the schedule file)."""
    d = tmp_path_factory.mktemp("fingerprint")
    model, schedule = d / "mlp.py", d / "S.yaml"
    model.write_text(ORIGINAL)
    code, _, err = run_cli(plan_main, model, *PLAN_FLAGS, "-o", schedule)
    assert code == 0, err
    return model, schedule


@pytest.fixture
def model_as(planned):
    """Rewrite the planned model file with edits; restored afterwards."""
    model, _ = planned
    yield lambda *edits: model.write_text(edited(*edits))
    model.write_text(ORIGINAL)


def test_the_schedule_records_the_fingerprint_and_the_command(planned):
    model, schedule = planned
    s = load_schedule(schedule)
    assert s.model.graph_sha256 == model_fingerprint(load_model_file(model)).sha256
    assert s.model.plan_command == f"karma-plan {model} {RECORDED_FLAGS}"
    code, out, _ = run_cli(inspect_main, schedule)
    assert code == 0
    assert f"planned by  {s.model.plan_command} -o {schedule}" in out


def test_a_comment_keeps_the_schedule_runnable(planned, model_as):
    from karma.cli.run import main as run_main

    _, schedule = planned
    model_as(COMMENT, REFORMAT)
    code, out, err = run_cli(run_main, schedule, "--steps", 2)
    assert code == 0, err
    assert "step 2/2" in out
    assert "has changed since the schedule was planned, but the model it builds has not" in err
    code, out, err = run_cli(inspect_main, "--check", schedule)
    assert (code, out) == (0, f"ok: {schedule}\n")
    assert err.startswith(f"karma-inspect: note: {schedule}: model file ")


def test_a_wider_layer_is_refused_with_the_command_that_plans_it_again(planned, model_as):
    from karma.cli.run import main as run_main

    model, schedule = planned
    model_as(WIDER)
    code, out, err = run_cli(run_main, schedule, "--steps", 2)
    assert code == 2 and "step 1/" not in out
    assert "Traceback" not in err and err.count("\n") == 1
    assert err.startswith("karma-run: error: the schedule is stale: model file ")
    assert "the parameters of block 0 (head) hold 3.19 KiB now, 2.12 KiB when planned " \
           "(inp.weight float32[48, 16]" in err
    replan = err.split("re-plan it: ")[1].strip()
    assert replan == f"karma-plan {model} {RECORDED_FLAGS} -o {schedule}"
    code, out, err = run_cli(inspect_main, "--check", schedule)
    assert code == 2 and out == ""
    assert err.startswith(f"karma-inspect: error: {schedule}: the schedule is stale: ")
    assert f"re-plan it: {replan}" in err
    # the command plans the wider model, and its schedule checks out
    fresh = schedule.with_name("fresh.yaml")
    code, _, err = run_cli(plan_main, *shlex.split(replan)[1:-1], fresh)
    assert code == 0, err
    assert run_cli(inspect_main, "--check", fresh)[0] == 0


def test_another_activation_is_refused(planned, model_as):
    _, schedule = planned
    model_as(GELU)
    s = load_schedule(schedule)
    with pytest.raises(StaleSchedule, match="its parameters are as planned, but its "
                                            "operations"):
        check_model(s, load_model_file(s.model.path), schedule)


def test_a_schedule_without_a_fingerprint_needs_the_same_bytes(planned, model_as, tmp_path):
    _, schedule = planned
    older = tmp_path / "older.yaml"
    data = yaml.safe_load(schedule.read_text())
    del data["model"]["graph_sha256"]
    older.write_text(dump_schedule(load_schedule(yaml.safe_dump(data, sort_keys=False))))
    s = load_schedule(older)
    assert s.model.graph_sha256 is None
    notes = []
    check_model(s, load_model_file(s.model.path), older, notes.append)  # the same bytes
    assert notes == []
    model_as(COMMENT)
    with pytest.raises(StaleSchedule, match="records no fingerprint of the model") as info:
        check_model(s, load_model_file(s.model.path), older)
    assert str(info.value).endswith(f"{s.model.plan_command} -o {older}")


def test_one_planning_computes_the_fingerprint_once(monkeypatch):
    """Inside remembering(mf) (karma.api's planning: model_ref, and the calibration keys of
    a model object) the fingerprint is computed once; outside, every call looks again."""
    import karma.fingerprint as fingerprint

    mf = load_model_file(MODELS / "mlp_schedule.py")
    made = []
    real = fingerprint.model_fingerprint
    monkeypatch.setattr(fingerprint, "model_fingerprint", lambda m: made.append(m) or real(m))
    with remembering(mf):
        first = graph_sha256(mf)
        assert graph_sha256(mf) == first and len(made) == 1
    assert graph_sha256(mf) == first and len(made) == 2
