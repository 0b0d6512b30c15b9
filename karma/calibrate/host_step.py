"""Each block's host optimizer step, timed as the runtime runs it.

    seconds = host_step_times(mf, graph, "fused", "cpu", say)   # per block, cached

[Note: timing the host step as the runtime runs it] The host stream steps a block's fp32
masters with the block's own optimizer, made by host_optimizer.host_make_optimizer (torch's
fused CPU kernel by default), on the host stream's worker thread with that stream's intra-op
threads (runtime/host/threads.py), over masters, gradients and state in a shared file
mapping as the CPU backend's tier holds them. Timing the model file's optimizer on the main
thread instead (what the CPU's in-context steps measure: its device step) put an
offload_all GPT's host steps at the single-tensor AdamW's 1-2 GB/s where the fused kernel on
the host stream runs at 5-6. So each distinct block (by its parameters' shapes) is stepped
here that way: one step that makes the state, then the median of REPEATS. The copies
beside it are the simulator's contention fractions, not timed here.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from karma.calibrate.cache import cache_path, read, write
from karma.calibrate.machine import machine_key
from karma.calibrate.measure_hw import on_worker, scratch_mapping
from karma.fingerprint import code_sha256
from karma.ir.graph import BlockGraph
from karma.modelfile import ModelFile, build_meta
from karma.runtime.host.threads import host_stream_threads
from karma.runtime.params.host_optimizer import host_make_optimizer

REPEATS = 5
Shapes = tuple[tuple[int, ...], ...]


def host_step_times(mf: ModelFile, graph: BlockGraph, choice: str, device: str,
                    say: Callable[[str], None], remeasure: bool = False) -> tuple[float, ...]:
    """Seconds of each block's host optimizer step with kernel `choice` on this machine, for
    the `device` backend's host stream (cached under the model's parameter shapes)."""
    shapes = block_shapes(mf, graph)
    threads = host_stream_threads(device)
    key = {"machine": machine_key(device), "model_code_sha256": code_sha256(mf), "shapes": shapes,
           "host_optimizer": choice, "threads": threads}
    path = cache_path("host-steps", key)
    cached = None if remeasure else read(path).get("host_step_s")
    if isinstance(cached, list) and len(cached) == len(shapes):
        return tuple(float(s) for s in cached)
    make = host_make_optimizer(mf.make_optimizer, choice)
    timed: dict[Shapes, float] = {}
    for s in shapes:
        if s not in timed:
            timed[s] = on_worker(lambda s=s: _step_seconds(s, make), threads)
    seconds = [timed[s] for s in shapes]
    say(f"timed the host optimizer's step ({choice}, {threads} thread(s)) of "
        f"{len(timed)} distinct block(s): {sum(seconds) * 1e3:.1f} ms a step in all")
    write(path, {"key": key, "host_step_s": seconds}, say)
    return tuple(seconds)


def block_shapes(mf: ModelFile, graph: BlockGraph) -> list[Shapes]:
    """The shapes of each block's own parameters (those its optimizer steps)."""
    model, _, _ = build_meta(mf, graph.batch_size)
    named = dict(model.named_parameters(remove_duplicate=False))
    return [tuple(tuple(named[n].shape) for n in b.params if named[n].requires_grad)
            for b in graph.blocks]


def _step_seconds(shapes: Shapes, make_optimizer: Callable) -> float:
    """Median seconds of `make_optimizer`'s step over fp32 masters of `shapes`, they and
    their gradients in a shared file mapping (the CPU tier's memory; the state where the
    optimizer makes it: on the 2-core test machine fused AdamW stepped a GPT's layers at 7.9
    GB/s in a mapping of /dev/shm and at 8.0 in private memory)."""
    if not shapes:
        return 0.0
    numels = [max(1, torch.Size(s).numel()) for s in shapes]
    total = sum(numels)
    mapping = scratch_mapping(2 * total, torch.float32, 8 * total)
    parts = iter(mapping.split([n for _ in range(2) for n in numels]))
    masters = [torch.nn.Parameter(next(parts).view(s).normal_()) for s in shapes]
    for m, s in zip(masters, shapes):
        m.grad = next(parts).view(s).fill_(1e-3)
    optimizer = make_optimizer(masters)
    optimizer.step()  # makes the state
    seconds = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        optimizer.step()
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds)
