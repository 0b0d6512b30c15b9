"""One rank of a multi-rank test: trains each schedule of a job in one process group.

    python -m tests.dist_worker JOB.json

JOB.json: {"runs": [{"schedule": PATH, "out": DIR, "steps": N}, ...]}. Each run checkpoints
its final step into DIR/ckpt (rank 0 writes it) and writes DIR/rank{R}.json, the run's report.
Joining the process group once for all runs saves a rendezvous per schedule.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from karma.runtime.train import RunOptions, open_model_file, train
from karma.schedule import load_schedule


def main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    dist.init_process_group("gloo")
    for spec in job["runs"]:
        schedule = load_schedule(Path(spec["schedule"]))
        mf = open_model_file(schedule, Path(spec["schedule"]))
        out = Path(spec["out"])
        report = train(schedule, mf, RunOptions(steps=spec["steps"], checkpoint_dir=out / "ckpt",
                                                log=lambda line: None))
        (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(report.to_json()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
