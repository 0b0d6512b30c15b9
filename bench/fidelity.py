"""Fidelity and overhead on the CPU backend: predicted against measured, per strategy.

    .venv/bin/python bench/fidelity.py [--size small] [--seq 64] [--batch-size 2] [--steps 6]
        [--cases swap_all:1.1,offload_all:1.1] [--rounds 3]
    .venv/bin/python bench/fidelity.py --model resnet --env KARMA_RESNET_IMAGE=64 --batch-size 8
    .venv/bin/python bench/fidelity.py --model mlp --batch-size 64

Plans an example (GPT-2 by default; --model resnet or mlp, --env KEY=VALUE for its size) as `karma-plan --hardware cpu` does by default (this machine's rates and block
times, measured once and cached: karma/calibrate; --no-measure: the roofline), then runs
the plain PyTorch loop (`python -m karma.reference`) and `karma-run` for each strategy, each
in a fresh process as users run them, alternating, and prints a markdown table: median step
time (measured and predicted), peak private memory above the baseline (measured and
predicted). The plain loop's column is a reference for the machine's drift. The
"independent" columns time the same plan as if the streams did not share cores (the profile's
contention fractions set to 0: the prediction before they existed).

Fresh processes matter: run inside this process, after the plain loop, a run finds thread
pools and freed pages already there, and measures 5-6 MiB under the peak a fresh karma-run
has and 10-16% under step times calibrated in a fresh process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.overhead import BIN  # noqa: E402
from bench.overhead import run as run_in_root  # noqa: E402 - exits with its stderr


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt", help="examples/MODEL.py")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="the example's size, e.g. KARMA_RESNET=50 (repeatable)")
    p.add_argument("--size", default="small", help="KARMA_GPT, for --model gpt")
    p.add_argument("--seq", default="64", help="KARMA_SEQ, for --model gpt")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=1,
                   help="run every case this many times in turn (medians over all rounds)")
    p.add_argument("--no-measure", action="store_true",
                   help="plan with the roofline estimate instead of this machine's measured "
                        "rates and block times (karma-plan's default, cached)")
    p.add_argument("--cases", default="keep_all:1.1,recompute_all:1.1,swap_all:1.1,"
                   "offload_all:1.1,ilp:0.7,ilp:0.5",
                   help="strategy:budget pairs, the budget a fraction of keep_all's peak")
    args = p.parse_args()
    if args.model == "gpt":
        os.environ.update({"KARMA_GPT": args.size, "KARMA_SEQ": args.seq})
    os.environ.update(dict(kv.split("=", 1) for kv in args.env))
    example = f"examples/{args.model}.py"

    from karma.api import calibration
    from karma.ir.build import build_block_graph
    from karma.ir.optimizer import optimizer_profile
    from karma.modelfile import load_model_file
    from karma.planner.baselines import BASELINES
    from karma.planner.hardware import dump_hardware
    from karma.planner.options import PlanOptions
    from karma.planner.pipeline import make_schedule
    from karma.planner.plan import evaluate
    from karma.planner.problem import build_problem
    from karma.schedule import ModelRef
    from karma.units import format_bytes

    mf = load_model_file(ROOT / example)
    graph = build_block_graph(mf, args.batch_size, model_name=example)
    opt_profile = optimizer_profile(mf)
    # what karma-plan --hardware cpu does by default: this machine's rates and block times
    # (measured once, cached: karma/calibrate); --no-measure: the roofline
    options = PlanOptions(hardware="cpu", batch_size=args.batch_size,
                          measure="estimate" if args.no_measure else "cached")
    cal = calibration(mf, graph, options, opt_profile, log=print)
    hw, measured = cal.hardware, cal.measured
    Path(tempfile.gettempdir(), "karma-fidelity-cpu.yaml").write_text(dump_hardware(hw))
    problem = build_problem(graph, hw, optimizer=opt_profile, measured=measured)
    keep_peak = evaluate(problem, BASELINES["keep_all"](problem, 1 << 60), 1 << 60).stage_peak_bytes
    model = ModelRef.now(example, mf.sha256, graph.to_json())

    tmp = Path(tempfile.mkdtemp(prefix="karma-fidelity-"))
    ref_cmd = [sys.executable, "-m", "karma.reference", example,
               "--batch-size", str(args.batch_size), "--steps", str(args.steps)]

    cases = [(case.split(":")[0], float(case.split(":")[1])) for case in args.cases.split(",")]
    independent = build_problem(graph, hw.independent_streams(), optimizer=opt_profile,
                                measured=measured)
    print(f"contention: compute slowdown {hw.compute_slowdown_copy:g} beside copies, "
          f"{hw.compute_slowdown_host:g} beside host steps; copies {hw.copy_slowdown_compute:g}"
          f", host steps {hw.host_slowdown_compute:g} beside compute")
    sizes = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("KARMA_"))
    print(f"{example} ({sizes}), batch {args.batch_size}; block times "
          f"{cal.summary}; the process outside its tensors "
          f"{format_bytes(measured.process_bytes)} "
          "(planned in every stage); medians over "
          f"steps 2..{args.steps} of {args.rounds} round(s); keep_all stage peak {format_bytes(keep_peak)}\n")
    print("| strategy | budget | step s measured | step s predicted | measured/predicted | "
          "predicted, independent | measured/independent | "
          "peak measured | peak predicted | within budget | plain loop step s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    planned = []  # (strategy, budget, schedule, plan), each planned once
    for strategy, fraction in cases:
        cap = int(keep_peak * fraction)
        try:
            report = make_schedule(graph, model, dataclasses.replace(
                options, gpu_mem=cap, hardware=hw, strategy=strategy), measured, opt_profile)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"| {strategy} | {format_bytes(cap)} | {type(e).__name__}: {e} |")
            continue
        path = tmp / f"case{len(planned)}.yaml"
        report.schedule.save(path)
        planned.append((strategy, cap, path, report.schedule, report.chosen.plan))
    # every round runs every case once (the plain loop first), so that a machine that drifts
    # within the hour spreads its drift over all of them; medians over steps 2.. of all rounds
    run_s = {k: [] for k in range(len(planned))}
    plain_s = {k: [] for k in range(len(planned))}
    peaks = {k: 0 for k in range(len(planned))}
    for _ in range(args.rounds):
        for k, (_, _, path, _, _) in enumerate(planned):
            ref = run_in_root(ref_cmd, dict(os.environ))
            plain_s[k] += json.loads(ref.stdout.strip().splitlines()[-1])["step_s"][1:]
            run_in_root([str(BIN / "karma-run"), str(path), "--steps", str(args.steps),
                         "--report", str(tmp / "report.json")], dict(os.environ))
            run = json.loads((tmp / "report.json").read_text())
            run_s[k] += run["step_s"][1:]
            peaks[k] = max(peaks[k], run["peak_device_bytes"])
    for k, (strategy, cap, _, schedule, plan) in enumerate(planned):
        measured, ref = statistics.median(run_s[k]), statistics.median(plain_s[k])
        predicted = schedule.predicted
        alone_s = evaluate(independent, plan, cap).step_s
        print(f"| {strategy} | {format_bytes(cap)} | {measured:.3f} | {predicted.step_s:.3f}"
              f" | {measured / predicted.step_s:.2f} | {alone_s:.3f} | "
              f"{measured / alone_s:.2f} | {format_bytes(peaks[k])}"
              f" | {format_bytes(predicted.peak_device_bytes)} | "
              f"{'yes' if peaks[k] <= cap else 'NO'} | {ref:.3f} |", flush=True)
    print(f"\n(commands: {' '.join(ref_cmd)} ; karma-run SCHEDULE --steps {args.steps}; "
          f"schedules in {tmp})")


if __name__ == "__main__":
    main()
