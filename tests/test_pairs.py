"""Two blocks recomputed under one checkpoint ([Note: a checkpoint over two blocks] in
karma/schedule.py): a block with `with_next` and the next one.

The schedules are baselines whose recomputing blocks are paired wherever the blocks allow it
(karma.testing.exactness.plan's `paired`): they train bitwise equal to plain PyTorch (dropout
drawing the same numbers, BatchNorm's statistics updated once, autocast, selective policies,
and every training option together) on one rank and on two, each block's forward running
once more in the pair's recompute. What
the first block returns is gone from the forward to the backward (the memory the pair is
for); a model that makes something between the two blocks is refused with the block's name.
The planner offers the pair where the IR allows it and the first block's output is saved by
both blocks, its fragments hold what a pair holds, the ILP keeps both halves together, the
checks refuse the edits the runtime cannot follow, and karma-inspect counts the pairs.
"""

from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch

from karma.cli.inspect import check_predicted, render, summary
from karma.errors import KarmaError
from karma.planner.hardware import load_hardware
from karma.planner.lowering import (
    Choice,
    Stages,
    fragment,
    valid_choices,
)
from karma.planner.pairs import mark_pairs, offers_pair
from karma.planner.problem import HeldSaved, build_problem, joins_next
from karma.runtime.replay.pair import Pairs
from karma.runtime.replay.training_options import MixedPrecision
from karma.schedule import BlockEntry, ScheduleFileError, dump_schedule
from karma.schedule_check import validate
from karma.schedule_load import load_schedule
from karma.selective_policy import SELECTIVE_POLICY
from karma.testing.exactness import (
    assert_bitwise_equal,
    block_graph,
    host_stepped,
    load_with_env,
    plan,
    run,
)
from tests.dist_helpers import train_job
from tests.runtime_helpers import load_small
from tests.test_runtime import STEPS, Probe, load_model_pt
from tests.test_selective import RANKS, assert_ranks_follow_the_averaged_loop, reference
from tests.test_training_options import OPTIONS, model_file
from tests.test_training_options import STEPS as TRAINING_STEPS
from tests.test_training_options import reference as option_reference

CASES = [("resnet", "recompute_all", "fp32"), ("gpt", "selective_all", "bf16"),
         ("hf_gpt2", "recompute_all", "fp32"), ("mlp", "recompute_all", "fp32"),
         ("resnet", "selective_all", "bf16")]
FAST = CASES[:2]  # BatchNorm; dropout, autocast and selective policies


def paired_plan(name: str, strategy: str, dtype: str, **options):
    schedule = plan(load_small(name), strategy, dtype=dtype, paired=True, **options)
    assert any(b.with_next for b in schedule.blocks), "no pair: the test proves nothing"
    return schedule


def case_id(name, strategy, dtype) -> str:
    return f"{name}-{strategy}-{dtype}"


# --- the runtime ---------------------------------------------------------------------------

@pytest.mark.parametrize("name,strategy,dtype", [
    pytest.param(*c, id=case_id(*c), marks=() if c in FAST else pytest.mark.slow)
    for c in CASES])
def test_pairs_train_bitwise_equal_to_plain_pytorch(name, strategy, dtype, tmp_path):
    schedule = paired_plan(name, strategy, dtype)
    ref = reference(name, dtype, **host_stepped(schedule))
    probe = Probe(load_small(name), schedule)

    report = run(schedule, probe.mf, STEPS, checkpoint_dir=tmp_path)

    assert report.losses == ref.losses
    assert_bitwise_equal(load_model_pt(tmp_path, STEPS), ref.model.state_dict())
    # both blocks of each pair ran their forward again, once a step
    paired = [b.index for b in schedule.blocks if b.with_next]
    for i in paired:
        assert probe.calls[i] == probe.calls[i + 1] == 2 * STEPS, probe.calls


@pytest.mark.parametrize("name", ["resnet", pytest.param("gpt", marks=pytest.mark.slow)])
def test_pairs_with_every_training_option_equal_the_plain_loop(name, tmp_path):
    """bf16, four micro-batches a step, gradient clipping and a LambdaLR together (the test
    matrix's "all", tests/test_training_options.py)."""
    options, scheduled = OPTIONS["all"]
    schedule = plan(load_small(name), "recompute_all", paired=True, **options)
    assert any(b.with_next for b in schedule.blocks)
    report = run(schedule, model_file(name, scheduled), TRAINING_STEPS,
                 checkpoint_dir=tmp_path)
    ref = option_reference(name, "all", **host_stepped(schedule))
    assert report.losses == ref.losses and report.grad_norms == ref.grad_norms
    assert_bitwise_equal(load_model_pt(tmp_path, TRAINING_STEPS), ref.model.state_dict())


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory) -> dict:
    """The fast cases planned for two ranks (sharded host state), paired, trained in one
    launch of tests/dist_worker.py."""
    schedules = {case_id(*c): paired_plan(*c, world_size=RANKS, host_state="sharded")
                 for c in FAST}
    runs = train_job(tmp_path_factory.mktemp("pairs-ranks"), schedules, STEPS, RANKS, 900)
    return {c: runs[case_id(*c)] for c in FAST}


@pytest.mark.parametrize("name,strategy,dtype", FAST, ids=[case_id(*c) for c in FAST])
def test_two_ranks_of_pairs_equal_one_process_averaging_them(two_rank_runs, name, strategy,
                                                            dtype):
    schedule, out = two_rank_runs[(name, strategy, dtype)]
    assert any(b.with_next for b in load_schedule(out / "schedule.yaml").blocks)
    assert_ranks_follow_the_averaged_loop(out, reference(name, dtype, RANKS,
                                                         **host_stepped(schedule)))


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.fc(x))


def entry(index: int, act: str = "recompute", with_next: bool = False) -> BlockEntry:
    return BlockEntry(index, f"l{index}", (f"l{index}",), (), (), act, "resident", "device", 0,
                      0, policy=SELECTIVE_POLICY if act == "selective" else "",
                      with_next=with_next)


def run_pair(between=None, pairs: Pairs | None = None):
    """Two layers, the first with with_next, called through Pairs as the hooks call them;
    `between`: what the caller does to the first layer's output before the second takes it.
    (the loss, a weak reference to the first layer's output, the two layers)"""
    torch.manual_seed(0)
    layers = [Layer(), Layer()]
    blocks = [entry(0, with_next=True), entry(1)]
    pairs = pairs or Pairs(blocks, MixedPrecision("cpu", None))
    x = torch.randn(4, 8, requires_grad=True)
    try:
        h = pairs.call(blocks[0], layers[0].forward, [], (x,), {})
        made = weakref.ref(h)
        if between is not None:
            h = between(h)
        out = pairs.call(blocks[1], layers[1].forward, [], (h,), {})
    except BaseException:
        pairs.abandon()  # as the engine does when a step fails (BlockHooks.stop)
        raise
    del h
    return out.square().sum(), made, layers


def test_what_the_first_block_returns_is_gone_until_the_backward_makes_it_again():
    loss, made, layers = run_pair()
    assert made() is None  # held by nothing: the second block's saved input is the pair's
    loss.backward()
    torch.manual_seed(0)
    plain = [Layer(), Layer()]
    x = torch.randn(4, 8, requires_grad=True)
    plain[1](plain[0](x)).square().sum().backward()
    for a, b in zip(layers, plain):
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("between,what", [
    (lambda h: h * 2, "made a tensor the second block takes"),  # saves nothing
    (lambda h: h.mul_(0.5), "changed in place a tensor the first block returned"),
    (lambda h: torch.sigmoid(h), "autograd saved a tensor of shape \\(4, 8\\)"),
])
def test_what_runs_between_the_two_blocks_is_refused_naming_them(between, what):
    """[Note: nothing between the two blocks] in karma/runtime/replay/pair.py: a hook or the
    caller's code between the two calls, which the recompute would not run again."""
    with pytest.raises(KarmaError, match=r"between block 0 \(l0\) and block 1 \(l1\), which "
                                         rf"recompute under one checkpoint .*{what}.*karma-plan "
                                         r"--no-pairs"):
        run_pair(between=between)


@pytest.mark.parametrize("between", [lambda h: h * 2, torch.sigmoid])
def test_a_forward_that_stops_inside_a_pair_closes_its_checkpoint(between):
    pairs = Pairs([entry(0, with_next=True), entry(1)], MixedPrecision("cpu", None))
    with pytest.raises(KarmaError):
        run_pair(between=between, pairs=pairs)
    # the failed pair's saved-tensor hooks are gone: a plain forward saves as usual
    w = torch.randn(3, requires_grad=True)
    (w * w).sum().backward()
    assert torch.equal(w.grad, 2 * w)
    loss, _, _ = run_pair(pairs=pairs)  # and the next pair works
    loss.backward()


class InPlace(Layer):
    def forward(self, x):
        return torch.relu_(self.fc(x))  # changes what its linear layer returned


def test_a_kept_output_changed_in_place_in_a_pair_names_its_block_and_the_fix():
    blocks = [entry(0, "selective", with_next=True), entry(1, "selective")]
    pairs = Pairs(blocks, MixedPrecision("cpu", None))
    layers = [Layer(), InPlace()]
    h = pairs.call(blocks[0], layers[0].forward, [], (torch.randn(4, 8),), {})
    out = pairs.call(blocks[1], layers[1].forward, [], (h,), {})
    with pytest.raises(KarmaError, match=r"block 1 \(l1\) is selective .*make that op out "
                                         r"of place"):
        out.sum().backward()


# --- the planner ---------------------------------------------------------------------------

def test_the_ir_allows_a_pair_of_layers_but_not_a_block_with_its_callers_ops():
    resnet = block_graph(load_small("resnet"))
    joins = dict(zip((b.name for b in resnet.blocks), joins_next(resnet)))
    assert joins["layer1.0"] and joins["layer3.1"]
    assert not joins["head"] and not joins["tail"] and not joins["layer4.1"]  # tail next
    # the MLP's head is its input layer and a ReLU its caller applies: not one module call
    mlp = block_graph(load_small("mlp"))
    assert mlp.blocks[0].modules == ("inp",) and not mlp.blocks[0].one_call
    assert not joins_next(mlp)[0] and joins_next(mlp)[1]


def resnet_problem():
    graph = block_graph(load_small("resnet"))
    return build_problem(graph, load_hardware("v100-16g"))


def test_a_pair_recomputes_the_first_block_before_the_second_and_frees_its_output_early():
    problem = resnet_problem()
    i = next(k for k, b in enumerate(problem.blocks) if b.joins_next)
    st = Stages(len(problem.blocks), problem.world_size)
    alone = fragment(problem, i, Choice("recompute"))
    first = fragment(problem, i, Choice("recompute", with_next=True))
    second = fragment(problem, i + 1, Choice("recompute", with_prev=True))

    def stage(f, key):
        return next(o.stage for o in f.ops if o.key == key)

    def buf(f, prefix):
        return next(b for b in f.buffers if b.name.startswith(prefix))

    assert stage(alone, ("recompute", i)) == st.bwd(i)
    assert stage(first, ("recompute", i)) == st.bwd(i + 1)
    # its output, which the next block saves too: held to that block's backward alone,
    # to its forward in a pair
    assert buf(alone, f"shared.{i}.{i}.").free == ("backward", i + 1)
    assert buf(first, f"shared.{i}.{i}.").free == ("forward", i + 1)
    assert buf(first, f"shared.{i}.{i}.").bytes > 0
    # the second block checkpoints no input
    assert not any(b.name == f"ckpt.{i + 1}" for b in second.buffers)
    assert problem.blocks[i + 1].ckpt_bytes > 0 or problem.blocks[i + 1].held_in_bytes > 0
    # what an earlier block made and the pair's first block reads (a skip connection around
    # the pair) is held as it would be without the pair
    skip = HeldSaved(i - 1, i, i + 2, 1 << 20)
    around = dataclasses.replace(problem, held_saved=problem.held_saved + (skip,))
    name = f"shared.{i - 1}.{i}.{i + 2}"
    assert buf(fragment(around, i, Choice("recompute", with_next=True)), name).free == \
        buf(fragment(around, i, Choice("recompute")), name).free == ("backward", i)


def test_the_planner_offers_pairs_where_the_first_blocks_output_is_shared():
    """A ResNet block's output, saved by its last ReLU and the next block: offered. A
    transformer layer's, saved by the next layer alone: the IR allows the pair, the planner
    does not offer it (pairs.offers_pair)."""
    gpt = build_problem(block_graph(load_small("gpt")), load_hardware("v100-16g"))
    assert any(b.joins_next for b in gpt.blocks)
    assert not any(c.with_next for i in range(len(gpt.blocks)) for c in valid_choices(gpt, i))
    problem = resnet_problem()
    for i, b in enumerate(problem.blocks):
        offered = valid_choices(problem, i)
        firsts = [c for c in offered if c.with_next]
        assert bool(firsts) == b.joins_next == offers_pair(problem, i)
        assert all(c.weights == "resident" and c.act in ("recompute", "selective")
                   and c.kept == "device" for c in firsts)
        assert not any(c.with_prev for c in offered)  # marked after the solve
    # the second block of a pair: any choice that recomputes, marked with_prev
    first, second = Choice("recompute", with_next=True), Choice("selective", "streamed",
                                                                "host", policy="p")
    assert mark_pairs((first, second)) == (first, dataclasses.replace(second, with_prev=True))
    for no in (Choice("keep"), Choice("swap"), first, Choice("selective", policy="p",
                                                             kept="host")):
        assert mark_pairs((first, no)) is None
    assert mark_pairs((Choice("keep"), first)) is None  # a pair of one block
    with pytest.raises(ValueError, match="not a choice"):
        Choice("keep", with_next=True)
    with pytest.raises(ValueError, match="not a choice"):
        Choice("recompute", "streamed", "host", with_next=True)


def test_resnet_50_on_a_v100_plans_pairs_within_a_tenth_of_the_ideal():
    """The selective-recompute target on the paper's ResNet-50 (batch 512, 16 GiB): the pairs
    take it from 1.126x to under 1.10x the ideal; each pair's halves agree."""
    mf = load_with_env("examples/resnet.py", {"KARMA_RESNET": "50"})
    schedule = plan_on_v100(mf, 512)
    p = schedule.predicted
    assert p.step_s / p.ideal_s <= 1.10, p.step_s / p.ideal_s
    assert any(b.with_next for b in schedule.blocks)
    validate(schedule)


def plan_on_v100(mf, batch: int):
    from karma.api import plan_options, plan_report

    options = plan_options(gpu_mem="16G", hardware="v100-16g", batch_size=batch,
                           measure="estimate")
    return plan_report(mf.path, options, log=lambda _: None).schedule


# --- the schedule ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sched():
    return paired_plan("resnet", "recompute_all", "fp32")


def edit(schedule, index: int, **fields):
    blocks = list(schedule.blocks)
    blocks[index] = dataclasses.replace(blocks[index], **fields)
    return dataclasses.replace(schedule, blocks=tuple(blocks))


def test_a_paired_schedule_round_trips_and_passes_the_checks(sched, tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(dump_schedule(sched))
    assert "with_next: true" in path.read_text()
    assert load_schedule(path).blocks == sched.blocks
    validate(sched)


@pytest.mark.parametrize("change,message", [
    (lambda s, i: edit(s, i + 1, act="keep"), r"has act: keep .*both blocks of a checkpoint "
                                              r"over two recompute"),
    (lambda s, i: edit(s, i, weights="streamed", optim="host"), r"weights: streamed"),
    (lambda s, i: edit(s, i + 1, with_next=True), r"a checkpoint covers two blocks at most"),
    (lambda s, i: edit(s, len(s.blocks) - 1, with_next=True), r"is the last block"),
    (lambda s, i: edit(s, 0, with_next=True), r"modules .*one module call each"),
])
def test_the_checks_refuse_a_pair_the_runtime_cannot_run(sched, change, message):
    i = next(b.index for b in sched.blocks if b.with_next)
    with pytest.raises(ScheduleFileError, match=message):
        validate(change(sched, i))


def test_the_checks_refuse_a_pair_whose_recomputes_are_out_of_order(sched):
    i = next(b.index for b in sched.blocks if b.with_next)
    with pytest.raises(ScheduleFileError, match="compute order"):
        validate(edit(sched, i, with_next=False))


def test_a_schedule_file_with_a_with_next_that_is_not_a_flag_is_refused(sched, tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(dump_schedule(sched).replace(", with_next: true,", ", with_next: 3,", 1))
    with pytest.raises(ScheduleFileError, match=r"with_next: 3 is not true or false"):
        load_schedule(path)


def test_inspect_counts_the_pairs(sched, tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(dump_schedule(sched))
    info = summary(sched, check_predicted(sched, str(path)), str(path))
    n = sum(b.with_next for b in sched.blocks)
    assert info["decisions"]["pairs"] == n > 0
    assert f"{n} pair(s) recomputed under one checkpoint" in render(info)
    assert [b["with_next"] for b in info["blocks"]] == [b.with_next for b in sched.blocks]
