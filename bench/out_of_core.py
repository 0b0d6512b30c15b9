"""Out-of-core for real: train a model under a hard memory cap that plain PyTorch cannot live under.

    .venv/bin/python bench/out_of_core.py [--model gpt] [--size medium] [--seq 128]
                                          [--batch-size 4] [--cap 1536M] [--steps 5]
                                          [--dtype bf16] [--accumulate 4] [--clip-grad-norm 1]

1. `karma-profile` measures this machine; `karma-plan --hardware <that profile>` plans the
   model for --cap of private memory.
2. The plain PyTorch loop (python -m karma.reference) runs without a limit: its losses and peak.
3. Both run under `prlimit --data=LIMIT`, LIMIT = cap + the process's fixed baseline (its data
   segment before the model is built, measured by karma-run's first line, plus a slack for
   thread stacks and allocator arenas stated in the output): the reference must die of
   out-of-memory, karma-run must train with the reference's losses (its host optimizer as
   given: `--host-optimizer as-given`, the plain loop's kernel).
Prints a markdown report for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
MIB = 1 << 20


def sh(cmd: list[str], env: dict, limit_bytes: int | None = None) -> subprocess.CompletedProcess:
    if limit_bytes is not None:
        cmd = ["prlimit", f"--data={limit_bytes}", *cmd]
    print("$", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)


def main() -> None:
    from karma.units import format_bytes, parse_size

    p = argparse.ArgumentParser()
    p.add_argument("--size", default="medium")
    p.add_argument("--seq", default="128")
    p.add_argument("--batch-size", default="4")
    p.add_argument("--cap", default="1536M")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--slack", default="128M", help="LIMIT = cap + baseline + slack")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--accumulate", default="1")
    p.add_argument("--clip-grad-norm", default=None)
    args = p.parse_args()
    training = ["--dtype", args.dtype, "--accumulate", args.accumulate]
    if args.clip_grad_norm is not None:
        training += ["--clip-grad-norm", args.clip_grad_norm]
    env = {**os.environ, "KARMA_GPT": args.size, "KARMA_SEQ": args.seq}
    cap = parse_size(args.cap)
    tmp = Path(tempfile.mkdtemp(prefix="karma-ooc-"))

    r = sh([str(BIN / "karma-profile"), "-o", str(tmp / "cpu.yaml")], env)
    assert r.returncode == 0, r.stderr
    profile = r.stdout
    schedule = tmp / "schedule.yaml"
    r = sh([str(BIN / "karma-plan"), "examples/gpt.py", "--hardware", str(tmp / "cpu.yaml"),
            "--gpu-mem", args.cap, "--batch-size", args.batch_size, "-o", str(schedule),
            *training], env)
    assert r.returncode == 0, r.stderr
    plan = r.stdout

    ref_cmd = [sys.executable, "-m", "karma.reference", "examples/gpt.py",
               "--batch-size", args.batch_size, "--steps", str(args.steps), *training]
    r = sh(ref_cmd, env)
    assert r.returncode == 0, r.stderr
    ref = json.loads(r.stdout.strip().splitlines()[-1])

    baseline_data = ref["baseline_data_bytes"]
    limit = cap + baseline_data + parse_size(args.slack)
    capped_ref = sh(ref_cmd, env, limit)
    # the model file's optimizer as given on the host: bitwise the plain loop's losses (the
    # fused default equals the reference that steps the same blocks with the same kernel)
    run_cmd = [str(BIN / "karma-run"), str(schedule), "--steps", str(args.steps),
               "--report", str(tmp / "report.json"), "--host-optimizer", "as-given"]
    capped_run = sh(run_cmd, env, limit)
    print(capped_run.stdout[-3000:], capped_run.stderr[-2000:])
    report = json.loads((tmp / "report.json").read_text()) if capped_run.returncode == 0 else {}

    ref_died = capped_ref.returncode != 0 and re.search(
        r"can't allocate memory|out of memory|MemoryError", capped_ref.stderr) is not None
    equal = report.get("losses") == ref["losses"]
    print("\n## result\n")
    print(f"- model: GPT-2 {args.size}, sequence {args.seq}, batch {args.batch_size}, "
          f"{args.steps} steps ({' '.join(training)}); budget (--gpu-mem) {format_bytes(cap)}")
    print(f"- plain PyTorch without a limit: peak private memory {format_bytes(ref['peak_private_bytes'])}"
          f" above its baseline = {ref['peak_private_bytes'] / cap:.2f}x the budget")
    print(f"- LIMIT = budget {format_bytes(cap)} + baseline data segment "
          f"{format_bytes(baseline_data)} + slack {args.slack} = {format_bytes(limit)} "
          f"(`prlimit --data={limit}`)")
    print(f"- plain PyTorch under LIMIT: exit {capped_ref.returncode}, "
          f"{'died of out-of-memory' if ref_died else 'DID NOT DIE OF OOM'}: "
          f"{(capped_ref.stderr.strip().splitlines() or [''])[-1][:160]}")
    if report:
        print(f"- karma-run under LIMIT: exit 0, {len(report['losses'])} steps, losses "
              f"{'EQUAL to' if equal else 'DIFFERENT from'} the unlimited reference")
        print(f"- step time: measured median {report['step_s_median']:.2f} s, predicted "
              f"{report['predicted_step_s']:.2f} s (ratio "
              f"{report['step_s_median'] / report['predicted_step_s']:.2f})")
        print(f"- peak private memory above baseline: measured "
              f"{format_bytes(report['peak_device_bytes'])}, predicted "
              f"{format_bytes(report['predicted_peak_device_bytes'])}, budget "
              f"{format_bytes(report['capacity_bytes'])}")
    else:
        print(f"- karma-run under LIMIT FAILED: exit {capped_run.returncode}: "
              f"{capped_run.stderr.strip()[-300:]}")
    print("\n### plan\n\n```\n" + plan.strip() + "\n```\n\n### profile\n\n```\n"
          + profile.strip() + "\n```")
    print("\nlosses (reference):", ref["losses"])
    print("losses (karma-run):", report.get("losses"))
    sys.exit(0 if (ref_died and equal) else 1)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
