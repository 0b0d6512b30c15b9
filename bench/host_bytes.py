"""Host memory a rank with sharded host state, beside PyTorch FSDP2's, on the CPU with gloo.

    .venv/bin/python bench/host_bytes.py [--ranks 2 4] [--steps 3] [--json FILE]

The model is bench/fsdp2_host.py's: examples/gpt.py at KARMA_GPT=8x512x8 (51.5M parameters),
KARMA_SEQ=1024, batch 1 a rank. karma plans it for the CPU backend with --strategy offload_all
(every block's weights streamed from the host, where AdamW steps them: the host state is all
of the training state), for one rank (replicated: there is nothing to shard) and for each
world size N (sharded), and trains 3 steps under torchrun (--standalone, one node), whose
report gives each rank's host memory at its peak (`rank_host_bytes`: its host tier's peak and
its share of the node's copy of the weights) beside the plan's per-rank prediction. FSDP2
(fully_shard on each block and the root, plain CPU FSDP2: everything is host memory) trains
the same model on the same ranks; its peak RSS per rank is what karma's host bytes are
compared with. On the CPU backend karma's host tier is a file in /dev/shm, which a rank's
private memory (the "device") does not include: the two columns are each system's whole
host-side training state, not the same kind of measure of one process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp2_host import GPT, SEQ, measure  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20
BIN = Path(sys.executable).parent


def karma_run(world_size: int, steps: int, work: Path) -> dict:
    """Plan and train on `world_size` ranks; the rank-0 report."""
    env = {**os.environ, "KARMA_GPT": GPT, "KARMA_SEQ": SEQ}
    schedule, report = work / f"s{world_size}.yaml", work / f"r{world_size}.json"
    subprocess.run([BIN / "karma-plan", "examples/gpt.py", "--hardware", "cpu", "--gpu-mem",
                    "3G", "--batch-size", "1", "--world-size", str(world_size), "--strategy",
                    "offload_all", "--no-measure", "-o", str(schedule)],
                   cwd=ROOT, env=env, check=True, capture_output=True)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", str(world_size), "-m", "karma.run", str(schedule),
                    "--steps", str(steps), "--report", str(report)],
                   cwd=ROOT, env=env, check=True, capture_output=True)
    return json.loads(report.read_text())


def table(karma: dict[int, dict], fsdp: dict[int, list[dict]]) -> str:
    single = max(karma[1]["rank_host_bytes"])
    lines = ["| ranks | rank | karma host bytes (predicted) | 1/N of one rank's + 10% "
             "| FSDP2 peak RSS | FSDP2 local state |",
             "|---:|---:|---:|---:|---:|---:|"]
    for n, report in sorted(karma.items()):
        for rank, measured in enumerate(report["rank_host_bytes"]):
            f = fsdp.get(n, [None] * n)[rank]
            lines.append(
                f"| {n} | {rank} | {measured / MIB:.1f} MiB "
                f"({report['predicted_host_bytes'] / MIB:.1f}) "
                f"| {1.1 * single / n / MIB:.1f} MiB "
                f"| {f['peak_rss_bytes'] / MIB:.0f} MiB | {f['state_bytes'] / MIB:.1f} MiB |"
                if f else
                f"| {n} | {rank} | {measured / MIB:.1f} MiB "
                f"({report['predicted_host_bytes'] / MIB:.1f}) | | | |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="karma-host-bytes-") as tmp:
        karma = {n: karma_run(n, args.steps, Path(tmp)) for n in [1, *args.ranks]}
    fsdp = {n: measure(n, args.steps) for n in args.ranks}
    print(f"KARMA_GPT={GPT} KARMA_SEQ={SEQ}, batch 1 a rank, {args.steps} steps, gloo")
    print(table(karma, fsdp))
    if args.json:
        args.json.write_text(json.dumps({"karma": karma, "fsdp2": fsdp}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
