"""Data parallelism: joining the ranks, checking they agree, and the phased gradient exchange.

karma-run joins a torch.distributed process group when the environment says it is one of
several ranks (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; so can anyone).
Two groups:

- the default group, for start-up checks and barriers (after a checkpoint, which rank 0
  writes while the others wait as long as it takes);
- the `net` group, with the run's --timeout, for the gradient all-reduces. They run on the
  schedule's `net` stream, one block at a time as its backward completes, so they overlap with
  the backward of the blocks before it.

[Note: all-reduce on device gradients] A block's gradients are averaged where the backward
left them, on the device, before any copy to the host: the host optimizer then receives the
averaged gradient with one device-to-host copy instead of one per rank, NCCL reduces device
memory over the fastest links, and the planner's model (the all-reduce's stage between the
block's backward and its gradients' copy or device step) is what runs. Gradients are summed
and divided by the number of ranks, as DDP does. A parameter with no gradient on a rank
contributes zeros there, and a flag counts the ranks that had one: where none had, it keeps
no gradient and the optimizer skips it, as plain PyTorch does. Every rank makes the same calls
in the same order. A block's gradients travel as one flat buffer per dtype (the planner counts
it): one collective per block instead of one per tensor cut a tiny GPT's exchange on gloo
from 45 ms to 8 ms a step.

A rank that dies closes its connections, and the others' next collective fails at once; a
rank that hangs is noticed when a collective outlasts --timeout. Either way the survivors stop
with an error that says so (RankLost), and torchrun stops the rest.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from dataclasses import dataclass

import torch
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

    @property
    def main(self) -> bool:
        return self.rank == 0


SINGLE = Ranks(rank=0, world_size=1, owns_group=False, net=None)


def _launch_hint(world_size: int) -> str:
    return (f"torchrun --nproc-per-node {world_size} --no-python karma-run SCHEDULE.yaml "
            f"(or --nnodes M --nproc-per-node {world_size}/M --rdzv-endpoint HOST:PORT on "
            "several machines)")


def join(world_size: int, schedule_sha256: str, options: dict, timeout_s: float) -> Ranks:
    """Join the run's ranks (from the environment torchrun sets) and check they agree.

    A schedule planned for `world_size` ranks runs only on that many; every rank must run
    the same schedule (same hash) with the same `options` (seed, steps, resume, ...).
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
    if not joined:
        _init(size, timeout_s)
    ranks = Ranks(dist.get_rank(), size, owns_group=not joined, net=None)
    try:
        ranks = Ranks(ranks.rank, size, ranks.owns_group, dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)))
        _check_same(ranks, "schedule", schedule_sha256[:16],
                    "every rank must run the same schedule file: copy one schedule to all "
                    "machines")
        _check_same(ranks, "options", " ".join(f"{k}={v}" for k, v in sorted(options.items())),
                    "start every rank with the same karma-run arguments")
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
    values: list = [None] * ranks.world_size
    try:
        dist.all_gather_object(values, value)
    except RuntimeError as e:
        raise lost(ranks, f"while comparing their {what}", e) from e
    if any(v != values[0] for v in values):
        groups: dict[str, list[int]] = {}
        for r, v in enumerate(values):
            groups.setdefault(v, []).append(r)
        listed = "; ".join(f"ranks {', '.join(map(str, rs))}: {v[:200]}"
                           for v, rs in groups.items())
        raise KarmaError(f"the ranks disagree on the {what} ({listed}); {fix}")


def agree(ranks: Ranks, what: str, value, fix: str) -> None:
    """All ranks hold the same `value` (one rank: nothing to check)."""
    if ranks.world_size > 1:
        _check_same(ranks, what, value, fix)


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
    elif ranks.net is not None:  # the caller's process group lives on; this run's group not
        dist.destroy_process_group(ranks.net)


def lost(ranks: Ranks, where: str, error: BaseException) -> RankLost:
    first = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
    return RankLost(
        f"rank {ranks.rank} of {ranks.world_size} lost the other ranks {where} ({first}): "
        "a rank died or stopped answering (see its own log); restart all ranks with --resume "
        "to continue from the last checkpoint")


class GradientExchange:
    """Averages a block's gradients over the ranks, on the `net` stream; times each call."""

    def __init__(self, ranks: Ranks):
        self.ranks = ranks
        self.intervals: list[tuple[float, float]] = []  # (start, end) perf_counter, this step

    def allreduce(self, params: list[torch.nn.Parameter]) -> None:
        start = time.perf_counter()
        trained = [p for p in params if p.requires_grad]  # frozen ones never have gradients
        for dtype in sorted({p.dtype for p in trained}, key=str):  # the same order on all ranks
            self._allreduce([p for p in trained if p.dtype == dtype])
        self.intervals.append((start, time.perf_counter()))

    def _allreduce(self, params: list[torch.nn.Parameter]) -> None:
        """One collective for `params` (one dtype): their gradients, zeros where a rank has
        none, then one flag per parameter that counts the ranks that had one."""
        parts = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(
            p.numel(), dtype=p.dtype, device=p.device) for p in params]
        parts.append(torch.tensor([float(p.grad is not None) for p in params],
                                  dtype=params[0].dtype, device=params[0].device))
        flat = torch.cat(parts)
        try:
            dist.all_reduce(flat, group=self.ranks.net)
        except RuntimeError as e:
            raise lost(self.ranks, "in a gradient exchange", e) from e
        counts = flat[-len(params):]
        flat = flat[:-len(params)].div_(self.ranks.world_size)
        with torch.no_grad():
            for p, part, count in zip(params, flat.split([p.numel() for p in params]),
                                      counts.tolist()):
                if count == 0:
                    p.grad = None  # no rank had one: the optimizer skips it, as in plain PyTorch
                elif p.grad is None:
                    p.grad = part.view_as(p).clone()
                else:
                    p.grad.copy_(part.view_as(p.grad))

    def take_intervals(self) -> list[tuple[float, float]]:
        out, self.intervals = self.intervals, []
        return out


def hidden_s(busy: list[tuple[float, float]], blocked: list[tuple[float, float]]) -> float:
    """How much of the `busy` intervals (all-reduces) fell outside `blocked` ones (the compute
    thread waiting): the part of the exchange that compute hid. `blocked` are disjoint."""
    total = 0.0
    for start, end in busy:
        overlap = sum(max(0.0, min(end, b_end) - max(start, b_start))
                      for b_start, b_end in blocked)
        total += (end - start) - overlap
    return total
