"""Sweeps checked against measurement: planned and measured step times across budgets and
batch sizes, on the CPU backend.

    .venv/bin/python bench/sweep.py [--seq 256] [--steps 6] [--rounds 3] [--json FILE]

The GPT of 8 layers, width 512, 8 heads (examples/gpt.py, KARMA_GPT=8x512x8), planned for this
machine (`--hardware cpu`, block times measured in context: calibrated) at four budgets (55%,
70%, 85% and 100% of keep_all's peak at batch 2) and at three batch sizes (1, 2, 4 at 85% of
that peak), plus the batch `--batch-size best` picks at 85% if it is none of those.

A calibration is one sample of a shared machine's speed, as a run is, so the bench samples
both in `--rounds` rounds. Each round calibrates every batch afresh (`--remeasure`; round 1's
is the batch search's, which calibrates every batch it tries), plans every point with that
calibration, and trains every point `--steps` steps, the points in an interleaved order
rotated by one each round, so that a slow minute falls on different points. A run's time is
the median of its steps 2..N; a point's planned and measured times are the medians over the
rounds. A point planned twice (batch 2 at 85% is in both sweeps) is trained once.

Printed: each point's planned and measured step with the spread of its runs (max over
min), between adjacent points the planned and the measured ratio, and the batch `best` picks
(with round 1's calibration) beside the best measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
FRACTIONS = (0.55, 0.7, 0.85, 1.0)
BATCHES = (1, 2, 4)
BATCH_FRACTION = 0.85


def plan(env: dict, out: Path, gpu_mem: int, batch: int | str, remeasure: bool = False
         ) -> dict | None:
    """The plan's --json, or None where no plan fits (exit 3)."""
    done = subprocess.run([str(BIN / "karma-plan"), "examples/gpt.py", "--hardware", "cpu",
                           "--gpu-mem", str(gpu_mem), "--batch-size", str(batch), "--json",
                           "-o", str(out), *(["--remeasure"] if remeasure else [])],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode == 3:
        return None
    if done.returncode != 0:
        sys.exit(f"karma-plan failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def train(env: dict, schedule: Path, steps: int, report: Path) -> float:
    """One run's step time: the median of its steps after the first."""
    done = subprocess.run([str(BIN / "karma-run"), str(schedule), "--steps", str(steps),
                           "--report", str(report)], cwd=ROOT, env=env, capture_output=True,
                          text=True)
    if done.returncode != 0:
        sys.exit(f"karma-run failed: {done.stderr[-2000:]}")
    return statistics.median(json.loads(report.read_text())["step_s"][1:])


def orders(n: int, rounds: int) -> list[list[int]]:
    """Each round's order of n points: even places then odd ones (neighbours do not run back
    to back), rotated by one more each round."""
    base = list(range(0, n, 2)) + list(range(1, n, 2))
    return [base[r % n:] + base[:r % n] for r in range(rounds)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", default="256")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    env = {**os.environ, "KARMA_GPT": "8x512x8", "KARMA_SEQ": args.seq}
    with tempfile.TemporaryDirectory(prefix="karma-sweep-") as tmp:
        tmp = Path(tmp)
        keep = subprocess.run([str(BIN / "karma-plan"), "examples/gpt.py", "--hardware", "cpu",
                               "--gpu-mem", "64G", "--batch-size", "2", "--strategy",
                               "keep_all", "--json"], cwd=ROOT, env=env, capture_output=True,
                              text=True, check=True)
        peak = json.loads(keep.stdout)["peak_device_bytes"]
        at = int(BATCH_FRACTION * peak)
        # the search (1, 2, 4, ... doubling, then around the best) with every batch it tries
        # calibrated afresh
        best = plan(env, tmp / "best.yaml", at, "best", remeasure=True)
        batches = sorted(set(BATCHES) | {best["batch_size"]})
        wanted = [("gpu-mem", int(f * peak), 2) for f in FRACTIONS] + \
                 [("batch", at, b) for b in batches]
        keys = list(dict.fromkeys((mem, batch) for _, mem, batch in wanted))
        planned: dict[tuple, list[float]] = {k: [] for k in keys}
        times: dict[tuple, list[float]] = {k: [] for k in keys}
        for r, order in enumerate(orders(len(keys), args.rounds)):
            if r:  # round 0's calibration is the search's
                for batch in batches:
                    plan(env, tmp / "calibrate.yaml", at, batch, remeasure=True)
            files = {}
            for k, (mem, batch) in enumerate(keys):
                files[k] = tmp / f"r{r}-s{k}.yaml"
                got = plan(env, files[k], mem, batch)
                planned[(mem, batch)].append(got["step_s"] if got else float("nan"))
            for k in order:
                if planned[keys[k]][-1] == planned[keys[k]][-1]:  # it fits (not nan)
                    times[keys[k]].append(train(env, files[k], args.steps,
                                                tmp / f"r{r}-{k}.json"))
        points = [(kind, mem, batch) for kind, mem, batch in wanted if times[(mem, batch)]]
    rows = []
    for kind, mem, batch in points:
        runs_s, plans_s = times[(mem, batch)], planned[(mem, batch)]
        measured, predicted = statistics.median(runs_s), statistics.median(plans_s)
        rows.append({"sweep": kind, "gpu_mem_bytes": mem, "batch_size": batch,
                     "planned_s": predicted, "measured_s": measured, "planned_runs_s": plans_s,
                     "runs_s": runs_s, "spread": max(runs_s) / min(runs_s),
                     "planned_samples_per_s": batch / predicted,
                     "measured_samples_per_s": batch / measured})
    print(f"KARMA_GPT=8x512x8 KARMA_SEQ={args.seq}; keep_all's peak at batch 2: "
          f"{peak / 2**20:.0f} MiB; {args.rounds} rounds, each calibrated afresh, planned and "
          f"trained; a run of {args.steps} steps is its median of steps 2..N; planned and "
          "measured are the medians over rounds")
    print("| sweep | budget | batch | planned | measured | spread of runs (max/min) | planned ratio to "
          "the previous | measured ratio | within 10% |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for k, r in enumerate(rows):
        prev = rows[k - 1] if k and rows[k - 1]["sweep"] == r["sweep"] else None
        if prev:
            planned, measured = r["planned_s"] / prev["planned_s"], \
                r["measured_s"] / prev["measured_s"]
            r["ratio_within_10pct"] = abs(measured / planned - 1) <= 0.10
            ratio = (f"{planned:.3f} | {measured:.3f} | "
                     f"{'yes' if r['ratio_within_10pct'] else 'no'}")
        else:
            ratio = " | | "
        print(f"| {r['sweep']} | {r['gpu_mem_bytes'] / 2**20:.0f} MiB | {r['batch_size']} "
              f"| {r['planned_s']:.2f} s | {r['measured_s']:.2f} s | {r['spread']:.2f}x "
              f"| {ratio} |")
    batch_rows = [r for r in rows if r["sweep"] == "batch"]
    top = max(batch_rows, key=lambda r: r["measured_samples_per_s"])
    picked = next(r for r in batch_rows if r["batch_size"] == best["batch_size"])
    short = 1 - picked["measured_samples_per_s"] / top["measured_samples_per_s"]
    print(f"--batch-size best picks {best['batch_size']} "
          f"({picked['measured_samples_per_s']:.3f} samples/s measured); the best measured "
          f"of {[r['batch_size'] for r in batch_rows]} is {top['batch_size']} "
          f"({top['measured_samples_per_s']:.3f} samples/s): {100 * short:.1f}% short "
          f"({'within' if short <= 0.05 else 'not within'} 5%)")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "best": best["batch_size"],
                                         "best_short_of_top": short}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
