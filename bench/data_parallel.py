"""Data parallelism on the CPU backend: two ranks under torchrun against one rank, and exactness.

    .venv/bin/python bench/data_parallel.py [--size small] [--seq 128] [--batch-size 2]
                                            [--cap 1G] [--steps 6] [--ranks 2]

1. `karma-profile` measures this machine; `karma-plan --world-size N` and `--world-size 1`
   plan GPT-2 for --cap per rank (the same per-rank batch: weak scaling).
2. `torchrun --nproc-per-node N --no-python karma-run` trains N ranks; `karma-run` trains one.
   Every process gets one thread (OMP_NUM_THREADS=1, torchrun's default), so that N ranks on
   this machine's cores compare with one rank.
3. `python -m karma.reference --world-size N` is the plain loop averaging the N ranks'
   gradients in one process: rank 0's losses must equal it.
Prints a markdown report for bench/RESULTS.md: per step, the step time, the all-reduce time
and the part of it hidden under backward; measured against predicted scaling efficiency.
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


def sh(cmd: list[str], env: dict) -> subprocess.CompletedProcess:
    print("$", " ".join(cmd), flush=True)
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return r


def main() -> None:
    from karma.units import format_bytes, format_seconds

    p = argparse.ArgumentParser()
    p.add_argument("--size", default="small")
    p.add_argument("--seq", default="128")
    p.add_argument("--batch-size", default="2", help="per rank")
    p.add_argument("--cap", default="1G", help="--gpu-mem of each rank")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--ranks", type=int, default=2)
    args = p.parse_args()
    env = {**os.environ, "KARMA_GPT": args.size, "KARMA_SEQ": args.seq, "OMP_NUM_THREADS": "1"}
    tmp = Path(tempfile.mkdtemp(prefix="karma-dp-"))

    sh([str(BIN / "karma-profile"), "-o", str(tmp / "cpu.yaml")], env)
    plans = {}
    for n in (args.ranks, 1):
        out = tmp / f"ranks{n}.yaml"
        sh([str(BIN / "karma-plan"), "examples/gpt.py", "--hardware", str(tmp / "cpu.yaml"),
            "--gpu-mem", args.cap, "--batch-size", args.batch_size, "--world-size", str(n),
            "-o", str(out)], env)
        plans[n] = json.loads(sh([str(BIN / "karma-inspect"), str(out), "--json"], env).stdout)

    many = tmp / "many.json"
    sh([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(args.ranks),
        "--no-python", str(BIN / "karma-run"), str(tmp / f"ranks{args.ranks}.yaml"),
        "--steps", str(args.steps), "--report", str(many)], env)
    one = tmp / "one.json"
    sh([str(BIN / "karma-run"), str(tmp / "ranks1.yaml"), "--steps", str(args.steps),
        "--report", str(one)], env)
    ref = json.loads(sh([sys.executable, "-m", "karma.reference", "examples/gpt.py",
                         "--batch-size", args.batch_size, "--steps", str(args.steps),
                         "--world-size", str(args.ranks)], env).stdout.strip().splitlines()[-1])

    r_many, r_one = json.loads(many.read_text()), json.loads(one.read_text())
    # the first step pays for warm-up (allocator, first collectives): medians of the rest
    t_many = statistics.median(r_many["step_s"][1:])
    t_one = statistics.median(r_one["step_s"][1:])
    ar = r_many["allreduce_s"][1:]
    hid = r_many["allreduce_hidden_s"][1:]
    predicted = plans[args.ranks]["predicted"]
    print("\n## result\n")
    print(f"- GPT-2 {args.size}, sequence {args.seq}, batch {args.batch_size} per rank, "
          f"--gpu-mem {args.cap} per rank, {args.steps} steps, one thread per process")
    print(f"- decisions on {args.ranks} ranks: {_decisions(plans[args.ranks])}; host state "
          f"{plans[args.ranks]['config']['host_state']}")
    print(f"- rank 0's losses {'EQUAL' if r_many['losses'] == ref['losses'] else 'NOT EQUAL'} "
          f"to karma.reference --world-size {args.ranks} (max relative difference "
          f"{_max_rel(r_many['losses'], ref['losses']):.2g})")
    print(f"- step time, median of steps 2..{args.steps}: {args.ranks} ranks "
          f"{format_seconds(t_many)} (predicted {format_seconds(predicted['step_s'])}), "
          f"1 rank {format_seconds(t_one)} (predicted "
          f"{format_seconds(plans[1]['predicted']['step_s'])})")
    print(f"- scaling efficiency (1-rank step time / {args.ranks}-rank step time, same batch per "
          f"rank): measured {t_one / t_many:.3f}, predicted {predicted['scaling_efficiency']:.3f}")
    print(f"- all-reduce per step: {format_seconds(statistics.median(ar))} median, "
          f"{100 * sum(hid) / sum(ar):.0f}% of it hidden under backward; peak "
          f"{format_bytes(r_many['peak_device_bytes'])} against "
          f"{format_bytes(r_many['predicted_peak_device_bytes'])} predicted")
    print("\n| step | step time | all-reduce | hidden |\n|---:|---:|---:|---:|")
    for s, t, a, h in zip(r_many["steps"], r_many["step_s"], r_many["allreduce_s"],
                          r_many["allreduce_hidden_s"]):
        print(f"| {s} | {format_seconds(t)} | {format_seconds(a)} | {format_seconds(h)} |")


def _decisions(inspected: dict) -> str:
    counts: dict[str, int] = {}
    for b in inspected["blocks"]:
        key = f"{b['act']}/{b['weights']}/{b['optim']}"
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n} x {k}" for k, n in sorted(counts.items()))


def _max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b)) if len(a) == len(b) else float("inf")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
