"""`make demo`: karma's main job on an embedded default.

GPT-2 small (sequence 64, batch 2) needs about 2 GiB of memory to train in plain PyTorch.
The demo plans it for an 800 MiB budget, shows plain PyTorch dying under a hard cap of that
budget plus the process's fixed baseline (`prlimit --data`), then trains it with karma-run
under the same cap, on the CPU backend, and checks its losses against the unlimited plain
PyTorch run that steps the schedule's host-stepped blocks with karma's host kernel
(`python -m karma.reference ... --schedule`). The text is Python's own documentation, byte
by byte (examples/gpt.py), so the
loss falls visibly within the few steps. With a CUDA GPU it does the same on the GPU: GPT-2
large planned for a smaller GPU, emulated with `karma-run --cap-device-memory`. Run it as
`python -m karma.demo`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from karma.schedule_load import load_schedule
from karma.units import format_bytes, parse_size

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "out" / "demo"
ENV = {"KARMA_GPT": "small", "KARMA_SEQ": "64"}
BATCH = "2"
BUDGET = "800M"
STEPS = "8"
SLACK = 128 << 20  # thread stacks and allocator arenas beyond the baseline (bench/RESULTS.md)
# On a GPU: GPT-2 large as if on a 24 GiB GPU (bench/gpu_throughput.py compares the same):
# planned for 23 GiB, the rest of the card for the CUDA context and library workspaces.
CUDA_ENV = {"KARMA_GPT": "large", "KARMA_SEQ": "1024"}
CUDA_BATCH = "8"
CUDA_CARD = "24G"
CUDA_BUDGET = "23G"


def _bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def _run(cmd: list[str], env: dict, limit: int | None = None, show: bool = True,
         capture: bool = False) -> subprocess.CompletedProcess:
    if limit is not None:
        cmd = ["prlimit", f"--data={limit}", *cmd]
    shown = " ".join(f"{k}={v}" for k, v in env.items() if k in ENV or k in CUDA_ENV)
    shown += " " + " ".join(c.replace(str(ROOT) + "/", "") for c in cmd)
    print(f"\n$ {shown}", flush=True)
    if capture or not show:
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    return subprocess.run(cmd, cwd=ROOT, env=env, text=True)


def main() -> int:
    import torch

    if torch.cuda.is_available():
        return main_cuda()
    env = {**os.environ, **ENV}
    OUT.mkdir(parents=True, exist_ok=True)
    schedule = OUT / "schedule.yaml"
    print("karma demo: train GPT-2 small (124M parameters, sequence 64, batch 2) in a budget "
          f"it does not fit, {BUDGET} of private memory, on the CPU backend.")

    # --remeasure: this machine and the blocks measured now, not read from a cache of another
    # hour, so that the predictions printed beside the measurements are this hour's (a
    # shared machine's speed drifts: [Note: a machine whose speed drifts]); about 45 s
    r = _run([_bin("karma-plan"), "examples/gpt.py", "--hardware", "cpu", "--gpu-mem", BUDGET,
              "--batch-size", BATCH, "--remeasure", "-o", str(schedule)], env)
    if r.returncode != 0:
        return r.returncode

    ref_cmd = [sys.executable, "-m", "karma.reference", "examples/gpt.py",
               "--batch-size", BATCH, "--steps", STEPS]
    print("\nPlain PyTorch, no limit:", end="")
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
    return _train_and_compare(schedule, env, ref_cmd, limit, [])


def main_cuda() -> int:
    """The same job on a GPU: a GPU smaller than this one, emulated for both the plain loop
    and karma-run (--cap-device-memory: the allocator capped at the card less the CUDA
    context)."""
    import torch

    env = {**os.environ, **CUDA_ENV}
    OUT.mkdir(parents=True, exist_ok=True)
    schedule = OUT / "schedule.yaml"
    print(f"karma demo on {torch.cuda.get_device_name()}: train GPT-2 large (774M parameters, "
          f"sequence {CUDA_ENV['KARMA_SEQ']}, batch {CUDA_BATCH}) as if on a {CUDA_CARD} GPU.")
    profile = OUT / "gpu.yaml"
    r = _run([_bin("karma-profile"), "--quick", "-o", str(profile)], env)
    if r.returncode != 0:
        return r.returncode
    r = _run([_bin("karma-plan"), "examples/gpt.py", "--hardware", str(profile), "--gpu-mem",
              CUDA_BUDGET, "--batch-size", CUDA_BATCH, "-o", str(schedule)], env)
    if r.returncode != 0:
        return r.returncode
    ref_cmd = [sys.executable, "-m", "karma.reference", "examples/gpt.py", "--batch-size",
               CUDA_BATCH, "--steps", STEPS, "--device", "cuda"]
    print("\nPlain PyTorch on the whole GPU:", end="")
    r = _run(ref_cmd, env, capture=True)
    if r.returncode != 0:
        print(r.stderr[-2000:])
        return r.returncode
    ref = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"  peak {format_bytes(ref['peak_cuda_bytes'])}")
    print(f"\nPlain PyTorch on a {CUDA_CARD} GPU:", end="")
    r = _run(ref_cmd + ["--cap-device-memory", CUDA_CARD], env, capture=True)
    last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
    print(f"  exit {r.returncode}: {last[:150]}")
    print(f"\nkarma-run on the same {CUDA_CARD} GPU:", flush=True)
    return _train_and_compare(schedule, env, ref_cmd, None,
                              ["--cap-device-memory", CUDA_CARD])


def _train_and_compare(schedule: Path, env: dict, ref_cmd: list[str], limit: int | None,
                       extra: list[str]) -> int:
    report = OUT / "report.json"
    r = _run([_bin("karma-run"), str(schedule), "--steps", STEPS, "--report", str(report),
              "--checkpoint-dir", str(OUT / "checkpoints"), *extra], env, limit)
    if r.returncode != 0:
        return r.returncode
    got = json.loads(report.read_text())
    # the reference karma must equal steps the schedule's host-stepped blocks with its kernel
    # (torch's fused CPU kernel by default: README, "The host optimizer")
    r = _run([*ref_cmd, "--schedule", str(schedule)], env, capture=True, show=False)
    if r.returncode != 0:
        print(r.stderr[-2000:])
        return r.returncode
    same = got["losses"] == json.loads(r.stdout.strip().splitlines()[-1])["losses"]
    fits = got["peak_device_bytes"] <= got["capacity_bytes"]
    first, last = got["losses"][0], got["losses"][-1]
    host_kernel = load_schedule(schedule).config.host_optimizer
    print(f"\nloss fell from {first:.2f} at step 1 to {last:.2f} at step {len(got['losses'])}. "
          f"For scale, the loss of\n{_yardsticks(env)}"
          f"\nlosses equal to plain PyTorch's, its host-stepped blocks stepped with karma's "
          f"kernel ({host_kernel}), bit for bit: {'yes' if same else 'NO'}"
          f"\nmeasured peak {format_bytes(got['peak_device_bytes'])} within the "
          f"{format_bytes(got['capacity_bytes'])} budget: {'yes' if fits else 'NO'}"
          f"\nschedule, report and checkpoints are in {OUT.relative_to(ROOT)}/; inspect the plan "
          f"with: karma-inspect {schedule.relative_to(ROOT)} --plot out/demo/plan.png")
    return 0 if same else 1


def _yardsticks(env: dict) -> str:
    """What models that know little about the text score, for scale."""
    import torch

    from karma.modelfile import load_model_file

    saved = dict(os.environ)
    os.environ.update(env)
    try:
        gpt = load_model_file(ROOT / "examples" / "gpt.py").module
    finally:
        os.environ.clear()
        os.environ.update(saved)
    p = torch.bincount(gpt.text()).double() / len(gpt.text())
    unigram = -(p[p > 0] * p[p > 0].log()).sum().item()
    lines = [(math.log(gpt.VOCAB), f"a uniform guess among the model's {gpt.VOCAB} tokens"),
             (math.log(128), "a uniform guess among the 128 ASCII bytes, the text's alphabet"),
             (unigram, "a guess that knows only how often each byte occurs in the text")]
    if gpt.VOCAB == 128:
        del lines[0]  # the same as the next
    return "\n".join(f"  {loss:6.2f}  {what}" for loss, what in lines)


if __name__ == "__main__":
    raise SystemExit(main())
