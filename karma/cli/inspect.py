"""karma-inspect: check a schedule file and summarize it.

    karma-inspect schedule.yaml                  # decisions, predictions, per-block table
    karma-inspect schedule.yaml --plot sched.png # memory timeline and per-stream Gantt chart
    karma-inspect schedule.yaml --json           # the summary as JSON
    karma-inspect schedule.yaml --trace t.json   # a step traced by karma-run --trace, beside
    karma-inspect schedule.yaml --trace t.json --plot t.png --chrome t.chrome.json
    karma-inspect --check schedules/*.yaml       # for CI: validation only, "ok: PATH" each

The schedule is validated (load_schedule: every invariant the runtime relies on,
karma/schedule_check.py) and its ops re-simulated; a file whose predicted step time, peak or
stream busy times do not match its ops was edited or is corrupt, and is rejected (exit 2).
--check validates instead, and checks the model file against the schedule as karma-run does
(karma/fingerprint.py): a model that changed since planning makes the schedule stale.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from karma.cli.common import run_cli
from karma.errors import KarmaError
from karma.planner.simulate import Contention, ScheduleError, SimResult, simulate
from karma.schedule import STREAMS, Schedule, ScheduleFileError, schedule_sha256
from karma.schedule_load import load_schedule
from karma.timeline import (
    check_trace,
    compare,
    load_trace,
    render_comparison,
    write_chrome_trace,
)
from karma.units import format_bytes, format_number, format_seconds

# [Note: how closely a re-simulation matches] The file holds times to 6 significant digits,
# good to 5e-6 relative each; a sum of rounded durations (a busy time, the step's
# critical path) is good to another 5e-6. Re-simulated times must match the file's within
# REL_TOL, which covers both; byte counts are integers and must match exactly.
REL_TOL = 2e-5
_CORRUPT = "the schedule was edited or is corrupt; re-plan with karma-plan"
MIB = 1 << 20


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="karma-inspect",
        description="Check a schedule written by karma-plan and summarize it.")
    p.add_argument("schedule", nargs="+", help="a schedule YAML file (with --check, several)")
    p.add_argument("--check", action="store_true",
                   help="only validate each schedule as karma-run would, its model file "
                        "checked against it too (no re-simulation, no summary): print 'ok: "
                        "PATH' for each valid one, else its error (a stale one: the command "
                        "that plans it again); exit 2 if any is invalid or stale")
    p.add_argument("--plot", metavar="PNG", default=None,
                   help="also draw the memory timeline and streams to this PNG file "
                        "(needs matplotlib: pip install 'karma[plot]')")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--trace", metavar="FILE", default=None,
                   help="a step traced by karma-run --trace FILE on this schedule: print its "
                        "per-stream busy times and the compute thread's waits beside the "
                        "plan's; --plot then draws the measured streams under the planned")
    p.add_argument("--chrome", metavar="JSON", default=None,
                   help="with --trace: write the planned and measured timelines in the Chrome "
                        "trace format (open it in ui.perfetto.dev or chrome://tracing)")
    return p


def check_predicted(schedule: Schedule, source: str) -> SimResult:
    """Re-simulate the schedule's ops; raise ScheduleFileError unless `predicted` matches."""
    c = schedule.config
    try:
        sim = simulate(schedule.ops, schedule.buffers, c.accumulate, c.clip_grad_norm is not None,
                       Contention.of(dict(schedule.hardware), c.nproc_per_node))
    except ScheduleError as e:
        raise ScheduleFileError(f"{source}: {e}; {_CORRUPT}") from None
    p = schedule.predicted
    busy = dict(p.busy_s)
    pairs = [("predicted.step_s", p.step_s, sim.step_s, _show_s, REL_TOL),
             ("predicted.peak_device_bytes", p.peak_device_bytes, sim.peak_device_bytes,
              _show_bytes, 0.0)]
    pairs += [(f"predicted.busy_s.{s}", busy.get(s, 0.0), sim.busy_s[s], _show_s, REL_TOL)
              for s in STREAMS]
    for key, written, simulated, show, tol in pairs:
        if abs(written - simulated) > tol * max(abs(written), abs(simulated)):
            raise ScheduleFileError(
                f"{source}: re-simulating its {len(schedule.ops)} ops gives {show(simulated)}, "
                f"but {key} is {show(written)}; {_CORRUPT}")
    return sim


def _show_s(x: float) -> str:
    return f"{x:.6g} s ({format_seconds(x)})"


def _show_bytes(n: int) -> str:
    return f"{n} ({format_bytes(n)})"


def summary(schedule: Schedule, sim: SimResult, source: str) -> dict:
    """Everything karma-inspect prints, as plain values (the --json output)."""
    s, c, p = schedule, schedule.config, schedule.predicted
    hardware = dict(s.hardware)
    return {
        "schedule": source,
        "schedule_sha256": schedule_sha256(s),
        "model": {"path": s.model.path, "sha256": s.model.sha256,
                  "ir_sha256": s.model.ir_sha256, "graph_sha256": s.model.graph_sha256,
                  "env": dict(s.model.env),
                  # the command that writes this file, where the schedule records it
                  "plan_command": s.model.plan_command and s.model.replan_command(source)},
        "strategy": s.strategy,
        "status": s.status,
        "solve_s": s.solve_s,
        "config": {"batch_size": c.batch_size, "dtype": c.dtype, "world_size": c.world_size,
                   "seed": c.seed, "capacity_bytes": c.capacity_bytes,
                   "accumulate": c.accumulate, "clip_grad_norm": c.clip_grad_norm,
                   "host_state": c.host_state, "nproc_per_node": c.nproc_per_node},
        "hardware": hardware.get("name"),
        "decisions": {
            "blocks": len(s.blocks),
            "keep": sum(b.act == "keep" for b in s.blocks),
            "swap": sum(b.act == "swap" for b in s.blocks),
            "recompute": sum(b.act == "recompute" for b in s.blocks),
            "selective": sum(b.act == "selective" for b in s.blocks),
            "kept_on_host": sum(b.kept == "host" for b in s.blocks),
            # checkpoints over two blocks ([Note: a checkpoint over two blocks])
            "pairs": sum(b.with_next for b in s.blocks),
            "streamed_weights": sum(b.weights == "streamed" for b in s.blocks),
            "host_optimizer": sum(b.optim == "host" for b in s.blocks),
        },
        "predicted": {
            "step_s": p.step_s,
            "lower_bound_s": p.lower_bound_s,
            "peak_device_bytes": p.peak_device_bytes,
            "peak_fraction_of_capacity": p.peak_device_bytes / c.capacity_bytes,
            "stage_peak_bytes": p.stage_peak_bytes,
            "process_bytes": s.process_bytes,  # the CPU process outside its tensors, measured
            "host_bytes": p.host_bytes,  # per rank
            "pinned_bytes": p.pinned_bytes,
            "node_host_bytes": p.node_host_bytes,  # per node (None where not recorded)
            "node_pinned_bytes": p.node_pinned_bytes,
            "scaling_efficiency": p.scaling_efficiency,
            "ideal_s": p.ideal_s,  # None where not recorded
            "price_of_budget": p.price_of_budget,
            # re-simulated from the ops, not stored in the file:
            "replay_s": sim.replay_s,  # the micro-batch that steps
            "micro_batch_s": sim.micro_batch_s,  # one that does not (accumulate > 1)
            "overlapped_step_s": sim.overlapped_step_s,  # with clipping
            "serial_step_s": sim.serial_step_s,  # the updates after the whole backward
        },
        "busy_s": dict(p.busy_s),
        "check": {"ops": len(s.ops), "buffers": len(s.buffers),
                  "simulated_step_s": sim.step_s,
                  "simulated_peak_device_bytes": sim.peak_device_bytes, "matches": True},
        "blocks": [{"index": b.index, "name": b.name, "act": b.act, "policy": b.policy,
                    "kept": b.kept, "with_next": b.with_next, "weights": b.weights,
                    "optim": b.optim, "param_bytes": b.param_bytes,
                    "act_bytes": b.act_bytes}
                   for b in s.blocks],
    }


def render(info: dict) -> str:
    """The summary as people read it."""
    m, c, p, d = info["model"], info["config"], info["predicted"], info["decisions"]
    env = "".join(f"  {k}={v}" for k, v in m["env"].items())
    ranks = f"{c['world_size']} rank" + ("s" if c["world_size"] > 1 else "")
    busy = ", ".join(f"{s} {format_seconds(t)}" for s, t in info["busy_s"].items())
    lines = [
        f"schedule    {info['schedule']}  (sha256 {info['schedule_sha256'][:12]}; "
        f"{info['check']['ops']} ops and {info['check']['buffers']} buffers, re-simulated: "
        f"they match)",
        f"model       {m['path']}  sha256 {m['sha256'][:12]}  ir {m['ir_sha256'][:12]}"
        + (f"  fingerprint {m['graph_sha256'][:12]}" if m["graph_sha256"] else "") + env,
        f"plan        {info['strategy']} ({info['status']}), solved in "
        f"{format_seconds(info['solve_s'])}",
        f"config      batch {c['batch_size']}, {c['dtype']}, {ranks}, seed {c['seed']}, "
        f"capacity {format_bytes(c['capacity_bytes'])}, hardware {info['hardware']}",
        f"decisions   {d['blocks']} blocks: {d['keep']} keep, {d['swap']} swap, "
        f"{d['recompute']} recompute, {d['selective']} selective"
        + (f" ({d['kept_on_host']} with their kept outputs on the host)"
           if d["kept_on_host"] else "")
        + (f", {d['pairs']} pair(s) recomputed under one checkpoint" if d["pairs"] else "")
        + f"; {d['streamed_weights']} streamed weights, "
        f"{d['host_optimizer']} host optimizer",
        f"step        {format_seconds(p['step_s'])} predicted ("
        + (f"{p['price_of_budget']:.2f}x the ideal {format_seconds(p['ideal_s'])} of "
           "unlimited memory; " if p["ideal_s"] else "")
        + f"stream bound {format_seconds(p['lower_bound_s'])})" + _step_parts(c, p),
        f"peak        {format_bytes(p['peak_device_bytes'])} of "
        f"{format_bytes(c['capacity_bytes'])} capacity "
        f"({100 * p['peak_fraction_of_capacity']:.1f}%); stage bound "
        f"{format_bytes(p['stage_peak_bytes'])}"
        + (f"; {format_bytes(p['process_bytes'])} of it the process outside its tensors "
           "(measured)" if p["process_bytes"] else ""),
        f"host        {c['host_state']} host state: {format_bytes(p['host_bytes'])} host "
        f"memory a rank, {format_bytes(p['pinned_bytes'])} of it pinned"
        + (f"; {format_bytes(p['node_host_bytes'])} a node of {c['nproc_per_node']} rank(s), "
           f"{format_bytes(p['node_pinned_bytes'])} pinned"
           if p["node_host_bytes"] is not None else ""),
        f"busy        {busy}",
    ]
    if m["plan_command"]:
        lines.append(f"planned by  {m['plan_command']}")
    if c["clip_grad_norm"] is not None:
        lines.append(f"overlapped  the step above has the host updates under the next "
                     f"step's forward, as the runtime runs them; after the backward it "
                     f"would take {format_seconds(p['serial_step_s'])}")
    if c["world_size"] > 1:
        lines.append(f"scaling     {p['scaling_efficiency']:.3f} (one rank's step time "
                     "over this one's)")
    lines += ["", *_block_table(info["blocks"])]
    return "\n".join(lines)


def _step_parts(c: dict, p: dict) -> str:
    """How a step's time is made up, when it is more than one replay of the ops."""
    text = ""
    if c["accumulate"] > 1:
        text += (f"; a step of {c['accumulate']} micro-batches: "
                 f"{c['accumulate'] - 1} x {format_seconds(p['micro_batch_s'])} without the "
                 f"update + {format_seconds(p['replay_s'])} with it")
    if c["clip_grad_norm"] is not None:
        text += f"; gradients clipped to norm {c['clip_grad_norm']:g}, every update after them"
    return text


def _block_table(blocks: list[dict]) -> list[str]:
    head = ("#", "block", "act", "weights", "optim", "param MiB", "act MiB")
    rows = [(str(b["index"]), b["name"],
             b["act"] + (" (kept on host)" if b["kept"] == "host" else ""), b["weights"],
             b["optim"],
             format_number(b["param_bytes"] / MIB), format_number(b["act_bytes"] / MIB))
            for b in blocks]
    widths = [max(len(r[k]) for r in [head, *rows]) for k in range(len(head))]
    right = {0, 5, 6}

    def line(r):
        cells = (v.rjust(w) if k in right else v.ljust(w)
                 for k, (v, w) in enumerate(zip(r, widths)))
        return "  ".join(cells).rstrip()

    return [line(head), *map(line, rows)]


def _check(sources: list[str]) -> int:
    """--check: every file validated and its model file checked against it, each error
    printed; exit 2 if any was invalid or stale."""
    failed = 0
    for source in sources:
        try:
            note = check_model_file(load_schedule(Path(source), source), Path(source))
        except KarmaError as e:
            where = "" if isinstance(e, ScheduleFileError) else f"{source}: "  # it names it
            print(f"karma-inspect: error: {where}{e}", file=sys.stderr)
            failed += 1
        else:
            print(f"ok: {source}")
            if note:
                print(f"karma-inspect: note: {source}: {note}", file=sys.stderr)
    return 2 if failed else 0


def check_model_file(schedule: Schedule, path: Path) -> str | None:
    """Check the schedule's model file as karma-run opens it (karma/fingerprint.py): its
    note when the file changed but not the model, StaleSchedule when the model changed. The
    KARMA_* environment it is loaded in is the schedule's, and restored after."""
    import os

    from karma.runtime.runtime import open_model_file

    notes: list[str] = []
    saved = dict(os.environ)
    try:
        open_model_file(schedule, path, notes.append)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return notes[0] if notes else None


def _inspect(args: argparse.Namespace) -> int:
    if args.check:
        if args.plot or args.json or args.trace or args.chrome:
            raise KarmaError("--check only validates; run --plot, --json, --trace or --chrome "
                             "without it")
        return _check(args.schedule)
    if len(args.schedule) > 1:
        raise KarmaError(f"karma-inspect summarizes one schedule, got {len(args.schedule)}; "
                         "give one, or add --check to validate several")
    source = args.schedule[0]
    if args.chrome and not args.trace:
        raise KarmaError("--chrome needs --trace FILE (a step traced by karma-run --trace)")
    schedule = load_schedule(Path(source), source)
    sim = check_predicted(schedule, source)
    info = summary(schedule, sim, source)
    trace = None
    if args.trace:
        trace = load_trace(args.trace)
        check_trace(trace, schedule, args.trace, source)
        info["trace"] = compare(schedule, sim, trace)
    if args.plot:
        from karma.plot import plot_schedule, plot_timeline

        if trace is None:
            plot_schedule(schedule, sim, args.plot)
        else:
            plot_timeline(schedule, sim, trace, args.plot)
        info["plot"] = args.plot
    if args.chrome:
        write_chrome_trace(args.chrome, schedule, sim, trace)
        info["chrome"] = args.chrome
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(render(info))
        if trace is not None:
            print("\n" + render_comparison(info["trace"], args.trace))
        written = [info[key] for key in ("plot", "chrome") if key in info]
        if written:
            print("\n" + "\n".join(f"wrote {path}" for path in written))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli("karma-inspect", _inspect, _parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
