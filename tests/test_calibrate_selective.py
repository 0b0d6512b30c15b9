"""The selective recompute timed (karma/ir/timing.py, [Note: timing the selective recompute])
and carried to the planner (karma/calibrate: alone, and in context by the ratio timed alone)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from karma.calibrate.blocks import Timed, read_times, selective_ratios
from karma.calibrate.cache import CACHE_VERSION, cache_path, write
from karma.calibrate.in_context import _with_selective
from karma.errors import KarmaError
from karma.ir.build import build_block_graph
from karma.ir.timing import BlockTimes, time_blocks
from karma.modelfile import load_model_file
from karma.planner.hardware import load_hardware
from karma.planner.lowering import Choice, fragment
from karma.planner.problem import build_problem
from karma.schedule import round_seconds
from karma.selective_policy import SELECTIVE_POLICY

S = SELECTIVE_POLICY  # every matmul kept: the policy every block with a matmul offers


def every(*seconds) -> tuple[dict[str, float], ...]:
    """Per block, its selective recompute's seconds under S (None: no time for it)."""
    return tuple({} if s is None else {S: s} for s in seconds)


@pytest.fixture
def one_thread():
    """Time on one thread: on a shared 2-core machine two OpenMP threads wait on each other
    for whole time slices (a ResNet block of 0.3 ms once took 185 ms)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Blocks where the matmuls carry the work: at the tiny sizes the dispatch modes' Python per
# op outweighs the ops the policy skips (the tiny GPT's layers recompute in 1.8x their
# forward), so "cheaper than the forward" needs blocks of some width.
@pytest.mark.parametrize("name, env, batch, blocks", [
    ("gpt", {"KARMA_GPT": "2x256x4x128", "KARMA_SEQ": "128"}, 2, ("h.0", "h.1")),
    ("resnet", {"KARMA_RESNET": "50", "KARMA_RESNET_IMAGE": "32"}, 2,
     ("layer3.1", "layer4.1")),
])
def test_a_selective_recompute_is_timed_below_its_forward(example, one_thread, name, env,
                                                          batch, blocks):
    times = time_blocks(example(name, **env), batch)
    assert all(s[S] > 0 for s in times.selective_s)  # every block can run it
    for block in blocks:  # these skip matmuls or convolutions that carry most of the forward
        i = times.names.index(block)
        assert times.selective_s[i][S] < times.fwd_bwd_s[i][0], (block, times)


def test_each_policy_a_block_offers_is_timed(example, one_thread):
    # a ResNet bottleneck's policies keep ever fewer convolutions: each recompute runs more
    mf = example("resnet", KARMA_RESNET="50", KARMA_RESNET_IMAGE="32")
    graph = build_block_graph(mf, 2)
    i = next(k for k, b in enumerate(graph.blocks) if b.name == "layer3.1")
    policies = tuple(s.policy for s in graph.blocks[i].selective)
    assert len(policies) == 3
    times = time_blocks(mf, 2, policies=[policies if k == i else () for k in
                                         range(len(graph.blocks))])
    assert list(times.selective_s[i]) == list(policies)
    # the same-shaped blocks after it share its times; a block of another shape: none asked
    assert times.selective_s[i + 1] == times.selective_s[i]
    assert times.selective_s[times.names.index("layer2.1")] == {}
    # keeping least, the recompute runs two of the three convolutions again
    assert times.selective_s[i][policies[-1]] > times.selective_s[i][policies[0]]


INPLACE_RELU = ("return x + self.act(self.norm(self.fc(x)))",
                "return x + self.norm(torch.relu_(self.fc(x)))")


def test_a_block_whose_policy_cannot_run_gets_none(example, tmp_path):
    # a ReLU in place on a linear layer's output: the output the policy keeps has changed
    mf = example("mlp")
    text = mf.path.read_text()
    assert INPLACE_RELU[0] in text
    path = tmp_path / "inplace_mlp.py"
    path.write_text(text.replace(*INPLACE_RELU))
    inplace = load_model_file(path)
    times = time_blocks(inplace, 2, repeats=1)
    graph = build_block_graph(inplace, 2)
    # the IR finds the same blocks, op by op on meta tensors
    assert [bool(s) for s in times.selective_s] == [bool(b.selective) for b in graph.blocks] \
        == [True, False, False, False, False, True]
    assert all(s > 0 for by in times.selective_s for s in by.values())


def test_a_forward_only_timing_leaves_out_the_backward_and_the_step(example):
    times = time_blocks(example("gpt"), 2, repeats=1, forward_only=True)
    assert all(f > 0 and b == 0 for f, b in times.fwd_bwd_s)
    assert all(s[S] > 0 for s in times.selective_s)
    assert set(times.step_s) == {(0.0, 0.0)} and set(times.stepped_bytes) == {0}


def test_a_measured_selective_recompute_is_the_plans_on_each_rank(example):
    # the recompute op of a selective choice: the measured seconds times the rank share (on
    # the CPU, k ranks of a node share its cores: RankShare); where not measured, the roofline's
    graph = build_block_graph(example("gpt"), 2)
    hw = load_hardware("cpu")
    n = len(graph.blocks)
    block_s = tuple((1e-3 * (i + 1), 2e-3) for i in range(n))
    seconds = (None, 2.5e-4, 3.5e-4, None)
    timed = Timed(block_s, ((0.0, 0.0),) * n, 0, "block by block", selective_s=every(*seconds))
    assert timed.measured.selective_s == every(*seconds)
    estimated = build_problem(graph, hw, measured=replace(timed.measured, selective_s=None))
    for ranks in (1, 2):
        problem = build_problem(graph, hw, world_size=ranks, measured=timed.measured,
                                nproc_per_node=ranks)
        for i, b in enumerate(graph.blocks):
            if not b.selective:  # the embedding: no matmul to keep
                continue
            (op,) = [o for o in fragment(problem, i, Choice("selective", policy=S)).ops
                     if o.kind == "recompute"]
            if seconds[i] is None:  # the roofline's share of the forward
                want = estimated.blocks[i].selective_under(S).recompute_s * ranks
            else:
                want = seconds[i] * ranks
            got = problem.blocks[i].selective_under(S).recompute_s
            assert got == pytest.approx(want)
            assert op.dur_s == round_seconds(got)


def fake_times(graph, batch: int, fwd_s, selective_s, names=None) -> BlockTimes:
    """time_blocks's answer for `graph`, made up: forwards `fwd_s`, selective `selective_s`."""
    n = len(graph.blocks)
    return BlockTimes(tuple((f, 2 * f) for f in fwd_s), every(*selective_s), ((0.0, 0.0),) * n,
                      (0,) * n, batch, n, names or tuple(b.name for b in graph.blocks))


def test_blocks_timed_alone_carry_their_selective_recompute_scaled_to_the_batch(
        example, monkeypatch, tmp_path):
    from karma.calibrate import blocks

    graph = build_block_graph(example("gpt"), 4)
    monkeypatch.setattr(blocks, "time_blocks", lambda mf, batch, *args, **kwargs: fake_times(
        graph, batch, (0.5, 1.0, 1.0, 0.5), (0.25, 0.5, 0.5, None)))
    monkeypatch.setattr(blocks, "timing_batch", lambda graph, roofline_s: 1)
    timed, how = blocks.timed_alone(example("gpt"), graph, [0.0] * 4, "cpu", None,
                                    tmp_path / "x.json", lambda line: None)
    assert how["timed_batch_size"] == 1
    assert timed.fwd_bwd_s == ((2.0, 4.0), (4.0, 8.0), (4.0, 8.0), (2.0, 4.0))
    assert timed.selective_s == every(1.0, 2.0, 2.0, None)  # batch 4 over 1, as the forward
    assert timed.measured.selective_s == every(1.0, 2.0, 2.0, None)


def test_in_context_the_forward_times_the_ratio_timed_alone():
    # [Note: the selective recompute in context]
    timed = Timed(((0.2, 0.4), (1.0, 2.0), (3.0, 1.0)), ((0.0, 0.0),) * 3, 0,
                  "in a keep_all step")
    said = []
    with_ratio = _with_selective(timed, lambda: every(0.5, None, 0.25), said.append)
    assert with_ratio.selective_s == every(0.1, None, 0.75) and not said
    assert with_ratio.fwd_bwd_s == timed.fwd_bwd_s

    def fails():
        raise KarmaError("timing block h.0 on cpu failed: RuntimeError: boom")

    unmeasured = _with_selective(timed, fails, said.append)
    assert unmeasured.selective_s is None and unmeasured.measured.selective_s is None
    assert "boom" in said[0] and "roofline" in said[0]


def test_the_ratios_are_forwards_only_timed_alone_within_a_small_budget(example, monkeypatch):
    from karma.calibrate import blocks

    graph = build_block_graph(example("gpt"), 4)
    calls = []

    def timed_at(mf, batch, *args, **kwargs):
        calls.append((batch, kwargs))
        return fake_times(graph, batch, (2.0, 4.0, 4.0, 1.0), (1.0, 1.0, 1.0, None))

    monkeypatch.setattr(blocks, "time_blocks", timed_at)
    # by the roofline, 20 s for a forward and backward of each distinct block at batch 4: a
    # batch of 1 stays within the ratios' 5 s
    ratios = selective_ratios(example("gpt"), graph, [5.0, 10.0, 10.0, 5.0], "cpu", None,
                              lambda line: None)
    assert calls == [(1, {"forward_only": True,
                          "policies": tuple(tuple(s.policy for s in b.selective)
                                            for b in graph.blocks)})]
    assert ratios == every(0.5, 0.25, 0.25, None)
    monkeypatch.setattr(blocks, "time_blocks", lambda *args, **kwargs: fake_times(
        graph, 1, (1.0,) * 4, (1.0,) * 4, names=("a", "b", "c", "d")))
    with pytest.raises(KarmaError, match="found the blocks a, b, c, d, not the plan's"):
        selective_ratios(example("gpt"), graph, [0.0] * 4, "cpu", None, lambda line: None)


def test_the_cache_keeps_the_selective_recompute_and_an_older_file_is_not_read(
        tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    timed = Timed(((0.2, 0.4), (1.0, 2.0)), ((0.0, 0.0),) * 2, 0, "block by block",
                  selective_s=every(0.1, None))
    path = cache_path("blocks", {"model": "m"})
    write(path, vars(timed), lambda line: None)
    assert read_times(path, 2) == timed
    assert json.loads(path.read_text())["version"] == CACHE_VERSION
    # a file from before the selective recompute was timed lacks it: measured again
    data = json.loads(path.read_text())
    del data["selective_s"]
    path.write_text(json.dumps(data))
    assert read_times(path, 2) is None
    for bad in ([{S: 0.1}], [{S: 0.1}, {S: -1.0}], [{S: 0.1}, {S: "x"}],
                [{S: float("nan")}, {}], [0.1, None]):
        path.write_text(json.dumps({**data, "selective_s": bad}))
        assert read_times(path, 2) is None, bad
    path.write_text(json.dumps({**data, "selective_s": None}))  # not timed: read as such
    assert read_times(path, 2).selective_s is None
