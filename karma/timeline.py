"""A measured timeline: one replay's operations as they ran, beside the plan.

    karma-run schedule.yaml --steps 3 --trace trace.json      # records step 2's ops
    karma-inspect schedule.yaml --trace trace.json            # busy times and waits, both
    karma-inspect schedule.yaml --trace trace.json --plot t.png --chrome t.chrome.json

A trace file is JSON: a header (the schedule's fingerprint, the model, the backend, the
step) and one row per op: its stream and its start and end in seconds since the
replay's start (runtime/replay/tracing.py records them): the step's replay, or with --accumulate N
its last micro-batch's, the one that steps, as karma-inspect --plot shows. `waits` are the
intervals in which the compute thread waited for another stream, each blamed on one
(runtime/replay/streams.py, [Note: which stream a wait is blamed on]).

`chrome_trace` writes the Chrome trace event format that Perfetto (ui.perfetto.dev) and
chrome://tracing open, as torch.profiler's export_chrome_trace does: the plan and the
measurement as two processes, one thread per stream.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from karma.errors import KarmaError
from karma.fileio import write_text_atomic
from karma.schedule import STREAMS, Schedule, schedule_sha256
from karma.units import format_bytes, format_seconds

if TYPE_CHECKING:
    from karma.planner.simulate import SimResult

TRACE_VERSION = 1
_GAP_S = 1e-12  # a planned compute gap shorter than this is rounding, not a wait


@dataclass(frozen=True)
class OpSpan:
    """One op as it ran (or as planned), in seconds since the replay's start."""

    op: int  # its id in the schedule
    kind: str
    block: int
    stream: str
    start_s: float
    end_s: float


@dataclass(frozen=True)
class ComputeWait:
    """An interval in which the compute thread waited for another stream."""

    stream: str  # the stream blamed: that of the last dependency to finish
    start_s: float
    end_s: float


@dataclass(frozen=True)
class StepTrace:
    """What `karma-run --trace` writes: the replay of one step that steps, measured."""

    schedule_sha256: str  # the schedule it ran (karma.schedule.schedule_sha256)
    model: str  # the schedule's model file, as planned
    backend: str  # cpu | cuda
    step: int
    step_s: float  # the traced replay's wall time on the compute thread
    ops: tuple[OpSpan, ...]
    waits: tuple[ComputeWait, ...]
    # (seconds, bytes): the memory the peak is measured on, sampled every millisecond
    # (CPU backend: private memory above the baseline; empty where not sampled)
    memory: tuple[tuple[float, int], ...] = ()
    # (seconds, bytes) at each compute op's end: the freed tensors the CPU backend's cache
    # keeps for reuse ([Note: a caching allocator for the CPU backend]), which `memory`
    # includes and the plan does not (as CUDA's reserved memory beside its allocated)
    kept: tuple[tuple[float, int], ...] = ()
    version: int = TRACE_VERSION

    def in_use(self) -> tuple[tuple[float, int], ...]:
        """`memory` less what the cache kept at the time: the memory in use, the plan's
        quantity, op by op (the peak the budget and the prediction are about is `memory`'s)."""
        if not self.kept:
            return self.memory
        times = [t for t, _ in self.kept]
        out = []
        for t, nbytes in self.memory:
            k = bisect.bisect_right(times, t) - 1
            out.append((t, nbytes - (self.kept[k][1] if k >= 0 else 0)))
        return tuple(out)

    def to_json(self) -> dict:
        return {"karma_trace": self.version, "schedule_sha256": self.schedule_sha256,
                "model": self.model, "backend": self.backend, "step": self.step,
                "step_s": self.step_s, "ops": [asdict(s) for s in self.ops],
                "waits": [asdict(w) for w in self.waits],
                "memory": [[round(t, 6), b] for t, b in self.memory],
                "kept": [[round(t, 6), b] for t, b in self.kept]}


def write_trace(path: str | Path, trace: StepTrace) -> None:
    write_text_atomic(path, json.dumps(trace.to_json(), indent=1) + "\n")


def load_trace(path: str | Path) -> StepTrace:
    """Read a trace file; KarmaError naming the file when it is not one."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError(f"it holds a JSON {type(data).__name__}, not a trace's object")
        if data.get("karma_trace") != TRACE_VERSION:
            raise ValueError(f"karma_trace is {data.get('karma_trace')!r}, not {TRACE_VERSION}")
        return StepTrace(str(data["schedule_sha256"]), str(data["model"]), str(data["backend"]),
                         int(data["step"]), float(data["step_s"]),
                         tuple(OpSpan(**row) for row in data["ops"]),
                         tuple(ComputeWait(**row) for row in data["waits"]),
                         tuple((float(t), int(b)) for t, b in data.get("memory", ())),
                         tuple((float(t), int(b)) for t, b in data.get("kept", ())))
    except FileNotFoundError:
        raise KarmaError(f"trace file {path} does not exist; write one with karma-run "
                         "SCHEDULE --trace FILE") from None
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise KarmaError(f"{path} is not a karma trace ({type(e).__name__}: {e}); write one "
                         "with karma-run SCHEDULE --trace FILE") from None


def check_trace(trace: StepTrace, schedule: Schedule, trace_source: str,
                schedule_source: str) -> None:
    """A trace is compared only with the schedule it ran."""
    sha = schedule_sha256(schedule)
    if trace.schedule_sha256 != sha:
        raise KarmaError(
            f"{trace_source} traced another schedule (sha256 {trace.schedule_sha256[:12]}, "
            f"{schedule_source} has {sha[:12]}); inspect it with the schedule it ran, or "
            f"trace this one with karma-run {schedule_source} --trace FILE")
    ids = {s.op for s in trace.ops}
    if not ids <= set(range(len(schedule.ops))):
        raise KarmaError(f"{trace_source} names ops the schedule does not have; re-trace it")


def planned_spans(schedule: Schedule, sim: SimResult) -> list[OpSpan]:
    """The schedule's ops as simulated (the replay that steps)."""
    return [OpSpan(op.id, op.kind, op.block, op.stream, sim.start_s[op.id], sim.end_s[op.id])
            for op in schedule.ops]


def planned_waits(schedule: Schedule, sim: SimResult) -> list[ComputeWait]:
    """The gaps on the simulated compute lane, each blamed as the runtime blames its waits:
    on the stream of the dependency that ended last."""
    waits, free_s = [], 0.0
    for op in schedule.ops:
        if op.stream != "compute":
            continue
        start_s = sim.start_s[op.id]
        if start_s - free_s > _GAP_S and op.deps:
            last = max(op.deps, key=lambda d: sim.end_s[d])
            waits.append(ComputeWait(schedule.ops[last].stream, free_s, start_s))
        free_s = sim.end_s[op.id]
    return waits


def busy_s_by_stream(spans) -> dict[str, float]:
    """Seconds each stream spent running these ops (every stream that ran one)."""
    total: dict[str, float] = {}
    for s in spans:
        total[s.stream] = total.get(s.stream, 0.0) + (s.end_s - s.start_s)
    return total


def wait_s_by_stream(waits) -> dict[str, float]:
    """Seconds of compute waits per stream blamed (every stream that had one)."""
    total: dict[str, float] = {}
    for w in waits:
        total[w.stream] = total.get(w.stream, 0.0) + (w.end_s - w.start_s)
    return total


def compare(schedule: Schedule, sim: SimResult, trace: StepTrace) -> dict:
    """Per stream, busy time and the compute waits blamed on it: measured and planned."""
    measured_busy = busy_s_by_stream(trace.ops)
    planned_busy = busy_s_by_stream(planned_spans(schedule, sim))
    measured_wait, planned_wait = wait_s_by_stream(trace.waits), wait_s_by_stream(
        planned_waits(schedule, sim))
    streams = {}
    for stream in STREAMS:
        busy = measured_busy.get(stream, 0.0)
        plan = planned_busy.get(stream, 0.0)
        ops = sum(op.stream == stream for op in schedule.ops)
        if ops:
            streams[stream] = {"ops": ops, "busy_s": busy, "planned_busy_s": plan,
                               "wait_s": measured_wait.get(stream, 0.0),
                               "planned_wait_s": planned_wait.get(stream, 0.0)}
    info = {"step": trace.step, "backend": trace.backend, "ops_traced": len(trace.ops),
            "ops": len(schedule.ops), "step_s": trace.step_s,
            "planned_s": sim.replay_s or sim.serial_step_s, "streams": streams}
    if trace.memory:
        rows = memory_by_op(sim, trace)
        info["memory"] = {
            "peak_bytes": max(b for _, b in trace.memory),
            "in_use_peak_bytes": max(b for _, b in trace.in_use()),
            "planned_peak_bytes": schedule.predicted.peak_device_bytes,
            "samples": len(trace.memory),
            "most_above_plan": [r._asdict() for r in sorted(
                rows, key=lambda r: r.planned_bytes - r.measured_bytes)[:MEMORY_ROWS]]}
    return info


MEMORY_ROWS = 3  # compute ops listed where measured memory is furthest above the plan


class OpMemory(NamedTuple):
    op: int
    kind: str
    block: int
    measured_bytes: int  # the largest sample while the op ran
    planned_bytes: int  # the largest planned allocation while the op ran, as planned


def memory_by_op(sim: SimResult, trace: StepTrace) -> list[OpMemory]:
    """For each traced compute op with samples: the memory measured while it ran beside
    the memory planned while it runs in the plan (each on its own clock), so that a gap
    between the measured and the planned peak is pinned on the op where it opens."""
    samples = sorted(trace.in_use())
    times = [t for t, _ in samples]
    plan = list(sim.timeline)
    plan_times = [t for t, _ in plan]
    rows = []
    for s in trace.ops:
        if s.stream != "compute":
            continue
        lo, hi = bisect.bisect_left(times, s.start_s), bisect.bisect_right(times, s.end_s)
        if lo >= hi:
            continue
        p_lo = max(bisect.bisect_right(plan_times, sim.start_s[s.op]) - 1, 0)
        p_hi = bisect.bisect_right(plan_times, sim.end_s[s.op])
        planned = max((b for _, b in plan[p_lo:max(p_hi, p_lo + 1)]), default=0)
        rows.append(OpMemory(s.op, s.kind, s.block, max(b for _, b in samples[lo:hi]),
                             planned))
    return rows


def render_comparison(info: dict, source: str) -> str:
    """The comparison as people read it."""
    lines = [f"trace       step {info['step']} ({info['backend']} backend) from {source}: "
             f"{info['ops_traced']} of {info['ops']} ops, "
             f"{format_seconds(info['step_s'])} measured against "
             f"{format_seconds(info['planned_s'])} planned"]
    head = ("stream", "ops", "busy", "planned", "compute waited for it", "planned")
    rows = [(s, str(v["ops"]), format_seconds(v["busy_s"]), format_seconds(v["planned_busy_s"]),
             format_seconds(v["wait_s"]), format_seconds(v["planned_wait_s"]))
            for s, v in info["streams"].items()]
    widths = [max(len(r[k]) for r in [head, *rows]) for k in range(len(head))]
    for r in [head, *rows]:
        lines.append("  " + "  ".join(v.ljust(w) if k == 0 else v.rjust(w)
                                      for k, (v, w) in enumerate(zip(r, widths))).rstrip())
    memory = info.get("memory")
    if memory:
        kept = memory["peak_bytes"] != memory["in_use_peak_bytes"]
        lines.append(f"  memory: peak {format_bytes(memory['peak_bytes'])} measured "
                     f"({memory['samples']} samples) against "
                     f"{format_bytes(memory['planned_peak_bytes'])} planned"
                     + (f"; in use (less the freed tensors the CPU cache kept) peak "
                        f"{format_bytes(memory['in_use_peak_bytes'])}" if kept else "")
                     + f"; most above the plan{' (in use)' if kept else ''}:")
        for r in memory["most_above_plan"]:
            lines.append(f"    op {r['op']} ({r['kind']} of block {r['block']}): "
                         f"{format_bytes(r['measured_bytes'])} measured, "
                         f"{format_bytes(r['planned_bytes'])} planned")
    return "\n".join(lines)


def chrome_trace(schedule: Schedule, sim: SimResult, trace: StepTrace) -> dict:
    """The plan (pid 1) and the measurement (pid 2) as Chrome trace events: one thread per
    stream, times in microseconds; the measured compute waits on a thread of their own."""
    tids = {s: k for k, s in enumerate(STREAMS)}
    waits_tid = len(STREAMS)
    events: list[dict] = []
    for pid, name in ((1, f"planned ({schedule.strategy})"),
                      (2, f"measured, step {trace.step} ({trace.backend})")):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"name": name}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"sort_index": pid}})
        for stream, tid in tids.items():
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"name": stream}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"sort_index": tid}})
    events.append({"name": "thread_name", "ph": "M", "pid": 2, "tid": waits_tid,
                   "args": {"name": "compute waits"}})
    for pid, spans in ((1, planned_spans(schedule, sim)), (2, trace.ops)):
        for s in spans:
            events.append({"name": f"{s.kind} {s.block}", "cat": s.kind, "ph": "X",
                           "ts": s.start_s * 1e6, "dur": (s.end_s - s.start_s) * 1e6,
                           "pid": pid, "tid": tids[s.stream],
                           "args": {"op": s.op, "block": s.block,
                                    "stage": schedule.ops[s.op].stage}})
    for pid, points in ((1, sim.timeline), (2, trace.memory)):  # counter tracks
        for t, nbytes in points:
            events.append({"name": "memory", "ph": "C", "ts": t * 1e6, "pid": pid,
                           "args": {"MiB": nbytes / 2**20}})
    for w in trace.waits:
        events.append({"name": f"wait for {w.stream}", "cat": "wait", "ph": "X",
                       "ts": w.start_s * 1e6, "dur": (w.end_s - w.start_s) * 1e6, "pid": 2,
                       "tid": waits_tid, "args": {"stream": w.stream}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | Path, schedule: Schedule, sim: SimResult,
                       trace: StepTrace) -> None:
    write_text_atomic(path, json.dumps(chrome_trace(schedule, sim, trace)) + "\n")
