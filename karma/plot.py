"""A schedule as a picture: device memory over one replay above a per-stream Gantt chart.

    karma-inspect schedule.yaml --plot schedule.png
    karma-inspect schedule.yaml --trace trace.json --plot timeline.png   # measured under it

The update stage (weights uploaded after their host steps; with --clip-grad-norm every
optimizer step, after the whole backward) is shaded. With gradient clipping a dotted line
marks where a step would end if the host updates overlapped the next forward instead. With
--accumulate N the chart shows the last micro-batch, the one that steps.

matplotlib is optional (`pip install 'karma[plot]'`); it is imported only when plotting.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

from karma.errors import KarmaError
from karma.fileio import replaced_atomically
from karma.schedule import OP_KINDS, STREAMS, Schedule
from karma.units import format_bytes, format_seconds

if TYPE_CHECKING:
    from karma.planner.simulate import SimResult
    from karma.timeline import OpSpan, StepTrace

# One color per op kind: compute work in blues, oranges and purples, copies in greens and
# cyans, host and network work in pinks and grays. Fixed, so plots compare at a glance.
KIND_COLORS = {
    "forward": "#1f77b4",
    "loss": "#d62728",
    "recompute": "#9467bd",
    "backward": "#ff7f0e",
    "device_step": "#8c564b",
    "swap_out": "#2ca02c",
    "swap_in": "#98df8a",
    "fetch": "#17becf",
    "grads_to_host": "#bcbd22",
    "allreduce": "#7f7f7f",
    "reduce_scatter": "#c7c7c7",
    "host_step": "#e377c2",
    "all_gather": "#f7b6d2",
    "upload": "#9edae5",
}
assert set(KIND_COLORS) == set(OP_KINDS)

_TIME_UNITS = (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9))
_BYTE_UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1))
_CAPACITY_OFF_SCALE = 4.0  # capacity above this many times the peak is named, not drawn
_FIG_WIDTH_IN, _DPI = 13.0, 110


def _byte_unit(top: float) -> tuple[str, int]:
    """The largest binary unit that `top` bytes fill at least once, and its bytes."""
    return next((u, k) for u, k in _BYTE_UNITS if top >= k or u == "B")


def _matplotlib():
    try:
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError:
        raise KarmaError("--plot needs matplotlib: pip install 'karma[plot]'") from None
    return Figure, Line2D, Patch


def _check_directory(path: Path) -> None:
    if not path.parent.is_dir():
        raise KarmaError(f"cannot write the plot to '{path}': directory '{path.parent}' does "
                         "not exist; create it or give another path")


def _time_unit(end_s: float) -> tuple[str, float]:
    return next((u, k) for u, k in _TIME_UNITS if end_s >= k or u == "ns")


def plot_schedule(schedule: Schedule, sim: SimResult, path: str | os.PathLike) -> None:
    """Draw `schedule` as simulated in `sim` and write it as a PNG to `path`, atomically."""
    Figure, Line2D, Patch = _matplotlib()
    path = Path(path)
    _check_directory(path)

    end_s = max(sim.replay_s or sim.serial_step_s, 1e-30)
    t_unit, t_scale = _time_unit(end_s)
    fig = Figure(figsize=(_FIG_WIDTH_IN, 7.5), dpi=_DPI, layout="constrained")
    ax_mem, ax_ops = fig.subplots(2, 1, sharex=True, height_ratios=(1.0, 1.15))

    _memory_panel(ax_mem, schedule, sim, end_s, t_scale, Line2D)
    kinds = _gantt_panel(ax_ops, schedule, sim, end_s, t_scale)
    ax_ops.set_xlim(0, end_s / t_scale * 1.01)
    _update_stage(ax_mem, ax_ops, schedule, sim, t_scale)

    c = schedule.config
    ax_ops.set_xlabel(_time_label(c.accumulate, t_unit))
    _kind_legend(ax_ops, kinds, Patch)
    fig.suptitle(_title(schedule), fontsize=11)
    _save_atomically(fig, path)


def plot_timeline(schedule: Schedule, sim: SimResult, trace: StepTrace,
                  path: str | os.PathLike) -> None:
    """The plan (memory, streams) above the traced step's measured streams, each on its
    own time axis; the compute thread's waits are hatched on the measured compute lane."""
    from karma.timeline import busy_s_by_stream, planned_spans

    Figure, Line2D, Patch = _matplotlib()
    path = Path(path)
    _check_directory(path)

    planned_s = max(sim.replay_s or sim.serial_step_s, 1e-30)
    measured_s = max([trace.step_s, *(s.end_s for s in trace.ops)])
    if trace.memory:
        fig = Figure(figsize=(_FIG_WIDTH_IN, 13.0), dpi=_DPI, layout="constrained")
        ax_mem, ax_plan, ax_run_mem, ax_run = fig.subplots(
            4, 1, height_ratios=(0.8, 1.0, 0.8, 1.0))
        ax_run_mem.sharex(ax_run)
    else:
        fig = Figure(figsize=(_FIG_WIDTH_IN, 10.5), dpi=_DPI, layout="constrained")
        ax_mem, ax_plan, ax_run = fig.subplots(3, 1, height_ratios=(0.8, 1.0, 1.0))
    ax_mem.sharex(ax_plan)

    t_unit, t_scale = _time_unit(planned_s)
    _memory_panel(ax_mem, schedule, sim, planned_s, t_scale, Line2D)
    planned = planned_spans(schedule, sim)
    # busy as the measured lanes count it (the replay drawn, ops as long as simulated), as
    # karma-inspect --trace prints it
    planned_busy = busy_s_by_stream(planned)
    kinds = _lanes(ax_plan, planned, planned_s, t_scale, planned_busy,
                   f"(b) streams as planned: {format_seconds(planned_s)}")
    ax_plan.set_xlim(0, planned_s / t_scale * 1.01)
    ax_plan.set_xlabel(_time_label(schedule.config.accumulate, t_unit), fontsize=9)
    _update_stage(ax_mem, ax_plan, schedule, sim, t_scale)

    m_unit, m_scale = _time_unit(measured_s)
    kinds |= _lanes(ax_run, list(trace.ops), measured_s, m_scale, busy_s_by_stream(trace.ops),
                    f"({'d' if trace.memory else 'c'}) streams as measured in step {trace.step} on the {trace.backend} "
                    f"backend: {format_seconds(trace.step_s)}")
    if trace.memory:
        _measured_memory_panel(ax_run_mem, schedule, trace, m_scale)
    if trace.waits:
        ax_run.broken_barh([(w.start_s / m_scale, (w.end_s - w.start_s) / m_scale)
                            for w in trace.waits], (-0.35, 0.7), facecolors="none",
                           edgecolors="#d62728", hatch="////", linewidth=0.6)
    ax_run.set_xlim(0, measured_s / m_scale * 1.01)
    ax_run.set_xlabel(f"time in the traced step ({m_unit})")
    _kind_legend(ax_run, kinds, Patch, extra=[Patch(facecolor="none", edgecolor="#d62728",
                                                    hatch="////", label="compute waiting")])
    fig.suptitle(_title(schedule), fontsize=11)
    _save_atomically(fig, path)


def _measured_memory_panel(ax, schedule: Schedule, trace: StepTrace, t_scale: float) -> None:
    """(c) the memory the peak is measured on, sampled in the traced step, against the
    predicted peak and the capacity (panel (a) is the same quantity as planned)."""
    capacity, peak = schedule.config.capacity_bytes, schedule.predicted.peak_device_bytes
    measured = max(b for _, b in trace.memory)
    top = max(peak, measured, capacity if capacity <= _CAPACITY_OFF_SCALE * max(peak, 1) else 0, 1)
    b_unit, b_scale = _byte_unit(top)
    ts = [t / t_scale for t, _ in trace.memory]
    ys = [b / b_scale for _, b in trace.memory]
    ax.fill_between(ts, ys, color="#2ca02c", alpha=0.18, linewidth=0)
    ax.plot(ts, ys, color="#2ca02c", linewidth=1.2,
            label=f"measured ({'private memory' if trace.backend == 'cpu' else 'allocated'}"
                  f"), peak {format_bytes(measured)}")
    if trace.kept:  # the CPU cache's kept tensors: what is in use lies below
        in_use = trace.in_use()
        ax.plot([t / t_scale for t, _ in in_use], [b / b_scale for _, b in in_use],
                color="#1f77b4", linewidth=1.0,
                label=f"in use (less the tensors the CPU cache keeps), peak "
                      f"{format_bytes(max(b for _, b in in_use))}")
    ax.axhline(peak / b_scale, color="#ff7f0e", linestyle=":", linewidth=1.4,
               label=f"predicted peak {format_bytes(peak)}")
    if top >= capacity:
        ax.axhline(capacity / b_scale, color="#d62728", linestyle="--", linewidth=1.4,
                   label=f"capacity {format_bytes(capacity)}")
    ax.set_ylim(0, top / b_scale * 1.12)
    ax.set_ylabel(f"memory ({b_unit})")
    ax.set_title(f"(c) memory as measured in step {trace.step}", loc="left", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=3, fontsize=9, frameon=False)


def _time_label(accumulate: int, t_unit: str) -> str:
    return (f"time in one step ({t_unit})" if accumulate == 1 else
            f"time in the last of {accumulate} micro-batches, the one that steps ({t_unit})")


def _kind_legend(ax, kinds: set[str], Patch, extra=()) -> None:
    handles = [Patch(facecolor=KIND_COLORS[k], edgecolor="white", label=k.replace("_", " "))
               for k in OP_KINDS if k in kinds]
    handles += list(extra)
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.22),
              ncol=min(len(handles), 6), frameon=False, fontsize=9,
              title="ops (bars labelled with their block)", title_fontsize=9)


def _title(schedule: Schedule) -> str:
    c, p = schedule.config, schedule.predicted
    ranks = f"{c.world_size} rank" + ("s" if c.world_size > 1 else "")
    training = "".join([f", {c.accumulate} micro-batches a step" if c.accumulate > 1 else "",
                        f", clip {c.clip_grad_norm:g}" if c.clip_grad_norm is not None else ""])
    return (f"{schedule.model.path}: {schedule.strategy} ({schedule.status}), batch "
            f"{c.batch_size}, {c.dtype}, {ranks}{training} — "
            f"step {format_seconds(p.step_s)} "
            f"(lower bound {format_seconds(p.lower_bound_s)}), peak "
            f"{format_bytes(p.peak_device_bytes)} of {format_bytes(c.capacity_bytes)}")


def _memory_panel(ax, schedule: Schedule, sim: SimResult, end_s: float, t_scale: float,
                  Line2D) -> None:
    """(a) allocated device memory over the replay, the predicted peak and the capacity."""
    capacity, peak = schedule.config.capacity_bytes, schedule.predicted.peak_device_bytes
    capacity_drawn = capacity <= _CAPACITY_OFF_SCALE * max(peak, 1)
    top = max(peak, capacity if capacity_drawn else 0, 1)
    b_unit, b_scale = _byte_unit(top)

    points = list(sim.timeline) or [(0.0, 0)]
    if points[0][0] > 0:
        points.insert(0, (0.0, 0))
    points.append((end_s, points[-1][1]))
    ts = [t / t_scale for t, _ in points]
    ys = [b / b_scale for _, b in points]
    ax.fill_between(ts, ys, step="post", color="#1f77b4", alpha=0.18, linewidth=0)
    ax.step(ts, ys, where="post", color="#1f77b4", linewidth=1.6, label="allocated (simulated)")

    ax.axhline(peak / b_scale, color="#ff7f0e", linestyle=":", linewidth=1.4,
               label=f"predicted peak {format_bytes(peak)}")
    peak_at = next((t for t, b in points if b == sim.peak_device_bytes), None)
    if peak_at is not None:
        ax.plot([peak_at / t_scale], [sim.peak_device_bytes / b_scale], "o", color="#ff7f0e",
                markersize=5)
    if capacity_drawn:
        ax.axhline(capacity / b_scale, color="#d62728", linestyle="--", linewidth=1.4,
                   label=f"capacity {format_bytes(capacity)}")
    else:
        ax.add_line(Line2D([], [], color="#d62728", linestyle="--",
                           label=f"capacity {format_bytes(capacity)} (off scale)"))
    ax.set_ylim(0, top / b_scale * 1.12)
    ax.set_ylabel(f"device memory ({b_unit})")
    ax.set_title("(a) device memory", loc="left", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=3, fontsize=9, frameon=False,
              borderaxespad=0.2)


def _gantt_panel(ax, schedule: Schedule, sim: SimResult, end_s: float,
                 t_scale: float) -> set[str]:
    """(b) one row per stream, a bar per op from its simulated start to its end."""
    from karma.timeline import planned_spans

    return _lanes(ax, planned_spans(schedule, sim), end_s, t_scale,
                  dict(schedule.predicted.busy_s), "(b) streams")


def _lanes(ax, spans: list[OpSpan], end_s: float, t_scale: float, busy: dict[str, float],
           title: str) -> set[str]:
    """One row per stream, a bar per op from its start to its end; the kinds drawn."""
    rows = {stream: k for k, stream in enumerate(STREAMS)}
    # Bars narrower than a label are left unlabelled: width in points of the axes, roughly.
    axes_points = _FIG_WIDTH_IN * 72 * 0.86
    bars: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    for s in spans:
        y = rows[s.stream]
        bars[(y, s.kind)].append((s.start_s / t_scale, (s.end_s - s.start_s) / t_scale))
        label = str(s.block)
        if (s.end_s - s.start_s) / end_s * axes_points > 6.5 * len(label) + 4:
            ax.text((s.start_s + s.end_s) / 2 / t_scale, y, label, ha="center", va="center",
                    fontsize=8, color="black")
    for (y, kind), xs in bars.items():
        ax.broken_barh(xs, (y - 0.35, 0.7), facecolors=KIND_COLORS[kind],
                       edgecolors="white", linewidth=0.6)
    ax.set_yticks(range(len(STREAMS)))
    ax.set_yticklabels([f"{s}\n{format_seconds(busy.get(s, 0.0))} busy" for s in STREAMS],
                       fontsize=9)
    ax.set_ylim(len(STREAMS) - 0.5, -0.5)  # compute on top
    ax.set_title(title, loc="left", fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    return {kind for _, kind in bars}


def _update_stage(ax_mem, ax_ops, schedule: Schedule, sim: SimResult, t_scale: float) -> None:
    """Shade the update stage; with clipping, mark the step time with overlapped updates."""
    last = max((op.stage for op in schedule.ops), default=0)
    update = [op for op in schedule.ops if op.stage == last
              and op.kind in ("device_step", "host_step", "upload")]
    if update:
        begin = min(sim.start_s[op.id] for op in update) / t_scale
        end = max(sim.end_s[op.id] for op in update) / t_scale
        for ax in (ax_mem, ax_ops):
            ax.axvspan(begin, end, color="#e377c2", alpha=0.08, linewidth=0, zorder=0)
        clipped = schedule.config.clip_grad_norm is not None
        ax_mem.text(end, ax_mem.get_ylim()[1] * 0.97,
                    "update stage" + (": every step, after the whole backward " if clipped
                                      else " "),
                    ha="right", va="top", fontsize=8, color="#8b3a70")
    overlapped = sim.overlapped_step_s
    if overlapped is not None and schedule.config.accumulate == 1:
        x = overlapped / t_scale
        ax_ops.axvline(x, color="#8b3a70", linestyle=":", linewidth=1.4)
        left = x > ax_ops.get_xlim()[1] / 2  # the label on the side with room
        ax_ops.text(x, len(STREAMS) - 0.55, f" step with the host updates under the next "
                    f"forward: {format_seconds(overlapped)} ", ha="right" if left else "left",
                    va="bottom", fontsize=8, color="#8b3a70")


def _save_atomically(fig, path: Path) -> None:
    """Write to a temporary file beside `path`, then rename: readers never see half a PNG."""
    try:
        with replaced_atomically(path) as tmp:
            fig.savefig(tmp, format="png", dpi=_DPI)
    except OSError as e:
        raise KarmaError(f"cannot write the plot to '{path}': {e}") from e


def plot_sweep(points: list[dict], quantity: str, path: str | os.PathLike) -> None:
    """karma-plan --sweep --plot: samples per second against the swept quantity, a line per
    strategy (the plan karma chooses drawn bold and marked), written as a PNG atomically.
    A strategy is drawn where it fits."""
    Figure, _, _ = _matplotlib()
    path = Path(path)
    _check_directory(path)
    xs, x_label = sweep_axis(points, quantity)
    fig = Figure(figsize=(8.0, 4.8), dpi=_DPI, layout="constrained")
    ax = fig.subplots()
    names = sorted({n for p in points for n in p["baselines"]})
    for name in names:
        line = [(x, p["samples_per_s"] * p["step_s"] / p["baselines"][name])
                for x, p in zip(xs, points) if p["feasible"] and p["baselines"].get(name)]
        if line:
            ax.plot(*zip(*line), label=name, linewidth=1.2, alpha=0.8,
                    color=_STRATEGY_COLORS.get(name))
    chosen = [(x, p["samples_per_s"]) for x, p in zip(xs, points) if p["feasible"]]
    if chosen:
        ax.plot(*zip(*chosen), label="karma's plan (ILP)", color="black", linewidth=2.2,
                marker="o", markersize=4)
    short = [x for x, p in zip(xs, points) if not p["feasible"]]
    for x in short:
        ax.axvline(x, color="#d62728", alpha=0.15, linewidth=6)
    ax.set_xlabel(x_label)
    ax.set_ylabel("predicted samples per second")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    ax.set_title(f"{quantity} sweep on {points[0]['hardware']}"
                 + (" (red: no plan fits)" if short else ""), fontsize=10)
    _save_atomically(fig, path)


def sweep_axis(points: list[dict], quantity: str) -> tuple[list[float], str]:
    """A sweep's x values and their label: budgets in the largest binary unit that the
    largest budget fills at least once (20M..40M in MiB, 8G..26G in GiB), or batch sizes."""
    if quantity != "gpu-mem":
        return [p["batch_size"] for p in points], "batch size per rank"
    top = max(p["gpu_mem_bytes"] for p in points)
    unit, scale = _byte_unit(top)
    return [p["gpu_mem_bytes"] / scale for p in points], f"device memory budget ({unit})"


_STRATEGY_COLORS = {"keep_all": "#1f77b4", "recompute_all": "#9467bd", "swap_all": "#2ca02c",
                    "offload_all": "#17becf", "greedy": "#ff7f0e", "selective_all": "#c5b0d5"}
