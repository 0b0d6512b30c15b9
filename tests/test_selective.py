"""Selective blocks train bitwise equal to plain PyTorch and keep what their policy names.

A selective block ([Note: selective recompute] in karma/selective_policy.py) has the ops of a
recompute block; what differs is what its checkpoint keeps: the outputs of the ops its policy
names (save-matmuls: matmuls, convolutions, attention), every other op running again just
before its backward. The schedules here are recompute_all and offload_all (recompute with
streamed weights and host steps) with every block made selective (the test matrix trains the
planner's own selective plans: tests/matrix.py). They train three small models (dropout, whose
recompute must draw the same numbers; BatchNorm, whose running statistics must be updated
once; a plain residual stack) in fp32 and bf16, on one rank and on two, bitwise equal to
karma.reference's loop. Counting the ATen ops each recompute runs shows that a selective block
really is not a whole-block recompute: it runs every op the plain recompute runs but the
matmuls.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import textwrap
from collections import Counter, defaultdict
from functools import cache

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import karma.runtime.replay.selective as contexts
from karma.errors import KarmaError
from karma.reference import train_reference
from karma.schedule import Schedule
from karma.schedule_load import load_schedule
from karma.selective_policy import SELECTIVE_POLICIES, SELECTIVE_POLICY
from karma.testing.exactness import (
    assert_bitwise_equal,
    block_graph,
    host_stepped,
    load_with_env,
    plan,
    run,
)
from tests.dist_helpers import train_job
from tests.matrix import MODELS
from tests.runtime_helpers import load_small
from tests.test_distributed import final_parameters
from tests.test_runtime import STEPS, Probe, load_model_pt

STRATEGIES = ("recompute_all", "offload_all")  # whose blocks all recompute
DTYPES = ("fp32", "bf16")
RANKS = 2
SAVED = SELECTIVE_POLICIES[SELECTIVE_POLICY]  # what the policy keeps: operator names


def selective(schedule: Schedule, policies: list[str] | None = None) -> Schedule:
    """`schedule` (every block recompute) with every block selective: the same ops; each
    under its policy of `policies`, or SELECTIVE_POLICY (every matmul kept)."""
    assert {b.act for b in schedule.blocks} == {"recompute"}
    policies = policies or [SELECTIVE_POLICY] * len(schedule.blocks)
    blocks = tuple(dataclasses.replace(b, act="selective", policy=policy)
                   for b, policy in zip(schedule.blocks, policies))
    return dataclasses.replace(schedule, blocks=blocks)


def least_kept(name: str) -> list[str]:
    """Each block's policy that keeps least (the cheapest matmuls recomputed too:
    karma/selective_policy.py), as the IR offers them; SELECTIVE_POLICY where it offers none."""
    return [b.selective[-1].policy if b.selective else SELECTIVE_POLICY
            for b in block_graph(load_small(name)).blocks]


@cache
def reference(name: str, dtype: str, world_size: int = 1, **host):
    """karma.reference's loop in `dtype`, `host` (host_stepped's) stepped as a schedule's
    host-stepped blocks; with several ranks on one thread, as each rank runs."""
    mf = load_small(name)
    threads = torch.get_num_threads()
    if world_size > 1:
        torch.set_num_threads(1)
    try:
        return train_reference(mf, block_graph(mf, dtype).batch_size, STEPS,
                               world_size=world_size, dtype=dtype, **host)
    finally:
        torch.set_num_threads(threads)


def case_id(name: str, strategy: str, dtype: str) -> str:
    return f"{name}-{strategy}-{dtype}"


CASES = [(name, strategy, dtype) for name in MODELS for strategy in STRATEGIES
         for dtype in DTYPES]
FAST = ("gpt", "offload_all", "bf16")  # dropout, streamed weights, host steps and autocast


# --- one rank --------------------------------------------------------------------------------

@pytest.mark.parametrize("name,strategy,dtype", [
    pytest.param(*c, id=case_id(*c), marks=() if c == FAST else pytest.mark.slow)
    for c in CASES])
def test_selective_blocks_train_bitwise_equal_to_plain_pytorch(name, strategy, dtype,
                                                               tmp_path):
    schedule = selective(plan(load_small(name), strategy, dtype=dtype))
    ref = reference(name, dtype, **host_stepped(schedule))
    probe = Probe(load_small(name), schedule)

    report = run(schedule, probe.mf, STEPS, checkpoint_dir=tmp_path)

    assert report.losses == ref.losses
    # parameters and buffers: a ResNet's running statistics updated once a step, not twice
    assert_bitwise_equal(load_model_pt(tmp_path, STEPS), ref.model.state_dict())
    # each block's forward ran again in its recompute (what it ran is counted below)
    assert probe.calls and all(calls == 2 * STEPS for calls in probe.calls.values()), \
        probe.calls


def test_the_running_statistics_would_differ_without_the_restore(tmp_path, monkeypatch):
    """The control of the test above: a ResNet's selective recompute runs its BatchNorms
    again, so without the buffers' restore their statistics move twice a step (and the
    parameters, normalized by the batch's statistics, do not notice)."""
    monkeypatch.setattr(contexts, "restore_buffers", lambda buffers: contextlib.nullcontext())
    schedule = selective(plan(load_small("resnet"), "recompute_all"))
    run(schedule, load_small("resnet"), STEPS, checkpoint_dir=tmp_path)
    trained, expected = load_model_pt(tmp_path, STEPS), reference("resnet", "fp32",
                                                                   **host_stepped(schedule))
    params = {n: p.detach() for n, p in expected.model.named_parameters()}
    assert_bitwise_equal({n: trained[n] for n in params}, params)
    with pytest.raises(AssertionError, match="running_mean"):
        assert_bitwise_equal(trained, expected.model.state_dict())


# --- what a selective recompute runs ---------------------------------------------------------

class RecomputedOps(TorchDispatchMode):
    """Counts the ATen operators each block's recompute runs, by operator name.

    Like tests/test_runtime.py's Probe, it wraps the forward of each one-module block before
    the runtime wraps it in its checkpoint; a call made during a backward is the recompute.
    Entered around the whole run, this mode sits under the selective contexts' dispatch mode:
    it sees only the ops that really run again, not those answered from what was kept."""

    def __init__(self, mf, schedule: Schedule):
        super().__init__()
        self.schedule = schedule
        self.ops: dict[int, Counter] = defaultdict(Counter)  # block -> op name -> calls
        self._recomputing: int | None = None
        self._build = mf.build_model
        self.mf = dataclasses.replace(mf, build_model=self.build)

    def build(self) -> torch.nn.Module:
        model = self._build()
        modules = dict(model.named_modules())
        for b in self.schedule.blocks:
            if len(b.modules) == 1:
                module = modules[b.modules[0]]
                module.forward = self._marked(b.index, module.forward)
        return model

    def _marked(self, block: int, forward):
        def marked(*args, **kwargs):
            if torch._C._current_graph_task_id() == -1:  # not inside a backward
                return forward(*args, **kwargs)
            self._recomputing = block
            try:
                return forward(*args, **kwargs)
            finally:
                self._recomputing = None
        return marked

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._recomputing is not None:
            self.ops[self._recomputing][func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def recomputed_ops(name: str, schedule: Schedule) -> dict[int, Counter]:
    counter = RecomputedOps(load_small(name), schedule)
    with counter:
        run(schedule, counter.mf, 1)
    return counter.ops


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "resnet" else pytest.mark.slow)
                                  for n in MODELS])
def test_a_selective_recompute_runs_all_but_the_matmuls(name):
    """Beside the plain recompute of the same blocks: the same ops (norms, activations,
    dropout's draws, residual adds), the same number of times, but none the policy keeps."""
    whole = recomputed_ops(name, plan(load_small(name), "recompute_all"))
    kept = recomputed_ops(name, selective(plan(load_small(name), "recompute_all")))

    assert whole.keys() == kept.keys() and whole
    with_matmuls = [i for i, ops in whole.items() if ops.keys() & SAVED]
    assert with_matmuls, "the plain recompute ran no matmul: the test proves nothing"
    for i, ops in whole.items():
        assert kept[i] == Counter({op: n for op, n in ops.items() if op not in SAVED}), i
    for i in with_matmuls:  # a norm runs again: it is recomputed, not kept
        assert kept[i].keys() & {"native_layer_norm", "native_batch_norm"}, kept[i]


def test_a_threshold_recomputes_the_cheaper_convolutions_and_trains_bitwise(tmp_path):
    """A ResNet's bottlenecks under the policy that keeps least: the 3x3 convolution's output
    kept, the 1x1 convolutions (fewer FLOPs an element) run again; bitwise as ever."""
    policies = least_kept("resnet")
    thresholds = [i for i, p in enumerate(policies) if "@" in p]
    assert thresholds, policies
    base = plan(load_small("resnet"), "recompute_all")
    schedule = selective(base, policies)
    ref = reference("resnet", "fp32", **host_stepped(schedule))
    report = run(schedule, load_small("resnet"), STEPS, checkpoint_dir=tmp_path)
    assert report.losses == ref.losses
    assert_bitwise_equal(load_model_pt(tmp_path, STEPS), ref.model.state_dict())

    whole = recomputed_ops("resnet", base)
    kept = recomputed_ops("resnet", schedule)
    for i in thresholds:
        assert 0 < kept[i]["convolution"] < whole[i]["convolution"], (i, kept[i], whole[i])


# A layer whose linear output an in-place ReLU changes: the policy keeps that output.
IN_PLACE_MODEL = textwrap.dedent('''
    """Residual layers whose linear output is changed in place (ReLU(inplace=True))."""
    import torch
    import torch.nn as nn

    BATCH_SIZE = 4


    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)
            self.act = nn.ReLU(inplace=True)

        def forward(self, x):
            return x + self.act(self.fc(x))


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(2))
            self.out = nn.Linear(16, 16)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.out(x)


    def build_model():
        return Net()


    def example_batch(batch_size):
        return torch.randn(batch_size, 16), torch.randint(0, 16, (batch_size,))
''')


def test_a_kept_output_changed_in_place_names_the_block_and_the_fix(tmp_path):
    path = tmp_path / "in_place.py"
    path.write_text(IN_PLACE_MODEL)
    mf = load_with_env(path)
    recompute = plan(mf, "recompute_all")
    run(recompute, mf, 1)  # a whole-block recompute keeps nothing of the forward: fine
    with pytest.raises(KarmaError, match=r"block 1 \(layers\.1\) is selective .*in place.*"
                                         r"make that op out of place"):
        run(selective(recompute), mf, 1)


# --- two ranks -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory) -> dict:
    """Every case planned for two ranks (sharded host state) and made selective, trained in
    one launch of tests/dist_worker.py: case -> (schedule, its run's directory)."""
    schedules = {case_id(*case): selective(plan(load_small(case[0]), case[1], world_size=RANKS,
                                                host_state="sharded", dtype=case[2]))
                 for case in CASES}
    runs = train_job(tmp_path_factory.mktemp("selective-ranks"), schedules, STEPS, RANKS, 900)
    return {case: runs[case_id(*case)] for case in CASES}


@pytest.mark.slow
@pytest.mark.parametrize("name,strategy,dtype", CASES, ids=[case_id(*c) for c in CASES])
def test_two_ranks_of_selective_blocks_equal_one_process_averaging_them(two_rank_runs, name,
                                                                       strategy, dtype):
    """Parameters only: the reference's buffers see every rank's batch (karma.reference)."""
    schedule, out = two_rank_runs[(name, strategy, dtype)]
    ran = load_schedule(out / "schedule.yaml")  # what the ranks loaded: selective blocks
    assert {(b.act, b.policy) for b in ran.blocks} == {("selective", SELECTIVE_POLICY)}
    assert_ranks_follow_the_averaged_loop(out, reference(name, dtype, RANKS,
                                                         **host_stepped(schedule)))


def assert_ranks_follow_the_averaged_loop(out, ref) -> None:
    """A 2-rank run in `out` (tests/dist_worker.py's): the parameters bitwise the
    gradient-averaged reference's `ref`, each rank's losses its own, no protocol violation."""
    ref_params = {n: p.detach() for n, p in ref.model.named_parameters()}
    assert_bitwise_equal(final_parameters(out, ref_params), ref_params)
    for rank in range(RANKS):
        report = json.loads((out / f"rank{rank}.json").read_text())
        assert report["losses"] == ref.rank_losses[rank]
        assert not report["protocol"]["violations"], report["protocol"]["violations"][:5]
