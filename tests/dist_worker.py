"""One rank of a multi-rank test: trains each schedule of a job in one process group.

    python -m tests.dist_worker JOB.json: {"runs": [{"schedule": PATH, "out": DIR, "steps": N}, ...], "dist_backend": NAME
(optional), "deterministic": true (optional: deterministic algorithms, as the GPU tests'
reference runs)}. Each run checkpoints its final step into DIR/ckpt (rank 0 writes it) and
writes DIR/rank{R}.json, the run's report. A schedule for the CPU runs under the checking
backend (tests/protocol.py), whose findings the report holds as "protocol"; one for CUDA under
the CUDA backend. Joining the process group once for all runs saves a rendezvous per schedule.
Optional keys of a run:

- "env": {NAME: VALUE}, set in os.environ for that run alone (KARMA_CHAOS, read at its start);
- "drop_dep": [OP, DEP], the schedule broken on purpose: op OP no longer waits for op DEP (a
  control, which the schedule check would refuse: the run skips it);
- "may_fail": true, a failed run writes {"error": MESSAGE} as its report instead of stopping
  the job ("timeout_s" bounds its collectives). Put such runs last: a rank that fails alone
  can leave the other in a collective until the timeout.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import karma.runtime.bringup
import karma.runtime.runtime
from karma.runtime.loop import RunOptions, open_model_file, train
from karma.schedule import Schedule
from karma.schedule_load import load_schedule
from tests.conftest import environment
from tests.protocol import CheckingBackend


def main(job_path: str) -> None:
    faulthandler.enable()  # a crash in a rank shows where in its stderr
    job = json.loads(Path(job_path).read_text())
    failed = False
    if job.get("deterministic"):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    make_backend = karma.runtime.runtime.make_backend
    validate = karma.runtime.bringup.validate
    for spec in job["runs"]:
        schedule = load_schedule(Path(spec["schedule"]))
        mf = open_model_file(schedule, Path(spec["schedule"]))
        karma.runtime.bringup.validate = validate
        if "drop_dep" in spec:
            schedule = without_dep(schedule, *spec["drop_dep"])
            karma.runtime.bringup.validate = lambda schedule: None  # it would refuse it
        out = Path(spec["out"])
        backend = None
        if dict(schedule.hardware).get("device_kind", "cpu") == "cpu":
            backend = CheckingBackend(schedule)
            karma.runtime.runtime.make_backend = lambda kind, backend=backend: backend
        else:
            karma.runtime.runtime.make_backend = make_backend
        options = RunOptions(steps=spec["steps"], checkpoint_dir=out / "ckpt",
                             dist_backend=job.get("dist_backend"), log=lambda line: None,
                             timeout_s=spec.get("timeout_s", 60.0))
        try:
            with environment(spec.get("env", {})):
                result = train(schedule, mf, options).to_json()
        except Exception as e:
            if not spec.get("may_fail"):
                raise
            result = {"error": f"{type(e).__name__}: {e}"}
            failed = True
        protocol = None if backend is None else {"violations": backend.violations[:20],
                                                 "collectives": backend.collectives}
        (out / f"rank{dist.get_rank()}.json").write_text(json.dumps({**result,
                                                                     "protocol": protocol}))
    if failed:
        # a run that failed on one rank can leave the other's net stream inside a collective
        # that no teardown can interrupt (gloo): leave without one, the reports being written
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    dist.destroy_process_group()


def without_dep(schedule: Schedule, op: int, dep: int) -> Schedule:
    ops = list(schedule.ops)
    assert dep in ops[op].deps, f"op {op} does not wait for op {dep}"
    ops[op] = dataclasses.replace(ops[op], deps=tuple(d for d in ops[op].deps if d != dep))
    return dataclasses.replace(schedule, ops=tuple(ops))


if __name__ == "__main__":
    main(sys.argv[1])
