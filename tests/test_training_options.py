"""Training as practitioners do: bf16 mixed precision, gradient accumulation, clipping by
global norm and an LR schedule, each and all together, bitwise equal to the plain loop of
karma.reference (autocast forward and loss, loss / N backward N times, clip_grad_norm_,
opt.step(), sched.step(), opt.zero_grad()) for every strategy of three models."""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch

from karma.errors import KarmaError
from karma.reference import train_reference
from karma.runtime.runtime import Runtime
from tests.runtime_helpers import assert_bitwise_equal, load_small, plan, run

STEPS = 3
MODELS = ("gpt", "resnet", "mlp")
STRATEGIES = [("keep_all", 1.0), ("recompute_all", 1.0), ("swap_all", 1.0),
              ("offload_all", 1.0), ("greedy", 1.0), ("ilp", 0.6)]
CLIP = 1.0
# (planned options, whether the model file gets a warmup + cosine LambdaLR)
OPTIONS = {
    "bf16": ({"dtype": "bf16"}, False),
    "accumulate4": ({"accumulate": 4}, False),
    "clip": ({"clip_grad_norm": CLIP}, False),
    "lambda_lr": ({}, True),
    "all": ({"dtype": "bf16", "accumulate": 4, "clip_grad_norm": CLIP}, True),
}


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
def reference(name: str, option: str):
    options, scheduled = OPTIONS[option]
    mf = model_file(name, scheduled)
    return train_reference(mf, mf.default_batch_size, STEPS, **options)


def _model_pt(directory, step: int) -> dict[str, torch.Tensor]:
    return torch.load(directory / f"step_{step}" / "model.pt", weights_only=True)


CASES = [(m, o, s, f) for o in OPTIONS for m in MODELS for s, f in STRATEGIES]


@pytest.mark.parametrize("name,option,strategy,fraction", CASES, ids=[
    f"{o}-{m}-{s}@{f:g}" if s == "ilp" else f"{o}-{m}-{s}" for m, o, s, f in CASES])
def test_every_option_and_strategy_equals_the_plain_loop(name, option, strategy, fraction,
                                                        tmp_path):
    options, scheduled = OPTIONS[option]
    mf = model_file(name, scheduled)
    schedule = plan(load_small(name), strategy, fraction, **options)
    report = run(schedule, mf, STEPS, checkpoint_dir=tmp_path)
    ref = reference(name, option)
    assert report.losses == ref.losses
    assert report.lrs == ref.lrs
    if "clip_grad_norm" in options:
        assert report.grad_norms == ref.grad_norms
        assert max(ref.grad_norms) > CLIP, "the gradients never reached the clipping norm"
    assert_bitwise_equal(_model_pt(tmp_path, STEPS), ref.model.state_dict())


@pytest.mark.parametrize("name", MODELS)
def test_each_option_changes_the_numbers(name):
    """Otherwise the equalities above could hold with the option ignored on both sides."""
    plain = train_reference(load_small(name), load_small(name).default_batch_size, STEPS)
    for option in OPTIONS:
        ref = reference(name, option)
        assert ref.losses != plain.losses or not torch.equal(
            next(ref.model.parameters()), next(plain.model.parameters())), option


def test_micro_batches_through_the_library(tmp_path):
    """Runtime.step is one micro-batch; every N-th call ends the optimizer step, and a state
    taken halfway through an accumulation is refused."""
    mf = load_small("mlp")
    schedule = plan(mf, "offload_all", accumulate=4)
    data = mf.checked_batches(mf.default_batch_size, 0, 1)
    with Runtime(schedule, model_file=mf, log=lambda line: None) as rt:
        assert rt.accumulate == 4
        stepped = []
        for _ in range(4):
            rt.step(*next(data))
            stepped.append(rt.stepped)
            if not rt.stepped:
                with pytest.raises(KarmaError, match="1 of the 4|2 of the 4|3 of the 4"):
                    rt.state_dict()
        assert stepped == [False, False, False, True] and rt.iterations == 1
        rt.state_dict()


@pytest.mark.parametrize("strategy,fraction", [("offload_all", 1.0), ("ilp", 0.6)])
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
    ref = train_reference(mf, mf.default_batch_size, 4, **options)
    assert full.losses == ref.losses
