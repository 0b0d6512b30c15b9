"""A full disk or a file-size limit during a run: a checkpoint or a growth
of the file-backed host tier that cannot be written stops karma-run with one line naming the
path and what to free (exit 2, no kill, no traceback); the previous checkpoint stays complete,
--resume from it trains the uninterrupted losses, and no partial step_N/ is left."""

from __future__ import annotations

import errno
import io
import json
import os
import resource
import shutil
import subprocess
import sys
import threading

import pytest
import torch

import karma.runtime.checkpoints.checkpoint
import karma.runtime.host.tier
import karma.runtime.loop
import karma.runtime.runtime
from karma.calibrate.measure_hw import scratch_mapping
from karma.cli.run import main
from karma.errors import KarmaError
from karma.runtime.checkpoints.checkpoint import latest_checkpoint
from karma.runtime.checkpoints.dir_lock import LOCK_NAME
from karma.runtime.checkpoints.export import model_state_dict
from karma.runtime.host.tier import HostPool
from karma.schedule import dump_schedule
from karma.schedule_load import load_schedule
from karma.testing.exactness import assert_bitwise_equal, plan, reference_train
from tests.conftest import ROOT
from tests.runtime_helpers import load_small

NO_SPACE = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


pytestmark = pytest.mark.usefixtures("restore_environment_and_signals")  # tests/conftest.py


@pytest.fixture
def schedule_path(tmp_path):
    path = tmp_path / "S.yaml"
    path.write_text(dump_schedule(plan(load_small("gpt"), "ilp", 0.6)))
    return path


def run_main(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_stopped_with(code: int, err: str, expected: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("karma-run: error: ") and expected in err, err


class FullDisk(io.FileIO):
    """A file on a filesystem that fills after `room` bytes."""

    room = 1000

    def write(self, data) -> int:
        if self.tell() + len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.name)
        return super().write(data)


def test_a_full_disk_at_a_checkpoint_keeps_the_last_one_and_resume_is_exact(
        schedule_path, tmp_path, capsys, monkeypatch):
    ckpt = tmp_path / "ckpt"
    real_open = open

    def open_on_a_full_disk(path, mode="r", *args, **kwargs):
        if ".step_2." in str(path) and "w" in mode:  # the files of step 2's checkpoint
            return io.BufferedWriter(FullDisk(path, "w"))
        return real_open(path, mode, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(karma.runtime.checkpoints.checkpoint, "open", open_on_a_full_disk, raising=False)
        code, out, err = run_main(capsys, schedule_path, "--steps", 3, "--checkpoint-every", 1,
                                  "--checkpoint-dir", ckpt)
    assert_stopped_with(code, err, f"cannot write checkpoint {ckpt / 'step_2'}: No space left "
                                   "on device (")
    assert " free there); free about " in err and "on its filesystem, or choose another " \
        "--checkpoint-dir (--resume continues from the newest complete checkpoint)" in err
    assert "step 2/3" in out and "step 3/3" not in out
    # nothing of step 2, hidden or not (the run's lock of the directory: dir_lock.py)
    assert sorted(os.listdir(ckpt)) == [LOCK_NAME, "step_1"]
    assert latest_checkpoint(ckpt) == ckpt / "step_1"

    code, out, err = run_main(capsys, schedule_path, "--steps", 3, "--checkpoint-dir", ckpt,
                              "--resume", "--report", tmp_path / "R.json")
    assert code == 0, err
    assert "resumed from" in out and "step 2/3" in out
    ref_sd, ref_losses = reference_train(load_small("gpt"), 4, 3,
                                         schedule=load_schedule(schedule_path))
    assert json.loads((tmp_path / "R.json").read_text())["losses"] == ref_losses[1:]
    assert_bitwise_equal(model_state_dict(ckpt / "step_3"), ref_sd)


def test_a_checkpoint_past_the_file_size_limit_is_an_error_not_a_kill(
        schedule_path, tmp_path, capsys, monkeypatch):
    """A real EFBIG from the kernel: SIGXFSZ, which would kill the process, is ignored."""
    ckpt = tmp_path / "ckpt"
    save = karma.runtime.runtime.save_checkpoint
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)

    def save_under_a_limit(directory, step, *args):
        if step == 2:
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
        try:
            return save(directory, step, *args)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))

    monkeypatch.setattr(karma.runtime.runtime, "save_checkpoint", save_under_a_limit)
    code, out, err = run_main(capsys, schedule_path, "--steps", 2, "--checkpoint-every", 1,
                              "--checkpoint-dir", ckpt)
    assert_stopped_with(code, err, f"cannot write checkpoint {ckpt / 'step_2'}: File too large: "
                                   "a file would pass this process's file-size limit of "
                                   "4.00 KiB (ulimit -f); raise the limit, or choose another ")
    assert sorted(os.listdir(ckpt)) == [LOCK_NAME, "step_1"]


@pytest.mark.slow
def test_the_host_tier_past_the_file_size_limit_under_prlimit(schedule_path, tmp_path):
    """karma-run in its own process under `prlimit --fsize`: the tier's first arena (64 MiB and
    more) passes 16 MiB, and the run ends with exit 2 and the limit, not killed by SIGXFSZ."""
    if shutil.which("prlimit") is None:
        pytest.skip("no prlimit (util-linux)")
    done = subprocess.run(
        ["prlimit", f"--fsize={16 << 20}", "--", sys.executable, "-m", "karma.cli.run",
         str(schedule_path), "--steps", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "KARMA_TIER_DIR": str(tmp_path)})
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert f"cannot write the host tier's file {tmp_path}/karma-tier-" in done.stderr
    assert "file-size limit of 16.0 MiB (ulimit -f); raise the limit, or set KARMA_TIER_DIR to a " \
        "directory on a filesystem with more room" in done.stderr
    assert not list(tmp_path.glob("karma-tier-*"))  # the tier's directory went with it


def test_a_tier_that_cannot_grow_names_its_file_and_what_to_free(tmp_path, monkeypatch):
    pool = HostPool(1 << 20, kind="file", directory=str(tmp_path))
    small = pool.empty((1000,), torch.float32)

    def full(fd, offset, length):
        raise NO_SPACE

    monkeypatch.setattr(karma.runtime.host.tier.os, "posix_fallocate", full)
    with pytest.raises(KarmaError) as e:
        pool.empty((1 << 20,), torch.float32)  # 4 MiB: the pool grows
    assert str(e.value).startswith(f"cannot write the host tier's file {tmp_path}/karma-tier-")
    assert "/arena1.bin: No space left on device (" in str(e.value)
    assert " free there); free about 4.00 MiB on its filesystem, or set KARMA_TIER_DIR" in str(e.value)
    small.fill_(1.0)  # what the pool held is untouched
    assert small.sum().item() == 1000
    pool.close()


def test_a_tier_that_cannot_grow_on_a_stream_stops_the_run_with_its_message(
        tmp_path, capsys, monkeypatch):
    """The growth happens on a stream's thread (swap_all's swap-outs, on the d2h stream): its
    KarmaError reaches karma-run as one line, not as "operation ... failed" or a traceback."""
    schedule_path = tmp_path / "S.yaml"
    schedule_path.write_text(dump_schedule(plan(load_small("gpt"), "swap_all")))
    alloc = HostPool._alloc

    def grow_on_streams(self, nbytes):
        if threading.current_thread().name.startswith("karma-"):
            self._grow(1 << 20)
        return alloc(self, nbytes)

    def full(fd, offset, length):
        if threading.current_thread().name.startswith("karma-"):
            raise NO_SPACE
        os.ftruncate(fd, offset + length)

    monkeypatch.setattr(HostPool, "_alloc", grow_on_streams)
    monkeypatch.setattr(karma.runtime.host.tier.os, "posix_fallocate", full)
    code, out, err = run_main(capsys, schedule_path, "--steps", 2)
    assert_stopped_with(code, err, "cannot write the host tier's file ")
    assert "No space left on device" in err and "operation" not in err
    assert "step 1/2" not in out


def test_a_tier_leaves_nothing_in_its_directory_while_it_runs(tmp_path):
    """Each arena's file and its directory go once the file is mapped, so a run killed
    mid-step (SIGKILL: no clean-up runs) leaves no karma-tier-* directory behind."""
    pool = HostPool(1 << 20, kind="file", directory=str(tmp_path))
    small = pool.empty((1000,), torch.float32).fill_(1.0)
    large = pool.empty((1 << 20,), torch.float32).fill_(2.0)  # 4 MiB: a second arena
    assert len(pool._arenas) == 2 and pool.directory == str(tmp_path)
    assert list(tmp_path.iterdir()) == []
    assert small.sum().item() == 1000 and large.sum().item() == 2 * (1 << 20)
    pool.close()


def test_calibrations_scratch_tier_leaves_nothing_in_the_tier_directory(tmp_path, monkeypatch):
    """Calibration times copies and host steps in a mapping like the tier's, in the tier's
    directory: its file goes at once, so a killed karma-plan leaves no RAM taken in
    /dev/shm."""
    monkeypatch.setenv("KARMA_TIER_DIR", str(tmp_path))
    mapping = scratch_mapping(1000, torch.float32, 4000)
    mapping.fill_(3.0)
    assert list(tmp_path.iterdir()) == [] and mapping.sum().item() == 3000
