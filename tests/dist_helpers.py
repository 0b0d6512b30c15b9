"""Helpers for multi-rank tests: start N rank processes the way torchrun does, on this host.

    procs = start_ranks(["-m", "karma.run", "s.yaml", "--steps", "3"], world_size=2)
    results = finish(procs, timeout_s=120)     # [(returncode, stdout, stderr)] per rank

Each rank is `python ARGS` with RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT and OMP_NUM_THREADS=1 (as torchrun sets them: the ranks are one node's), in the
repository root.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world_size: int, port: int, extra: dict[str, str] | None = None,
             per_node: int | None = None):
    """Rank `rank`'s environment; the ranks are nodes of `per_node` (default: one node)."""
    per_node = per_node or world_size
    env = {k: v for k, v in os.environ.items() if not k.startswith("KARMA_")}
    env.update(RANK=str(rank), LOCAL_RANK=str(rank % per_node),
               LOCAL_WORLD_SIZE=str(per_node), GROUP_RANK=str(rank // per_node),
               WORLD_SIZE=str(world_size),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT))
    env.update(extra or {})
    return env


def start_ranks(args: list[str], world_size: int, ranks: list[int] | None = None,
                port: int | None = None, extra_env: dict[str, str] | None = None,
                cwd: Path = ROOT, per_node: int | None = None) -> list[subprocess.Popen]:
    port = port or free_port()
    return [subprocess.Popen([sys.executable, *args], cwd=cwd, text=True,
                             env=rank_env(r, world_size, port, extra_env, per_node),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for r in (ranks if ranks is not None else range(world_size))]


def wait_for_line(procs: list[subprocess.Popen], rank: int, text: str,
                  timeout_s: float) -> None:
    """Read rank `rank`'s stdout until a line contains `text` (killing every rank past
    `timeout_s`). A thread keeps draining it afterwards, so the rank never blocks on a full
    pipe; finish() then returns what was read after that line."""
    lines: queue.Queue[str | None] = queue.Queue()
    stream = procs[rank].stdout
    rest: list[str] = []

    def drain() -> None:
        for line in stream:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=drain, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            line = None
        if line is None:
            for p in procs:
                p.kill()
            raise AssertionError(f"rank {rank} printed no line with {text!r} in {timeout_s} s")
        if text in line:
            break

    def keep_draining() -> None:
        while (line := lines.get()) is not None:
            rest.append(line)

    threading.Thread(target=keep_draining, daemon=True).start()
    _DRAINED[id(procs[rank])] = rest


_DRAINED: dict[int, list[str]] = {}  # id(Popen) -> its stdout lines read by wait_for_line


def finish(procs: list[subprocess.Popen], timeout_s: float) -> list[tuple[int, str, str]]:
    """Wait for every rank (killing all of them past `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    out = []
    for p in procs:
        if id(p) in _DRAINED:  # its stdout belongs to wait_for_line's reader
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
            out.append((p.returncode, "".join(_DRAINED.pop(id(p))), p.stderr.read()))
            continue
        try:
            stdout, stderr = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired as e:
            for q in procs:
                q.kill()
            stdout, stderr = p.communicate()
            raise AssertionError(
                f"ranks still running after {timeout_s} s:\n{stdout}\n{stderr}") from e
        out.append((p.returncode, stdout, stderr))
    return out


def train_job(root: Path, schedules: dict, steps: int, world_size: int,
              timeout_s: float) -> dict:
    """Train each schedule of `schedules` (name -> Schedule) on `world_size` ranks in one
    launch of tests/dist_worker.py, each in a directory of its own under `root`: name ->
    (schedule, its run's directory, which holds rank{R}.json and ckpt/)."""
    from karma.schedule import dump_schedule

    runs, out = [], {}
    for name, schedule in schedules.items():
        directory = root / name
        directory.mkdir()
        (directory / "schedule.yaml").write_text(dump_schedule(schedule))
        runs.append({"schedule": str(directory / "schedule.yaml"), "out": str(directory),
                     "steps": steps})
        out[name] = (schedule, directory)
    job = root / "job.json"
    job.write_text(json.dumps({"runs": runs}))
    for rank, (code, _, stderr) in enumerate(
            finish(start_ranks(["-m", "tests.dist_worker", str(job)], world_size),
                   timeout_s=timeout_s)):
        assert code == 0, f"rank {rank} failed:\n{stderr[-4000:]}"
    return out
