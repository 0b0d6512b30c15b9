"""The price of a budget, measured beside planned: out-of-core plans' steps over keep_all's, on
the CPU backend.

    .venv/bin/python bench/price.py [--budgets 400M,600M,800M] [--rounds 3] [--steps 9]
                                    [--no-trace] [--json FILE] [--keep DIR] [--no-selective-too]
                                    [--no-pairs-too]
                                    [--model FILE --env K=V,... --batch N] [--host-mem SIZE]

The GPT of 8 layers, width 512, 8 heads, a vocabulary of 8192, sequence 256, batch 8
(examples/gpt.py, KARMA_GPT=8x512x8x8192; keep_all peaks at 1.1 GiB; at GPT-2's vocabulary of
50257 its output layer alone would need 1.4 GiB at this batch) is planned for this machine (`--hardware cpu`, block
times measured in keep_all steps, taken again here with `--remeasure` so that every planned
time is of this sitting; or --model, its --env and --batch; --host-mem: the host memory the
plans have): keep_all with unlimited memory, and the ILP at each budget (with
--no-selective-too, at each budget also without selective recompute: karma-plan
--no-selective, the budget's name followed by "-nosel"; with --no-pairs-too, also without
two blocks recomputed under one checkpoint: --no-pairs, "-nopairs").

Then `--rounds` rounds, each training every plan `--steps` steps in a fresh karma-run, the
plans' order rotated by one each round. A run's step time is the median of its steps after
the first; its spread the slowest of those over the fastest. A plan's measured price in a
round is its step over keep_all's in the same round; printed are the median over rounds, their
range, and the planned price (the plan's predicted step over keep_all's).

Then (unless --no-trace) one more run of each plan traces `--steps - 1` steps (karma-run
--trace-steps), and karma-inspect sets each stream's busy time in every traced step beside the
simulator's: printed, per stream, the median over the steps of measured over planned.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from karma.planner.fit_contention import FITTED
from karma.planner.simulate import SIDE_STREAMS

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
ENV = {"KARMA_GPT": "8x512x8x8192", "KARMA_SEQ": "256"}
BATCH = 8


def run(cmd: list[str], env: dict) -> str:
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd[:3])} ... failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return done.stdout


NO_SELECTIVE = "-nosel"  # a budget's name with this suffix: planned with --no-selective
NO_PAIRS = "-nopairs"  # and with this one: planned with --no-pairs


def plan(env: dict, out: Path, name: str, keep_all: bool = False, model: str = "examples/gpt.py",
         batch: int = BATCH, host_mem: str | None = None) -> dict:
    gpu_mem = name.removesuffix(NO_SELECTIVE).removesuffix(NO_PAIRS)
    return json.loads(run([str(BIN / "karma-plan"), model, "--hardware", "cpu",
                           "--gpu-mem", gpu_mem, "--batch-size", str(batch), "--json",
                           "-o", str(out),
                           *(["--host-mem", host_mem] if host_mem and not keep_all else []),
                           *(["--strategy", "keep_all", "--remeasure"] if keep_all else []),
                           *(["--no-selective"] if name.endswith(NO_SELECTIVE) else []),
                           *(["--no-pairs"] if name.endswith(NO_PAIRS) else [])],
                          env))


def train(env: dict, schedule: Path, steps: int, report: Path, *trace: str) -> list[float]:
    """The step times of one fresh run, the first included."""
    run([str(BIN / "karma-run"), str(schedule), "--steps", str(steps), "--report",
         str(report), *trace], env)
    return json.loads(report.read_text())["step_s"]


def busy_ratios(env: dict, schedule: Path, traces: list[Path]) -> dict[str, list[float]]:
    """Per stream, measured busy over planned in each traced step (karma-inspect --trace)."""
    ratios: dict[str, list[float]] = {}
    for t in traces:
        info = json.loads(run([str(BIN / "karma-inspect"), str(schedule), "--trace", str(t),
                               "--json"], env))
        for stream, v in info["trace"]["streams"].items():
            if v["planned_busy_s"] > 0:
                ratios.setdefault(stream, []).append(v["busy_s"] / v["planned_busy_s"])
    return ratios


def side_streams(schedule: Path) -> dict[str, float]:
    """The side streams' contention fields the calibration fitted, as the schedule carries
    them (the profile's where it kept them)."""
    from karma.schedule_load import load_schedule

    hw = dict(load_schedule(schedule).hardware)
    return {k: float(hw.get(k, 0.0)) for k in FITTED}


def attribution(schedule: Path, traces: list[Path]) -> dict[str, dict[str, float]]:
    """Per side stream, over every traced step: its ops' measured seconds over their planned
    duration alone (`Op.dur_s`), for the ops that ran alone (under a quarter of their span
    beside compute) and for those beside compute (over three quarters), with the slowdown the
    plan's contention fractions give beside compute. A ratio above 1 alone is the runtime's
    own cost (page faults, a second copy); beside compute above the planned slowdown, sharing
    the cores costs more than the calibration measured."""
    from karma.planner.simulate import Contention
    from karma.schedule_load import load_schedule
    from karma.timeline import load_trace

    plan = load_schedule(schedule)
    fractions = Contention.of(dict(plan.hardware))
    beside_planned = {"h2d": 1 / (1 - fractions.copy_slowdown_compute),
                      "d2h": 1 / (1 - (fractions.d2h_slowdown_compute
                                       or fractions.copy_slowdown_compute)),
                      "host": 1 / (1 - fractions.host_slowdown_compute)}
    sums: dict[tuple[str, str], list[float]] = {}
    for path in traces:
        trace = load_trace(path)
        compute = sorted((o.start_s, o.end_s) for o in trace.ops if o.stream == "compute")
        for o in trace.ops:
            if o.stream not in SIDE_STREAMS or o.end_s <= o.start_s:
                continue
            span = o.end_s - o.start_s
            shared = sum(max(0.0, min(e, o.end_s) - max(s, o.start_s)) for s, e in compute)
            where = "alone" if shared < 0.25 * span else \
                "beside" if shared > 0.75 * span else "partly"
            got = sums.setdefault((o.stream, where), [0.0, 0.0, 0])
            got[0] += span
            got[1] += plan.ops[o.op].dur_s
            got[2] += 1
    out: dict[str, dict[str, float]] = {}
    for (stream, where), (measured, planned, n) in sums.items():
        row = out.setdefault(stream, {"beside_planned": beside_planned[stream]})
        row[f"{where}_ops"] = n
        row[f"{where}_s"] = measured
        row[f"{where}_over_alone"] = measured / planned if planned > 0 else float("nan")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budgets", default="400M,600M,800M")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=9)
    p.add_argument("--no-trace", action="store_true")
    p.add_argument("--json", type=Path)
    p.add_argument("--model", default="examples/gpt.py", help="the model file")
    p.add_argument("--env", default=None, metavar="K=V,...",
                   help="its environment (default, for the GPT: "
                        + ",".join(f"{k}={v}" for k, v in ENV.items()) + ")")
    p.add_argument("--batch", type=int, default=BATCH)
    p.add_argument("--host-mem", default=None, help="the node's host memory the plans have")
    p.add_argument("--no-selective-too", action="store_true",
                   help="plan each budget without selective recompute too (karma-plan "
                        "--no-selective), beside the default")
    p.add_argument("--no-pairs-too", action="store_true",
                   help="plan each budget without two blocks under one checkpoint too "
                        "(karma-plan --no-pairs), beside the default")
    p.add_argument("--keep", type=Path, metavar="DIR",
                   help="leave the schedules, reports and traces in DIR (default: a temporary "
                        "directory, removed)")
    args = p.parse_args()
    model_env = ENV if args.env is None else dict(kv.split("=", 1)
                                                    for kv in args.env.split(",") if kv)
    env = {**os.environ, **model_env}
    shape = {"model": args.model, "batch": args.batch, "host_mem": args.host_mem}
    budgets = args.budgets.split(",")
    suffixes = ("", *([NO_SELECTIVE] if args.no_selective_too else []),
                *([NO_PAIRS] if args.no_pairs_too else []))
    names = ["keep_all", *(b + s for b in budgets for s in suffixes)]
    where = contextlib.nullcontext(args.keep) if args.keep else \
        tempfile.TemporaryDirectory(prefix="karma-price-")
    with where as tmp:
        tmp = Path(tmp)
        tmp.mkdir(parents=True, exist_ok=True)
        files = {n: tmp / f"{k}.yaml" for k, n in enumerate(names)}
        plans = {"keep_all": plan(env, files["keep_all"], "64G", keep_all=True, **shape)}
        fitted = side_streams(files["keep_all"])
        for n in names[1:]:
            plans[n] = plan(env, files[n], n, **shape)
        steps: dict[str, list[list[float]]] = {n: [] for n in names}
        for r in range(args.rounds):
            for n in names[r % len(names):] + names[:r % len(names)]:
                steps[n].append(train(env, files[n], args.steps, tmp / f"r{r}-{n}.json"))
        busy: dict[str, dict[str, list[float]]] = {}
        causes: dict[str, dict] = {}
        if not args.no_trace:
            for n in names:
                stem = tmp / f"trace-{n}.json"
                train(env, files[n], args.steps, tmp / f"t-{n}.json", "--trace", str(stem),
                      "--trace-steps", str(args.steps - 1))
                traces = [stem.with_name(f"{stem.stem}.step{s}.json")
                          for s in range(2, args.steps + 1)]
                busy[n] = busy_ratios(env, files[n], traces)
                causes[n] = attribution(files[n], traces)
    rows = []
    keep = [statistics.median(s[1:]) for s in steps["keep_all"]]
    for n in names:
        runs = [statistics.median(s[1:]) for s in steps[n]]
        prices = [a / b for a, b in zip(runs, keep)]
        predicted = plans[n]["step_s"] / plans["keep_all"]["step_s"]
        rows.append({
            "plan": n, "predicted_s": plans[n]["step_s"], "decisions": plans[n]["decisions"],
            "measured_s": statistics.median(runs), "runs_s": runs,
            "predicted_price": predicted, "measured_price": statistics.median(prices),
            "prices": prices,
            "step_spread": statistics.median(max(s[1:]) / min(s[1:]) for s in steps[n]),
            "busy_over_planned": {s: statistics.median(v) for s, v in busy.get(n, {}).items()},
        })
    print(f"{args.model} {' '.join(f'{k}={v}' for k, v in model_env.items())}, batch "
          f"{args.batch}" + (f", host memory {args.host_mem}" if args.host_mem else "")
          + f"; {args.rounds} "
          f"rounds of {args.steps} steps a plan, each run's median of steps 2..{args.steps}")
    print("side streams as calibrated: " + ", ".join(f"{k} {v:g}" for k, v in fitted.items()))
    print("| plan | predicted step | measured step | predicted price | measured price (median) "
          "| range over rounds | within 10% | step spread (max/min) | "
          + " | ".join(f"{s} busy / planned" for s in SIDE_STREAMS)
          + " | keep / swap / recompute / selective, pairs |")
    print("|---|---:|---:|---:|---:|---|---|---:|" + "---:|" * len(SIDE_STREAMS) + "---|")
    keep_spread = rows[0]["step_spread"]
    for r in rows:
        within = abs(r["measured_price"] / r["predicted_price"] - 1) <= 0.10
        r["price_within_10pct"] = within
        busy_cells = " | ".join(f"{r['busy_over_planned'][s]:.2f}"
                                if s in r["busy_over_planned"] else "" for s in SIDE_STREAMS)
        print(f"| {r['plan']} | {r['predicted_s']:.2f} s | {r['measured_s']:.2f} s "
              f"| {r['predicted_price']:.3f} | {r['measured_price']:.3f} "
              f"| {min(r['prices']):.3f}-{max(r['prices']):.3f} | {'yes' if within else 'no'} "
              f"| {r['step_spread']:.2f} | {busy_cells} | "
              + " / ".join(str(r["decisions"].get(a, 0))
                           for a in ("keep", "swap", "recompute", "selective"))
              + f", {r['decisions'].get('pairs', 0)} |")
    print(f"keep_all's step spread {keep_spread:.2f}; out-of-core plans within it + 10%: "
          + ", ".join(f"{r['plan']} {'yes' if r['step_spread'] <= keep_spread + 0.10 else 'no'}"
                      for r in rows[1:]))
    if causes:
        print("\nSide streams' ops, measured over planned alone (Op.dur_s), by how much of "
              "each op ran beside compute, over every traced step:")
        print("| plan | stream | alone: ops, ratio | partly: ops, ratio | beside: ops, ratio "
              "| planned beside |")
        print("|---|---|---|---|---|---:|")
        for n in names[1:]:
            for stream, v in sorted(causes[n].items()):
                cells = " | ".join(
                    f"{v[w + '_ops']}, {v[w + '_over_alone']:.2f}" if w + "_ops" in v else ""
                    for w in ("alone", "partly", "beside"))
                print(f"| {n} | {stream} | {cells} | {v['beside_planned']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "causes": causes, "side_streams": fitted},
                                        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
