"""Data parallelism: joining the ranks and checking they agree (the exchange: exchange.py).

karma-run joins a torch.distributed process group when the environment says it is one of
several ranks (torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; so can
anyone). Two groups:

- the default group, always gloo, for start-up checks and barriers (after a checkpoint, which
  rank 0 writes while the others wait as long as it takes);
- the `net` group, with the run's --timeout and the backend --dist-backend chose (`nccl` or
  `gloo`), for the gradient all-reduces. They run on the schedule's `net` stream, one block at
  a time as its backward completes, so they overlap with the backward of the blocks before it.

[Note: choosing the collective backend] gloo all-reduces CPU and CUDA tensors; NCCL only
CUDA ones, one rank per GPU. So the CPU backend takes gloo, and the CUDA backend NCCL unless
told otherwise; ranks that share a GPU (the first GPU this project gets is a single one) are
refused NCCL with a message that says to use gloo. Which ranks share a GPU is decided from
every rank's GPU UUID, gathered over the default group: host names and CUDA_VISIBLE_DEVICES
can hide it, a UUID cannot.

A rank that dies closes its connections, and the others' next collective fails at once; a
rank that hangs is noticed when a collective outlasts --timeout. Either way the survivors stop
with an error that says so (RankLost), and torchrun stops the rest. (With NCCL, a collective
that outlasts --timeout is ended by NCCL's own watchdog, which stops the process.)
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
from dataclasses import dataclass

import torch.distributed as dist

from karma.errors import KarmaError

# After a checkpoint the ranks other than 0 wait this long: rank 0 may be writing a large one.
CHECKPOINT_WAIT_S = 30 * 60.0


class RankLost(KarmaError):
    """Another rank died or stopped answering."""


@dataclass(frozen=True)
class Ranks:
    """Where this process stands among the ranks of a run."""

    rank: int
    world_size: int
    owns_group: bool  # this run created the process group (and destroys it at the end)
    net: object | None  # the all-reduce group (None on one rank)
    dist_backend: str | None = None  # the all-reduce group's backend, nccl or gloo
    # the group for collectives on host tensors (sharded host state's all-gathers): the
    # net group where it is gloo, else a gloo group of its own (NCCL reduces device memory)
    host_net: object | None = None

    @property
    def main(self) -> bool:
        return self.rank == 0


SINGLE = Ranks(rank=0, world_size=1, owns_group=False, net=None)

DIST_BACKENDS = ("nccl", "gloo")


def choose_backend(requested: str | None, device_kind: str) -> str:
    """The collective backend for --dist-backend `requested` (None: the default) on a
    schedule for `device_kind` ([Note: choosing the collective backend])."""
    if requested is None:
        return "nccl" if device_kind == "cuda" else "gloo"
    if requested not in DIST_BACKENDS:
        raise KarmaError(f"--dist-backend {requested!r} is not one karma knows; use nccl or gloo")
    if requested == "nccl" and device_kind != "cuda":
        raise KarmaError("--dist-backend nccl all-reduces CUDA tensors, but this schedule runs "
                         "on the CPU backend; use --dist-backend gloo (the default there)")
    return requested


def shared_gpus(device_ids: list[str | None]) -> dict[str, list[int]]:
    """Of every rank's GPU id (in rank order), those held by more than one rank, with them."""
    ranks: dict[str, list[int]] = {}
    for r, device in enumerate(device_ids):
        if device is not None:
            ranks.setdefault(device, []).append(r)
    return {device: rs for device, rs in ranks.items() if len(rs) > 1}


def _launch_hint(world_size: int) -> str:
    return (f"torchrun --nproc-per-node {world_size} --no-python karma-run SCHEDULE.yaml "
            f"(or --nnodes M --nproc-per-node {world_size}/M --rdzv-endpoint HOST:PORT on "
            "several machines)")


def join(world_size: int, schedule_sha256: str, options: dict, timeout_s: float,
         dist_backend: str = "gloo", device_id: str | None = None) -> Ranks:
    """Join the run's ranks (from the environment torchrun sets) and check they agree.

    A schedule planned for `world_size` ranks runs only on that many; every rank must run
    the same schedule (same hash) with the same `options` (seed, steps, resume, ...). The
    all-reduces go through `dist_backend`; `device_id`: this rank's GPU (its UUID), or None.
    """
    joined = dist.is_available() and dist.is_initialized()
    size = dist.get_world_size() if joined else _env_int("WORLD_SIZE", 1)
    if size != world_size:  # checked before any rendezvous: no need for the others to come
        raise KarmaError(
            f"this schedule was planned for {world_size} rank(s), but this run has {size}: "
            f"launch it on {world_size} with "
            f"{_launch_hint(world_size) if world_size > 1 else 'karma-run SCHEDULE.yaml'}, or "
            f"re-plan for {size} with karma-plan ... --world-size {size}")
    if size == 1 and not joined:
        return SINGLE
    if dist_backend == "nccl" and not dist.is_nccl_available():
        raise KarmaError("--dist-backend nccl: this PyTorch was built without NCCL; use "
                         "--dist-backend gloo")
    if not joined:
        _init(size, timeout_s)
    ranks = Ranks(dist.get_rank(), size, owns_group=not joined, net=None)
    try:
        _check_same(ranks, "schedule", schedule_sha256[:16],
                    "every rank must run the same schedule file: copy one schedule to all "
                    "machines")
        _check_same(ranks, "options", " ".join(f"{k}={v}" for k, v in sorted(options.items())),
                    "start every rank with the same karma-run arguments")
        if dist_backend == "nccl":
            _check_own_gpus(ranks, device_id)
        timeout = datetime.timedelta(seconds=timeout_s)
        net = dist.new_group(backend=dist_backend, timeout=timeout)
        host_net = net if dist_backend == "gloo" else dist.new_group(backend="gloo",
                                                                     timeout=timeout)
        ranks = Ranks(ranks.rank, size, ranks.owns_group, net, dist_backend, host_net)
    except RuntimeError as e:  # a rank died during the start-up checks
        leave(ranks)
        raise lost(ranks, "at start-up", e) from e
    except BaseException:
        leave(ranks)  # a process group left to the interpreter's exit aborts the process
        raise
    return ranks


def _env_int(key: str, default: int) -> int:
    text = os.environ.get(key, str(default))
    try:
        return int(text)
    except ValueError:
        raise KarmaError(f"{key}={text!r} is not a whole number; launch with "
                         "torchrun, which sets it") from None


def _init(world_size: int, timeout_s: float) -> None:
    """init_process_group from the environment; gloo on the CPU (NCCL is the CUDA backend's)."""
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise KarmaError(f"WORLD_SIZE={world_size} is set but {', '.join(missing)} is not: "
                         f"launch with {_launch_hint(world_size)}")
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    message = (f"rank {os.environ['RANK']} could not join the other "
               f"{world_size - 1} rank(s) at the rendezvous {where} within {timeout_s:g} s: "
               "check that every rank was started, that MASTER_ADDR/--rdzv-endpoint names a "
               "host and port reachable from here, and raise --timeout for slow starts")
    # [Note: rendezvous deadline] the store client retries its connection for up to about
    # twice its timeout, and rank 0 waits for the others as long as the group's timeout: a
    # watchdog keeps the promise of --timeout and exits the process.
    watchdog = threading.Timer(timeout_s, _give_up, args=(message,))
    watchdog.daemon = True
    watchdog.start()
    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError) as e:
        raise KarmaError(f"{message} ({str(e).splitlines()[0][:200]})") from e
    finally:
        watchdog.cancel()


def _give_up(message: str) -> None:
    print(f"karma-run: error: {message}", file=sys.stderr, flush=True)
    os._exit(2)


def _check_same(ranks: Ranks, what: str, value: str, fix: str) -> None:
    """Every rank must hold the same `value` (a string); else an error naming the ranks and
    what each holds."""
    values = _every_rank(ranks, value, f"while comparing their {what}")
    if any(v != values[0] for v in values):
        groups: dict[str, list[int]] = {}
        for r, v in enumerate(values):
            groups.setdefault(v, []).append(r)
        listed = "; ".join(f"ranks {', '.join(map(str, rs))}: {v[:200]}"
                           for v, rs in groups.items())
        raise KarmaError(f"the ranks disagree on the {what} ({listed}); {fix}")


def _check_own_gpus(ranks: Ranks, device_id: str | None) -> None:
    """NCCL needs a GPU per rank: refuse, on every rank alike, ranks that share one."""
    shared = shared_gpus(_every_rank(ranks, device_id, "while comparing their GPUs"))
    if shared:
        device, rs = next(iter(shared.items()))
        raise KarmaError(
            f"--dist-backend nccl needs a GPU of its own for each rank, but ranks "
            f"{', '.join(map(str, rs))} share GPU {device}: run several ranks on one GPU "
            "with --dist-backend gloo, or give each rank its own GPU")


def agree(ranks: Ranks, what: str, value, fix: str) -> None:
    """All ranks hold the same `value` (one rank: nothing to check)."""
    if ranks.world_size > 1:
        _check_same(ranks, what, value, fix)


def gather(ranks: Ranks, value, where: str) -> list:
    """Every rank's `value` (picklable), in rank order, on every rank."""
    if ranks.world_size == 1:
        return [value]
    return _every_rank(ranks, value, where)


def _every_rank(ranks: Ranks, value, where: str) -> list:
    """Every rank's `value` (picklable), in rank order, over the default group; a rank lost
    meanwhile is reported as lost `where`."""
    values: list = [None] * ranks.world_size
    try:
        dist.all_gather_object(values, value)
    except RuntimeError as e:
        raise lost(ranks, where, e) from e
    return values


def barrier(ranks: Ranks, where: str, timeout_s: float, others_s: float | None = None) -> None:
    """Wait for every rank: rank 0 at most `timeout_s`, the others at most `others_s`
    (default the same). After a checkpoint rank 0 arrives last (it was writing while the
    others waited): it waits only --timeout for them, so a rank that hangs is noticed, and
    the others wait for it as long as the write takes."""
    if ranks.world_size == 1:
        return
    wait_s = timeout_s if ranks.main or others_s is None else others_s
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=wait_s))
    except RuntimeError as e:
        raise lost(ranks, where, e) from e


def leave(ranks: Ranks) -> None:
    if not dist.is_initialized():
        return
    if ranks.owns_group:
        dist.destroy_process_group()
    elif ranks.net is not None:  # the caller's process group lives on; this run's groups not
        dist.destroy_process_group(ranks.net)
        if ranks.host_net is not None and ranks.host_net is not ranks.net:
            dist.destroy_process_group(ranks.host_net)


def lost(ranks: Ranks, where: str, error: BaseException) -> RankLost:
    first = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
    return RankLost(
        f"rank {ranks.rank} of {ranks.world_size} lost the other ranks {where} ({first}): "
        "a rank died or stopped answering (see its own log); restart all ranks with --resume "
        "to continue from the last checkpoint")
