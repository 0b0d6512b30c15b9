"""Learning-rate schedules: the model file's make_scheduler(optimizer), one scheduler driving
every block's optimizer (karma/runtime/params/lr.py), bitwise equal to the plain loop's
`opt.step(); sched.step()`, continued exactly by --resume.

tests/models/mlp_schedule.py: warmup (factor 0 at step 0) then cosine, by LambdaLR; with
KARMA_SCHEDULE=onecycle, SGD under OneCycleLR, which schedules the momentum as well.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

import karma
from karma.cli.plan import main as plan_main
from karma.cli.run import main as run_main
from karma.reference import train_reference
from karma.runtime.checkpoints.export import model_state_dict
from karma.testing.exactness import (
    assert_bitwise_equal,
    host_stepped,
    load_with_env,
    plan,
    reference_train,
    run,
)
from tests.conftest import MODELS, environment
from tests.matrix import ONE_BUDGET, strategy_cells
from tests.runtime_helpers import load_small

MODEL = MODELS / "mlp_schedule.py"
STEPS = 4


@functools.cache
def _load(kind: str = "warmup_cosine"):
    """tests/models/mlp_schedule.py with this KARMA_SCHEDULE, loaded once."""
    return load_with_env(MODEL, {"KARMA_SCHEDULE": kind})


def _model_pt(directory, step: int) -> dict[str, torch.Tensor]:
    return model_state_dict(directory / f"step_{step}")


@pytest.mark.parametrize("strategy,fraction", strategy_cells(ONE_BUDGET))
def test_every_strategy_follows_the_schedule_bitwise(strategy, fraction, tmp_path):
    mf = _load()
    schedule = plan(mf, strategy, fraction)
    if strategy == "offload_all":  # every block's optimizer steps on the host, mid-backward
        assert {b.optim for b in schedule.blocks} == {"host"}
    report = run(schedule, mf, STEPS, checkpoint_dir=tmp_path)
    ref = train_reference(mf, schedule.config.batch_size, STEPS, **host_stepped(schedule))
    assert report.losses == ref.losses
    assert report.lrs == ref.lrs
    assert ref.lrs[0] == 0.0 and len(set(ref.lrs)) == STEPS  # warmup from 0, then changing
    assert_bitwise_equal(_model_pt(tmp_path, STEPS), ref.model.state_dict())


@pytest.mark.parametrize("strategy", ["keep_all", "offload_all"])
def test_a_schedule_of_momentum_too(strategy, tmp_path):
    """OneCycleLR cycles SGD's momentum as well as its lr: every scheduled value reaches
    every block's optimizer."""
    mf = _load("onecycle")
    schedule = plan(mf, strategy)
    report = run(schedule, mf, STEPS, checkpoint_dir=tmp_path)
    ref = train_reference(mf, schedule.config.batch_size, STEPS, **host_stepped(schedule))
    assert report.losses == ref.losses and report.lrs == ref.lrs
    assert_bitwise_equal(_model_pt(tmp_path, STEPS), ref.model.state_dict())


@pytest.mark.slow
@pytest.mark.parametrize("strategy,fraction", [("offload_all", 1.0), ("ilp", 0.6)])
def test_resume_mid_schedule_continues_exactly(strategy, fraction, tmp_path):
    mf = _load()
    schedule = plan(mf, strategy, fraction)
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    full = run(schedule, mf, STEPS, checkpoint_dir=whole)
    first = run(schedule, mf, 2, checkpoint_dir=parts)
    second = run(schedule, mf, STEPS, checkpoint_dir=parts, resume=True)
    assert second.steps == [3, 4]
    assert first.losses + second.losses == full.losses
    assert first.lrs + second.lrs == full.lrs
    assert_bitwise_equal(_model_pt(parts, STEPS), _model_pt(whole, STEPS))
    saved = torch.load(parts / "step_2" / "extras.pt", weights_only=True)
    assert saved["lr_schedule"]["scheduler"]["last_epoch"] == 2


def test_the_library_state_holds_the_schedule():
    """Runtime.state_dict / load_state_dict: the schedule goes back with the weights."""
    mf = _load()
    schedule = plan(mf, "offload_all")
    batches = [b for _, b in zip(range(4), mf.checked_batches(schedule.config.batch_size))]
    with karma.Runtime(schedule, model_file=mf, log=lambda line: None) as rt:
        for x, y in batches[:2]:
            rt.step(x.args[0], y)
        state = rt.state_dict()
        lr_at_2 = rt.lr
        after = [(rt.step(x.args[0], y), rt.last.lr) for x, y in batches[2:]]
        assert rt.lr != lr_at_2
        rt.load_state_dict(state)
        assert rt.lr == lr_at_2
        assert all(g["lr"] == lr_at_2 for g in rt.optimizer.param_groups)
        again = [(rt.step(x.args[0], y), rt.last.lr) for x, y in batches[2:]]
    assert again == after


@pytest.mark.slow
def test_progress_line_and_report_show_the_learning_rate(tmp_path, capsys):
    schedule, report = tmp_path / "s.yaml", tmp_path / "r.json"
    assert plan_main([str(MODEL), "--hardware", "cpu", "--gpu-mem", "64M", "--strategy",
                      "offload_all", "-o", str(schedule)]) == 0
    assert run_main([str(schedule), "--steps", "3", "--report", str(report)]) == 0
    out = capsys.readouterr().out
    assert "step 1/3  loss" in out and "lr 0  " in out and "lr 0.005  " in out, out
    assert json.loads(report.read_text())["lrs"] == [0.0, 0.005, 0.01]


@pytest.mark.slow
def test_a_scheduler_without_step_is_one_line(tmp_path, capsys):
    path = tmp_path / "model.py"
    path.write_text(MODEL.read_text() + (
        "\n\ndef make_scheduler(optimizer):\n"
        "    return {'lr': 0.1}\n"))
    schedule = tmp_path / "s.yaml"
    assert plan_main([str(path), "--hardware", "cpu", "--gpu-mem", "64M", "--strategy",
                      "keep_all", "-o", str(schedule)]) == 0
    capsys.readouterr()
    code = run_main([str(schedule), "--steps", "1"])
    out, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in err and err.count("\n") == 1, err
    assert "make_scheduler(optimizer) returned dict, which has no step()" in err
    assert "torch.optim.lr_scheduler" in err and "step 1/" not in out


def test_without_make_scheduler_the_lr_stays_as_before(tmp_path):
    mf = load_small("mlp")
    assert mf.make_scheduler is None
    schedule = plan(mf, "offload_all")
    report = run(schedule, mf, 3, checkpoint_dir=tmp_path)
    ref_sd, ref_losses = reference_train(mf, schedule.config.batch_size, 3, schedule=schedule)
    assert report.losses == ref_losses and report.lrs == [1e-3] * 3
    assert_bitwise_equal(_model_pt(tmp_path, 3), ref_sd)
    saved = torch.load(tmp_path / "step_3" / "extras.pt", weights_only=True)
    assert saved["lr_schedule"] is None


@pytest.mark.slow
def test_a_schedule_that_ends_before_the_run_is_one_line(tmp_path, capsys):
    """OneCycleLR refuses a step past its total_steps (6 here): karma says whose it is."""
    schedule = tmp_path / "s.yaml"
    with environment({"KARMA_SCHEDULE": "onecycle"}):
        assert plan_main([str(MODEL), "--hardware", "cpu", "--gpu-mem", "64M", "--strategy",
                          "keep_all", "-o", str(schedule)]) == 0
    capsys.readouterr()
    code = run_main([str(schedule), "--steps", "7"])
    out, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in err and err.count("\n") == 1, err
    assert "make_scheduler(optimizer)" in err and "total_steps" in err
    assert "step 5/7" in out
