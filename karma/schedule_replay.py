"""What replaying a schedule does that its checks rely on: which op happens before which in
every replay (`HappensBefore`), and the device memory live stage by stage
(`walk_peak_bytes`). The checker (schedule_check.py) holds a schedule to both; they follow
from the stream and stage rules of schedule.py's docstring.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from karma.schedule import LAST_MICRO_BATCH_KINDS, Op, Schedule


def walk_peak_bytes(schedule: Schedule) -> tuple[int, int]:
    """(peak bytes, the stage where it is reached) of the buffers live stage by stage: a
    buffer counts in every stage from its `alloc` op's (the first, when null) through its
    `free` op's (the last, when null).

    [Note: the peak walked over stages] Within a stage the streams run side by side, so a
    buffer freed by one op of a stage may still be live when another op of the same stage
    allocates; across stages the barrier orders them (schedule.py: an op on a barrier stream
    starts when every op of the earlier stages on those streams has finished). So each
    buffer counts in its whole span of stages: the planner's own bound
    (predicted.stage_peak_bytes, which it keeps within the budget), never below the timed
    simulation's peak of those buffers. The one exception: a host step's temporaries
    (hoststep.N, on the CPU backend) run on the host stream, outside the barrier; the planner
    counts them in every stage their step may reach, this walk in their step's stage only,
    so the walk stays within the planner's bound there too. An op's own temporaries (a
    buffer that op allocates and frees: steptmp.N, hoststep.N) never meet those of another
    op of its stream, which runs one op at a time: per stage and stream only the largest
    counts (the planner takes the same maximum for the device steps' temporaries; summing
    them refused a valid plan of tests/models/mlp_schedule.py for 2 ranks)."""
    last = max((op.stage for op in schedule.ops), default=0)
    # live bytes change only at the stages where a buffer starts or after one it ends: kept
    # by stage, not in a list as long as the largest stage number (a stage edited to 2**62
    # would take all memory: tests/test_fuzz.py edits numbers so)
    delta: dict[int, int] = defaultdict(int)
    # an op's own temporaries (allocated and freed by that op): one op of a stream runs at
    # a time, so per stage and stream only the largest of them is live at once
    transient: dict[tuple[int, str], int] = defaultdict(int)
    for b in schedule.buffers:
        if b.alloc is not None and b.alloc == b.free:
            op = schedule.ops[b.alloc]
            transient[op.stage, op.stream] = max(transient[op.stage, op.stream], b.bytes)
            continue
        first = schedule.ops[b.alloc].stage if b.alloc is not None else 0
        final = schedule.ops[b.free].stage if b.free is not None else last
        delta[first] += b.bytes
        delta[max(first, final) + 1] -= b.bytes
    on_top = defaultdict(int)
    for (stage, _), nbytes in transient.items():
        on_top[stage] += nbytes
    peak, at, live = 0, 0, 0
    for stage in sorted(delta.keys() | on_top.keys()):
        if stage > last:
            break
        live += delta[stage]
        if live + on_top[stage] > peak:
            peak, at = live + on_top[stage], stage
    return peak, at


@dataclass(frozen=True)
class HappensBefore:
    """[Note: happens-before] Op a happens before op b when a has finished whenever b
    starts, in every replay: a is among b's deps, or precedes it on its stream (each stream
    runs its ops in list order, the compute thread too), or either through a chain of such
    steps. With accumulation, a micro-batch that does not step skips the side ops of
    LAST_MICRO_BATCH_KINDS: the engine marks them done at once, without waiting for their
    deps, and they take no place on their stream. So an order that must hold in every
    replay is checked in both: `full` (the replay that steps) and `micro` (one that does
    not; the same as full without accumulation)."""

    full: tuple[int, ...]  # op id -> bit set of the ops that happen before it
    micro: tuple[int, ...]
    skipped: frozenset[int]  # ops a micro-batch that does not step skips

    @classmethod
    def of(cls, schedule: Schedule) -> HappensBefore:
        skipped = frozenset(op.id for op in schedule.ops if op.kind in LAST_MICRO_BATCH_KINDS
                            and op.stream != "compute") \
            if schedule.config.accumulate > 1 else frozenset()
        full = _before(schedule.ops, frozenset())
        return cls(full, _before(schedule.ops, skipped) if skipped else full, skipped)

    def before(self, a: int, b: int) -> bool:
        """Whether op a happens before op b in every replay that runs both."""
        if not self.full[b] >> a & 1:
            return False
        return a in self.skipped or b in self.skipped or bool(self.micro[b] >> a & 1)


def _before(ops: tuple[Op, ...], skipped: frozenset[int]) -> tuple[int, ...]:
    sets: list[int] = []
    last_on: dict[str, int] = {}
    for op in ops:
        preds = set() if op.id in skipped else set(op.deps)
        if op.id not in skipped and op.stream in last_on:
            preds.add(last_on[op.stream])
        bits = 0
        for p in preds:
            bits |= sets[p] | (1 << p)
        sets.append(bits)
        if op.id not in skipped:
            last_on[op.stream] = op.id
    return tuple(sets)
