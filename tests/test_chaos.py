"""Chaos timing (KARMA_CHAOS, karma/runtime/replay/chaos.py): the streams' ordering protocol holds
under random pauses around every operation and hand-off, and the pauses do catch a missing
wait ([Note: chaos timing]).

Every family of exactness tests (bitwise equal to the plain loop) has a counterpart here,
each under three seeds, in the cheapest form that still puts work on the other streams:
small models, few steps, shorter pauses where a step has many operations. Each case names
the tests it mirrors. The two-rank runs, whose all-reduces add the `net` stream, are checked
under chaos in tests/test_distributed.py, in the launch its exactness test already pays for.
examples/own_loop.py (the user's own loop over karma.Runtime) runs under chaos in
test_library.py. Not mirrored: karma-run's command line (test_cli_run.py), a thin layer over
the train() these runs use, a resume after a full disk (test_full_disk.py; resumes under chaos
are below), and the CUDA runs of test_gpu.py.
"""

from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace

import pytest
import torch

from karma.errors import KarmaError
from karma.reference import train_reference
from karma.runtime.checkpoints.export import model_state_dict
from karma.runtime.replay.chaos import Chaos
from karma.testing.exactness import (
    assert_bitwise_equal,
    host_stepped,
    plan,
    reference_train,
    run,
)
from tests.matrix import strategy_cells
from tests.runtime_helpers import load_small
from tests.test_training_options import CLIP, OPTIONS, model_file
from tests.test_training_options import STEPS as OPTION_STEPS
from tests.test_training_options import reference as option_reference

SEEDS = (1, 2, 3)
SEED_PARAMS = [pytest.param(seed, marks=() if seed == SEEDS[0] else pytest.mark.slow)
               for seed in SEEDS]  # the first seed in `make test-fast`
PAUSE_MS = 10  # up to 10 ms before and after each op and hand-off, half the time
STEPS = 3


@functools.cache
def gpt_reference(strategy: str, fraction: float):
    """The gpt model file, the schedule of `strategy` and the plain loop's run of it."""
    mf = load_small("gpt")
    schedule = plan(mf, strategy, fraction)
    return mf, schedule, reference_train(mf, batch_size=4, steps=STEPS, schedule=schedule)


def trained(mf, schedule, tmp_path) -> dict[str, torch.Tensor]:
    run(schedule, mf, STEPS, checkpoint_dir=tmp_path)
    return model_state_dict(tmp_path / f"step_{STEPS}")


@pytest.mark.parametrize("seed", SEED_PARAMS)
# the strategies with work on other streams (recompute_all has none: nothing to reorder)
@pytest.mark.parametrize("strategy,fraction", strategy_cells(
    (("swap_all", 1.0), ("offload_all", 1.0), ("ilp", 0.6))))
def test_training_is_bitwise_the_plain_loops_under_chaos(strategy, fraction, seed,
                                                         tmp_path, monkeypatch):
    mf, schedule, (ref_sd, ref_losses) = gpt_reference(strategy, fraction)
    monkeypatch.setenv("KARMA_CHAOS", f"{seed}:{PAUSE_MS}")
    report = run(schedule, mf, STEPS, checkpoint_dir=tmp_path)
    assert report.losses == ref_losses
    assert_bitwise_equal(model_state_dict(tmp_path / f"step_{STEPS}"), ref_sd)


# --- every other family of exactness tests -------------------------------------------------

CASE_STEPS = OPTION_STEPS  # 2: the references of test_training_options.py serve here too
CASE_PAUSE_MS = 5  # a step of these has 30 to 120 operations


@dataclasses.dataclass(frozen=True)
class Case:
    """One schedule trained under chaos, bitwise as the plain loop, like the tests it mirrors."""

    model: str  # load_small's name
    strategy: str
    fraction: float = 1.0
    option: str = "fp32"  # a key of test_training_options.OPTIONS, or fp32: none of them
    built_in_tier: bool = False  # every factory tensor of the build in the host tier

    @property
    def id(self) -> str:
        where = f"@{self.fraction:g}" if self.strategy == "ilp" else ""
        return "-".join([self.model, self.strategy + where, self.option] +
                        ["tier"] * self.built_in_tier)


# The strategies with work on other streams (keep_all, recompute_all and greedy at full
# budget have none: test_the_strategies_left_out_have_nothing_to_reorder); gpt's are above.
CASES = [
    # test_runtime.py: test_training_is_bitwise_equal_to_plain_pytorch (BatchNorm) and, with
    # an ILP that mixes keep and recompute, streamed weights, device and host steps,
    # test_a_model_built_in_the_host_tier_trains_exactly
    Case("resnet", "swap_all"), Case("resnet", "offload_all"),
    Case("resnet", "ilp", 0.4, built_in_tier=True),
    # test_runtime.py: test_parameters_without_gradients_are_skipped_as_in_plain_pytorch
    # (some blocks step on the device, some on the host)
    Case("unused_frozen", "ilp", 0.6),
    # test_model_io.py: test_backward_is_found_whatever_the_order_of_keyword_arguments
    Case("kw_order", "swap_all", 1.5),
    # test_training_options.py: test_every_option_and_strategy_equals_the_plain_loop (and
    # test_runtime.py's for mlp), on an ILP that mixes device and host steps: accumulation
    # (host gradients add up), clipping (norms taken on the streams, updates deferred into
    # the next step) and all four options together (bf16 and a LambdaLR schedule too, as in
    # test_lr_schedule.py's test_every_strategy_follows_the_schedule_bitwise); and all four
    # with every block's update deferred
    Case("mlp", "ilp", 0.6, "accumulate4"), Case("mlp", "ilp", 0.6, "clip"),
    Case("mlp", "ilp", 0.6, "all"), Case("mlp", "offload_all", 1.0, "all"),
]


@functools.cache
def case_reference(model: str, option: str, **host):
    """The plain loop's run for CASE_STEPS steps, `host` (host_stepped's) stepped as a
    schedule's host-stepped blocks (shared with test_training_options.py)."""
    if option in OPTIONS:
        return option_reference(model, option, **host)
    mf = load_small(model)
    return train_reference(mf, mf.default_batch_size, CASE_STEPS, **host)


def assert_equals_reference(report, saved: dict[str, torch.Tensor], ref) -> None:
    assert report.losses == ref.losses
    assert report.lrs == ref.lrs
    if ref.grad_norms:
        assert report.grad_norms == ref.grad_norms
    assert_bitwise_equal(saved, ref.model.state_dict())


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_family_of_exactness_tests_holds_under_chaos(case, seed, tmp_path, monkeypatch):
    options, scheduled = OPTIONS.get(case.option, ({}, False))
    schedule = plan(load_small(case.model), case.strategy, case.fraction, **options)
    if case.built_in_tier:
        monkeypatch.setattr("karma.runtime.bringup.TIER_MIN_BYTES", 1)
    monkeypatch.setenv("KARMA_CHAOS", f"{seed}:{CASE_PAUSE_MS}")
    report = run(schedule, model_file(case.model, scheduled), CASE_STEPS,
                 checkpoint_dir=tmp_path)
    assert_equals_reference(report, model_state_dict(tmp_path / f"step_{CASE_STEPS}"),
                            case_reference(case.model, case.option, **host_stepped(schedule)))


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_resume_with_updates_in_flight_holds_under_chaos(seed, tmp_path, monkeypatch):
    """test_runtime.py's test_resume_continues_exactly and test_training_options.py's
    test_resume_mid_schedule_and_accumulation_continues_exactly (and test_lr_schedule.py's
    resume): with clipping, the host steps of the last step are still running when a
    checkpoint is taken (Engine.settle), and the resumed run starts from what they wrote."""
    options, scheduled = OPTIONS["all"]
    schedule = plan(load_small("mlp"), "ilp", 0.6, **options)
    mf = model_file("mlp", scheduled)
    monkeypatch.setenv("KARMA_CHAOS", f"{seed}:{CASE_PAUSE_MS}")
    first = run(schedule, mf, CASE_STEPS - 1, checkpoint_dir=tmp_path)
    second = run(schedule, mf, CASE_STEPS, checkpoint_dir=tmp_path, resume=True)
    assert second.steps == [CASE_STEPS]
    joined = dataclasses.replace(second, losses=first.losses + second.losses,
                                 lrs=first.lrs + second.lrs,
                                 grad_norms=first.grad_norms + second.grad_norms)
    assert_equals_reference(joined, model_state_dict(tmp_path / f"step_{CASE_STEPS}"),
                            case_reference("mlp", "all", **host_stepped(schedule)))


@functools.cache
def dict_io_reference(**host):
    return train_reference(load_small("dict_io"), 4, CASE_STEPS, eval_every=1,
                           clip_grad_norm=CLIP, **host)


@pytest.mark.parametrize("seed", SEED_PARAMS)
def test_evaluation_and_dict_outputs_hold_under_chaos(seed, tmp_path, monkeypatch):
    """test_model_io.py's test_keyword_inputs_and_dict_outputs_train_bitwise and
    test_eval_every_equals_a_plain_no_grad_forward: keyword inputs, a dict out, and an
    evaluation after every step, which must wait for the host steps clipping leaves in
    flight and fetch the streamed weights they wrote."""
    mf = load_small("dict_io")
    schedule = plan(mf, "offload_all", clip_grad_norm=CLIP)
    ref = dict_io_reference(**host_stepped(schedule))
    monkeypatch.setenv("KARMA_CHAOS", f"{seed}:{CASE_PAUSE_MS}")
    report = run(schedule, mf, CASE_STEPS, checkpoint_dir=tmp_path, eval_every=1)
    assert [{"step": e["step"], "loss": e["loss"]} for e in report.evals] == ref.evals
    assert_equals_reference(report, model_state_dict(tmp_path / f"step_{CASE_STEPS}"), ref)


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_a_hugging_face_model_holds_under_chaos(seed, tmp_path, monkeypatch):
    """test_zoo.py's test_zoo_model_trains_bitwise_at_half_of_keep_all, for Llama (rotary
    tables and a mask that every layer reads; streamed weights, device and host steps), with
    its plan and reference (skipped with the zoo, without transformers)."""
    from tests.test_zoo import STEPS as ZOO_STEPS
    from tests.test_zoo import zoo_case

    mf, schedule, (ref_sd, ref_losses) = zoo_case("hf_llama")
    monkeypatch.setenv("KARMA_CHAOS", f"{seed}:{CASE_PAUSE_MS}")
    report = run(schedule, mf, ZOO_STEPS, checkpoint_dir=tmp_path)
    assert report.losses == ref_losses
    assert_bitwise_equal(model_state_dict(tmp_path / f"step_{ZOO_STEPS}"), ref_sd)


@pytest.mark.parametrize("name", ["gpt", "resnet", "mlp"])
def test_the_strategies_left_out_have_nothing_to_reorder(name):
    """keep_all, recompute_all and greedy at the full budget (the rest of test_runtime.py's
    exactness tests) run every operation on the compute thread: no pause can reorder them."""
    for strategy in ("keep_all", "recompute_all", "greedy"):
        schedule = plan(load_small(name), strategy)
        assert {op.stream for op in schedule.ops} == {"compute"}, (name, strategy)


def without_wait(schedule, kind: str, on: str):
    """`schedule` with every `kind` op no longer waiting for its `on` ops."""
    ops = schedule.ops
    return dataclasses.replace(schedule, ops=tuple(
        dataclasses.replace(op, deps=tuple(d for d in op.deps if ops[d].kind != on))
        if op.kind == kind else op for op in ops))


@pytest.mark.slow
def test_a_missing_wait_is_caught_under_chaos(tmp_path, monkeypatch):
    """The control: host steps that no longer wait for their gradients' copy to the host
    (offload_all). Without chaos the copy nearly always lands first, and the run passes;
    under chaos some host step reads gradients that have not arrived, in every seed tried
    here (4 of 4, twice, when written)."""
    mf, schedule, (ref_sd, _) = gpt_reference("offload_all", 1.0)
    broken = without_wait(schedule, "host_step", on="grads_to_host")
    with pytest.raises(KarmaError, match="rule: dependencies"):  # what a user's run would see
        run(broken, mf, STEPS, checkpoint_dir=tmp_path / "checked")
    monkeypatch.setattr("karma.runtime.bringup.validate", lambda schedule: None)  # to run it
    caught = []
    for seed in SEEDS:
        monkeypatch.setenv("KARMA_CHAOS", f"{seed}:20")
        sd = trained(mf, broken, tmp_path / str(seed))
        try:
            assert_bitwise_equal(sd, ref_sd)
        except AssertionError:
            caught.append(seed)
    assert caught, "chaos timing did not expose a host step that skips its gradients' copy"


def test_the_setting_is_read_and_checked(monkeypatch):
    monkeypatch.delenv("KARMA_CHAOS", raising=False)
    assert Chaos.from_env() is None
    monkeypatch.setenv("KARMA_CHAOS", "0")
    assert Chaos.from_env() is None
    monkeypatch.setenv("KARMA_CHAOS", "7:20")
    chaos = Chaos.from_env()
    assert (chaos.seed, chaos.max_pause_s) == (7, 0.02)
    monkeypatch.setenv("KARMA_CHAOS", "seven")
    with pytest.raises(KarmaError, match="SEED or SEED:MAX_MS"):
        Chaos.from_env()


def test_each_rank_pauses_differently(monkeypatch):
    """The ranks' threads have the same names; without the rank in the seed every rank would
    pause in step with the others."""
    def pauses(rank: int) -> list[float]:
        monkeypatch.setattr("karma.runtime.replay.chaos._rank", lambda: rank)
        chaos = Chaos(1, 0.02)
        slept: list[float] = []
        with monkeypatch.context() as m:  # the pauses, recorded instead of slept
            m.setattr("karma.runtime.replay.chaos.time", SimpleNamespace(sleep=slept.append))
            for _ in range(20):
                chaos.pause()
        return slept

    assert pauses(0) == pauses(0) and pauses(1) == pauses(1)  # seeded
    assert pauses(0) != pauses(1)
