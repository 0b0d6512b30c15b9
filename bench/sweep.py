"""Sweeps checked against measurement: planned and measured step times across budgets and
batch sizes, on the CPU backend.

    .venv/bin/python bench/sweep.py [--seq 256] [--steps 4] [--json FILE]

The GPT of 8 layers, width 512, 8 heads (examples/gpt.py, KARMA_GPT=8x512x8), planned for this
machine (`--hardware cpu`, block times measured: calibrated) at four budgets (55%, 70%, 85%
and 100% of keep_all's peak at batch 2) and at three batch sizes (1, 2, 4 at 85% of that
peak); each point trained `--steps` steps with karma-run, the runs in an interleaved order,
its step time the median of steps 2..N. Printed: each point's planned and measured
iteration and samples/s, and between adjacent points the planned and the measured ratio;
the batch `--batch-size best` picks beside the best measured.
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


def plan(env: dict, out: Path, gpu_mem: int, batch: int | str) -> dict | None:
    """The plan's --json, or None where no plan fits (exit 3)."""
    done = subprocess.run([str(BIN / "karma-plan"), "examples/gpt.py", "--hardware", "cpu",
                           "--gpu-mem", str(gpu_mem), "--batch-size", str(batch), "--json",
                           "-o", str(out)], cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode == 3:
        return None
    if done.returncode != 0:
        sys.exit(f"karma-plan failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def train(env: dict, schedule: Path, steps: int, report: Path) -> float:
    done = subprocess.run([str(BIN / "karma-run"), str(schedule), "--steps", str(steps),
                           "--report", str(report)], cwd=ROOT, env=env, capture_output=True,
                          text=True)
    if done.returncode != 0:
        sys.exit(f"karma-run failed: {done.stderr[-2000:]}")
    return statistics.median(json.loads(report.read_text())["step_s"][1:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", default="256")
    p.add_argument("--steps", type=int, default=4)
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
        points = [("gpu-mem", int(f * peak), 2) for f in FRACTIONS] + \
                 [("batch", int(0.85 * peak), b) for b in BATCHES]
        plans = {}
        for k, (_, mem, batch) in enumerate(points):
            plans[k] = plan(env, tmp / f"s{k}.yaml", mem, batch)
        points = [pt for k, pt in enumerate(points) if plans[k] is not None]
        plans = [pl for pl in plans.values() if pl is not None]
        best = plan(env, tmp / "best.yaml", int(0.85 * peak), "best")
        for k, (_, mem, batch) in enumerate(points):  # the fitting ones, renumbered
            plan(env, tmp / f"s{k}.yaml", mem, batch)
        order = list(range(len(points)))
        order = order[::2] + order[1::2]  # interleaved: neighbours do not run back to back
        measured = {k: train(env, tmp / f"s{k}.yaml", args.steps, tmp / f"r{k}.json")
                    for k in order}
    rows = []
    for k, (kind, mem, batch) in enumerate(points):
        rows.append({"sweep": kind, "gpu_mem_bytes": mem, "batch_size": batch,
                     "planned_s": plans[k]["iteration_s"], "measured_s": measured[k],
                     "planned_samples_per_s": batch / plans[k]["iteration_s"],
                     "measured_samples_per_s": batch / measured[k]})
    print(f"KARMA_GPT=8x512x8 KARMA_SEQ={args.seq}; keep_all's peak at batch 2: "
          f"{peak / 2**20:.0f} MiB; {args.steps} steps a point, median of steps 2..N")
    print("| sweep | budget | batch | planned | measured | planned ratio to the previous "
          "| measured ratio | within 10% |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for k, r in enumerate(rows):
        prev = rows[k - 1] if k and rows[k - 1]["sweep"] == r["sweep"] else None
        ratio = (f"{r['planned_s'] / prev['planned_s']:.3f} | "
                 f"{r['measured_s'] / prev['measured_s']:.3f} | "
                 f"{'yes' if abs(r['measured_s'] / prev['measured_s'] / (r['planned_s'] / prev['planned_s']) - 1) <= 0.10 else 'no'}"
                 if prev else " | | ")
        print(f"| {r['sweep']} | {r['gpu_mem_bytes'] / 2**20:.0f} MiB | {r['batch_size']} "
              f"| {r['planned_s']:.2f} s | {r['measured_s']:.2f} s | {ratio} |")
    batch_rows = [r for r in rows if r["sweep"] == "batch"]
    top = max(batch_rows, key=lambda r: r["measured_samples_per_s"])
    print(f"--batch-size best picks {best['batch_size']}; the best measured of "
          f"{[r['batch_size'] for r in batch_rows]} is {top['batch_size']} "
          f"({top['measured_samples_per_s']:.3f} samples/s)")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "best": best["batch_size"]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
