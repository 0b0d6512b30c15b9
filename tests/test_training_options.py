"""Training as practitioners do: bf16 mixed precision, gradient accumulation, clipping by
global norm and an LR schedule, each and all together, bitwise equal to the plain loop of
karma.reference (autocast forward and loss, loss / N backward N times, clip_grad_norm_,
opt.step(), sched.step(), opt.zero_grad()) for every strategy of three models."""

from __future__ import annotations

import dataclasses
import functools
import json
import math

import pytest
import torch

from karma.cli.plan import main as plan_main
from karma.cli.run import main as run_main
from karma.errors import KarmaError
from karma.reference import train_reference
from karma.runtime.checkpoints.export import model_state_dict
from karma.runtime.runtime import Runtime
from karma.testing.exactness import SMALL_ENV, assert_bitwise_equal, host_stepped, plan, run
from tests.conftest import EXAMPLES
from tests.matrix import FAST, MODELS, ONE_BUDGET, cell_id, first_fast, strategy_cells
from tests.matrix import OPTIONS as PLANNED
from tests.runtime_helpers import load_small

STEPS = 2
CLIP = PLANNED["clip"]["clip_grad_norm"]
# (planned options, whether the model file gets a warmup + cosine LambdaLR): each of the
# matrix's options, a LambdaLR alone, and all of them with it
OPTIONS = {**{option: (options, option == "all") for option, options in PLANNED.items()
              if option != "all"},
           "lambda_lr": ({}, True), "all": (PLANNED["all"], True)}


def warmup_cosine(step: int) -> float:
    if step < 2:
        return (step + 1) / 3
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - 2) / 4)))


@functools.cache
def model_file(name: str, scheduled: bool):
    mf = load_small(name)
    if not scheduled:
        return mf
    return dataclasses.replace(
        mf, make_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine))


@functools.cache
def reference(name: str, option: str, **host):
    """The plain loop with `option`, `host` (host_stepped's) stepped as a schedule's
    host-stepped blocks."""
    options, scheduled = OPTIONS[option]
    mf = model_file(name, scheduled)
    return train_reference(mf, mf.default_batch_size, STEPS, **options, **host)


def _model_pt(directory, step: int) -> dict[str, torch.Tensor]:
    return model_state_dict(directory / f"step_{step}")


# every option, model and strategy; `make test-fast` trains all the options together on the
# MLP's ILP plan
CASES = [pytest.param(m, o, s, f, id=f"{o}-{cell_id(m, s, f)}",
                      marks=() if (o, m, (s, f)) == ("all", "mlp", FAST) else pytest.mark.slow)
         for o in OPTIONS for m in MODELS for s, f in ONE_BUDGET]


@pytest.mark.parametrize("name,option,strategy,fraction", CASES)
def test_every_option_and_strategy_equals_the_plain_loop(name, option, strategy, fraction,
                                                        tmp_path):
    options, scheduled = OPTIONS[option]
    mf = model_file(name, scheduled)
    schedule = plan(load_small(name), strategy, fraction, **options)
    report = run(schedule, mf, STEPS, checkpoint_dir=tmp_path)
    ref = reference(name, option, **host_stepped(schedule))
    assert report.losses == ref.losses
    assert report.lrs == ref.lrs
    if "clip_grad_norm" in options:
        assert report.grad_norms == ref.grad_norms
        assert max(ref.grad_norms) > CLIP, "the gradients never reached the clipping norm"
    assert_bitwise_equal(_model_pt(tmp_path, STEPS), ref.model.state_dict())


@pytest.mark.parametrize("name", first_fast(("mlp", "gpt", "resnet")))
def test_each_option_changes_the_numbers(name):
    """Otherwise the equalities above could hold with the option ignored on both sides."""
    plain = train_reference(load_small(name), load_small(name).default_batch_size, STEPS)
    for option in OPTIONS:
        ref = reference(name, option)
        assert ref.losses != plain.losses or not torch.equal(
            next(ref.model.parameters()), next(plain.model.parameters())), option


def test_micro_batches_through_the_library(tmp_path):
    """Runtime.micro_step is one micro-batch; every N-th call ends the optimizer step, a
    state taken halfway through an accumulation is refused, and Runtime.step (one whole
    optimizer step on one batch) says to take the micro-batches one by one."""
    mf = load_small("mlp")
    schedule = plan(mf, "offload_all", accumulate=4)
    data = mf.checked_batches(mf.default_batch_size, 0, 1)
    with Runtime(schedule, model_file=mf, log=lambda line: None) as rt:
        assert rt.accumulate == 4
        with pytest.raises(KarmaError, match="accumulates 4 micro-batches.*micro_step"):
            rt.step(*next(data))
        assert rt.steps == 0 and not rt.stepped
        stepped = []
        for _ in range(4):
            rt.micro_step(*next(data))
            stepped.append(rt.stepped)
            if not rt.stepped:
                with pytest.raises(KarmaError, match="1 of the 4|2 of the 4|3 of the 4"):
                    rt.state_dict()
        assert stepped == [False, False, False, True] and rt.steps == 1
        rt.state_dict()


@pytest.mark.parametrize("strategy,fraction", strategy_cells((("offload_all", 1.0), ("ilp", 0.6))))
def test_resume_mid_schedule_and_accumulation_continues_exactly(strategy, fraction, tmp_path):
    """A run stopped after step 2 and resumed gives the uninterrupted run's losses, learning
    rates and parameters: the data resumes 2 x N micro-batches in, the LR schedule at 2."""
    options, _ = OPTIONS["all"]
    mf = model_file("mlp", True)
    schedule = plan(load_small("mlp"), strategy, fraction, **options)
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    full = run(schedule, mf, 4, checkpoint_dir=whole)
    first = run(schedule, mf, 2, checkpoint_dir=parts)
    second = run(schedule, mf, 4, checkpoint_dir=parts, resume=True)
    assert second.steps == [3, 4]
    assert first.losses + second.losses == full.losses
    assert first.lrs + second.lrs == full.lrs
    assert first.grad_norms + second.grad_norms == full.grad_norms
    assert_bitwise_equal(_model_pt(parts, 4), _model_pt(whole, 4))
    ref = train_reference(mf, mf.default_batch_size, 4, **options, **host_stepped(schedule))
    assert full.losses == ref.losses


# --- the commands, and bad input -----------------------------------------------------------

MLP = EXAMPLES / "mlp.py"


@pytest.fixture
def small_mlp(monkeypatch):
    """examples/mlp.py at its test size for the commands (bf16 matmuls are slow on CPUs
    without bf16 units)."""
    for key, value in SMALL_ENV["mlp"].items():
        monkeypatch.setenv(key, value)


@pytest.mark.parametrize("argv,expected", [
    (["--accumulate", "0"], "accumulate 0 (--accumulate) must be a whole number"),
    (["--clip-grad-norm", "-1"], "clip_grad_norm -1.0 (--clip-grad-norm) must be a positive"),
    (["--dtype", "fp16"], "fp16 (--dtype fp16) is not supported: it needs a loss scaler"),
    (["--dtype", "int8"], "dtype 'int8' (--dtype) is not a training dtype"),
])
def test_bad_training_options_are_one_line(argv, expected, capsys):
    code = plan_main([str(MLP), "--hardware", "cpu", "--gpu-mem", "64M", *argv])
    err = capsys.readouterr().err
    assert code == 2 and expected in err and "Traceback" not in err and err.count("\n") == 1, err


@pytest.mark.slow
@pytest.mark.parametrize("edit,expected", [
    ("  clip_grad_norm: null", "  clip_grad_norm: -1"),
    ("  accumulate: 1", "  accumulate: 0"),
    ("  dtype: fp32", "  dtype: fp16"),
])
def test_a_schedule_edited_to_bad_training_options_is_refused(edit, expected, tmp_path, capsys,
                                                             small_mlp):
    path = tmp_path / "s.yaml"
    assert plan_main([str(MLP), "--hardware", "cpu", "--gpu-mem", "64M", "-o", str(path)]) == 0
    text = path.read_text()
    assert edit in text
    path.write_text(text.replace(edit, expected))
    capsys.readouterr()
    code = run_main([str(path), "--steps", "1"])
    err = capsys.readouterr().err
    key = expected.split(":")[0].strip()
    assert code == 2 and f"config.{key}" in err and "Traceback" not in err, err


@pytest.mark.slow
def test_a_clipped_schedule_whose_steps_come_early_is_refused(tmp_path, capsys, small_mlp):
    """A schedule planned without clipping (host steps during the backward) with clipping
    written into its config: the runtime cannot clip it, and says so before any step."""
    path = tmp_path / "s.yaml"
    assert plan_main([str(MLP), "--hardware", "cpu", "--gpu-mem", "64M", "--strategy",
                      "offload_all", "-o", str(path)]) == 0
    path.write_text(path.read_text().replace("  clip_grad_norm: null", "  clip_grad_norm: 1"))
    capsys.readouterr()
    code = run_main([str(path), "--steps", "1"])
    out, err = capsys.readouterr()
    assert code == 2 and "every optimizer step follows every gradient" in err, err
    assert "clip_grad_norm" in err and "step 1/" not in out


@pytest.mark.slow
def test_progress_line_and_report_show_the_options_and_the_norm(tmp_path, capsys, small_mlp):
    schedule, report = tmp_path / "s.yaml", tmp_path / "r.json"
    assert plan_main([str(MLP), "--hardware", "cpu", "--gpu-mem", "64M", "--dtype", "bf16",
                      "--accumulate", "2", "--clip-grad-norm", "0.5", "-o", str(schedule)]) == 0
    assert "bf16 mixed precision, 2 micro-batches per step, clip at norm 0.5" in \
        capsys.readouterr().out
    assert run_main([str(schedule), "--steps", "2", "--report", str(report)]) == 0
    out = capsys.readouterr().out
    assert "training: bf16 mixed precision, 2 micro-batches per step, clip at norm 0.5" in out
    norms = json.loads(report.read_text())["grad_norms"]
    assert len(norms) == 2 and all(n > 0 for n in norms)
    assert f"grad norm {norms[0]:.4g}" in out


def test_norms_of_host_gradients_are_taken_where_they_become_final():
    """With every block on the host optimizer, each gradient's norm is taken by the
    grads_to_host that makes it final (on its stream), not after the backward."""
    mf = load_small("mlp")
    schedule = plan(mf, "offload_all", clip_grad_norm=CLIP)
    data = mf.checked_batches(mf.default_batch_size, 0, 1)
    with Runtime(schedule, model_file=mf, log=lambda line: None) as rt:
        rt.step(*next(data))
        taken = rt.engine.updates.norms  # what the streams recorded this step
        assert set(taken) == {id(p) for p in rt.model.parameters()}
        assert rt.last.grad_norm > 0
