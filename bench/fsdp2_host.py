"""Peak host memory per rank of PyTorch FSDP2 training a GPT on the CPU with gloo.

    .venv/bin/python bench/fsdp2_host.py [--ranks 2 4] [--steps 3] [--json FILE]

For each world size N, N processes (one thread each) train examples/gpt.py with
KARMA_GPT=8x512x8, KARMA_SEQ=1024, batch size 1 per rank, `fully_shard` on every block and
then on the root, and AdamW. Per rank it reports the peak RSS (VmHWM), the RSS after building
the model (before `fully_shard`), the peak RSS of the training steps alone (VmHWM reset through
/proc/self/clear_refs after setup), and the bytes of the rank's local shards of parameters,
gradients and optimizer state after the last step. A single process without FSDP gives the
unsharded baseline. `measure(world_size, steps)` returns the per-rank numbers.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
GPT = "8x512x8"
SEQ = "1024"
MIB = 2**20


def _proc_status_bytes(field: str) -> int:
    """A `kB` field of /proc/self/status (VmRSS, VmHWM), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _load_gpt() -> ModuleType:
    os.environ["KARMA_GPT"] = GPT
    os.environ["KARMA_SEQ"] = SEQ
    spec = importlib.util.spec_from_file_location("gpt", ROOT / "examples" / "gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tensor_bytes(t: object) -> int:
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    if not isinstance(t, torch.Tensor):
        return 0
    return t.numel() * t.element_size()


def _state_bytes(model: object, optimizer: object) -> dict[str, int]:
    """Bytes of this rank's local parameters, gradients and optimizer state."""
    params = list(model.parameters())
    opt = sum(_tensor_bytes(v) for s in optimizer.state.values() for v in s.values())
    return {
        "param_bytes": sum(_tensor_bytes(p) for p in params),
        "grad_bytes": sum(_tensor_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer_bytes": opt,
    }


def _worker(rank: int, world_size: int, steps: int, fsdp: bool, out: Path) -> None:
    """Train one rank and write its numbers to `out` as JSON."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.set_num_threads(1)
    gpt = _load_gpt()
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = gpt.build_model()
    model_rss = _proc_status_bytes("VmRSS")
    if fsdp:
        for block in model.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = gpt.batches(1, rank, world_size)
    setup_peak = _proc_status_bytes("VmHWM")
    reset = _reset_peak_rss()
    start = time.perf_counter()
    losses = []
    for _ in range(steps):
        inputs, targets = next(data)
        optimizer.zero_grad()
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    seconds = time.perf_counter() - start
    parts = _state_bytes(model, optimizer)
    peak = _proc_status_bytes("VmHWM")
    result = {
        "world_size": world_size,
        "rank": rank,
        "fsdp": fsdp,
        "peak_rss_bytes": max(setup_peak, peak),
        "train_peak_rss_bytes": peak if reset else None,
        "model_rss_bytes": model_rss,
        "final_rss_bytes": _proc_status_bytes("VmRSS"),
        "state_bytes": sum(parts.values()),
        **parts,
        "losses": losses,
        "seconds_per_step": seconds / steps,
    }
    out.write_text(json.dumps(result))
    if fsdp:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(world_size: int, steps: int, fsdp: bool = True) -> list[dict]:
    """Train `world_size` FSDP2 ranks (or, with fsdp=False, one plain process) for `steps`
    steps; one dict per rank with rank, peak_rss_bytes, state_bytes and more."""
    if not fsdp and world_size != 1:
        raise ValueError("the plain baseline runs one process")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KARMA_GPT": GPT, "KARMA_SEQ": SEQ,
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    with tempfile.TemporaryDirectory(prefix="fsdp2-host-") as tmp:
        outs = [Path(tmp) / f"rank{r}.json" for r in range(world_size)]
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--worker", str(r), "--world-size", str(world_size),
                 "--steps", str(steps), *([] if fsdp else ["--no-fsdp"]), "--out", str(out)],
                cwd=ROOT, env=env)
            for r, out in enumerate(outs)
        ]
        codes = [p.wait() for p in procs]
        if any(codes):
            raise RuntimeError(f"world size {world_size}: ranks exited with {codes}")
        return [json.loads(out.read_text()) for out in outs]


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / MIB:.1f}"


def _row(label: str, r: dict) -> str:
    return (f"| {label:>10} | {r['rank']:>4} | {_mib(r['model_rss_bytes']):>13} "
            f"| {_mib(r['peak_rss_bytes']):>12} | {_mib(r['train_peak_rss_bytes']):>18} "
            f"| {_mib(r['state_bytes']):>15} | {r['seconds_per_step']:>8.2f} |")


def _table(results: dict[str, list[dict]]) -> str:
    lines = [
        "| world size | rank | RSS model MiB | peak RSS MiB | train peak RSS MiB "
        "| local state MiB | s / step |",
        "|-----------:|-----:|--------------:|-------------:|-------------------:"
        "|----------------:|---------:|",
    ]
    for label, ranks in results.items():
        lines += [_row(label, r) for r in ranks]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json", type=Path, help="write all numbers to this file")
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    p.add_argument("--world-size", type=int, help=argparse.SUPPRESS)
    p.add_argument("--no-fsdp", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker is not None:
        _worker(args.worker, args.world_size, args.steps, not args.no_fsdp, args.out)
        return

    start = time.perf_counter()
    results = {"1 (plain)": measure(1, args.steps, fsdp=False)}
    for n in args.ranks:
        results[str(n)] = measure(n, args.steps)
    print(f"KARMA_GPT={GPT} KARMA_SEQ={SEQ}, batch size 1 per rank, {args.steps} steps, "
          "gloo, one thread per rank")
    print(_table(results))
    print(f"total {time.perf_counter() - start:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
