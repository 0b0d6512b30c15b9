"""Peak memory per step: the quantity the schedule's `predicted.peak_device_bytes` predicts.

- CUDA: `torch.cuda.max_memory_allocated` above what was allocated before the model
  (`DevicePeak`).
- CPU backend: the process's private (anonymous) memory above its baseline (`PrivatePeak`),
  what a `prlimit --data` cap holds; the file-backed host tier is shared memory and is not
  counted.

[Note: sampling private memory from another process] The kernel keeps no high-water mark of
anonymous memory alone (VmHWM counts the file tier's pages too), so the peak is sampled.
A sampling thread inside the process costs the training loop about 10% of its step time
(measured on a 30M-parameter GPT: 5.14-5.52 s/step with it, 4.60-4.99 s without), because
each of its thousand wake-ups a second takes the GIL from the compute thread. The sampler
is therefore a small child process (`python -I -S`, no torch): every millisecond it reads
this process's `/proc/PID/statm` (resident minus shared pages: RssAnon) and keeps the
maximum; the training process talks to it over a pipe twice a step, and waits only for the
second (reset, then read the peak). It
holds no GIL of ours and is not counted in our private memory. It runs under SCHED_IDLE, on
a core that has nothing else to do: a sampler of normal priority waking a thousand times a
second preempts one of PyTorch's OpenMP threads, and every parallel kernel then waits at
its barrier for the preempted thread (on 2 cores, gpt tiny's keep_all step took 0.173 s
with such a sampler and 0.013 s without). The training loop leaves a core idle often (Python
between kernels, single-threaded kernels), which is when memory changes hands; the reading
at stop() is taken in-process. It exits when its pipe closes (the trainer exited) or its
parent changes.
"""

from __future__ import annotations

import os
import subprocess
import sys

from karma.runtime.host.tier import private_bytes

SAMPLE_S = 0.001

_SAMPLER = r"""
import os, select, sys, time
pid, interval, parent = sys.argv[1], float(sys.argv[2]), os.getppid()
try:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # only on an idle core
except (AttributeError, OSError):
    os.nice(19)
page = os.sysconf("SC_PAGE_SIZE")
statm = os.open(f"/proc/{pid}/statm", os.O_RDONLY)
cmd_in, out = sys.stdin.fileno(), sys.stdout.fileno()
def now():
    fields = os.pread(statm, 256, 0).split()
    return (int(fields[1]) - int(fields[2])) * page
peak, samples, recording = now(), [], False
while True:
    ready = select.select([cmd_in], [], [], interval)[0]
    try:
        current = now()
    except OSError:
        break  # the process is gone
    if current > peak:
        peak = current
    if recording and len(samples) < 1000000:
        samples.append(b"%.6f %d" % (time.perf_counter(), current))
    if not ready:
        if os.getppid() != parent:
            break
        continue
    cmd = os.read(cmd_in, 1)
    if not cmd:
        break
    if cmd in (b"r", b"R"):  # a new step; R: and record its samples (no reply)
        peak, samples, recording = current, [], cmd == b"R"
        continue
    if cmd == b"d":  # the recorded samples, then stop recording
        recording = False
        os.write(out, b"\n".join([b"%d" % len(samples), *samples]) + b"\n")
        samples = []
        continue
    os.write(out, b"%d\n" % peak)
"""


class PrivatePeak:
    """Peak private memory above `baseline`, per step and over the run, sampled every
    `interval_s` by a child process ([Note: sampling private memory from another process]).
    Where no child can be started (no /proc), the peak is read at step boundaries only."""

    def __init__(self, baseline: int, interval_s: float = SAMPLE_S):
        self.baseline = baseline
        self.peak = 0  # over the whole run
        self.step_peak = 0
        self._child: subprocess.Popen | None = None
        if os.path.exists(f"/proc/{os.getpid()}/statm"):
            try:
                self._child = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-c", _SAMPLER, str(os.getpid()),
                     str(interval_s)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                    bufsize=0)
            except OSError:
                self._child = None

    def start(self, record: bool = False) -> None:
        """Start a new step (stop() returns that step's peak); with `record`, keep every
        sample of it for `samples()`."""
        self.step_peak = 0
        self._tell(b"R" if record else b"r")

    def samples(self) -> list[tuple[float, int]]:
        """The recorded step's samples: (time.perf_counter() seconds, bytes above the
        baseline), every `interval_s`; empty without a sampler. Ends the recording."""
        child = self._child
        if child is None:
            return []
        try:
            child.stdin.write(b"d")
            count = int(child.stdout.readline())
            rows = [child.stdout.readline().split() for _ in range(count)]
            return [(float(t), int(b) - self.baseline) for t, b in rows]
        except (OSError, ValueError):
            self._child = None
            return []

    def stop(self) -> int:
        """This step's peak above the baseline."""
        sampled = self._ask(b"q")
        now = max(private_bytes(), sampled) - self.baseline
        self.step_peak = max(0, now)
        self.peak = max(self.peak, self.step_peak)
        return self.step_peak

    def absolute(self) -> dict[str, int]:
        return {}  # private memory: see the run's baseline_private_bytes

    def close(self) -> None:
        child, self._child = self._child, None
        if child is not None:
            child.stdin.close()
            try:
                child.wait(timeout=5)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            child.stdout.close()

    def _tell(self, cmd: bytes) -> None:
        """Send a command that has no reply: the step goes on without waiting for the
        sampler, which may be waiting for an idle core."""
        child = self._child
        if child is not None:
            try:
                child.stdin.write(cmd)
            except OSError:
                self._child = None

    def _ask(self, cmd: bytes) -> int:
        """Send a command to the sampler; its peak since the last reset (0 without one)."""
        child = self._child
        if child is None:
            return 0
        try:
            child.stdin.write(cmd)
            line = child.stdout.readline()
            return int(line)
        except (OSError, ValueError):  # it died: sample at step boundaries from now on
            self._child = None
            return 0


class DevicePeak:
    """Peak device memory above what was allocated before the model was placed."""

    def __init__(self, backend):
        self._backend = backend
        backend.warm_up()  # cuBLAS's workspace: a one-time cost of CUDA, not of the schedule
        self.baseline = backend.memory_baseline()
        self.outside_bytes = backend.outside_allocator_bytes()  # the CUDA context and the like
        self.peak = 0
        self.allocated_bytes = 0  # absolute, over the run
        self.reserved_bytes = 0

    def start(self, record: bool = False) -> None:
        self._backend.reset_peak()

    def samples(self) -> list[tuple[float, int]]:
        return []  # a device memory curve would need the allocator's history: not recorded

    def stop(self) -> int:
        allocated = self._backend.peak_bytes()
        self.allocated_bytes = max(self.allocated_bytes, allocated)
        self.reserved_bytes = max(self.reserved_bytes, self._backend.peak_reserved_bytes())
        step_peak = max(0, allocated - self.baseline)
        self.peak = max(self.peak, step_peak)
        return step_peak

    def absolute(self) -> dict[str, int]:
        """The run's absolute device figures, as RunReport names them: what a GPU of a given
        size must hold is the reserved peak plus what is outside the allocator."""
        return {"device_peak_allocated_bytes": self.allocated_bytes,
                "device_peak_reserved_bytes": self.reserved_bytes,
                "device_outside_allocator_bytes": self.outside_bytes}

    def close(self) -> None:
        pass
