"""Throughput on a smaller GPU, emulated: karma against PyTorch's own memory savers.

    python bench/gpu_throughput.py [--size medium] [--seq 1024] [--batch-size 8] [--cap 16G]
                                   [--gpu-mem 14.5G] [--schedule S.yaml] [--steps 5] [--out DIR]

Every contender trains the same model file (examples/gpt.py: its init, AdamW and data) in its
own process, on a GPU of --cap emulated the same way for all: PyTorch's caching allocator may
hold --cap less what the process already has in use outside it (the CUDA context, measured
with torch.cuda.mem_get_info once CUDA is up), as `karma-run --cap-device-memory` does:

- `karma`: the schedule (--schedule, planned beforehand on any machine with `karma-plan
  examples/gpt.py --hardware h200-141g --gpu-mem GPU_MEM --batch-size B`; else planned here),
  run with `karma-run --cap-device-memory CAP`. It runs first: it is the row that matters.
  --gpu-mem leaves room under --cap for the context and workspaces, which karma's budget
  does not count;
- `plain`: the plain loop (karma.reference's), everything on the GPU;
- `checkpoint`: every block of the model's ModuleLists under non-reentrant
  `torch.utils.checkpoint` (recompute everything), optimizer on the GPU;
- `save_on_cpu`: `torch.autograd.graph.save_on_cpu(pin_memory=True)` around the forward
  (swap everything, synchronously), optimizer on the GPU.

Each contender has its own timeout (--timeout-s, karma's --karma-timeout-s). Prints a markdown
row per contender as it finishes (samples/s, median of steps 2..N; the absolute peaks: bytes
allocated, bytes reserved by the allocator plus in use outside it, which is what the card must
hold; or the error), and saves them to OUT/results.json and OUT/throughput.md.
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


def contender(mode: str, steps: int, batch_size: int, cap_bytes: int, device: str) -> dict:
    """One of PyTorch's strategies, in this process: {"step_s": [...], peaks}."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from karma.modelfile import load_model_file

    mf = load_model_file(ROOT / "examples" / "gpt.py")
    outside = 0
    if device == "cuda":  # the card emulated as karma-run --cap-device-memory does
        from karma.runtime.backends.cuda_backend import cap_device_memory

        outside = cap_device_memory(cap_bytes).outside_bytes
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
    on_cuda = device == "cuda"
    return {"step_s": times,
            "allocated_bytes": torch.cuda.max_memory_allocated() if on_cuda else 0,
            "reserved_bytes": torch.cuda.max_memory_reserved() if on_cuda else 0,
            "outside_bytes": outside}


def run_contender(mode: str, args, env: dict) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", mode, "--steps",
           str(args.steps), "--batch-size", str(args.batch_size), "--cap", args.cap,
           "--device", args.device]
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=args.timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"over its {args.timeout_s:g} s timeout"}
    if r.returncode != 0:
        lines = r.stderr.strip().splitlines() or ["(no output)"]
        oom = any("out of memory" in line.lower() for line in lines)
        return {"error": "out of memory" if oom else lines[-1][:160]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def plan_karma(args, env: dict, out: Path) -> Path | dict:
    """The schedule to run: --schedule, or one planned now (the slow way: plan beforehand)."""
    if args.schedule is not None:
        return args.schedule
    schedule = out / "karma.yaml"
    hardware = "h200-141g" if args.device == "cuda" else "cpu"
    r = subprocess.run([sys.executable, "-m", "karma.cli.plan", "examples/gpt.py", "--hardware",
                        hardware, "--gpu-mem", args.gpu_mem, "--batch-size",
                        str(args.batch_size), "--time-limit", "20", "-o", str(schedule)],
                       cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["karma-plan failed"])[-1][:160]}
    print(r.stdout, flush=True)
    return schedule


def run_karma(args, env: dict, out: Path) -> dict:
    schedule = plan_karma(args, env, out)
    if isinstance(schedule, dict):
        return schedule
    report = out / "karma-report.json"
    cmd = [sys.executable, "-m", "karma.run", str(schedule), "--steps", str(args.steps),
           "--report", str(report)]
    if args.device == "cuda":
        cmd += ["--cap-device-memory", args.cap]
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=args.karma_timeout_s)
    except subprocess.TimeoutExpired as e:
        print((e.stdout or b"")[-3000:].decode(errors="replace")
              if isinstance(e.stdout, bytes) else (e.stdout or "")[-3000:], flush=True)
        return {"error": f"over its {args.karma_timeout_s:g} s timeout"}
    print(r.stdout[-3000:], flush=True)
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["karma-run failed"])[-1][:160]}
    got = json.loads(report.read_text())
    return {"step_s": got["step_s"], "allocated_bytes": got["device_peak_allocated_bytes"],
            "reserved_bytes": got["device_peak_reserved_bytes"],
            "outside_bytes": got["device_outside_allocator_bytes"],
            "predicted_step_s": got["predicted_step_s"],
            "peak_above_baseline_bytes": got["peak_device_bytes"],
            "predicted_peak_bytes": got["predicted_peak_device_bytes"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="medium")
    p.add_argument("--seq", default="1024")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--cap", default="16G", help="the GPU size to emulate")
    p.add_argument("--gpu-mem", default="14.5G", help="karma's budget, when it plans here")
    p.add_argument("--schedule", type=Path, default=None, help="karma's schedule, planned before")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--timeout-s", type=float, default=60.0, help="each PyTorch contender's")
    p.add_argument("--karma-timeout-s", type=float, default=120.0)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from karma.units import format_bytes, format_seconds, parse_size

    cap = parse_size(args.cap)
    if args.one:
        print(json.dumps(contender(args.one, args.steps, args.batch_size, cap, args.device)))
        return
    # every contender with expandable segments, the CUDA backend's default
    # (runtime/backends/cuda_backend.py, [Note: expandable segments]), so that the allocator
    # is not what separates them
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", **os.environ,
           "KARMA_GPT": args.size, "KARMA_SEQ": args.seq,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out = args.out or Path(tempfile.mkdtemp(prefix="karma-gpu-"))
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"GPT-2 {args.size}, sequence {args.seq}, batch {args.batch_size}, fp32, AdamW; "
             f"{args.device} emulating a {args.cap} card (the allocator capped at {args.cap} "
             f"less what is in use outside it, expandable segments on); medians of steps "
             f"2..{args.steps}; peaks "
             "absolute: allocated, and reserved + outside the allocator (what the card holds)",
             "", "| strategy | samples/s | step | allocated | reserved + outside | note |",
             "|---|---:|---:|---:|---:|---|"]
    print("\n" + "\n".join(lines), flush=True)
    results = {}
    for mode in ("karma", *MODES):
        r = run_karma(args, env, out) if mode == "karma" else run_contender(mode, args, env)
        results[mode] = r
        lines.append(_row(mode, r, args.batch_size, format_bytes, format_seconds))
        print(lines[-1], flush=True)
        (out / "results.json").write_text(json.dumps(results, indent=2))
        (out / "throughput.md").write_text("\n".join(lines) + "\n")


def _row(mode: str, r: dict, batch_size: int, format_bytes, format_seconds) -> str:
    if "error" in r:
        return f"| {mode} | - | - | - | - | {r['error']} |"
    step = statistics.median(r["step_s"][1:] or r["step_s"])
    note = ""
    if "predicted_step_s" in r:
        note = (f"predicted {format_seconds(r['predicted_step_s'])}; above its baseline "
                f"{format_bytes(r['peak_above_baseline_bytes'])}, predicted "
                f"{format_bytes(r['predicted_peak_bytes'])}")
    card = r["reserved_bytes"] + r["outside_bytes"]
    return (f"| {mode} | {batch_size / step:.2f} | {format_seconds(step)} | "
            f"{format_bytes(r['allocated_bytes'])} | {format_bytes(card)} | {note} |")


if __name__ == "__main__":
    main()
