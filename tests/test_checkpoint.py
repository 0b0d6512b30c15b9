"""Checkpoints as files: karma-export, and damaged or foreign checkpoints at --resume.

(Resuming exactly, on one rank and on several, at the same or another world size:
tests/test_runtime.py and tests/test_distributed.py.)
"""

from __future__ import annotations

import json
import signal

import pytest
import torch

from karma.cli.export import main as export_main
from karma.cli.run import main as run_main
from karma.runtime.checkpoints.dcp_state import consolidated_optimizer
from karma.runtime.checkpoints.export import model_state_dict
from karma.schedule import dump_schedule
from karma.schedule_load import load_schedule
from karma.testing.exactness import assert_bitwise_equal, plan, run
from tests.runtime_helpers import load_small

pytestmark = pytest.mark.usefixtures("restore_environment_and_signals")  # tests/conftest.py


@pytest.fixture
def trained(tmp_path):
    """The tiny GPT (tied embedding) trained 2 steps under offload_all, checkpointed."""
    mf = load_small("gpt")
    schedule = plan(mf, "offload_all")
    path = tmp_path / "S.yaml"
    path.write_text(dump_schedule(schedule))
    run(schedule, mf, 2, checkpoint_dir=tmp_path / "ckpt")
    return mf, path, tmp_path / "ckpt"


def cli(main, capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# --- karma-export --------------------------------------------------------------------------

def test_export_writes_a_state_dict_the_user_s_own_model_loads(trained, tmp_path, capsys):
    mf, _, ckpt = trained
    code, out, err = cli(export_main, capsys, ckpt, "-o", tmp_path / "model.pt")
    assert code == 0, err
    assert f"from {ckpt / 'step_2'}" in out
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    fresh = mf.build_model()
    assert list(state) == list(fresh.state_dict())  # tied weights under both names
    fresh.load_state_dict(state, strict=True)
    assert_bitwise_equal(state, model_state_dict(ckpt / "step_2"))


def test_export_as_safetensors_with_the_whole_optimizer_state(trained, tmp_path, capsys):
    from safetensors.torch import load_file

    mf, _, ckpt = trained
    out_file = tmp_path / "model.safetensors"
    code, out, err = cli(export_main, capsys, ckpt / "step_2", "-o", out_file, "--optimizer")
    assert code == 0, err
    fresh = mf.build_model()
    fresh.load_state_dict(load_file(str(out_file)), strict=True)
    saved = model_state_dict(ckpt / "step_2")
    assert_bitwise_equal(dict(fresh.state_dict()), saved)
    opt = torch.load(tmp_path / "model.optimizer.pt", weights_only=True)
    names = {n for n, _ in fresh.named_parameters()}
    assert set(opt["state"]) == names
    whole = consolidated_optimizer(ckpt / "step_2" / "state")
    for name in names:
        assert opt["state"][name]["exp_avg"].shape == fresh.state_dict()[name].shape
        assert torch.equal(opt["state"][name]["exp_avg_sq"], whole[name]["exp_avg_sq"])
    assert set(opt["optimizers"]) == {"AdamW"}
    assert all(g[0]["lr"] == 1e-3 for g in opt["param_groups"] if g)


EXPORT_BAD = [
    ("nothing", "holds no complete checkpoint"),
    ("ckpt/step_2/state", "holds no complete checkpoint"),
]


@pytest.mark.parametrize("where,expected", EXPORT_BAD, ids=[w for w, _ in EXPORT_BAD])
def test_export_of_no_checkpoint_is_one_line(trained, tmp_path, capsys, where, expected):
    (tmp_path / "nothing").mkdir()
    code, out, err = cli(export_main, capsys, tmp_path / where, "-o", tmp_path / "m.pt")
    assert code == 2 and expected in err and "Traceback" not in err
    assert not (tmp_path / "m.pt").exists()


# --- resuming from damaged or foreign checkpoints ------------------------------------------

def damage(step_dir, how: str) -> None:
    shard = step_dir / "state" / "__0_0.distcp"
    if how == "missing shard":
        shard.unlink()
    elif how == "truncated shard":
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size // 2)
    elif how == "another optimizer":
        extras = torch.load(step_dir / "extras.pt", weights_only=True)
        extras["optimizers"] = ["SGD" if o else o for o in extras["optimizers"]]
        torch.save(extras, step_dir / "extras.pt")
    elif how == "another model":
        meta = json.loads((step_dir / "meta.json").read_text())
        (step_dir / "meta.json").write_text(json.dumps({**meta, "model_sha256": "0" * 64}))
    elif how == "truncated metadata":
        metadata = step_dir / "state" / ".metadata"
        with open(metadata, "r+b") as f:
            f.truncate(metadata.stat().st_size // 2)


DAMAGE = [("missing shard", "a shard is missing or damaged"),
          ("truncated shard", "a shard is missing or damaged"),
          ("another optimizer", "holds the state of a SGD for block 0, but the model file's "
                                "make_optimizer makes a AdamW"),
          ("another model", "was written by another model file"),
          ("truncated metadata", "a shard is missing or damaged")]


@pytest.mark.parametrize("how,expected", DAMAGE, ids=[h for h, _ in DAMAGE])
def test_resuming_from_a_damaged_or_foreign_checkpoint_is_one_line(trained, capsys, how,
                                                                     expected):
    _, schedule, ckpt = trained
    damage(ckpt / "step_2", how)
    code, out, err = cli(run_main, capsys, schedule, "--steps", 3, "--checkpoint-dir", ckpt,
                         "--resume")
    assert code == 2, err
    assert err.startswith("karma-run: error: ") and expected in err, err
    assert "Traceback" not in err and "step 3/3" not in out


@pytest.mark.parametrize("meta", [[1, 2], {"step": "two", "complete": True},
                                  {"complete": True}, {"step": 99, "complete": True}],
                         ids=["a list", "a step not a number", "no step", "another step"])
def test_a_checkpoint_whose_meta_is_not_its_own_is_passed_over(trained, capsys, meta):
    """A meta.json that does not say step_2 is step 2, complete, is not a complete
    checkpoint: --resume takes the one before (it ended in an internal error, or resumed at
    the step the file claimed)."""
    from karma.runtime.checkpoints.checkpoint import latest_checkpoint

    mf, schedule, ckpt = trained
    run(load_schedule(schedule), mf, 1, checkpoint_dir=ckpt / "one")
    step_1 = ckpt / "one" / "step_1"
    step_1.rename(ckpt / "step_1")
    (ckpt / "step_2" / "meta.json").write_text(json.dumps(meta))
    assert latest_checkpoint(ckpt) == ckpt / "step_1"
    code, out, err = cli(run_main, capsys, schedule, "--steps", 2, "--checkpoint-dir", ckpt,
                         "--resume")
    assert code == 0 and "Traceback" not in err, err
    assert f"resumed from {ckpt / 'step_1'} (step 1)" in out and "step 2/2" in out


def test_a_checkpoint_of_other_shapes_is_not_called_damaged(trained, tmp_path, capsys):
    """The same model file at another width (its environment) has the same entries, of
    other shapes: the message says so, not that a shard is damaged (whose advice, to delete
    the checkpoint, would throw good ones away)."""
    from karma.testing.exactness import load_with_env

    _, _, ckpt = trained
    wider = load_with_env("examples/gpt.py", {"KARMA_GPT": "2x48x2x128", "KARMA_SEQ": "32"})
    path = tmp_path / "wider.yaml"
    path.write_text(dump_schedule(plan(wider, "offload_all")))
    code, out, err = cli(run_main, capsys, path, "--steps", 3, "--checkpoint-dir", ckpt,
                         "--resume")
    assert code == 2 and "Traceback" not in err, err
    assert "holds tensors of other shapes than this model's" in err and "damaged" not in err


def test_a_resume_with_nothing_left_to_train_says_so(trained, capsys):
    _, schedule, ckpt = trained
    code, out, err = cli(run_main, capsys, schedule, "--steps", 1, "--checkpoint-dir", ckpt,
                         "--resume")
    assert code == 2 and "Traceback" not in err, err
    assert "was taken after step 2, and --steps 1 ends there: nothing is left to train; give " \
        "--steps more than 2" in err


def test_one_run_writes_a_checkpoint_directory_at_a_time(trained, capsys):
    """A second run into a directory another run is writing stops before it trains; the
    first run clears what killed writes left hidden there."""
    from karma.runtime.checkpoints.dir_lock import DirectoryLock

    _, schedule, ckpt = trained
    (ckpt / ".step_7.tmp" / "state").mkdir(parents=True)  # a killed write's leftovers
    (ckpt / ".step_2.old123").mkdir()
    other = DirectoryLock(ckpt)
    assert other.acquire() is None  # another run holds the directory
    assert not (ckpt / ".step_7.tmp").exists() and not (ckpt / ".step_2.old123").exists()
    try:
        code, out, err = cli(run_main, capsys, schedule, "--steps", 3, "--checkpoint-dir",
                             ckpt, "--resume")
    finally:
        other.release()
    assert code == 2 and "step 3/3" not in out, err
    assert f"is writing checkpoints in {ckpt}; wait for it to end, or choose another " \
        "--checkpoint-dir" in err
    code, out, err = cli(run_main, capsys, schedule, "--steps", 3, "--checkpoint-dir", ckpt,
                         "--resume")
    assert code == 0 and "step 3/3" in out, err


def test_a_run_killed_while_saving_resumes_from_the_checkpoint_before(trained, tmp_path):
    """karma-run killed (SIGKILL) after writing step 2's shards, before the
    checkpoint is in place: step 1's is the newest complete one, and --resume takes it."""
    import subprocess
    import sys

    from karma.runtime.checkpoints.checkpoint import latest_checkpoint
    from tests.conftest import ROOT

    _, schedule, _ = trained
    ckpt = tmp_path / "killed"
    dies = (
        "import os, signal, sys\n"
        "import karma.runtime.checkpoints.dcp_state as d\n"
        "real = d.save\n"
        "def save(model, engine, ranks, directory, standalone):\n"
        "    real(model, engine, ranks, directory, standalone)\n"
        "    if '.step_2.' in str(directory):\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "d.save = save\n"
        "from karma.cli.run import main\n"
        f"sys.exit(main([{str(schedule)!r}, '--steps', '3', '--checkpoint-every', '1',\n"
        f"               '--checkpoint-dir', {str(ckpt)!r}]))\n")
    done = subprocess.run([sys.executable, "-c", dies], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    assert (ckpt / ".step_2.tmp" / "state").is_dir()  # its shards were written
    assert latest_checkpoint(ckpt) == ckpt / "step_1"
    resumed = subprocess.run([sys.executable, "-m", "karma.run", str(schedule), "--steps", "3",
                              "--checkpoint-dir", str(ckpt), "--resume"], cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed from {ckpt / 'step_1'} (step 1)" in resumed.stdout
    assert latest_checkpoint(ckpt) == ckpt / "step_3"


def test_an_exported_hugging_face_model_round_trips_through_from_pretrained(tmp_path, capsys):
    """karma-export of an unmodified Hugging Face GPT-2: the keys are the model's own, so
    load_state_dict, save_pretrained and from_pretrained give back the trained weights."""
    pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from karma.testing.exactness import load_with_env
    from tests.conftest import EXAMPLES

    mf = load_with_env(EXAMPLES / "hf_gpt2.py", {"KARMA_HF": "tiny"})
    run(plan(mf, "offload_all"), mf, 1, checkpoint_dir=tmp_path / "ckpt")
    code, _, err = cli(export_main, capsys, tmp_path / "ckpt", "-o", tmp_path / "m.safetensors")
    assert code == 0, err
    model = mf.build_model()
    model.load_state_dict(load_file(str(tmp_path / "m.safetensors")), strict=True)
    model.save_pretrained(tmp_path / "trained")
    again = type(model).from_pretrained(tmp_path / "trained")
    assert_bitwise_equal(dict(again.state_dict()), model_state_dict(tmp_path / "ckpt" / "step_1"))
