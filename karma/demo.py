"""`make demo`: karma's main job on an embedded default.

GPT-2 small (sequence 64, batch 2) needs about 2 GiB of memory to train in plain PyTorch.
The demo plans it for an 800 MiB budget, shows plain PyTorch dying under a hard cap of that
budget plus the process's fixed baseline (`prlimit --data`), then trains it with karma-run
under the same cap, on the CPU backend, and checks its losses against the unlimited plain
PyTorch run. Run it as `python -m karma.demo`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from karma.units import format_bytes, parse_size

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "out" / "demo"
ENV = {"KARMA_GPT": "small", "KARMA_SEQ": "64"}
BATCH = "2"
BUDGET = "800M"
STEPS = "5"
SLACK = 128 << 20  # thread stacks and allocator arenas beyond the baseline (bench/RESULTS.md)


def _bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def _run(cmd: list[str], env: dict, limit: int | None = None, show: bool = True,
         capture: bool = False) -> subprocess.CompletedProcess:
    if limit is not None:
        cmd = ["prlimit", f"--data={limit}", *cmd]
    shown = " ".join(f"{k}={v}" for k, v in ENV.items()) + " " + " ".join(
        c.replace(str(ROOT) + "/", "") for c in cmd)
    print(f"\n$ {shown}", flush=True)
    if capture or not show:
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    return subprocess.run(cmd, cwd=ROOT, env=env, text=True)


def main() -> int:
    env = {**os.environ, **ENV}
    OUT.mkdir(parents=True, exist_ok=True)
    schedule = OUT / "schedule.yaml"
    print("karma demo: train GPT-2 small (124M parameters, sequence 64, batch 2) in a budget "
          f"it does not fit, {BUDGET} of private memory, on the CPU backend.")

    r = _run([_bin("karma-plan"), "examples/gpt.py", "--hardware", "cpu", "--gpu-mem", BUDGET,
              "--batch-size", BATCH, "-o", str(schedule)], env)
    if r.returncode != 0:
        return r.returncode

    ref_cmd = [sys.executable, "-m", "karma.reference", "examples/gpt.py",
               "--batch-size", BATCH, "--steps", STEPS]
    print("\nPlain PyTorch, no limit (the reference karma must equal):", end="")
    t0 = time.perf_counter()
    r = _run(ref_cmd, env, capture=True)
    if r.returncode != 0:
        print(r.stderr)
        return r.returncode
    ref = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"  peak {format_bytes(ref['peak_private_bytes'])} above its baseline, "
          f"{time.perf_counter() - t0:.0f} s")

    limit = None
    if shutil.which("prlimit"):
        limit = parse_size(BUDGET) + ref["baseline_data_bytes"] + SLACK
        print(f"\nThe hard cap: budget {BUDGET} + the process's baseline data segment "
              f"{format_bytes(ref['baseline_data_bytes'])} + {format_bytes(SLACK)} slack = "
              f"{format_bytes(limit)}.\nPlain PyTorch under the cap:", end="")
        r = _run(ref_cmd, env, limit, capture=True)
        last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        print(f"  exit {r.returncode}: {last[:150]}")
    else:
        print("\n(prlimit is not installed: karma-run runs without a hard cap)")

    print("\nkarma-run under the same cap:", flush=True)
    report = OUT / "report.json"
    r = _run([_bin("karma-run"), str(schedule), "--steps", STEPS, "--report", str(report),
              "--checkpoint-dir", str(OUT / "checkpoints")], env, limit)
    if r.returncode != 0:
        return r.returncode
    got = json.loads(report.read_text())
    same = got["losses"] == ref["losses"]
    print(f"\nlosses equal to plain PyTorch, bit for bit: {'yes' if same else 'NO'}"
          f"\nmeasured peak {format_bytes(got['peak_device_bytes'])} within the "
          f"{BUDGET} budget: {'yes' if got['peak_device_bytes'] <= got['capacity_bytes'] else 'NO'}"
          f"\nschedule, report and checkpoints are in {OUT.relative_to(ROOT)}/; inspect the plan "
          f"with: karma-inspect {schedule.relative_to(ROOT)} --plot out/demo/plan.png")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
