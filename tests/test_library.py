"""karma as a library: karma.plan, karma.load_schedule, karma.Runtime, examples/own_loop.py."""

from __future__ import annotations

import pytest
import torch

import karma
from karma.cli.plan import main as plan_main
from karma.cli.run import main as run_main
from karma.runtime.checkpoints.export import model_state_dict
from karma.schedule_load import load_schedule
from karma.testing.exactness import assert_bitwise_equal
from tests.conftest import EXAMPLES, environment

GPT = str(EXAMPLES / "gpt.py")
TINY = {"KARMA_GPT": "tiny"}


def test_plan_is_what_karma_plan_writes(tmp_path, capsys):
    with environment(TINY):
        # the roofline (measure="estimate"): 400 KiB is out of core, below what a measured plan
        # also counts for the process outside its tensors (tests/test_calibrate.py)
        schedule = karma.plan(GPT, gpu_mem="400K", hardware="cpu", batch_size=2, measure="estimate")
        assert plan_main([GPT, "--gpu-mem", "400K", "--hardware", "cpu", "--batch-size", "2",
                          "--no-measure",
                          "-o", str(tmp_path / "cli.yaml")]) == 0
    capsys.readouterr()
    schedule.save(tmp_path / "api.yaml")
    api, cli = karma.load_schedule(tmp_path / "api.yaml"), load_schedule(tmp_path / "cli.yaml")
    assert api.blocks == cli.blocks == schedule.blocks
    assert api.ops == cli.ops and api.buffers == cli.buffers and api.model == cli.model
    assert any(b.weights == "streamed" for b in api.blocks)  # out of core, not keep_all


@pytest.mark.slow
def test_plan_refuses_a_budget_nothing_fits():
    with environment(TINY), pytest.raises(karma.InfeasiblePlan) as e:
        karma.plan(GPT, gpu_mem="10K", hardware="cpu", batch_size=2)
    assert e.value.min_capacity_bytes > 10 << 10


@pytest.mark.slow
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
    assert_bitwise_equal(own, model_state_dict(tmp_path / "ckpt" / "step_4"))
    # and under chaos timing ([Note: chaos timing]; tests/test_chaos.py has the others)
    for seed in (1, 2, 3):
        with environment({**TINY, "KARMA_CHAOS": f"{seed}:5"}):
            own_loop(["--out", str(tmp_path / f"chaos{seed}"), "--steps", "4"])
        capsys.readouterr()
        assert_bitwise_equal(torch.load(tmp_path / f"chaos{seed}" / "model.pt",
                                        weights_only=True), own)


def test_state_dict_round_trip_continues_exactly(tmp_path):
    with environment(TINY):
        schedule = karma.plan(GPT, gpu_mem="400K", hardware="cpu", batch_size=2,
                              measure="estimate")
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


def _schedule(strategy="swap_all"):
    from tests.conftest import MODELS

    return karma.plan(str(MODELS / "dict_io.py"), gpu_mem="64M", hardware="cpu",
                      strategy=strategy)


@pytest.mark.slow
def test_evaluate_before_any_step_is_a_plain_eval_forward():
    from karma.modelfile import load_model_file
    from tests.conftest import MODELS

    for strategy in ("offload_all", "swap_all"):
        with karma.Runtime(_schedule(strategy), seed=0, log=lambda line: None) as rt:
            x, y = rt.model_file.checked_eval_batches(4)[0]
            rng = torch.get_rng_state()
            loss = rt.evaluate(x, y)
            assert torch.equal(torch.get_rng_state(), rng)
            assert all(m.training for m in rt.model.modules())
        torch.manual_seed(0)
        model = load_model_file(MODELS / "dict_io.py").build_model().eval()
        with torch.no_grad():
            assert model(**x.kwargs)["loss"].item() == loss, strategy


def test_a_failed_step_leaves_no_hooks_and_refuses_more_steps():
    hooks = torch._C._autograd._top_saved_tensors_default_hooks
    with karma.Runtime(_schedule("swap_all"), seed=0, log=lambda line: None) as rt:
        x, y = next(rt.model_file.batches(4))
        bad = {**x, "scale": torch.ones(3, 1)}  # fails inside layers.0, a swap block
        with pytest.raises(RuntimeError):
            rt.step(bad, y)
        assert hooks(False) is None  # karma's saved-tensor hooks did not stay installed
        with pytest.raises(karma.KarmaError, match="stopped after a failed step"):
            rt.step(x, y)
    with pytest.raises(karma.KarmaError, match="is closed"):
        rt.step(x, y)


def test_load_state_dict_says_what_is_wrong():
    with karma.Runtime(_schedule("keep_all"), seed=0, log=lambda line: None) as rt:
        with pytest.raises(karma.KarmaError, match="not a karma state"):
            rt.load_state_dict(rt.model.state_dict())
        state = rt.state_dict()
        state["model"]["inp.weight"] = torch.zeros(1)
        with pytest.raises(karma.KarmaError, match=r"inp.weight has shape \(1,\)"):
            rt.load_state_dict(state)
