"""Throughput on a smaller GPU, emulated: karma against PyTorch's own memory savers.

    python bench/gpu_throughput.py [--size medium] [--seq 1024] [--batch-size 8] [--cap 16G]
                                   [--steps 5] [--out DIR]

Every contender trains the same model file (examples/gpt.py: its init, AdamW and data) in its
own process, under `torch.cuda.set_per_process_memory_fraction((cap + 256 MiB) / total)` (the
slack `karma-run --cap-device-memory` leaves for cuBLAS workspaces and rounding):

- `plain`: the plain loop (karma.reference), everything on the GPU;
- `checkpoint`: every block of the model's ModuleLists under non-reentrant
  `torch.utils.checkpoint` (recompute everything), optimizer on the GPU;
- `save_on_cpu`: `torch.autograd.graph.save_on_cpu(pin_memory=True)` around the forward
  (swap everything, synchronously), optimizer on the GPU;
- `karma`: `karma-plan --hardware h200-141g --gpu-mem CAP`, then `karma-run
  --cap-device-memory` (the same cap), both as `python -m` (no install needed).

Prints a markdown row per contender as it finishes (samples/s, median of steps 2..N; peak
device memory; or the error, out of memory), and saves them to OUT/results.json.
`--device cpu --size tiny` runs the same code on the CPU, as a smoke test.
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = ("plain", "checkpoint", "save_on_cpu")
SLACK = 256 << 20  # as karma-run --cap-device-memory (karma/runtime/train.py)


def contender(mode: str, steps: int, batch_size: int, cap_bytes: int, device: str) -> dict:
    """One of PyTorch's strategies, in this process: {"step_s": [...], "peak_bytes": n}."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from karma.modelfile import load_model_file

    mf = load_model_file(ROOT / "examples" / "gpt.py")
    if device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, (cap_bytes + SLACK) / total))
    torch.manual_seed(0)
    model = mf.build_model().to(device)
    model.train()
    if mode == "checkpoint":
        for container in [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]:
            for block in container:
                forward = block.forward
                block.forward = lambda *a, _f=forward, **k: checkpoint(
                    _f, *a, use_reentrant=False, **k)
    opt = mf.make_optimizer(model.parameters())
    data = mf.batches(batch_size, 0, 1)
    saving = (lambda: torch.autograd.graph.save_on_cpu(pin_memory=device == "cuda")) \
        if mode == "save_on_cpu" else contextlib.nullcontext
    times = []
    for _ in range(steps):
        x, y = next(data)
        x, y = x.to(device), y.to(device)
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with saving():
            loss = mf.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss.item()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
    return {"step_s": times, "peak_bytes": peak}


def run_contender(mode: str, args, env: dict) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", mode, "--steps",
           str(args.steps), "--batch-size", str(args.batch_size), "--cap", args.cap,
           "--device", args.device]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        lines = r.stderr.strip().splitlines() or ["(no output)"]
        oom = any("out of memory" in line.lower() for line in lines)
        return {"error": "out of memory" if oom else lines[-1][:160]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_karma(args, env: dict, out: Path) -> dict:
    schedule = out / "karma.yaml"
    hardware = "h200-141g" if args.device == "cuda" else "cpu"
    r = subprocess.run([sys.executable, "-m", "karma.cli.plan", "examples/gpt.py", "--hardware",
                        hardware,
                        "--gpu-mem", args.cap, "--batch-size", str(args.batch_size),
                        "--time-limit", "20", "-o", str(schedule)],
                       cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["karma-plan failed"])[-1][:160]}
    print(r.stdout, flush=True)
    report = out / "karma-report.json"
    cmd = [sys.executable, "-m", "karma.run", str(schedule), "--steps", str(args.steps), "--report",
           str(report)] + (["--cap-device-memory"] if args.device == "cuda" else [])
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    print(r.stdout[-3000:], flush=True)
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["karma-run failed"])[-1][:160]}
    got = json.loads(report.read_text())
    return {"step_s": got["step_s"], "peak_bytes": got["peak_device_bytes"],
            "predicted_step_s": got["predicted_step_s"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="medium")
    p.add_argument("--seq", default="1024")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--cap", default="16G", help="the GPU size to emulate")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from karma.units import format_bytes, format_seconds, parse_size

    cap = parse_size(args.cap)
    if args.one:
        print(json.dumps(contender(args.one, args.steps, args.batch_size, cap, args.device)))
        return
    env = {**os.environ, "KARMA_GPT": args.size, "KARMA_SEQ": args.seq,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out = args.out or Path(tempfile.mkdtemp(prefix="karma-gpu-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"\nGPT-2 {args.size}, sequence {args.seq}, batch {args.batch_size}, fp32, AdamW; "
          f"{args.device} capped at {args.cap}; medians of steps 2..{args.steps}\n")
    print("| strategy | samples/s | step | peak | note |\n|---|---:|---:|---:|---|", flush=True)
    results = {}
    for mode in (*MODES, "karma"):
        r = run_karma(args, env, out) if mode == "karma" else run_contender(mode, args, env)
        results[mode] = r
        print(_row(mode, r, args.batch_size, format_bytes, format_seconds), flush=True)
        (out / "results.json").write_text(json.dumps(results, indent=2))


def _row(mode: str, r: dict, batch_size: int, format_bytes, format_seconds) -> str:
    if "error" in r:
        return f"| {mode} | - | - | - | {r['error']} |"
    step = statistics.median(r["step_s"][1:] or r["step_s"])
    note = f"predicted {format_seconds(r['predicted_step_s'])}" if "predicted_step_s" in r else ""
    return (f"| {mode} | {batch_size / step:.2f} | {format_seconds(step)} | "
            f"{format_bytes(r['peak_bytes'])} | {note} |")


if __name__ == "__main__":
    main()
