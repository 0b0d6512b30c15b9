"""A selective block with `kept: host` keeps its policy's outputs on the host between its
forward and its recompute ([Note: what a selective block keeps, on the host] in
karma/runtime/replay/kept.py), and trains bitwise equal to plain PyTorch.

The schedules are a baseline's recompute blocks made selective, all but the last keeping
on the host (karma.testing.exactness.plan's kept_on_host): recompute_all and offload_all
(streamed weights and host steps beside the swaps), on the three small models, in fp32 and
bf16, on one rank and on two, under chaos timing too. The bytes each swap moves are the
bytes the plan gives its swap ops; the schedule's checks refuse the edits that break the
decision, and karma-inspect shows it.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from dataclasses import replace

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from karma.cli.inspect import check_predicted, render, summary
from karma.planner.hardware import load_hardware
from karma.planner.lowering import Choice, valid_choices
from karma.planner.problem import build_problem
from karma.runtime.backends.backend import CpuBackend
from karma.runtime.host.tier import HostPool
from karma.runtime.replay import kept as kept_module
from karma.runtime.replay.kept import KeptSwap
from karma.runtime.replay.selective import _MUTATED as MUTATED
from karma.runtime.replay.streams import StreamWorker
from karma.runtime.replay.tables import DivergedError
from karma.schedule import Schedule, ScheduleFileError, dump_schedule
from karma.schedule_check import validate
from karma.schedule_load import load_schedule
from karma.selective_policy import SELECTIVE_POLICY, checkpoint_policy
from karma.testing.exactness import (
    assert_bitwise_equal,
    block_graph,
    host_stepped,
    plan,
    run,
)
from tests.dist_helpers import train_job
from tests.runtime_helpers import load_small
from tests.test_runtime import STEPS, load_model_pt
from tests.test_selective import RANKS, assert_ranks_follow_the_averaged_loop, reference

CPU = CpuBackend()  # what KeptSwap asks of a backend: a marker (none on the CPU)
CASES = [("gpt", "offload_all", "bf16"), ("resnet", "recompute_all", "fp32"),
         ("mlp", "recompute_all", "fp32"), ("gpt", "recompute_all", "fp32"),
         ("resnet", "offload_all", "bf16")]
FAST = CASES[:2]  # dropout, streamed weights, host steps, autocast; BatchNorm


def kept_plan(name: str, strategy: str, dtype: str, **options) -> Schedule:
    schedule = plan(load_small(name), strategy, dtype=dtype, kept_on_host=True, **options)
    kept = [b for b in schedule.blocks if b.kept == "host"]
    assert kept and all(b.act == "selective" for b in kept)
    return schedule


def case_id(name, strategy, dtype) -> str:
    return f"{name}-{strategy}-{dtype}"


@pytest.fixture
def moved(monkeypatch) -> dict[str, list[int]]:
    """Block name -> the bytes each of its swap-outs copied to the host tier."""
    out: dict[str, list[int]] = {}
    swap_out = KeptSwap.swap_out

    def counting(self):
        release = swap_out(self)
        out.setdefault(self.block, []).append(
            sum(k.host.numel() * k.host.element_size() for k in self._kept))
        return release

    monkeypatch.setattr(KeptSwap, "swap_out", counting)
    return out


# --- one rank ------------------------------------------------------------------------------

@pytest.mark.parametrize("name,strategy,dtype", [
    pytest.param(*c, id=case_id(*c), marks=() if c in FAST else pytest.mark.slow)
    for c in CASES])
def test_kept_on_the_host_trains_bitwise_equal_to_plain_pytorch(name, strategy, dtype,
                                                                moved, tmp_path):
    schedule = kept_plan(name, strategy, dtype)
    ref = reference(name, dtype, **host_stepped(schedule))

    report = run(schedule, load_small(name), STEPS, checkpoint_dir=tmp_path)

    assert report.losses == ref.losses
    assert_bitwise_equal(load_model_pt(tmp_path, STEPS), ref.model.state_dict())
    # each swap moved what the plan says its policy's ops return, every step
    planned = {schedule.blocks[o.block].name: o.bytes for o in schedule.ops
               if o.kind == "swap_out"}
    assert planned and moved == {block: [nbytes] * STEPS for block, nbytes in planned.items()}


def test_the_device_copies_are_dropped_and_the_recompute_gets_them_back():
    """KeptSwap alone, on a checkpointed function: after the swap-out the storage holds no
    tensor; the swap-in gives the recompute the forward's values, so the gradient is the
    one of keeping them on the device; a recompute before the swap-in is refused."""
    pool = HostPool(1 << 20)
    w = torch.randn(8, 8, requires_grad=True)

    def fn(x):
        return torch.relu(x @ w) @ w

    x = torch.randn(4, 8)
    expected = torch.autograd.grad(fn(x).sum(), w)[0]
    policy = checkpoint_policy(SELECTIVE_POLICY)
    store = KeptSwap("f", pool)

    made = []  # the contexts of the call: (forward's caching mode, recompute's cached mode)
    out = checkpoint(fn, x, use_reentrant=False,
                     context_fn=lambda: made.append(store.contexts(policy)) or made[-1])
    release = store.prepare_swap_out()()
    release()
    held = [getattr(leaf, "val", "none") for calls in made[0][0].storage.values()
            for entry in calls.values()
            for leaf in (entry if isinstance(entry, tuple) else (entry,))]
    made.clear()  # the checkpoint's own references to its contexts are the ones that count
    assert held and all(v is None for v in held if v != "none")  # both matmuls' outputs
    fresh = store.allocate()
    back = [weakref.ref(t.untyped_storage()) for t in fresh]  # lives while any tensor uses it
    store.swap_in(fresh, backend=CPU)
    del fresh
    assert all(r() is not None for r in back)
    assert torch.equal(torch.autograd.grad(out.sum(), w)[0], expected)
    # once the recompute has taken them, nothing holds the swapped-in memory: it goes with the
    # block's backward, as planned (sac.N@in), not at the end of the step
    assert all(r() is None for r in back)

    early = KeptSwap("f", pool)
    out = checkpoint(fn, x, use_reentrant=False, context_fn=lambda: early.contexts(policy))
    early.prepare_swap_out()()
    with pytest.raises(DivergedError, match="before their swap-in"):
        torch.autograd.grad(out.sum(), w)


def fill_zeros(t: torch.Tensor) -> None:
    t.zero_()


def test_a_returned_output_changed_in_place_by_the_next_block_is_refused():
    """A kept output that the block returns is held by the next block, which may change it
    in place while the swap-out copies it: the recompute refuses it, as on the device."""
    w = torch.randn(8, 8, requires_grad=True)
    store = KeptSwap("f", HostPool(1 << 20))
    policy = checkpoint_policy(SELECTIVE_POLICY)
    def block(x):  # returns a kept matmul output, which its recompute needs (the relu's input)
        y = x @ w
        return y, torch.relu(y)

    y, z = checkpoint(block, torch.randn(4, 8), use_reentrant=False,
                      context_fn=lambda: store.contexts(policy))
    store.returned((y, z))
    store.prepare_swap_out()()()
    y.mul_(2)  # the next block's in-place op, after the copy
    store.swap_in(store.allocate(), backend=CPU)
    with pytest.raises(RuntimeError, match=MUTATED):
        torch.autograd.grad(z.sum(), w)


def test_a_stream_holds_nothing_of_an_op_it_has_run():
    """A copy stream waiting for its next op no longer references the last one's work (a
    swap-in's fresh tensors would live on, beyond the plan, until the next copy)."""
    events: dict = {"op": threading.Event()}
    stream = StreamWorker("h2d", events, [], CPU)
    held = torch.empty(1 << 10)
    gone = weakref.ref(held)
    stream.submit("op", functools.partial(fill_zeros, held), ())
    del held
    assert events["op"].wait(timeout=10)
    deadline = time.monotonic() + 10
    while gone() is not None and time.monotonic() < deadline:
        time.sleep(0.01)  # the event is set just before the worker lets go of the op
    released = gone() is None
    stream.close()
    assert released


def test_a_kept_output_changed_in_place_is_still_refused():
    """Changed in place during the forward (before its swap-out), a kept output cannot be
    handed back from the host either: the recompute refuses it, as on the device."""
    w = torch.randn(8, 8, requires_grad=True)

    def fn(x):
        return torch.relu_(x @ w) @ w  # the kept matmul output, changed in place

    store = KeptSwap("f", HostPool(1 << 20))
    policy = checkpoint_policy(SELECTIVE_POLICY)
    out = checkpoint(fn, torch.randn(4, 8), use_reentrant=False,
                     context_fn=lambda: store.contexts(policy))
    store.prepare_swap_out()()
    store.swap_in(store.allocate(), backend=CPU)
    with pytest.raises(RuntimeError, match=MUTATED):
        torch.autograd.grad(out.sum(), w)


def test_under_chaos_timing(monkeypatch, tmp_path):
    """Random pauses around every op and hand-off: a swap-in late for its recompute would
    show ([Note: chaos timing])."""
    name, strategy, dtype = FAST[0]
    schedule = kept_plan(name, strategy, dtype)
    ref = reference(name, dtype, **host_stepped(schedule))
    monkeypatch.setenv("KARMA_CHAOS", "7:5")
    report = run(schedule, load_small(name), STEPS, checkpoint_dir=tmp_path)
    assert report.losses == ref.losses
    assert_bitwise_equal(load_model_pt(tmp_path, STEPS), ref.model.state_dict())


# --- two ranks -----------------------------------------------------------------------------

TWO_RANK_CASES = [("gpt", "offload_all", "bf16"), ("resnet", "recompute_all", "fp32")]


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory) -> dict:
    """Each case planned for two ranks (sharded host state), trained in one launch of
    tests/dist_worker.py: case -> (schedule, its run's directory)."""
    schedules = {case_id(*case): kept_plan(*case, world_size=RANKS, host_state="sharded")
                 for case in TWO_RANK_CASES}
    runs = train_job(tmp_path_factory.mktemp("kept-ranks"), schedules, STEPS, RANKS, 600)
    return {case: runs[case_id(*case)] for case in TWO_RANK_CASES}


@pytest.mark.slow
@pytest.mark.parametrize("name,strategy,dtype", TWO_RANK_CASES,
                         ids=[case_id(*c) for c in TWO_RANK_CASES])
def test_two_ranks_equal_one_process_averaging_them(two_rank_runs, name, strategy, dtype):
    schedule, out = two_rank_runs[(name, strategy, dtype)]
    assert any(b.kept == "host" for b in load_schedule(out / "schedule.yaml").blocks)
    assert_ranks_follow_the_averaged_loop(out, reference(name, dtype, RANKS,
                                                         **host_stepped(schedule)))


# --- the plan, the schedule, karma-inspect -------------------------------------------------

@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_selective_choices_keep_on_the_host_but_in_the_last_block_and_blocks_of_several_calls(
        name):
    """A block of several modules is checkpointed call by call, and a later call's
    checkpoint holds what an earlier one kept: its kept outputs stay on the device."""
    graph = block_graph(load_small(name))
    problem = build_problem(graph, load_hardware("cpu"))
    n = len(problem.blocks)
    selective = [i for i in range(n) if problem.blocks[i].selective]
    assert len(selective) > 1
    several = {i for i, b in enumerate(graph.blocks) if len(b.modules) > 1}
    for i in selective:
        kept = {c.kept for c in valid_choices(problem, i) if c.act == "selective"}
        alone = i < n - 1 and i not in several
        assert kept == ({"device", "host"} if alone else {"device"}), (i, graph.blocks[i].modules)
    assert name != "resnet" or several & set(selective)  # its head: conv, norm, relu, pool
    with pytest.raises(ValueError, match="not a choice"):
        Choice("recompute", kept="host")


@pytest.fixture(scope="module")
def sched() -> Schedule:
    return load_schedule(dump_schedule(kept_plan("gpt", "recompute_all", "fp32")))


def test_the_schedule_reads_back_what_it_wrote(sched):
    text = dump_schedule(sched)
    assert "kept: host" in text
    assert load_schedule(text) == sched
    kept = next(b.index for b in sched.blocks if b.kept == "host")
    kinds = [(o.kind, o.bytes) for o in sched.ops if o.block == kept and "swap" in o.kind]
    assert [k for k, _ in kinds] == ["swap_out", "swap_in"] and kinds[0][1] == kinds[1][1] > 0


def refused(s: Schedule, *fragments: str) -> None:
    with pytest.raises(ScheduleFileError) as info:
        validate(s, "s.yaml")
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def with_block(s: Schedule, i: int, **fields) -> Schedule:
    blocks = list(s.blocks)
    blocks[i] = replace(blocks[i], **fields)
    return replace(s, blocks=tuple(blocks))


def test_the_checks_refuse_a_decision_its_ops_do_not_follow(sched):
    kept = next(b.index for b in sched.blocks if b.kept == "host")
    refused(with_block(sched, kept, kept="device"),
            f"is one swap_out too many for block {kept}",
            f"blocks[{kept}].kept is device, and a selective block's kept outputs are swapped "
            "out and in once if they are kept on the host")
    refused(with_block(sched, kept, act="recompute", policy=""),
            "has act: recompute and kept: host", "only a selective block keeps outputs")
    # the swap-in after the recompute that needs it
    into = next(o for o in sched.ops if (o.kind, o.block) == ("swap_in", kept))
    recompute = next(o for o in sched.ops if (o.kind, o.block) == ("recompute", kept))
    ops = [replace(o, deps=tuple(d for d in o.deps if d != into.id)) if o.id == recompute.id
           else o for o in sched.ops]
    refused(replace(sched, ops=tuple(ops)),
            "what a selective block keeps is swapped in before its recompute")


def test_the_checks_refuse_kept_on_host_where_the_runtime_cannot_swap_it(sched):
    kept = next(b for b in sched.blocks if b.kept == "host")
    refused(with_block(sched, kept.index, modules=(*kept.modules, "lm_head")),
            "has kept: host and 2 modules", "set its kept to device")
    last = sched.blocks[-1]  # its backward follows its forward at once
    refused(with_block(sched, last.index, act="selective", policy=kept.policy, kept="host",
                       modules=last.modules[:1]),
            "has kept: host and is the last block", "set its kept to device")
    # a swap-out issued with its block's forward would find nothing kept yet
    out = next(o for o in sched.ops if (o.kind, o.block) == ("swap_out", kept.index))
    fwd = next(o for o in sched.ops if (o.kind, o.block) == ("forward", kept.index))
    # the swap-out moved into the forward's stage, ahead of the next forward in the list
    nxt = next(o for o in sched.ops if (o.kind, o.block) == ("forward", kept.index + 1))
    assert nxt.id == out.id - 1 and not set(out.deps) & {nxt.id}
    early = with_ids_swapped(sched, nxt.id, out.id)
    early = replace(early, ops=tuple(replace(o, stage=fwd.stage) if o.id == nxt.id else o
                                     for o in early.ops))
    refused(early, f"is in stage {fwd.stage}, that of its block's forward",
            f"move it to stage {fwd.stage + 1}")


def with_ids_swapped(s: Schedule, a: int, b: int) -> Schedule:
    """`s` with ops a and b trading places in the list (ids, deps and buffers renamed)."""
    new = {a: b, b: a}
    ops = sorted((replace(o, id=new.get(o.id, o.id),
                          deps=tuple(new.get(d, d) for d in o.deps)) for o in s.ops),
                 key=lambda o: o.id)
    buffers = tuple(replace(x, alloc=new.get(x.alloc, x.alloc), free=new.get(x.free, x.free))
                    for x in s.buffers)
    return replace(s, ops=tuple(ops), buffers=buffers)


def test_a_kept_place_that_is_not_one_is_refused_on_load(sched):
    text = dump_schedule(sched).replace(", kept: host,", ", kept: disk,", 1)
    with pytest.raises(ScheduleFileError, match="'disk' is not where a selective block's kept "
                                                "outputs wait; use one of device, host"):
        load_schedule(text)


def test_karma_inspect_shows_where_a_selective_block_keeps(sched):
    path = "s.yaml"
    info = summary(sched, check_predicted(sched, str(path)), str(path))
    n = sum(b.kept == "host" for b in sched.blocks)
    assert info["decisions"]["kept_on_host"] == n
    text = render(info)
    assert f"({n} with their kept outputs on the host)" in text
    assert text.count("selective (kept on host)") == n


def test_the_policy_module_is_what_the_runtime_swaps():
    # the private torch classes kept.py builds on are those create_selective_checkpoint_
    # contexts returns in this torch: a torch that renames them fails here, not in training
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    forward, recompute = create_selective_checkpoint_contexts(checkpoint_policy(SELECTIVE_POLICY))
    assert type(forward) is kept_module._CachingTorchDispatchMode
    assert isinstance(recompute, kept_module._CachedTorchDispatchMode)
    assert forward.storage is recompute.storage
