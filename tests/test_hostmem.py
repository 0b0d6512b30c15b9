"""Host memory checked at start (karma/runtime/host/check.py): the decision on made-up numbers,
and what it reads from this machine."""

from __future__ import annotations

from dataclasses import replace

from karma.runtime.host.check import HostMemory, host_memory_problem, mem_available_bytes
from karma.storage import filesystem_type

GIB = 1 << 30

FITS = HostMemory(backend="cpu", host_bytes=40 * GIB, pinned_bytes=GIB, device_bytes=2 * GIB,
                  ranks_here=1, available_bytes=22 * GIB, tier_dir="/scratch",
                  tier_free_bytes=100 * GIB, tier_in_memory=False)


def test_a_cpu_tier_on_disk_needs_disk_not_memory():
    assert host_memory_problem(FITS) is None  # 40 GiB of tier beside 22 GiB of memory


def test_a_cpu_tier_larger_than_its_filesystem_is_refused_with_the_directory():
    problem = host_memory_problem(replace(FITS, tier_free_bytes=30 * GIB))
    assert problem == ("the schedule's host tier needs 40.0 GiB of disk, but /scratch, where "
                       "the CPU backend keeps it as a file, has 30.0 GiB free; plan with a "
                       "smaller model or batch, or set KARMA_TIER_DIR to a directory with more room")


def test_cpu_device_memory_is_ram():
    problem = host_memory_problem(replace(FITS, device_bytes=23 * GIB))
    assert problem is not None
    assert problem.startswith("the schedule needs 23.0 GiB of host memory (device memory "
                              "23.0 GiB, which is RAM on the CPU backend), but this machine "
                              "has 22.0 GiB available (/proc/meminfo MemAvailable)")


def test_a_cpu_tier_in_tmpfs_is_memory():
    tmpfs = replace(FITS, host_bytes=19 * GIB, tier_in_memory=True, tier_dir="/dev/shm")
    assert host_memory_problem(replace(tmpfs, host_bytes=20 * GIB)) is None  # 20 + 2 = 22
    problem = host_memory_problem(replace(tmpfs, host_bytes=21 * GIB))
    assert problem is not None and "needs 23.0 GiB of host memory (device memory 2.00 GiB, " \
        "which is RAM on the CPU backend, + host tier 21.0 GiB in tmpfs at /dev/shm)" in problem
    assert "of memory (tmpfs)" in host_memory_problem(replace(tmpfs, tier_free_bytes=GIB))


def test_cuda_pins_the_whole_tier():
    cuda = replace(FITS, backend="cuda", tier_free_bytes=0)  # the tier's disk is not used
    problem = host_memory_problem(cuda)
    assert problem == ("the schedule needs 40.0 GiB of pinned host memory (host tier 40.0 GiB, "
                       "pinned 1.00 GiB; on CUDA the whole tier is pinned), but this machine "
                       "has 22.0 GiB available (/proc/meminfo MemAvailable); plan with a "
                       "smaller model or batch, or free memory")
    assert host_memory_problem(replace(cuda, host_bytes=20 * GIB, device_bytes=40 * GIB)) is None
    assert "needs 23.0 GiB of pinned" in host_memory_problem(
        replace(cuda, host_bytes=20 * GIB, pinned_bytes=23 * GIB))


def test_ranks_on_one_machine_each_need_it_all():
    two = replace(FITS, ranks_here=2, device_bytes=12 * GIB)
    assert "for each of 2 ranks on this machine" in host_memory_problem(two)
    assert host_memory_problem(replace(two, ranks_here=1)) is None


def test_unknown_memory_is_not_checked():
    assert host_memory_problem(replace(FITS, available_bytes=None, tier_free_bytes=None,
                                       device_bytes=1 << 50)) is None


def test_meminfo_and_mounts_are_read(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  24000000 kB\nMemAvailable:   1000 kB\n")
    assert mem_available_bytes(str(meminfo)) == 1000 * 1024
    assert mem_available_bytes(str(tmp_path / "none")) is None
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/vda / ext4 rw 0 0\ntmpfs /dev/shm tmpfs rw 0 0\n"
                      "tmpfs /mnt/my\\040disk tmpfs rw 0 0\n")
    assert filesystem_type("/dev/shm/karma", str(mounts)) == "tmpfs"
    assert filesystem_type("/dev/shmx", str(mounts)) == "ext4"
    assert filesystem_type("/mnt/my disk/x", str(mounts)) == "tmpfs"


def test_the_cpu_tier_goes_to_a_tmpfs_with_room(tmp_path, monkeypatch):
    """[Note: the CPU tier lives in memory where it can]: /dev/shm when it is a tmpfs with
    room for the tier (and memory for it), else the temporary directory; KARMA_TIER_DIR
    chooses."""
    import tempfile

    import karma.storage
    from karma.storage import tier_directory

    monkeypatch.delenv("KARMA_TIER_DIR", raising=False)
    shm = tmp_path / "shm"
    shm.mkdir()
    kinds = {str(shm): "tmpfs"}
    monkeypatch.setattr(karma.storage, "filesystem_type", lambda p: kinds.get(p, "ext4"))
    room = karma.storage.free_bytes(shm)
    assert tier_directory(GIB, shm=str(shm)) == str(shm)
    assert tier_directory(room + 1, shm=str(shm)) == tempfile.gettempdir()  # no room
    assert tier_directory(GIB, memory_bytes=GIB - 1, shm=str(shm)) == tempfile.gettempdir()
    assert tier_directory(GIB, shm=str(tmp_path / "none")) == tempfile.gettempdir()
    kinds[str(shm)] = "ext4"  # a disk: its pages are written back
    assert tier_directory(GIB, shm=str(shm)) == tempfile.gettempdir()
    monkeypatch.setenv("KARMA_TIER_DIR", "/scratch/tier")
    assert tier_directory(1 << 60, shm=str(shm)) == "/scratch/tier"
