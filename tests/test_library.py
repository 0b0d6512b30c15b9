"""karma as a library: karma.plan, karma.load_schedule, karma.Runtime, examples/own_loop.py."""

from __future__ import annotations

import pytest
import torch

import karma
from karma.cli.plan import main as plan_main
from karma.cli.run import main as run_main
from karma.schedule import load_schedule
from tests.conftest import EXAMPLES, environment
from tests.runtime_helpers import assert_bitwise_equal

GPT = str(EXAMPLES / "gpt.py")
TINY = {"KARMA_GPT": "tiny"}


def test_plan_is_what_karma_plan_writes(tmp_path, capsys):
    with environment(TINY):
        schedule = karma.plan(GPT, gpu_mem="400K", hardware="cpu", batch_size=2)
        assert plan_main([GPT, "--gpu-mem", "400K", "--hardware", "cpu", "--batch-size", "2",
                          "-o", str(tmp_path / "cli.yaml")]) == 0
    capsys.readouterr()
    schedule.save(tmp_path / "api.yaml")
    api, cli = karma.load_schedule(tmp_path / "api.yaml"), load_schedule(tmp_path / "cli.yaml")
    assert api.blocks == cli.blocks == schedule.blocks
    assert api.ops == cli.ops and api.buffers == cli.buffers and api.model == cli.model
    assert any(b.weights == "streamed" for b in api.blocks)  # out of core, not keep_all


def test_plan_refuses_a_budget_nothing_fits():
    with environment(TINY), pytest.raises(karma.InfeasiblePlan) as e:
        karma.plan(GPT, gpu_mem="10K", hardware="cpu", batch_size=2)
    assert e.value.min_capacity_bytes > 10 << 10


def test_own_loop_trains_bitwise_as_karma_run(tmp_path, capsys):
    from examples.own_loop import main as own_loop

    with environment(TINY):
        own_loop(["--out", str(tmp_path / "own"), "--steps", "4", "--eval-every", "2"])
        out = capsys.readouterr().out
        assert out.count("eval loss") == 2
        assert run_main([str(tmp_path / "own" / "schedule.yaml"), "--steps", "4",
                         "--checkpoint-dir", str(tmp_path / "ckpt")]) == 0
    capsys.readouterr()
    own = torch.load(tmp_path / "own" / "model.pt", weights_only=True)
    assert_bitwise_equal(own, torch.load(tmp_path / "ckpt" / "step_4" / "model.pt",
                                         weights_only=True))


def test_state_dict_round_trip_continues_exactly(tmp_path):
    with environment(TINY):
        schedule = karma.plan(GPT, gpu_mem="400K", hardware="cpu", batch_size=2)
        quiet = {"log": lambda line: None}
        with karma.Runtime(schedule, seed=3, **quiet) as rt:
            data = rt.model_file.batches(2)
            first = [rt.step(*next(data)) for _ in range(2)]
            state = rt.state_dict()
            later = [rt.step(*next(data)) for _ in range(2)]
        with karma.Runtime(schedule, seed=3, **quiet) as rt:
            assert rt.optimizer.param_groups and all("lr" in g for g in rt.optimizer.param_groups)
            rt.load_state_dict(state)
            data = rt.model_file.batches(2)
            for _ in range(2):
                next(data)
            again = [rt.step(*next(data)) for _ in range(2)]
    assert again == later and first != later
