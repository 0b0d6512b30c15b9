"""karma-run against the plain PyTorch loop, in alternating fresh processes, on the CPU backend.

    .venv/bin/python bench/overhead.py                         # keep_all: the runtime's cost
    .venv/bin/python bench/overhead.py --gpu-mem 600M --cap    # an out-of-core plan, capped
    .venv/bin/python bench/overhead.py --size medium --seq 128 --batch-size 4 --gpu-mem 1536M

Plans GPT-2 (examples/gpt.py) once: `--strategy keep_all` with unlimited memory by default
(nothing moved, recomputed or offloaded: what is left is the runtime's own cost), or the ILP
for --gpu-mem. Then, --rounds times, runs `python -m karma.reference` (the plain loop, as a
user runs it: no limit, default allocator) and `karma-run` (under `prlimit --data` at the
budget plus the baseline with --cap), each for --steps steps, and prints the median step time
of each over steps 2..N of every round, and their ratio. Alternating the two in one run
shares out the drift of a busy machine between them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
SLACK = 128 << 20  # thread stacks and allocator arenas beyond the baseline (as make demo)


def run(cmd: list[str], env: dict) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return r


def main() -> None:
    from karma.units import format_bytes, parse_size

    p = argparse.ArgumentParser()
    p.add_argument("--size", default="small")
    p.add_argument("--seq", default="64")
    p.add_argument("--batch-size", default="2")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--gpu-mem", default=None, help="plan the ILP for this budget "
                                                  "(default: keep_all, unlimited)")
    p.add_argument("--cap", action="store_true", help="run karma-run under prlimit --data")
    args = p.parse_args()
    env = {**os.environ, "KARMA_GPT": args.size, "KARMA_SEQ": args.seq}
    tmp = Path(tempfile.mkdtemp(prefix="karma-overhead-"))
    schedule = tmp / "schedule.yaml"
    plan = [str(BIN / "karma-plan"), "examples/gpt.py", "--hardware", "cpu",
            "--batch-size", args.batch_size, "-o", str(schedule)]
    plan += ["--gpu-mem", args.gpu_mem] if args.gpu_mem else ["--gpu-mem", "1T",
                                                               "--strategy", "keep_all"]
    print("$", " ".join(plan), flush=True)
    print(run(plan, env).stdout.split("\n\n")[0])

    steps = str(args.steps)
    ref_cmd = [sys.executable, "-m", "karma.reference", "examples/gpt.py",
               "--batch-size", args.batch_size, "--steps", steps]
    karma_cmd = [str(BIN / "karma-run"), str(schedule), "--steps", steps,
                 "--report", str(tmp / "report.json")]
    plain_s, karma_s, plain_peak, karma_peak = [], [], 0, 0
    for k in range(args.rounds):
        ref = json.loads(run(ref_cmd, env).stdout.strip().splitlines()[-1])
        plain_s += ref["step_s"][1:]
        plain_peak = max(plain_peak, ref["peak_private_bytes"])
        cmd = karma_cmd
        if args.cap and args.gpu_mem and shutil.which("prlimit"):
            limit = parse_size(args.gpu_mem) + ref["baseline_data_bytes"] + SLACK
            cmd = ["prlimit", f"--data={limit}", *karma_cmd]
        run(cmd, env)
        report = json.loads((tmp / "report.json").read_text())
        karma_s += report["step_s"][1:]
        karma_peak = max(karma_peak, report["peak_device_bytes"])
        print(f"round {k + 1}: plain {statistics.median(ref['step_s'][1:]):.3f} s/step, "
              f"karma {statistics.median(report['step_s'][1:]):.3f} s/step", flush=True)
    plain, karma = statistics.median(plain_s), statistics.median(karma_s)
    print(f"\n| GPT-2 {args.size}, seq {args.seq}, batch {args.batch_size} | plan | plain s/step "
          f"| karma s/step | karma / plain | plain peak | karma peak |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print(f"| {args.rounds} rounds x steps 2..{args.steps} | "
          f"{('ILP at ' + args.gpu_mem + (' (capped)' if args.cap else '')) if args.gpu_mem else 'keep_all'} | "
          f"{plain:.3f} | {karma:.3f} | {karma / plain:.3f} | {format_bytes(plain_peak)} | "
          f"{format_bytes(karma_peak)} |")
    print(f"\n(commands: {' '.join(ref_cmd)} ; {' '.join(karma_cmd)})")


if __name__ == "__main__":
    main()
