"""The replay tables: what the engine looks up while it replays a schedule, built once.

    tables = ReplayTables.of(schedule)
    tables.compute_ops        # the compute thread's ops, in order
    tables.due[op_id]         # side ops whose holdings are free when compute op op_id starts
    tables.weight_params[buf] # the parameter names behind weight buffer `w.OWNER@fUSER`
                              # (schedule.WeightBuffer)

Plain values built from the schedule alone, without torch: each table can be read and tested
by itself, and the engine (engine.py) holds the live objects (parameters, events, streams)
that the tables name.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

from karma.errors import KarmaError
from karma.schedule import (
    DEFERRED_KINDS,
    EXCHANGE_KINDS,
    GRAD_KINDS,
    Op,
    Schedule,
    WeightBuffer,
    is_barrier,
)


class DivergedError(KarmaError):
    """Execution did not follow the schedule (the model's forward left its planned order)."""


@dataclass(frozen=True)
class ReplayTables:
    """Lookups for one schedule, keyed by the schedule's op ids and block indices."""

    n_ops: int
    compute_ops: tuple[Op, ...]  # on the compute stream, in the order they run
    side_ops: tuple[Op, ...]  # on the other streams, in the order they are issued
    # op id -> the weight buffers whose parameters are released when the op's work is done
    releases: Mapping[int, tuple[str, ...]]
    # compute op id -> the side ops on barrier streams whose stages end before its own that
    # no earlier compute op was handed: what they hold is free when it starts (backends/backend.py,
    # [Note: released where the schedule frees])
    due: Mapping[int, tuple[int, ...]]
    # weight buffer -> the names of the parameters it holds (a tied weight's share of the
    # owner's parameters for another block's use)
    weight_params: Mapping[str, tuple[str, ...]]
    grad_ops: tuple[int, ...]  # the ops after which some block's gradients are final
    # blocks whose gradients are all-reduced on the host, after their copy there ([Note:
    # gradients accumulate where the block steps], update.py)
    reduce_on_host: frozenset[int]
    # ops that may run on into the next replay: the host steps and uploads, with clipping
    # ([Note: updates overlapped with the next forward], update.py); empty without
    deferred: frozenset[int]
    # block -> the uploads of the weights its forward reads (its own and a tied owner's)
    forward_waits: Mapping[int, tuple[int, ...]]
    # fetch op id -> the host step that updates the masters it copies, where there is one
    fetch_waits: Mapping[int, int]

    @classmethod
    def of(cls, schedule: Schedule) -> ReplayTables:
        ops = schedule.ops
        compute = tuple(op for op in ops if op.stream == "compute")
        side = tuple(op for op in ops if op.stream != "compute")
        weight_params = _weight_params(schedule)
        releases: dict[int, list[str]] = defaultdict(list)
        for buf in schedule.buffers:
            if buf.free is not None and buf.name in weight_params:
                releases[buf.free].append(buf.name)
        order = {(op.kind, op.block): op.id for op in ops}
        reduce_on_host = frozenset(
            b.index for b in schedule.blocks
            for kind in EXCHANGE_KINDS
            if (kind, b.index) in order and ("grads_to_host", b.index) in order
            and order[kind, b.index] > order["grads_to_host", b.index])
        clip = schedule.config.clip_grad_norm is not None
        deferred = frozenset(op.id for op in ops if op.kind in DEFERRED_KINDS) if clip \
            else frozenset()
        uploads = {op.block: op.id for op in ops if op.kind == "upload"}
        # a fetch waits for the last update of the masters it copies: the host step, or
        # the all-gather after it (sharded host state)
        host_steps = {op.block: op.id for op in ops if op.kind in ("host_step", "all_gather")}
        owner = {n: b.index for b in schedule.blocks for n in b.params}
        forward_waits = {
            b.index: tuple(uploads[o] for o in sorted(
                {b.index, *(owner[n] for n in b.shared_params if n in owner)}) if o in uploads)
            for b in schedule.blocks}
        fetch_waits = {}
        for op in ops:
            if op.kind == "fetch":
                buffer_owner = _weight_buffer(op.uses[0]).owner
                if buffer_owner in host_steps:
                    fetch_waits[op.id] = host_steps[buffer_owner]
        return cls(
            n_ops=len(ops), compute_ops=compute, side_ops=side,
            releases={k: tuple(v) for k, v in releases.items()},
            due=_releases_due(compute, side), weight_params=weight_params,
            grad_ops=tuple(op.id for op in ops if op.kind in GRAD_KINDS),
            reduce_on_host=reduce_on_host, deferred=deferred, forward_waits=forward_waits,
            fetch_waits=fetch_waits)


def _weight_buffer(name: str) -> WeightBuffer:
    weights = WeightBuffer.parse(name)
    if weights is None:
        raise DivergedError(f"fetch of unknown buffer {name!r}")
    return weights


def _weight_params(schedule: Schedule) -> dict[str, tuple[str, ...]]:
    """The parameters behind each weight buffer `w.OWNER@fUSER` / `w.OWNER@bUSER` that the
    schedule frees or fetches."""
    names = {buf.name for buf in schedule.buffers if WeightBuffer.parse(buf.name)}
    names |= {op.uses[0] for op in schedule.ops if op.kind == "fetch"}
    blocks = schedule.blocks
    table = {}
    for name in sorted(names):
        weights = _weight_buffer(name)
        owner, user = weights.owner, weights.user
        owned = set(blocks[owner].params)
        table[name] = blocks[owner].params if user == owner else tuple(
            n for n in blocks[user].shared_params if n in owned)
    return table


def _releases_due(compute_ops: tuple[Op, ...], side_ops: tuple[Op, ...]
                  ) -> dict[int, tuple[int, ...]]:
    """For each compute op, the side ops on the barrier streams whose stages end before its
    own and that no earlier compute op was handed."""
    due: dict[int, tuple[int, ...]] = {}
    handed = 0
    side = [op for op in side_ops if is_barrier(op.stream, op.kind)]
    for op in compute_ops:
        start = handed
        while handed < len(side) and side[handed].stage < op.stage:
            handed += 1
        due[op.id] = tuple(s.id for s in side[start:handed])
    return due
