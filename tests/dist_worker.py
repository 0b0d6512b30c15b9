"""One rank of a multi-rank test: trains each schedule of a job in one process group.

    python -m tests.dist_worker JOB.json

JOB.json: {"runs": [{"schedule": PATH, "out": DIR, "steps": N}, ...]}. Each run checkpoints
its final step into DIR/ckpt (rank 0 writes it) and writes DIR/rank{R}.json, the run's report.
Joining the process group once for all runs saves a rendezvous per schedule. Optional keys of
a run:

- "env": {NAME: VALUE}, set in os.environ for that run alone (KARMA_CHAOS, read at its start);
- "drop_dep": [OP, DEP], the schedule broken on purpose: op OP no longer waits for op DEP (a
  control, which the schedule check would refuse from a file);
- "may_fail": true, a failed run writes {"error": MESSAGE} as its report instead of stopping
  the job ("timeout_s" bounds its collectives). Put such runs last: a rank that fails alone
  can leave the other in a collective until the timeout.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch.distributed as dist

from karma.runtime.train import RunOptions, open_model_file, train
from karma.schedule import Schedule, load_schedule
from tests.conftest import environment


def main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    dist.init_process_group("gloo")
    for spec in job["runs"]:
        schedule = load_schedule(Path(spec["schedule"]))
        mf = open_model_file(schedule, Path(spec["schedule"]))
        if "drop_dep" in spec:
            schedule = without_dep(schedule, *spec["drop_dep"])
        out = Path(spec["out"])
        options = RunOptions(steps=spec["steps"], checkpoint_dir=out / "ckpt",
                             log=lambda line: None, timeout_s=spec.get("timeout_s", 60.0))
        try:
            with environment(spec.get("env", {})):
                result = train(schedule, mf, options).to_json()
        except Exception as e:
            if not spec.get("may_fail"):
                raise
            result = {"error": f"{type(e).__name__}: {e}"}
        (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def without_dep(schedule: Schedule, op: int, dep: int) -> Schedule:
    ops = list(schedule.ops)
    assert dep in ops[op].deps, f"op {op} does not wait for op {dep}"
    ops[op] = dataclasses.replace(ops[op], deps=tuple(d for d in ops[op].deps if d != dep))
    return dataclasses.replace(schedule, ops=tuple(ops))


if __name__ == "__main__":
    main(sys.argv[1])
