"""karma's planning API: what `karma-plan` does, as a function.

    import karma
    schedule = karma.plan("examples/gpt.py", gpu_mem="16G", hardware="v100-16g", batch_size=8)
    schedule.save("schedule.yaml")           # the YAML karma-run replays
    schedule = karma.load_schedule("schedule.yaml")

`karma-plan` is a thin layer over `plan_report` (it prints the report); `plan` returns the
report's schedule.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from karma.calibrate import Calibration, FromPlanning, Probe, calibrate
from karma.calibrate.blocks import Timed
from karma.errors import KarmaError
from karma.ir.build import build_block_graph
from karma.ir.graph import BlockGraph, OptimizerProfile
from karma.ir.optimizer import optimizer_profile
from karma.modelfile import ModelFile, load_model_file
from karma.planner.fit_contention import fit_side_streams
from karma.planner.hardware import Hardware, load_hardware
from karma.planner.pipeline import (
    STRATEGIES,
    PlanReport,
    PlanRequest,
    make_schedule,
    probe_schedule,
)
from karma.planner.plan import InfeasiblePlan
from karma.planner.problem import build_problem
from karma.schedule import DTYPES, HOST_STATES, ModelRef, Schedule
from karma.units import parse_size


def plan(model_file: str | Path, gpu_mem: str | int = "16G", hardware: str | Hardware = "v100-16g",
         batch_size: int | None = None, **options) -> Schedule:
    """Plan training of a model file within `gpu_mem` bytes of device memory ("16G" or an
    int) on `hardware` (a built-in profile's name, a karma-profile file, or a Hardware).
    Options, as karma-plan's flags: world_size, dtype ("fp32", or "bf16" for mixed
    precision), accumulate (micro-batches per optimizer step), clip_grad_norm (a float, or
    None), nproc_per_node (ranks per node; default the profile's devices_per_node, capped by
    world_size; every rank on a cpu profile), host_mem (the node's host memory, "384G" or an int; default the profile's),
    host_state ("auto", "sharded" or "replicated"), strategy, seed, time_limit_s, gap, blocks,
    measure (default: measure block times
    when `hardware` is this machine; False: the roofline estimate, as --no-measure; see
    karma/calibrate), remeasure (True: measure again what is cached, as --remeasure).
    Raises InfeasiblePlan (with min_capacity_bytes) if nothing fits."""
    return plan_report(model_file, gpu_mem, hardware, batch_size, **options).schedule


def plan_report(model_file: str | Path, gpu_mem: str | int, hardware: str | Hardware,
                batch_size: int | None = None, *, world_size: int = 1, dtype: str = "fp32",
                strategy: str = "ilp", seed: int = 0, time_limit_s: float = 60.0,
                gap: float = 0.01, blocks: str | None = None, measure: bool | None = None,
                accumulate: int = 1, clip_grad_norm: float | None = None,
                nproc_per_node: int | None = None, host_mem: str | int | None = None,
                host_state: str = "auto", log: Callable[[str], None] | None = None,
                profile_blocks: bool = False, remeasure: bool = False) -> PlanReport:
    """`plan`, with everything karma-plan prints: the chosen plan's evaluation and every
    baseline's. `log` gets notes about the model (e.g. a KV cache turned off) and about
    measuring (default: printed to stderr). profile_blocks=True is the old name of
    measure=True. remeasure=True measures the machine and the blocks again instead of reading
    them from the cache (karma-plan --remeasure)."""
    prepared = _prepare(model_file, _bytes(gpu_mem), hardware, batch_size,
                        world_size=world_size, dtype=dtype, strategy=strategy, seed=seed,
                        time_limit_s=time_limit_s, gap=gap, blocks=blocks,
                        measure=True if profile_blocks else measure, accumulate=accumulate,
                        clip_grad_norm=clip_grad_norm, nproc_per_node=nproc_per_node,
                        host_mem=host_mem, host_state=host_state, log=log,
                        remeasure=remeasure)
    return _solve(prepared, prepared.request)


@dataclass(frozen=True)
class _Prepared:
    """What every plan of one model at one batch size shares: its block graph, its
    calibration and the request the points of a sweep vary."""

    graph: BlockGraph
    model: ModelRef
    request: PlanRequest
    block_times: str


def _prepare(model_file, capacity: int, hardware, batch_size: int | None, *,
             world_size: int = 1, dtype: str = "fp32", strategy: str = "ilp", seed: int = 0,
             time_limit_s: float = 60.0, gap: float = 0.01, blocks: str | None = None,
             measure: bool | None = None, accumulate: int = 1,
             clip_grad_norm: float | None = None, nproc_per_node: int | None = None,
             host_mem: str | int | None = None, host_state: str = "auto",
             log: Callable[[str], None] | None = None, remeasure: bool = False) -> _Prepared:
    """The options checked, the model traced and calibrated: what plans are made from."""
    if strategy not in STRATEGIES:
        raise KarmaError(f"strategy {strategy!r} (--strategy) is not a strategy; use one of "
                         f"{', '.join(STRATEGIES)}")
    if time_limit_s <= 0 or not 0 <= gap < 1:
        raise KarmaError(f"the time limit {time_limit_s:g} s (--time-limit) must be positive "
                         f"and the gap {gap:g} (--gap) in [0, 1), e.g. 60 and 0.01")
    check_training_options(dtype, accumulate, clip_grad_norm)
    if remeasure and measure is False:
        raise KarmaError("remeasure (--remeasure) and measure=False (--no-measure) contradict "
                         "each other; give one")
    hw = hardware if isinstance(hardware, Hardware) else load_hardware(hardware)
    node = node_layout(hw, world_size, nproc_per_node, host_mem, host_state)
    mf = load_model_file(model_file)
    graph = build_block_graph(mf, batch_size, blocks, model_name=str(model_file), dtype=dtype)
    for note in graph.notes:
        (log or _note_to_stderr)(note)
    model = ModelRef.now(str(model_file), mf.sha256, graph.to_json())
    optimizer = optimizer_profile(mf)
    cal = calibration(mf, graph, hardware, hw, optimizer, measure, blocks,
                      log or _note_to_stderr, remeasure)
    request = PlanRequest(
        capacity_bytes=capacity, hardware=cal.hardware, batch_size=graph.batch_size,
        dtype=dtype, world_size=world_size, seed=seed, strategy=strategy,
        time_limit_s=time_limit_s, gap=gap, optimizer=optimizer,
        measured_s=cal.measured_s, measured_step_s=cal.measured_step_s,
        process_bytes=cal.process_bytes, measured_loss_s=cal.measured_loss_s,
        accumulate=accumulate, clip_grad_norm=clip_grad_norm,
        nproc_per_node=node.nproc_per_node, host_state=host_state,
        host_mem_bytes=node.host_mem_bytes,
    )
    return _Prepared(graph, model, request, cal.summary)


def _solve(prepared: _Prepared, request: PlanRequest) -> PlanReport:
    try:
        report = make_schedule(prepared.graph, prepared.model, request)
    except InfeasiblePlan as e:
        e.batch_size = prepared.graph.batch_size  # for the advice of a smaller batch
        raise
    return replace(report, block_times=prepared.block_times)


SWEEPS = ("gpu-mem", "batch-size")


def sweep(model_file: str | Path, quantity: str, values: Sequence[int],
          gpu_mem: str | int | None, hardware: str | Hardware = "v100-16g",
          batch_size: int | None = None, **options) -> list[dict]:
    """Plan at every value of `quantity` ("gpu-mem": device memory budgets in bytes;
    "batch-size"), the other options as plan_report's; one record per point, an infeasible
    one naming the resource that ran out. A budget sweep traces and calibrates once: each
    point is a solve."""
    if quantity not in SWEEPS:
        raise KarmaError(f"--sweep {quantity}=...: karma sweeps {' or '.join(SWEEPS)}")
    points = []
    prepared = None
    for value in values:
        capacity = value if quantity == "gpu-mem" else gpu_mem
        batch = value if quantity == "batch-size" else batch_size
        if prepared is None or quantity == "batch-size":
            prepared = _prepare(model_file, _bytes(capacity), hardware, batch, **options)
        request = replace(prepared.request, capacity_bytes=_bytes(capacity))
        points.append(_point(prepared, request))
    return points


BATCH_CHOICES = ("max", "best")
MAX_BATCH = 1 << 16  # the search's ceiling


def choose_batch(model_file: str | Path, how: str, gpu_mem: str | int,
                 hardware: str | Hardware = "v100-16g", **options) -> tuple[int, list[dict]]:
    """The batch `how` asks for ("max": the largest any plan fits in the budget; "best": the
    one of most predicted samples per second, up to that), and the points searched (sweep's
    records, in the order tried). The search doubles from 1 until no plan fits, then halves
    the interval around the answer: logarithmic, then refined."""
    if how not in BATCH_CHOICES:
        raise KarmaError(f"--batch-size {how!r}: give a number, max or best")
    tried: dict[int, dict] = {}

    def point(batch: int) -> dict:
        if batch not in tried:
            tried[batch] = sweep(model_file, "batch-size", [batch], gpu_mem, hardware,
                                 **options)[0]
        return tried[batch]

    if not point(1)["feasible"]:
        raise InfeasiblePlan(f"no batch fits: {point(1)['reason']}", 0,
                             resource=point(1)["resource"])
    fits = 1
    while 2 * fits <= MAX_BATCH and point(2 * fits)["feasible"]:
        fits *= 2
    low, high = fits, min(2 * fits, MAX_BATCH + 1)  # low fits, high does not
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if point(mid)["feasible"] else (low, mid)
    if how == "max":
        return low, list(tried.values())
    best = max((b for b, p in tried.items() if p["feasible"]),
               key=lambda b: tried[b]["samples_per_s"])
    step = max(1, best // 4)  # refine around it, in halving steps
    while step >= 1:
        for b in (best - step, best + step):
            if 1 <= b <= low and point(b)["feasible"] \
                    and point(b)["samples_per_s"] > tried[best]["samples_per_s"]:
                best = b
        step //= 2
    return best, list(tried.values())


def _bytes(size: str | int | None) -> int:
    if size is None:
        raise KarmaError("a batch-size sweep plans at one budget: give --gpu-mem")
    value = size if isinstance(size, int) else parse_size(str(size), "gpu_mem")
    if value <= 0:
        raise KarmaError(f"the memory budget {size!r} (gpu_mem, --gpu-mem) must be more than "
                         "zero, e.g. 16G")
    return value


def _point(prepared: _Prepared, request: PlanRequest) -> dict:
    """One point of a sweep: the plan's figures, or why nothing fits."""
    samples = request.batch_size * request.world_size * request.accumulate
    point = {"gpu_mem_bytes": request.capacity_bytes, "batch_size": request.batch_size,
             "world_size": request.world_size, "nproc_per_node": request.nproc_per_node}
    try:
        report = _solve(prepared, request)
    except InfeasiblePlan as e:
        return {**point, "feasible": False, "resource": e.resource, "reason": str(e),
                "iteration_s": None, "samples_per_s": None, "baselines": {}}
    ev, p = report.chosen, report.schedule.predicted
    return {**point, "feasible": True, "strategy": ev.plan.strategy,
            "iteration_s": ev.step_s, "samples_per_s": samples / ev.step_s,
            "peak_device_bytes": ev.peak_device_bytes, "host_bytes": p.host_bytes,
            "node_host_bytes": p.node_host_bytes, "scaling_efficiency": p.scaling_efficiency,
            "baselines": {name: b.step_s if b.feasible else None
                          for name, b in report.baselines.items()}}


def calibration(mf: ModelFile, graph: BlockGraph, hardware: str | Hardware, hw: Hardware,
                optimizer: OptimizerProfile, measure: bool | None = None,
                blocks: str | None = None, log: Callable[[str], None] | None = None,
                remeasure: bool = False) -> Calibration:
    """What to plan `graph` with on `hw` (karma/calibrate): calibration entered once, with
    what it needs from planning handed in (`optimizer`: the model file's, measured)."""
    roofline = build_problem(graph, hw, graph.dtype)

    # the model file by its absolute path: karma-run trains it from another directory
    model = ModelRef.now(str(Path(mf.path).resolve()), mf.sha256, graph.to_json())

    def keep_all(measured: Hardware) -> Schedule:
        return make_schedule(graph, model, PlanRequest(
            capacity_bytes=1 << 62, hardware=measured, batch_size=graph.batch_size,
            dtype=graph.dtype, strategy="keep_all", optimizer=optimizer)).schedule

    def probe(measured: Hardware, timed: Timed) -> Probe:
        schedule = probe_schedule(graph, model, PlanRequest(
            capacity_bytes=1 << 62, hardware=measured, batch_size=graph.batch_size,
            dtype=graph.dtype, optimizer=optimizer, measured_s=timed.fwd_bwd_s,
            measured_step_s=timed.step_s, process_bytes=timed.process_bytes,
            measured_loss_s=timed.loss_s))
        return Probe(schedule, functools.partial(fit_side_streams, schedule))

    planning = FromPlanning(tuple(b.fwd_s + b.bwd_s for b in roofline.blocks), keep_all, probe)
    return calibrate(mf, graph, hardware, hw, planning, measure, blocks, log, remeasure)


@dataclass(frozen=True)
class NodeLayout:
    """How the ranks sit on nodes: what karma-plan's --nproc-per-node and --host-mem say."""

    nproc_per_node: int
    host_mem_bytes: int | None  # the node's host memory (None: the profile's)


def node_layout(hw: Hardware, world_size: int, nproc_per_node: int | None = None,
                host_mem: str | int | None = None, host_state: str = "auto") -> NodeLayout:
    """Check the node options against the profile: ranks per node (default the profile's
    devices_per_node, capped by world_size; on a cpu profile every rank, as ranks started on
    one machine are) divide the ranks and fit the node's devices."""
    if host_state not in ("auto", *HOST_STATES):
        raise KarmaError(f"host_state {host_state!r} (--host-state) is not one karma knows; use "
                         "auto, sharded or replicated")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise KarmaError(f"world_size {world_size!r} (--world-size) must be a whole number of "
                         "ranks, 1 or more")
    given = nproc_per_node is not None
    k = nproc_per_node if given else world_size if hw.device_kind == "cpu" else min(
        hw.devices_per_node, world_size)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise KarmaError(f"nproc_per_node {k!r} (--nproc-per-node) must be a whole number of "
                         "ranks, 1 or more")
    if hw.device_kind == "cuda" and k > hw.devices_per_node:
        raise KarmaError(f"--nproc-per-node {k} is more than the {hw.devices_per_node} GPUs of "
                         f"a {hw.name} node; use at most {hw.devices_per_node} (one rank a GPU), "
                         "or a profile of a larger node (--hardware FILE with devices_per_node)")
    if k > world_size or world_size % k:
        flag = "--nproc-per-node" if given else f"the profile's {hw.devices_per_node} devices " \
                                                 "per node (--nproc-per-node)"
        raise KarmaError(f"--world-size {world_size} is not a multiple of {flag} {k}: every "
                         f"node runs as many ranks; use a world size of N x {k}, or set "
                         "--nproc-per-node to a divisor of the world size")
    host_mem_bytes = None
    if host_mem is not None:
        host_mem_bytes = host_mem if isinstance(host_mem, int) else parse_size(
            str(host_mem), "--host-mem")
        if host_mem_bytes <= 0:
            raise KarmaError(f"--host-mem {host_mem!r} must be more than zero: the node's host "
                             "memory, e.g. 384G")
    return NodeLayout(k, host_mem_bytes)


def check_training_options(dtype: str, accumulate: int, clip_grad_norm: float | None) -> None:
    """The training options (dtype, accumulate, clip_grad_norm) a schedule can ask for."""
    if dtype == "fp16":
        raise KarmaError("fp16 (--dtype fp16) is not supported: it needs a loss scaler, whose "
                         "skipped steps no plan can predict, and bf16 has fp32's range without "
                         "one; use --dtype bf16")
    if dtype not in DTYPES:
        raise KarmaError(f"dtype {dtype!r} (--dtype) is not a training dtype; use fp32, or bf16 "
                         "for mixed precision")
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise KarmaError(f"accumulate {accumulate!r} (--accumulate) must be a whole number of "
                         "micro-batches per optimizer step, 1 or more (1: no accumulation)")
    if clip_grad_norm is not None and (isinstance(clip_grad_norm, bool) or not isinstance(
            clip_grad_norm, (int, float)) or not math.isfinite(clip_grad_norm)
            or clip_grad_norm <= 0):
        raise KarmaError(f"clip_grad_norm {clip_grad_norm!r} (--clip-grad-norm) must be a "
                         "positive number, the largest global gradient norm (e.g. 1.0); leave "
                         "it out for no clipping")


def _note_to_stderr(note: str) -> None:
    print(f"karma: note: {note}", file=sys.stderr)
