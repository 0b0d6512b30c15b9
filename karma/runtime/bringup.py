"""Bringing a run up, and down again: everything a Runtime trains with.

    backend = make_backend(device_kind)            # before the ranks join (their GPUs)
    parts = bring_up(schedule, mf, backend, ranks, seed, log)
    parts.engine, parts.model, parts.optimizer ...
    parts.close()                                  # in the reverse order of bring-up

In order: the host-memory check, the CPU backend's cache, the baseline the peak is measured
above, the peak meter, the device cap (on CUDA), the host tier, the model (built in the tier on the
CPU backend), the node's copy of the weights (sharded host state), the gradient exchange,
the engine's parts (build_engine_parts: the schedule checked against the model, each
block's weights with its host-state layout, the storage of streamed parameters, the model
placed on the device, the swap stores), the engine, which wires the replay over them, the
optimizers, the LR schedule, and on the CPU backend asked for a cap, the hard cap on the
process's data segment (host/memcap.py, [Note: the hard cap from the plan]). Each piece
that must be closed is pushed on one `contextlib.ExitStack` as it is made, so a failure
halfway closes what was made, newest first, and `Parts.close` does the same for a whole
run.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from karma.errors import KarmaError
from karma.modelfile import ModelFile
from karma.runtime.backends.backend import Backend, CpuBackend
from karma.runtime.backends.cuda_backend import CudaBackend
from karma.runtime.distributed import process_group
from karma.runtime.distributed.exchange import GradientExchange
from karma.runtime.distributed.process_group import Ranks
from karma.runtime.host import cpu_cache, memcap
from karma.runtime.host.check import HostMemory, host_memory_problem, measure_host_memory
from karma.runtime.host.memcap import DataCap
from karma.runtime.host.nodecopy import NodeCopy, whole_bytes
from karma.runtime.host.peak import DevicePeak, PrivatePeak
from karma.runtime.host.threads import start_thread_pool
from karma.runtime.host.tier import (
    BuildInTier,
    HostPool,
    data_bytes,
    pool_bytes,
    private_bytes,
    return_freed_memory_promptly,
)
from karma.runtime.params.host_optimizer import host_make_optimizer
from karma.runtime.params.layout import (
    HostLayout,
    ReplicatedLayout,
    ShardedLayout,
    sharded_params,
)
from karma.runtime.params.lr import LRSchedule
from karma.runtime.params.placement import place_buffers
from karma.runtime.params.streamed import SharedStorage
from karma.runtime.params.weights import BlockWeights
from karma.runtime.replay.engine import Engine, EngineParts
from karma.runtime.replay.kept import KeptSwap
from karma.runtime.replay.swap import SwapStore
from karma.runtime.replay.training_options import GradClip, MixedPrecision
from karma.schedule import BlockEntry, Schedule
from karma.schedule_check import check_model_names, validate
from karma.storage import tier_directory
from karma.units import format_bytes

# On the CPU backend, factory tensors of at least this size are built in the host tier.
TIER_MIN_BYTES = 1 << 20


@dataclass(frozen=True)
class Parts:
    """What a run trains with; `close` takes it down."""

    model: torch.nn.Module
    engine: Engine
    pool: HostPool
    meter: PrivatePeak | DevicePeak  # each step's peak memory
    exchange: GradientExchange | None  # on several ranks
    precision: MixedPrecision
    optimizer: BlockOptimizers
    lr_schedule: LRSchedule | None  # the model file's make_scheduler, if any (params/lr.py)
    cache_bound: cpu_cache.PlannedBound | None  # the CPU backend's cache, where it runs
    baseline_private_bytes: int  # before the model was built: what the peak is measured above
    baseline_data_bytes: int  # VmData then: the process's fixed cost under prlimit --data
    stack: contextlib.ExitStack
    node: NodeCopy | None = None  # the node's copy of the weights (sharded host state)
    data_cap: DataCap | None = None  # the process's hard cap (CPU backend, where asked for)

    @property
    def host_bytes(self) -> int:
        """This rank's host memory at its peak: its pool's, and its share of the node's."""
        return self.pool.peak_bytes + (self.node.share_bytes if self.node else 0)

    @property
    def host_optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers of host-stepped blocks, whose steps may run on into the next
        step (replay/update.py)."""
        return [w.optimizer for w in self.engine.weights
                if w.optim == "host" and w.optimizer is not None]

    def close(self) -> None:
        """Stop the streams, free the host tier, stop the meter and the cache. Idempotent."""
        self.stack.close()


def bring_up(schedule: Schedule, mf: ModelFile, backend: Backend, ranks: Ranks, seed: int,
             log: Callable[[str], None], cap_device_memory: bool | int = False,
             timeout_s: float = 60.0) -> Parts:
    """Everything `schedule` trains with, in the reference's order: torch.manual_seed(seed),
    build_model() on the CPU, the optimizers, the model file's LR scheduler.
    `cap_device_memory` (True: the schedule's budget on CUDA, its predicted peak on the CPU;
    or a number of bytes): on CUDA, emulate a GPU of that much memory; on the CPU backend,
    whose device memory is the process's private memory, cap the process's data segment
    at what the schedule needs with that peak ([Note: the hard cap from the plan])."""
    capping_data = bool(cap_device_memory) and backend.name == "cpu"
    with contextlib.ExitStack() as stack:
        start = _before_the_model(schedule, mf, backend, log, cap_device_memory, stack)
        built = time.perf_counter()
        pool, tier = _host_tier(schedule, backend, start.host_memory, log, stack)
        torch.manual_seed(seed)
        with tier or contextlib.nullcontext():
            model = mf.build(log)  # on the CPU: initial values do not depend on it
        model.train()
        node = _node_copy(schedule, model, backend, ranks, start.host_memory.tier_dir,
                          timeout_s, log, stack)
        exchange = GradientExchange(ranks, backend) if ranks.world_size > 1 else None
        clip = schedule.config.clip_grad_norm
        parts = build_engine_parts(schedule, model, mf.make_optimizer, pool, backend, exchange,
                                   tier, node, MixedPrecision.of(schedule, backend.device.type),
                                   GradClip(clip) if clip is not None else None)
        data_before_engine = data_bytes()
        engine = Engine(schedule, model, parts)
        stack.callback(engine.close)
        if capping_data:
            engine.on_each_stream(start_thread_pool)  # [Note: the hard cap from the plan]
        engine_data_bytes = max(0, data_bytes() - data_before_engine)  # its threads, mostly
        if tier is not None:
            tier.release_unused()
        # the tier's peak counts training from here: building the model in it (BuildInTier)
        # held the whole model for a moment, which the plan's host bytes do not count
        pool.reset_peak()
        optimizer = BlockOptimizers([w.optimizer for w in engine.weights
                                     if w.optimizer is not None])
        lr_schedule = None if mf.make_scheduler is None else LRSchedule(
            mf.make_optimizer, mf.make_scheduler, list(model.parameters()),
            optimizer.optimizers, mf.path)
        data_cap = _cap_data(schedule, start, engine_data_bytes, cap_device_memory, log,
                             stack) if capping_data else None
        if start.bound is not None:
            start.bound.bound(0)
        # every rank has built its model (ranks that build slower than the timeout get longer)
        process_group.barrier(ranks, "before the first step",
                              timeout_s + time.perf_counter() - built)
        return Parts(model, engine, pool, start.meter, exchange, parts.precision, optimizer,
                     lr_schedule, start.bound, start.baseline_private_bytes,
                     start.baseline_data_bytes, stack.pop_all(), node, data_cap)


@dataclass(frozen=True)
class Start:
    """What bring-up measures and starts before the model exists."""

    host_memory: HostMemory  # what the schedule needs of the host, and where the tier goes
    meter: PrivatePeak | DevicePeak  # each step's peak memory
    bound: cpu_cache.PlannedBound | None  # the CPU backend's cache, where it runs
    baseline_private_bytes: int  # what the peak is measured above
    baseline_data_bytes: int  # VmData: the process's fixed cost under prlimit --data


def _before_the_model(schedule: Schedule, mf: ModelFile, backend: Backend,
                      log: Callable[[str], None], cap_device_memory: bool | int,
                      stack: contextlib.ExitStack) -> Start:
    """The host-memory check, the CPU backend's cache, the baseline the peak is measured
    above, the peak meter and the device cap."""
    # before anything is allocated: [Note: where the host tier's bytes live]
    host_memory = measure_host_memory(schedule, backend.name)
    problem = host_memory_problem(host_memory)
    if problem is not None:
        raise KarmaError(problem)
    return_freed_memory_promptly()
    if cap_device_memory and backend.name == "cpu":  # [Note: the hard cap from the plan]
        start_thread_pool()  # the compute thread's OpenMP team, in the fixed cost
    cache = cpu_cache.load(log) if backend.name == "cpu" else None
    if cache is not None:  # [Note: a caching allocator for the CPU backend]
        cache.start(1 << 62)  # bounded below, once the baseline is known
        stack.callback(_stop_cache, cache, log)
    baseline_private, baseline_data = _baseline(mf, schedule, log)
    bound = None if cache is None else cpu_cache.PlannedBound(
        cache, baseline_private, schedule.predicted.peak_device_bytes)
    meter = PrivatePeak(baseline_private) if backend.name == "cpu" else DevicePeak(backend)
    stack.callback(meter.close)
    if cap_device_memory and backend.name != "cpu":  # the CPU's: after the threads, _cap_data
        _cap(backend, schedule.config.capacity_bytes if cap_device_memory is True
             else int(cap_device_memory), log)
    return Start(host_memory, meter, bound, baseline_private, baseline_data)


def _host_tier(schedule: Schedule, backend: Backend, host_memory: HostMemory,
               log: Callable[[str], None],
               stack: contextlib.ExitStack) -> tuple[HostPool, BuildInTier | None]:
    """The host tier's pool, and on the CPU backend the mode that builds the model in it
    (host/tier.py, BuildInTier): its weights need not fit in the memory the schedule allows."""
    pool = HostPool(pool_bytes(_pool_bytes(schedule)), kind=backend.pool_kind,
                    directory=host_memory.tier_dir)
    stack.callback(pool.close)
    if backend.name == "cpu" and schedule.predicted.host_bytes:
        log(f"host tier: {format_bytes(schedule.predicted.host_bytes)} in "
            f"{pool.directory} " + (
                "(RAM: a tmpfs, which a cap on the process's data does not count; "
                "KARMA_TIER_DIR=/path/on/disk puts it on a disk)" if host_memory.tier_in_memory
                else "(a file on disk, whose pages the kernel writes back: slower than a "
                "tmpfs; set KARMA_TIER_DIR to one with room)"))
    return pool, (BuildInTier(pool, TIER_MIN_BYTES) if backend.name == "cpu" else None)


def _node_copy(schedule: Schedule, model: torch.nn.Module, backend: Backend, ranks: Ranks,
               tier_dir: str, timeout_s: float, log: Callable[[str], None],
               stack: contextlib.ExitStack) -> NodeCopy | None:
    """With sharded host state, the node's copy of the whole weights ([Note: the node's
    copy of the weights]); else None."""
    if not schedule.config.sharded:
        return None
    named = dict(model.named_parameters(remove_duplicate=False))
    shapes = [(named[n].shape, named[n].dtype) for n in sharded_params(schedule)]
    pinned = backend.pool_kind == "pinned"
    # pinned, in shared memory, where the driver can pin it (host/nodecopy.py)
    node_dir = tier_directory() if pinned else tier_dir
    node = NodeCopy(whole_bytes(shapes, ranks.world_size), ranks, node_dir, pinned, timeout_s,
                    log)
    stack.callback(node.close)
    return node


def build_engine_parts(schedule: Schedule, model: torch.nn.Module, make_optimizer: Callable,
                       pool: HostPool, backend: Backend, exchange: GradientExchange | None,
                       tier: BuildInTier | None, node: NodeCopy | None,
                       precision: MixedPrecision, clip: GradClip | None) -> EngineParts:
    """What the engine replays over: each block's weights with its host-state layout, the
    storage of streamed parameters and the swap stores; the model (built on the CPU, its
    large tensors in the host tier when built under `tier`) placed on the backend's device
    on the way. `node`: where sharded host state keeps the whole weights (host/nodecopy.py;
    the schedule's host_state says whether)."""
    if schedule.config.world_size > 1 and exchange is None:
        raise KarmaError(f"this schedule was planned for {schedule.config.world_size} ranks; "
                         "run it on that many (karma-run under torchrun)")
    validate(schedule)  # a Schedule made in memory was never loaded (and checked)
    named = dict(model.named_parameters(remove_duplicate=False))
    check_model_names(schedule, named, {name for name, _ in model.named_modules()})
    shared = SharedStorage()
    host_kernel = host_make_optimizer(make_optimizer, schedule.config.host_optimizer)
    weights = []
    for b in schedule.blocks:
        params = [(n, named[n]) for n in b.params]
        layout = _layout(schedule, b, [p for _, p in params], pool, node, exchange)
        make = host_kernel if b.optim == "host" else make_optimizer
        weights.append(BlockWeights(b.name, params, b.weights, b.optim, make, pool,
                                    shared, layout, backend.device, tier))
    place_buffers(model, backend.device, tier, pool)
    # after placement: a parameter's storage is the one on the device
    param_storages = {p.untyped_storage()._cdata for p in model.parameters()}
    swaps: dict[int, SwapStore | KeptSwap] = {
        b.index: SwapStore(b.name, pool, param_storages, backend.device)
        for b in schedule.blocks if b.act == "swap"}
    swaps.update({b.index: KeptSwap(b.name, pool, backend.device)
                  for b in schedule.blocks if b.act == "selective" and b.kept == "host"})
    return EngineParts(weights, shared, swaps, backend, precision, exchange, clip)


def _layout(schedule: Schedule, block: BlockEntry, params: list[torch.nn.Parameter],
            pool: HostPool, node: NodeCopy | None,
            exchange: GradientExchange | None) -> HostLayout | None:
    """Where `block`'s host state lives (params/layout.py): None for a block stepped on the
    device; else whole on this rank, or its rows of it with sharded host state."""
    if block.optim != "host":
        return None
    if schedule.config.sharded:
        return ShardedLayout(params, pool, node, exchange.ranks, schedule.config.accumulate)
    return ReplicatedLayout(params, pool)


def _pool_bytes(schedule: Schedule) -> int:
    """The host tier a rank's pool starts with: the schedule's per-rank host bytes, less the
    share of the node's copy of the weights the planner counted in them (host/nodecopy.py)."""
    c = schedule.config
    whole = sum(b.param_bytes for b in schedule.blocks if b.optim == "host") \
        if schedule.config.sharded else 0
    return max(0, schedule.predicted.host_bytes - -(-whole // c.nproc_per_node))


def _baseline(mf: ModelFile, schedule: Schedule, log: Callable[[str], None]) -> tuple[int, int]:
    """The process's private bytes and data segment before the model: what the peak is
    measured above, and the fixed cost under prlimit --data."""
    # The first optimizer a process makes imports torch._dynamo (about 70 MiB): a one-time
    # cost of PyTorch, not of the schedule, so it happens before the baseline is taken.
    mf.make_optimizer([torch.nn.Parameter(torch.zeros(1))])
    gc.collect()  # what an earlier model in this process left is not this run's baseline
    private, data = private_bytes(), data_bytes()
    log(f"training: {schedule.config.training_text()}")
    log(f"baseline before the model: {format_bytes(private)} private, {format_bytes(data)} "
        "data segment (what prlimit --data caps)")
    return private, data


class BlockOptimizers:
    """The per-block optimizers as one: their param_groups (the model file's make_scheduler,
    through lr.LRSchedule, sets `lr` in each), zero_grad, and their states."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> list[dict]:
        return [opt.state_dict() for opt in self.optimizers]


def make_backend(device_kind: str) -> Backend:
    """The backend of a schedule planned for `device_kind`; on CUDA, this rank's GPU, made
    current before anything else touches the GPU (NCCL uses it)."""
    if device_kind != "cuda":
        return CpuBackend()
    if not torch.cuda.is_available():
        raise KarmaError("this schedule was planned for a CUDA GPU and none is available "
                         "here; re-plan with --hardware cpu to train on the CPU backend")
    device = torch.device("cuda", local_device_index(os.environ, torch.cuda.device_count(),
                                                     torch.cuda.current_device()))
    torch.cuda.set_device(device)
    return CudaBackend(device)


def local_device_index(env, device_count: int, current: int) -> int:
    """The GPU of this rank: LOCAL_RANK's (torchrun sets it; ranks beyond the GPUs share them
    round-robin, which only gloo can all-reduce on), else the current device."""
    if "LOCAL_RANK" not in env:
        return current
    try:
        return int(env["LOCAL_RANK"]) % max(device_count, 1)
    except ValueError:
        raise KarmaError(f"LOCAL_RANK={env['LOCAL_RANK']!r} is not a whole number; launch "
                         "with torchrun, which sets it") from None


def _cap_data(schedule: Schedule, start: Start, threads_bytes: int, peak: bool | int,
              log: Callable[[str], None], stack: contextlib.ExitStack) -> DataCap:
    """Cap this process's data segment, until the run closes, at its fixed cost, what
    karma's threads took, the schedule's predicted peak (or `peak` bytes) and the slack
    ([Note: the hard cap from the plan]), and say so."""
    cap = DataCap(start.baseline_data_bytes, threads_bytes,
                  schedule.predicted.peak_device_bytes if peak is True else int(peak))
    limit, restore = memcap.apply(cap)
    stack.callback(restore)
    log(cap.text(schedule.predicted.host_bytes, start.host_memory.tier_dir,
                 start.host_memory.tier_in_memory))
    if limit < cap.limit_bytes:
        log(f"the process's data was already capped lower, at {format_bytes(limit)} "
            "(ulimit -d or prlimit --data), and stays so")
    return cap


def _cap(backend: Backend, size: int, log: Callable[[str], None]) -> None:
    cap = backend.cap(size)
    log(f"device memory capped as on a GPU of {format_bytes(size)}: PyTorch's allocator may "
        f"hold {format_bytes(cap.allocator_bytes)}, the {format_bytes(cap.outside_bytes)} in "
        f"use outside it (the CUDA context) counted in (the card has "
        f"{format_bytes(cap.total_bytes)})")


def _stop_cache(cache: cpu_cache.CPUCache, log: Callable[[str], None]) -> None:
    stats = cache.stats()
    if stats.hits + stats.misses:  # a run that trained: how the cache served it
        log(stats.text())
    cache.stop()
