"""How fast the host steps AdamW, against the bound the machine's memory bandwidth sets.

    .venv/bin/python bench/host_optimizer.py [--layers 8] [--width 512] [--heads 8] [--seq 256]
        [--vocab 8192] [--batch-size 8] [--repeats 5] [--traced-steps 4] [--gpu-mem 2G]
        [--json FILE]

On the block shapes of examples/gpt.py (by default KARMA_GPT=8x512x8x8192, KARMA_SEQ=256,
batch 8), one table in GB/s (1e9 bytes a second) of fp32 parameter bytes stepped:

1. the machine's memory bandwidth: a STREAM-like triad over all of torch's threads, on arrays
   far larger than the caches (the best of --repeats, as STREAM reports it; bytes counted
   as the bus carries them, write-allocate included);
2. the bound that implies for AdamW, which moves 28 bytes a parameter (parameter read and
   write, gradient read, exp_avg and exp_avg_sq each read and write): bandwidth x 4 / 28;
3. torch.optim.AdamW alone, all of the model's parameters in one optimizer, single-tensor
   (foreach=False), foreach=True and fused=True: one warm-up step, then the median of
   --repeats steps;
4. karma's host steps inside a traced out-of-core step: karma-plan --hardware cpu --strategy
   offload_all (every block's weights streamed, every block stepped on the host; block times
   estimated, --no-measure), karma-run tracing steps 3 to 2 + --traced-steps, and from the
   traces the parameter bytes of the blocks the host_step ops stepped (the schedule's
   param_bytes) over the sum of their durations: all of them; those that no compute op
   (forward, loss, recompute, backward, device_step) of their step overlapped in time; and
   those that one did.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's karma, here and in the commands it runs

from karma.fileio import write_text_atomic  # noqa: E402
from karma.modelfile import load_model_file  # noqa: E402
from karma.runtime.loop import trace_file  # noqa: E402
from karma.schedule import Schedule  # noqa: E402
from karma.schedule_load import load_schedule  # noqa: E402
from karma.timeline import OpSpan, StepTrace, load_trace  # noqa: E402
from karma.units import format_bytes, format_number, format_seconds  # noqa: E402

GPT = ROOT / "examples" / "gpt.py"
TRIAD_ELEMENTS = 1 << 25  # 128 MiB an fp32 array: several times a CPU's last-level cache
ADAMW_BYTES_PER_PARAM = 28  # param r+w 8, grad r 4, exp_avg r+w 8, exp_avg_sq r+w 8
FP32_BYTES = 4
KERNELS = {"single-tensor": {"foreach": False}, "foreach": {"foreach": True},
           "fused": {"fused": True}}


@dataclass(frozen=True)
class Row:
    """One line of the table: `nbytes` in `seconds`."""

    measure: str
    bytes_per_s: float | None  # None: nothing measured (no such host steps)
    nbytes: int  # fp32 parameter bytes stepped (the triad: bytes moved, write-allocate counted)
    seconds: float
    detail: str
    ops: int | None = None  # karma's rows: how many host_step ops


def rate_row(measure: str, nbytes: int, seconds: float, detail: str,
             ops: int | None = None) -> Row:
    return Row(measure, nbytes / seconds if seconds > 0 else None, nbytes, seconds, detail, ops)


def gpt_env(args: argparse.Namespace) -> dict[str, str]:
    """The KARMA_* variables that size examples/gpt.py."""
    return {"KARMA_GPT": f"{args.layers}x{args.width}x{args.heads}x{args.vocab}",
            "KARMA_SEQ": str(args.seq)}


def median_s(fn, repeats: int) -> float:
    """The median wall time of `repeats` calls of `fn`, after one call to warm up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def triad_row(repeats: int, n: int = TRIAD_ELEMENTS) -> Row:
    """Memory bandwidth: a = b + s * c on n fp32 elements, on all of torch's threads, the
    best of `repeats` (as STREAM reports it)."""
    a, b, c = torch.empty(n), torch.rand(n), torch.rand(n)
    torch.add(b, c, alpha=3.0, out=a)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        times.append(time.perf_counter() - start)
    # Counted as the bus carries them: b and c read, a written, and a read first (the cache
    # reads a line before writing it: write-allocate), 4 x 4 bytes an element. AdamW reads
    # every array it writes, so its 28 bytes a parameter are all it moves: counted alike.
    # (STREAM counts 3 x 4 bytes, and so reports 3/4 of this.)
    return rate_row("memory bandwidth (triad)", 4 * FP32_BYTES * n, min(times),
                    f"3 x {format_bytes(n * FP32_BYTES)} arrays, 16 bytes moved an element")


def param_shapes(env: dict[str, str]) -> list[torch.Size]:
    """The shapes of examples/gpt.py's parameters at `env` (a tied weight once)."""
    os.environ.update(env)
    mf = load_model_file(GPT)
    with torch.device("meta"):
        model = mf.build_model()
    return [p.shape for p in model.parameters()]


def adamw_row(shapes: list[torch.Size], kernel: str, repeats: int) -> Row:
    """torch's AdamW (lr=1e-3, the model file's default) with `kernel`, every parameter in
    one optimizer: one step's parameter bytes and time."""
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-3, **KERNELS[kernel])
    seconds = median_s(opt.step, repeats)
    return rate_row(f"torch AdamW {kernel}", sum(p.numel() for p in params) * FP32_BYTES,
                    seconds, f"{len(params)} tensors")


def run(cmd: list[str], env: dict[str, str]) -> None:
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-3000:]}")


def traced_steps(args: argparse.Namespace, work: Path) -> tuple[Schedule, list[StepTrace]]:
    """Plan offload_all for the GPT, train 2 + --traced-steps steps and trace all from the
    third."""
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, **gpt_env(args), "PYTHONPATH": os.pathsep.join(path)}
    schedule, trace = work / "schedule.yaml", work / "trace.json"
    run([sys.executable, "-m", "karma.cli.plan", str(GPT), "--hardware", "cpu", "--strategy",
         "offload_all", "--gpu-mem", args.gpu_mem, "--batch-size", str(args.batch_size),
         "--no-measure", "-o", str(schedule)], env)
    k = args.traced_steps
    run([sys.executable, "-m", "karma.cli.run", str(schedule), "--steps", str(2 + k),
         "--trace-step", "3", "--trace-steps", str(k), "--trace", str(trace)], env)
    paths = [trace_file(trace, n, k) for n in range(3, 3 + k)]
    return load_schedule(schedule), [load_trace(path) for path in paths]


def overlaps(span: OpSpan, others: list[OpSpan]) -> bool:
    """Whether any of `others` ran for some time inside `span` (an instant does not)."""
    return any(min(span.end_s, o.end_s) > max(span.start_s, o.start_s) for o in others)


def host_rate(name: str, steps: list[OpSpan], schedule: Schedule) -> Row:
    """The parameter bytes `steps` stepped over the sum of their durations."""
    nbytes = sum(schedule.blocks[s.block].param_bytes for s in steps)
    seconds = sum(s.end_s - s.start_s for s in steps)
    plural = "" if len(steps) == 1 else "s"
    return rate_row(name, nbytes, seconds, f"{len(steps)} host step{plural}", len(steps))


def karma_rows(schedule: Schedule, traces: list[StepTrace]) -> list[Row]:
    """The traced steps' host steps: all, those beside no compute op, those beside one."""
    steps, alone, beside = [], [], []
    for trace in traces:
        compute = [s for s in trace.ops if s.stream == "compute"]
        for s in trace.ops:
            if s.kind == "host_step":
                steps.append(s)
                (beside if overlaps(s, compute) else alone).append(s)
    return [host_rate("karma host steps, all", steps, schedule),
            host_rate("karma host steps, no compute op overlapping", alone, schedule),
            host_rate("karma host steps, a compute op overlapping", beside, schedule)]


def table(rows: list[Row], bound: float) -> str:
    lines = ["| measure | GB/s | of the AdamW bound | bytes | time | detail |",
             "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        rate = "n/a" if r.bytes_per_s is None else format_number(r.bytes_per_s / 1e9)
        share = "" if r.bytes_per_s is None or r.measure.startswith("memory") \
            else f"{r.bytes_per_s / bound:.0%}"
        lines.append(f"| {r.measure} | {rate} | {share} | {format_bytes(r.nbytes)} "
                     f"| {format_seconds(r.seconds)} | {r.detail} |")
    return "\n".join(lines)


def measure(args: argparse.Namespace) -> list[Row]:
    triad = triad_row(args.repeats)
    # the parameter bytes whose AdamW step moves as many bytes as the triad did, in its time
    rows = [triad, rate_row("AdamW bound: bandwidth x 4/28",
                            triad.nbytes * FP32_BYTES // ADAMW_BYTES_PER_PARAM, triad.seconds,
                            "28 bytes moved a parameter")]
    shapes = param_shapes(gpt_env(args))
    rows += [adamw_row(shapes, kernel, args.repeats) for kernel in KERNELS]
    with tempfile.TemporaryDirectory(prefix="karma-host-optimizer-") as tmp:
        rows += karma_rows(*traced_steps(args, Path(tmp)))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("layers", 8), ("width", 512), ("heads", 8), ("seq", 256),
                          ("vocab", 8192), ("batch-size", 8), ("repeats", 5),
                          ("traced-steps", 4)):
        p.add_argument(f"--{flag}", type=int, default=default)
    p.add_argument("--gpu-mem", default="2G", help="karma-plan's budget (default 2G)")
    p.add_argument("--json", type=Path, help="also write the table here")
    args = p.parse_args()
    for flag in ("layers", "width", "heads", "seq", "vocab", "batch_size", "repeats",
                 "traced_steps"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)} is not positive; "
                    "give a whole number of 1 or more")
    rows = measure(args)
    bound = rows[1].bytes_per_s
    env = " ".join(f"{k}={v}" for k, v in gpt_env(args).items())
    print(f"{env}, batch {args.batch_size}, {torch.get_num_threads()} threads, "
          f"median of {args.repeats} (the triad: the best; karma: the host steps of "
          f"{args.traced_steps} traced step(s)); GB/s "
          "of fp32 parameter bytes stepped (the triad: of bytes moved)")
    print(table(rows, bound))
    if args.json:
        write_text_atomic(args.json, json.dumps(
            {"env": gpt_env(args), "batch_size": args.batch_size, "repeats": args.repeats,
             "traced_steps": args.traced_steps,
             "threads": torch.get_num_threads(), "adamw_bound_bytes_per_s": bound,
             "rows": [asdict(r) for r in rows]}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
