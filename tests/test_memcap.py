"""karma-run --cap-memory: the CPU backend's process held, by RLIMIT_DATA, to what its
schedule needs ([Note: the hard cap from the plan], karma/runtime/host/memcap.py)."""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys

import pytest
import torch

import karma
from karma.cli.plan import main as plan_main
from karma.cli.run import main as run_main
from karma.cli.run import user_error
from karma.runtime.host.memcap import SLACK_BYTES, DataCap, apply
from karma.runtime.host.tier import data_bytes
from karma.schedule import dump_schedule
from karma.testing.exactness import load_with_env, plan
from karma.units import format_bytes
from tests.conftest import EXAMPLES, ROOT, environment

# weights of 512 x 512: every stream's copies and host steps run parallel regions, so every
# stream worker's OpenMP team starts ([Note: the hard cap from the plan])
MLP_ENV = {"KARMA_MLP_WIDTH": "512", "KARMA_MLP_DEPTH": "3", "KARMA_MLP_IN": "64"}
MLP = str(EXAMPLES / "mlp.py")
# karma-run with several intra-op threads, whatever the machine's cores
WITH_THREADS = ("import sys, torch; torch.set_num_threads(int(sys.argv[1])); "
                "from karma.cli.run import main; sys.exit(main(sys.argv[2:]))")


@pytest.fixture(scope="module")
def offload_schedule(tmp_path_factory):
    """The small MLP planned as a user plans it: every weight streamed, every block
    stepped on the host (so that every side stream works)."""
    path = tmp_path_factory.mktemp("cap") / "S.yaml"
    with environment(MLP_ENV):
        assert plan_main([MLP, "--hardware", "cpu", "--gpu-mem", "64M", "--strategy",
                          "offload_all", "--no-measure", "-o", str(path)]) == 0
    return path


def test_a_capped_run_with_several_threads_trains_under_the_cap(offload_schedule, tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", WITH_THREADS, "6", str(offload_schedule), "--steps", "3",
         "--cap-memory", "--checkpoint-dir", str(tmp_path / "ckpt"), "--report",
         str(tmp_path / "R.json")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, **MLP_ENV})
    assert done.returncode == 0, done.stderr[-2000:] + done.stdout[-2000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("capping this process")]
    report = json.loads((tmp_path / "R.json").read_text())
    assert len(report["losses"]) == 3 and (tmp_path / "ckpt" / "step_3").is_dir()
    parts = re.search(r"\(RLIMIT_DATA, as prlimit --data=(\d+)\): its fixed cost (.+) \+ "
                      r"karma's threads .+ \+ the plan's peak (.+) \+ slack (.+); the host "
                      r"tier, .+, is RAM in ", line)
    assert parts, line
    assert parts[2] == format_bytes(report["baseline_data_bytes"])
    assert parts[3] == format_bytes(report["predicted_peak_device_bytes"])
    assert parts[4] == format_bytes(SLACK_BYTES)
    threads_bytes = int(parts[1]) - report["baseline_data_bytes"] \
        - report["predicted_peak_device_bytes"] - SLACK_BYTES
    # the streams' teams of six started before the cap, each thread's stack counted in it
    assert threads_bytes >= 3 * 6 * (1 << 20)
    assert "KARMA_TIER_DIR=/path/on/disk" in line


def test_the_applied_limit_is_what_the_plan_says(restore_environment_and_signals):
    mf = load_with_env(MLP, MLP_ENV)
    schedule = plan(mf, "offload_all")
    before = resource.getrlimit(resource.RLIMIT_DATA)
    with karma.Runtime(schedule, model_file=mf, cap_device_memory=True,
                       log=lambda line: None) as rt:
        cap = rt.parts.data_cap
        assert resource.getrlimit(resource.RLIMIT_DATA) == (cap.limit_bytes, before[1])
        assert cap.limit_bytes == (rt.baseline_data_bytes + cap.threads_bytes
                                   + schedule.predicted.peak_device_bytes + SLACK_BYTES)
        assert cap.baseline_bytes == rt.baseline_data_bytes and cap.threads_bytes > 0
        assert data_bytes() < cap.limit_bytes
        inputs, targets = next(rt.model_file.batches(schedule.config.batch_size))
        assert torch.isfinite(torch.tensor(rt.step(inputs, targets)))
    assert resource.getrlimit(resource.RLIMIT_DATA) == before  # given back at close
    with karma.Runtime(schedule, model_file=mf, log=lambda line: None) as rt:
        assert rt.parts.data_cap is None  # not asked for
        assert resource.getrlimit(resource.RLIMIT_DATA) == before


def test_a_cap_sets_the_soft_limit_and_gives_it_back():
    before = resource.getrlimit(resource.RLIMIT_DATA)
    cap = DataCap(data_bytes(), 8 << 20, 1 << 40)
    assert cap.limit_bytes == data_bytes() + (8 << 20) + (1 << 40) + SLACK_BYTES
    limit, restore = apply(cap)
    try:
        hard = before[1]
        assert limit == (cap.limit_bytes if hard == resource.RLIM_INFINITY
                         else min(cap.limit_bytes, hard))
        assert resource.getrlimit(resource.RLIMIT_DATA) == (limit, hard)
    finally:
        restore()
    assert resource.getrlimit(resource.RLIMIT_DATA) == before


def test_the_line_says_where_the_tier_is():
    cap = DataCap(300 << 20, 60 << 20, 100 << 20)
    line = cap.text(40 << 20, "/dev/shm", True)
    assert line.startswith("capping this process's data at 588 MiB (RLIMIT_DATA, as prlimit "
                           f"--data={588 << 20}): its fixed cost 300 MiB + karma's threads "
                           "60.0 MiB + the plan's peak 100 MiB + slack 128 MiB; the host tier, "
                           "40.0 MiB, is RAM in /dev/shm (a tmpfs)")
    assert "a file on disk in /data/tier, outside the cap" in cap.text(40 << 20, "/data/tier",
                                                                       False)


def test_each_backend_refuses_the_others_cap(offload_schedule, tmp_path, capsys,
                                             restore_environment_and_signals):
    assert run_main([str(offload_schedule), "--steps", "1", "--cap-device-memory"]) == 2
    assert "on the CPU backend --cap-memory caps this process" in capsys.readouterr().err
    cuda = tmp_path / "cuda.yaml"
    cuda.write_text(dump_schedule(plan(load_with_env(MLP, MLP_ENV), "keep_all",
                                       hardware="v100-16g")))
    assert run_main([str(cuda), "--steps", "1", "--cap-memory"]) == 2
    assert "--cap-memory caps the CPU backend's process" in capsys.readouterr().err


def test_a_thread_that_cannot_start_is_the_users_to_fix():
    error = user_error(RuntimeError("can't start new thread"))
    assert error is not None and "--cap-memory" in str(error)
