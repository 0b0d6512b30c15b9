"""The performance model: an event simulation of one step of a schedule's operations.

Each stream runs its operations in order; an operation starts when its stream is free and its
dependencies have finished, and lasts its predicted duration, or longer where streams
contend for the same cores (see [Note: processor sharing]). Buffers are allocated when
their allocating operation starts and freed when their freeing operation ends, which gives
the device memory timeline. The simulation also checks the schedule: every buffer an
operation uses must be filled and not yet freed when the operation starts.

An optimizer step of `accumulate` micro-batches replays the op list that many times, the
first accumulate-1 without the ops of LAST_MICRO_BATCH_KINDS (see [Note: accumulation] in
lowering.py): the step takes (accumulate-1) replays without them plus one full replay, each
simulated.
With clipping, the updates run after the whole backward; `overlapped_step_s` is what
a step would take if they overlapped the next step's forward instead (see
overlapped_step_s below).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from functools import cached_property

from karma.errors import KarmaError
from karma.schedule import (
    DEFERRED_KINDS,
    LAST_MICRO_BATCH_KINDS,
    STREAMS,
    Buffer,
    Op,
    WeightBuffer,
    resident_owner,
)


class ScheduleError(KarmaError):
    """A schedule that cannot run as written (a buffer used before it is filled, ...)."""


@dataclass(frozen=True)
class Contention:
    """Fractions of its speed a stream loses while another is busy (see [Note: contention
    between streams] in hardware.py); all 0, the default: independent streams (a GPU)."""

    compute_slowdown_copy: float = 0.0  # compute, while h2d or d2h copies
    copy_slowdown_compute: float = 0.0  # a copy (h2d or d2h), while compute runs
    compute_slowdown_host: float = 0.0  # compute, while a host step runs
    host_slowdown_compute: float = 0.0  # a host step, while compute runs
    d2h_slowdown_compute: float = 0.0  # a copy to the host, while compute runs (0: as h2d's)
    side_wait_s: float = 0.0  # a side op started while compute runs waits this long for a core
    # (wait_s, [Note: waiting for a core])
    # the host stream off the cores the others share ([Note: the host step beside compute,
    # ranks sharing a CPU]): it and compute never slow each other
    host_apart: bool = False

    @classmethod
    def of(cls, hardware: Mapping[str, object], ranks_per_node: int = 1) -> Contention:
        """The fractions among a profile's fields (a Hardware's, or a schedule's `hardware`
        pairs as a dict), those it lacks 0, for one of `ranks_per_node` ranks of a node.

        [Note: the host step beside compute, ranks sharing a CPU] The profile's fractions are
        one process's, whose compute team spans every core. With k ranks a node on the CPU
        backend a rank's compute and host step already take k times one process's
        (RankShare, planner/problem.py): the cores divided among every rank's threads, each
        rank's host stream on its own one. So there the host stream is apart from the cores
        the rank's other streams share: no fraction between it and compute, no wait, and it
        is not among the streams whose speeds add up to at most 1. An 8-layer GPT (width 512,
        sequence 256, vocabulary 8192, batch 8) planned at 600M for 2 ranks of the 2-core
        test machine, sharded: its host stream traced 20.0 ms busy a step (the median of 4),
        simulated 20.2 ms so, 33.2 ms with the host among the shared cores. One rank: 37.7 ms
        traced, 33.3 ms simulated with its fractions (bench/RESULTS.md, "The host
        optimizer"). The copies' fractions and wait stay."""
        alone = cls(**{f.name: float(hardware.get(f.name, 0.0))
                       for f in fields(cls) if f.name != "host_apart"})
        if ranks_per_node > 1 and hardware.get("device_kind") == "cpu":
            return replace(alone, compute_slowdown_host=0.0, host_slowdown_compute=0.0,
                           host_apart=True)
        return alone

    @cached_property
    def core_streams(self) -> tuple[str, ...]:
        """The streams on the cores compute shares (the network is not the cores)."""
        return ("compute", "h2d", "d2h") if self.host_apart else ("compute", "h2d", "d2h", "host")

    @cached_property  # asked for every busy stream at every event of the simulation
    def shared(self) -> bool:
        """Whether the streams share cores (the CPU): any fraction above 0."""
        return any(getattr(self, f.name) for f in fields(self))

    def speed(self, stream: str, busy) -> float:
        """The speed of `stream` (1: its ops' full speed) while the streams in `busy` run
        (`stream` among them).

        [Note: every stream on shared cores conserves work] The pairwise fractions say how
        compute and one side stream share the cores; on the CPU the side streams share them
        with each other too (a swap-out beside a host step, a fetch beside a swap-out), and
        no set of streams runs faster together than one of them alone on every core. So
        where the streams share cores, the speeds of the busy streams are scaled down to add
        up to at most 1; the measured pairs are kept as measured (calibrate/measure_hw.py,
        _contention).
        Traced steps of GPT-2 small's 861 MiB plan took the sum of their streams' work alone
        (2.318 s against 2.379 s, and 2.567 against 2.535 s; bench/contention_fit.py), where
        the micro-benchmark's compute and host step add up to 1.106: taken as measured, every
        overlapped second looked 10% cheaper than it was, and the ILP put the optimizer on the
        host where keep_all fits and is faster. And before the bound covered the side streams
        too, a copy and a host step overlapping each other ran at full speed both: GPT-2
        medium's 2 GiB plan was predicted 13.9 s, less than the 14.2 s of its streams' work.
        The net stream is left out: the network is not the cores, and it was not measured."""
        raw = self._pairwise(stream, busy)
        if not self.shared or stream not in self.core_streams:
            return raw
        total = sum(self._pairwise(other, busy) for other in busy if other in self.core_streams)
        return raw / total if total > 1.0 else raw

    def _pairwise(self, stream: str, busy) -> float:
        if stream == "compute":
            speed = 1.0
            if "h2d" in busy or "d2h" in busy:
                speed *= 1.0 - self.compute_slowdown_copy
            if "host" in busy:
                speed *= 1.0 - self.compute_slowdown_host
            return speed
        if "compute" not in busy:
            return 1.0
        if stream == "d2h" and self.d2h_slowdown_compute:
            return 1.0 - self.d2h_slowdown_compute
        if stream in ("h2d", "d2h"):
            return 1.0 - self.copy_slowdown_compute
        if stream == "host":
            return 1.0 - self.host_slowdown_compute
        return 1.0

    def wait_s(self, stream: str, working) -> float:
        """How long an op of `stream` started while the streams in `working` run waits for a
        core before it works.

        [Note: waiting for a core] On the CPU a side stream's op runs on a worker thread
        (and that thread's OpenMP team) which, while compute's threads keep every core busy,
        gets one only when the kernel's scheduler next gives it a time slice. The wait does
        not depend on the op's bytes: in traced steps of an 8-layer GPT on two cores a 12.6 MB
        fetch (0.48 ms alone) took from 1 to 12 ms, a 75.6 MB swap-in (2.9 ms alone) 11 to
        19 ms, and over all copies beside compute the traced seconds against the planned
        ones alone are a line through about 1.4 ms (planner/fit_contention.py). So an op
        started while compute works first waits `side_wait_s`, holding its stream and taking
        no core (compute keeps its speed), then works at its shared speed; one started
        while compute is idle finds a core at once. 0, the default, on a GPU and in a
        profile: the calibration fits it ([Note: side streams timed in context])."""
        if stream in SIDE_STREAMS and stream in self.core_streams and "compute" in working:
            return self.side_wait_s
        return 0.0


SIDE_STREAMS = ("h2d", "d2h", "host")  # the streams of worker threads beside compute's
INDEPENDENT = Contention()


@dataclass(frozen=True)
class SimResult:
    serial_step_s: float  # one optimizer step, every micro-batch's replay, updates in the last
    busy_s: dict[str, float]  # per stream, summed over the step's replays
    peak_device_bytes: int
    timeline: tuple[tuple[float, int], ...]  # (time, device bytes allocated from then on)
    start_s: tuple[float, ...]  # per op, in the replay that steps
    end_s: tuple[float, ...]  # per op, in the replay that steps
    lower_bound_s: float  # max over streams of busy time: no schedule of these ops is faster
    transfer_bytes: dict[str, int]  # bytes moved per copy stream, summed over the step
    replay_s: float = 0.0  # the replay that steps (what start_s and end_s show)
    micro_batch_s: float | None = None  # a replay that does not step (accumulate > 1)
    overlapped_step_s: float | None = None  # with clipping: updates under the next forward

    @property
    def step_s(self) -> float:
        """One optimizer step as the runtime runs it: with clipping the host updates overlap
        the next step's forward (runtime/replay/update.py, [Note: updates overlapped with the
        next forward]), so the overlapped figure; else serial_step_s."""
        overlapped = self.overlapped_step_s
        return overlapped if overlapped is not None else self.serial_step_s


def simulate(ops: Sequence[Op], buffers: Sequence[Buffer], accumulate: int = 1,
             clip: bool = False, contention: Contention = INDEPENDENT) -> SimResult:
    """One optimizer step of `accumulate` micro-batches (with `clip`, the overlapped figure
    too); with the defaults, one replay of the op list on independent streams."""
    if accumulate < 1:
        raise ValueError(f"accumulate = {accumulate} must be at least 1")
    start, end = _times(ops, contention)
    _check_residency(ops, buffers, start, end)
    timeline, peak = _memory(buffers, start, end)
    replay_s = max(end, default=0.0)
    micro_s = None
    if accumulate > 1:  # the other replays: their own timing, their own memory peak
        micro = _without_step(ops)
        micro_start, micro_end = _times(micro, contention)
        _check_residency(micro, buffers, micro_start, micro_end)
        peak = max(peak, _memory(buffers, micro_start, micro_end)[1])
        micro_s = max(micro_end, default=0.0)

    busy = dict.fromkeys(STREAMS, 0.0)
    moved = {"h2d": 0, "d2h": 0}
    for op in ops:
        times = 1 if op.kind in LAST_MICRO_BATCH_KINDS else accumulate
        busy[op.stream] += times * op.dur_s
        if op.stream in moved:
            moved[op.stream] += times * op.bytes
    return SimResult(
        serial_step_s=replay_s + (accumulate - 1) * (micro_s or 0.0),
        busy_s=busy,
        peak_device_bytes=peak,
        timeline=tuple(timeline),
        start_s=tuple(start),
        end_s=tuple(end),
        lower_bound_s=max(busy.values()),
        transfer_bytes=moved,
        replay_s=replay_s,
        micro_batch_s=micro_s,
        overlapped_step_s=(overlapped_step_s(ops, accumulate, contention)
                                if clip else None),
    )


def _memory(buffers: Sequence[Buffer], start: list[float], end: list[float]
            ) -> tuple[list[tuple[float, int]], int]:
    """The device memory timeline (time, bytes allocated from then on) and its peak."""
    events: list[tuple[float, int, int]] = []  # (time, order: frees first, delta)
    for b in buffers:
        events.append((start[b.alloc] if b.alloc is not None else 0.0, 1, b.bytes))
        if b.free is not None:
            events.append((end[b.free], 0, -b.bytes))
    events.sort()
    timeline, current, peak = [], 0, 0
    for t, _, delta in events:
        current += delta
        peak = max(peak, current)
        if timeline and timeline[-1][0] == t:
            timeline[-1] = (t, current)
        else:
            timeline.append((t, current))
    return timeline, peak


def _times(ops: Sequence[Op], contention: Contention = INDEPENDENT
           ) -> tuple[list[float], list[float]]:
    """Start and end of every op: each stream in list order, each op after its deps.

    [Note: processor sharing] Time advances from one op's end to the next. Between two such
    events the set of busy streams is fixed, so each running op progresses at the constant
    speed `contention.speed` gives its stream (1 on independent streams): an op's duration
    is work at full speed, and it ends when that work is done. A compute op that overlaps a
    copy for half its length thus takes longer by half its length times the slowdown, and
    the copy likewise. With no contention every speed stays 1, and every op ends at exactly
    start + dur_s, the same floats as a plain list schedule. A side op that must first wait
    for a core ([Note: waiting for a core]) is its stream's from its start but among the
    busy streams only from the end of its wait.
    """
    start = [0.0] * len(ops)
    end = [0.0] * len(ops)
    done = [False] * len(ops)
    waiting: dict[str, deque[Op]] = {stream: deque() for stream in STREAMS}
    for op in ops:
        if any(d >= op.id for d in op.deps):
            raise ScheduleError(f"op {op.id} ({op.kind} of block {op.block}) depends on a "
                                "later op; the op list must be in issue order")
        waiting[op.stream].append(op)
    running: dict[str, _Running] = {}
    now = 0.0
    while True:
        # start each idle stream's next op once its deps are done
        working = {s for s, r in running.items() if r.ready_s <= now}
        for stream, queue in waiting.items():
            if stream not in running and queue and all(done[d] for d in queue[0].deps):
                op = queue.popleft()
                start[op.id] = now
                ready_s = now + contention.wait_s(stream, working)
                running[stream] = _Running(op.id, ready_s, op.dur_s, 0.0, ready_s)
                if ready_s <= now:
                    working.add(stream)
        if not running:
            break
        for stream in working:
            r = running[stream]
            speed = contention.speed(stream, working)
            if speed != r.speed:  # from now on: the work left, at the new speed
                left_s = r.left_s - (now - r.since_s) * r.speed
                running[stream] = _Running(r.op, now, left_s, speed, r.ready_s)
        finish = {stream: r.ready_s if r.ready_s > now
                  else r.since_s + max(r.left_s, 0.0) / r.speed
                  for stream, r in running.items()}
        now = min(finish.values())
        for stream, t in finish.items():
            r = running[stream]
            waited = r.speed == 0.0 and r.left_s > 0.0  # its wait ends now: it works from now
            if t == now and not waited:
                running.pop(stream)
                end[r.op] = now
                done[r.op] = True
    return start, end


@dataclass(frozen=True)
class _Running:
    """The op a stream is running: `left_s` of its work (at full speed) was left at
    `since_s`, and it has run at `speed` since."""

    op: int
    since_s: float
    left_s: float
    speed: float
    ready_s: float = 0.0  # it waits for a core until then, doing no work


def _without_step(ops: Sequence[Op]) -> list[Op]:
    """The replay of a micro-batch that does not step: the step's ops take no time."""
    return [replace(op, dur_s=0.0) if op.kind in LAST_MICRO_BATCH_KINDS else op for op in ops]


def overlapped_step_s(ops: Sequence[Op], accumulate: int = 1,
                           contention: Contention = INDEPENDENT) -> float:
    """[Note: updates under the next forward] The step time if host steps and uploads ran
    while the next step's forward does, each done before its block's weights are next
    read: a fetch of block o's weights waits for o's host step, the first op reading o's
    resident weights for o's upload (issued on h2d just before that op).

    Two replays are simulated back to back: the first without its updates, then the
    second (a micro-batch that does not step when accumulate > 1) with the first's updates
    interleaved as above. The second starts where the first's other work ends (E1) and the
    state at that point repeats every step, so one step takes E2 - E1 (E2: where the
    second's work other than its own updates ends), plus accumulate - 2 micro-batches and
    the first's E1 when accumulate > 1.
    """
    merged: list[Op] = []

    def add(op: Op, deps) -> int:
        merged.append(replace(op, id=len(merged), deps=tuple(sorted(set(deps)))))
        return len(merged) - 1

    first: dict[int, int] = {}  # id in `ops` -> id in `merged`, for the first step
    for op in ops:
        if op.kind not in DEFERRED_KINDS:
            first[op.id] = add(op, (first[d] for d in op.deps if d in first))
    e1 = max(_times(merged, contention)[1], default=0.0)
    # the second step starts when the first's work (its updates aside) is done
    last = {op.stream: k for k, op in enumerate(merged)}
    host_step: dict[int, int] = {}
    for op in ops:  # a block's host step, then (sharded) its all-gather: the last updates
        if op.kind in ("host_step", "all_gather"):
            host_step[op.block] = first[op.id] = add(op, (first[d] for d in op.deps))
    pending = {op.block: op for op in ops if op.kind == "upload"}

    second: dict[int, int] = {}
    for op in _without_step(ops) if accumulate > 1 else ops:
        if op.kind in DEFERRED_KINDS:
            continue
        deps = [second[d] for d in op.deps if d in second] + list(last.values())
        for name in op.uses:
            fetched, owner = WeightBuffer.parse(name), resident_owner(name)
            if fetched is not None and op.kind == "fetch" and fetched.owner in host_step:
                deps.append(host_step[fetched.owner])
            elif owner is not None and owner in pending:
                up = pending.pop(owner)
                deps.append(add(up, [first[d] for d in up.deps]))
        second[op.id] = add(op, deps)
    end = _times(merged, contention)[1]
    e2 = max((end[k] for k in second.values()), default=e1)
    if accumulate == 1:
        return e2 - e1
    return e2 + (accumulate - 2) * max(_times(_without_step(ops), contention)[1], default=0.0)


def _check_residency(ops: Sequence[Op], buffers: Sequence[Buffer], start: list[float],
                     end: list[float]) -> None:
    by_name = {b.name: b for b in buffers}
    for op in ops:
        for name in op.uses:
            b = by_name.get(name)
            if b is None:
                continue  # an empty buffer (zero bytes) is never listed
            if b.alloc is not None and b.alloc != op.id and end[b.alloc] > start[op.id] + 1e-12:
                raise ScheduleError(
                    f"op {op.id} ({op.kind} of block {op.block}) starts at {start[op.id]:.6f} s "
                    f"before buffer {name} is filled (at {end[b.alloc]:.6f} s)")
            if b.free is not None and b.free != op.id and end[b.free] <= start[op.id]:
                raise ScheduleError(
                    f"op {op.id} ({op.kind} of block {op.block}) uses buffer {name} after "
                    f"op {b.free} freed it")
