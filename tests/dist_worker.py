"""One rank of a multi-rank test: trains each schedule of a job in one process group.

    python -m tests.dist_worker JOB.json

JOB.json: {"runs": [{"schedule": PATH, "out": DIR, "steps": N}, ...], "dist_backend": NAME
(optional), "deterministic": true (optional: deterministic algorithms, as the GPU tests'
reference runs)}. Each run checkpoints its final step into DIR/ckpt (rank 0 writes it) and
writes DIR/rank{R}.json, the run's report. A schedule for the CPU runs under the checking
backend (tests/protocol.py), whose findings the report holds as "protocol"; one for CUDA under
the CUDA backend. Joining the process group once for all runs saves a rendezvous per schedule.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import karma.runtime.runtime
from karma.runtime.train import RunOptions, open_model_file, train
from karma.schedule import load_schedule
from tests.protocol import CheckingBackend


def main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    if job.get("deterministic"):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    make_backend = karma.runtime.runtime.make_backend
    for spec in job["runs"]:
        schedule = load_schedule(Path(spec["schedule"]))
        mf = open_model_file(schedule, Path(spec["schedule"]))
        out = Path(spec["out"])
        backend = None
        if dict(schedule.hardware).get("device_kind", "cpu") == "cpu":
            backend = CheckingBackend(schedule)
            karma.runtime.runtime.make_backend = lambda kind, backend=backend: backend
        else:
            karma.runtime.runtime.make_backend = make_backend
        report = train(schedule, mf, RunOptions(steps=spec["steps"], checkpoint_dir=out / "ckpt",
                                                dist_backend=job.get("dist_backend"),
                                                log=lambda line: None))
        protocol = None if backend is None else {"violations": backend.violations[:20],
                                                 "collectives": backend.collectives}
        (out / f"rank{dist.get_rank()}.json").write_text(
            json.dumps({**report.to_json(), "protocol": protocol}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
