"""The replay tables, read from the golden schedules without torch.

Each table is checked against what the schedule itself says, op by op: a table that lost or
misfiled an op would make the engine wait for the wrong thing or free memory early.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

import karma
from karma.runtime.replay.tables import DivergedError, ReplayTables
from karma.schedule import BARRIER_STREAMS, DEFERRED_KINDS

GOLDEN = sorted((Path(__file__).parent.parent / "schedules").glob("*.yaml"))


@pytest.fixture(scope="module", params=[p.name for p in GOLDEN])
def schedule(request):
    return karma.load_schedule(Path(__file__).parent.parent / "schedules" / request.param)


def test_the_tables_need_no_torch():
    code = ("import sys, karma.runtime.replay.tables; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_compute_and_side_ops_split_the_schedule_in_order(schedule):
    t = ReplayTables.of(schedule)
    assert t.n_ops == len(schedule.ops)
    assert [op.id for op in t.compute_ops] == [op.id for op in schedule.ops
                                               if op.stream == "compute"]
    assert sorted(op.id for op in (*t.compute_ops, *t.side_ops)) == list(range(t.n_ops))
    assert all(op.stream != "compute" for op in t.side_ops)
    assert [op.id for op in t.side_ops] == sorted(op.id for op in t.side_ops)


def test_each_barrier_side_op_is_released_by_the_first_compute_op_of_a_later_stage(schedule):
    """[Note: released where the schedule frees]: when compute op c starts, every side op on
    a barrier stream of an earlier stage has been handed over (by c or before), and c is
    handed nothing of its own stage or later."""
    t = ReplayTables.of(schedule)
    ops = schedule.ops
    barrier = [op for op in t.side_ops if op.stream in BARRIER_STREAMS]
    handed: set[int] = set()
    for c in t.compute_ops:
        due = set(t.due[c.id])
        assert not due & handed  # each once
        assert all(ops[s].stream in BARRIER_STREAMS and ops[s].stage < c.stage for s in due)
        handed |= due
        assert {op.id for op in barrier if op.stage < c.stage} <= handed, c
    assert handed, "the schedule releases nothing where compute starts"


def test_weight_buffers_name_their_parameters_and_are_released_where_freed(schedule):
    t = ReplayTables.of(schedule)
    blocks = schedule.blocks
    freed = {b.name: b.free for b in schedule.buffers if b.name in t.weight_params}
    assert freed, "the golden schedules stream weights"
    for name, params in t.weight_params.items():
        owner = int(name.split(".")[1].split("@")[0])
        assert set(params) <= set(blocks[owner].params) and params
        if freed.get(name) is not None:
            assert name in t.releases[freed[name]]
    released = [buf for bufs in t.releases.values() for buf in bufs]
    assert sorted(released) == sorted(n for n, op in freed.items() if op is not None)


def test_updates_are_deferred_only_with_clipping(schedule):
    assert ReplayTables.of(schedule).deferred == frozenset()
    clipped = replace(schedule, config=replace(schedule.config, clip_grad_norm=1.0))
    t = ReplayTables.of(clipped)
    assert t.deferred == {op.id for op in schedule.ops if op.kind in DEFERRED_KINDS}
    assert t.deferred, "the golden schedules step some blocks on the host"


def test_forwards_wait_for_the_uploads_of_the_weights_they_read(schedule):
    t = ReplayTables.of(schedule)
    ops = schedule.ops
    uploads = {op.block: op.id for op in ops if op.kind == "upload"}
    for b in schedule.blocks:
        waits = t.forward_waits[b.index]
        assert all(ops[i].kind == "upload" for i in waits)
        assert (uploads.get(b.index) in waits) == (b.index in uploads)
    for fetch, step in t.fetch_waits.items():
        assert ops[fetch].kind == "fetch" and ops[step].kind == "host_step"
        assert ops[fetch].uses[0].startswith(f"w.{ops[step].block}@")


def test_grad_ops_are_the_ops_after_which_gradients_are_final(schedule):
    t = ReplayTables.of(schedule)
    kinds = {schedule.ops[i].kind for i in t.grad_ops}
    assert "backward" in kinds and kinds <= {"backward", "allreduce", "grads_to_host"}
    assert t.reduce_on_host == frozenset()  # one rank: nothing is all-reduced


def test_a_fetch_of_an_unknown_buffer_is_refused(schedule):
    fetch = next(op for op in schedule.ops if op.kind == "fetch")
    ops = list(schedule.ops)
    ops[fetch.id] = replace(fetch, uses=("act.0",))
    with pytest.raises(DivergedError, match="fetch of unknown buffer 'act.0'"):
        ReplayTables.of(replace(schedule, ops=tuple(ops)))
