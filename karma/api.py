"""karma's planning API: what `karma-plan` does, as functions.

    import karma
    schedule = karma.plan("examples/gpt.py", gpu_mem="16G", hardware="v100-16g", batch_size=8)
    schedule.save("schedule.yaml")           # the YAML karma-run replays
    schedule = karma.load_schedule("schedule.yaml")

    options = PlanOptions(gpu_mem="16G", hardware="v100-16g", world_size=4)
    report = plan_report("examples/gpt.py", options)    # everything karma-plan prints

`karma-plan` makes one `PlanOptions` from its flags and calls these (cli/plan.py,
cli/capacity.py); `plan` makes one from its keyword arguments. The capacity questions
(`sweep`, `choose_batch`) vary one option over many plans.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path

from karma import logs
from karma.batch_search import search_batch
from karma.calibrate import Calibration, FromPlanning, Probe, calibrate
from karma.calibrate.blocks import Timed
from karma.calibrate.in_context import CALIBRATING
from karma.errors import KarmaError
from karma.fingerprint import model_ref, remembering
from karma.ir.build import build_block_graph
from karma.ir.graph import BlockGraph, OptimizerProfile
from karma.ir.optimizer import optimizer_profile
from karma.model_object import MODEL_KEYWORDS, as_model
from karma.modelfile import ModelFile, load_model_file
from karma.planner.fit_contention import fit_side_streams
from karma.planner.hardware import Hardware
from karma.planner.options import BATCH_CHOICES, PlanOptions
from karma.planner.pipeline import PlanReport, make_schedule, probe_schedule
from karma.planner.plan import InfeasiblePlan
from karma.planner.problem import build_problem
from karma.schedule import ModelRef, Schedule

Log = Callable[[str], None]
Model = str | Path | ModelFile  # a model file's path, or karma.model(...)


def plan(model: Model, gpu_mem: str | int = "16G", hardware: str | Hardware | None = None,
         batch_size: int | None = None, *, log: Log | None = None, **options) -> Schedule:
    """Plan training of a model within `gpu_mem` bytes of device memory ("16G" or an int)
    on `hardware` (a built-in profile's name, a karma-profile file, or a Hardware; default:
    this machine).

    `model`: a model file's path, `karma.model(...)`, or an nn.Module (or a function that
    builds one) with karma.model's keyword arguments here: example_batch, loss_fn,
    make_optimizer, make_scheduler, batches, eval_batches (karma/model_object.py). The
    other options are PlanOptions' fields, as karma-plan's flags: world_size, dtype ("fp32",
    or "bf16" for mixed precision), accumulate, clip_grad_norm, nproc_per_node, host_mem,
    host_state, strategy, seed, time_limit_s, gap, blocks, measure ("cached", "fresh" or
    "estimate"), host_optimizer ("fused" or "as-given"), selective (False: no selective
    recompute), pairs (False: no two blocks recomputed under one checkpoint). `log` gets
    notes about the model and about measuring (default: the "karma" logger). Raises
    InfeasiblePlan (with min_capacity_bytes) if nothing fits."""
    functions = {name: options.pop(name) for name in MODEL_KEYWORDS if name in options}
    if functions or not isinstance(model, (str, Path, ModelFile)):
        model = as_model(model, **functions)
    if hardware is not None:
        options["hardware"] = hardware
    chosen = plan_options(gpu_mem=gpu_mem, batch_size=batch_size, **options)
    for note in chosen.machine_notes:  # which hardware "this machine" is
        (log or _note_to_stderr)(note)
    return plan_report(model, chosen, log).schedule


def plan_options(**options) -> PlanOptions:
    """PlanOptions from keyword arguments, an unknown one refused with the known ones."""
    known = [f.name for f in fields(PlanOptions) if f.init]
    unknown = [name for name in options if name not in known]
    if unknown:
        raise KarmaError(f"{', '.join(map(repr, unknown))} is not a planning option; the "
                         f"options are {', '.join(known)}")
    return PlanOptions(**options)


def plan_report(model_file: Model, options: PlanOptions,
                log: Log | None = None) -> PlanReport:
    """`plan`, with everything karma-plan prints: the chosen plan's evaluation and every
    baseline's, and where the block times came from. A batch size of max or best is
    searched first (choose_batch), and the points tried come with the report."""
    searched: list[dict] = []
    if options.searches_batch:
        batch, searched = choose_batch(model_file, options.batch_size, options, log)
        options = replace(options, batch_size=batch)
    prepared = _prepare(model_file, options, log)
    report = _solve(prepared, options)
    return replace(report, batch_search=tuple(sorted(searched, key=lambda p: p["batch_size"])))


@dataclass(frozen=True)
class _Prepared:
    """What every plan of one model at one batch size shares: its block graph, its
    calibration and the model file's optimizer."""

    graph: BlockGraph
    model: ModelRef
    calibration: Calibration
    optimizer: OptimizerProfile


def _prepare(model: Model, options: PlanOptions, log: Log | None) -> _Prepared:
    """The model traced and calibrated for `options`: what its plans are made from."""
    say = log or _note_to_stderr
    options.check_plannable()  # before tracing
    if os.environ.get(CALIBRATING):
        raise KarmaError("the model file plans when it is imported (karma.plan at its top "
                         "level), and calibration imports it in a karma-run of its own; put "
                         "the planning under `if __name__ == \"__main__\":`")
    mf = model if isinstance(model, ModelFile) else load_model_file(model)
    name = str(mf.path) if isinstance(model, ModelFile) else str(model)  # as given
    graph = build_block_graph(mf, options.batch_size, options.blocks,
                              model_name=name, dtype=options.dtype)
    for note in graph.notes:
        say(note)
    optimizer = optimizer_profile(mf)
    command = None if mf.entry is not None else \
        replace(options, batch_size=graph.batch_size).plan_command(name)
    with remembering(mf):  # the model's fingerprint: recorded, and a model object's key
        model = model_ref(name, mf, graph.to_json(), plan_command=command)
        measured = calibration(mf, graph, options, optimizer, say)
    return _Prepared(graph, model, measured, optimizer)


def _solve(prepared: _Prepared, options: PlanOptions) -> PlanReport:
    cal = prepared.calibration
    try:
        report = make_schedule(prepared.graph, prepared.model,
                               replace(options, hardware=cal.hardware), cal.measured,
                               prepared.optimizer)
    except InfeasiblePlan as e:
        e.batch_size = prepared.graph.batch_size  # for the advice of a smaller batch
        raise
    return replace(report, block_times=cal.summary)


SWEEPS = {"gpu-mem": "gpu_mem", "batch-size": "batch_size"}  # the quantity -> its option


def sweep(model_file: Model, quantity: str, values: Sequence[int],
          options: PlanOptions, log: Log | None = None) -> list[dict]:
    """Plan at every value of `quantity` ("gpu-mem": device memory budgets in bytes;
    "batch-size"), the other options as given; one record per point, an infeasible one
    naming the resource that ran out. A budget sweep traces and calibrates once: each point
    is a solve."""
    if quantity not in SWEEPS:
        raise KarmaError(f"--sweep {quantity}=...: karma sweeps {' or '.join(SWEEPS)}")
    if options.searches_batch and quantity != "batch-size":
        raise KarmaError(f"--batch-size {options.batch_size} plans one schedule at the batch "
                         "it finds; give a number of samples to sweep or compare plans")
    points = []
    prepared = None
    for value in values:
        point = replace(options, **{SWEEPS[quantity]: value})
        if prepared is None or quantity != "gpu-mem":
            prepared = _prepare(model_file, point, log)
        points.append(_point(prepared, point))
    return points


MAX_BATCH = 1 << 16  # the search's ceiling


def choose_batch(model_file: Model, how: str, options: PlanOptions,
                 log: Log | None = None) -> tuple[int, list[dict]]:
    """The batch `how` asks for ("max": the largest any plan fits in the budget; "best": the
    one of most predicted samples per second, up to that), and the points searched (sweep's
    records, in the order tried): karma/batch_search.py, each batch planned once. A note
    said at every batch (timing it, say) is said for the first."""
    if how not in BATCH_CHOICES:
        raise KarmaError(f"--batch-size {how!r}: give a number, max or best")
    if options.gpu_mem is None:
        raise KarmaError(f"--batch-size {how} searches the batches that fit a budget: give "
                         "--gpu-mem")
    say = logs.OncePerKind(log or _note_to_stderr)
    tried: dict[int, dict] = {}

    def point(batch: int) -> dict:
        if batch not in tried:
            tried[batch] = sweep(model_file, "batch-size", [batch], options, say)[0]
        return tried[batch]

    if not point(1)["feasible"]:
        raise InfeasiblePlan(f"no batch fits: {point(1)['reason']}",
                             point(1)["min_capacity_bytes"], resource=point(1)["resource"])
    batch = search_batch(how, lambda b: point(b)["feasible"],
                         lambda b: point(b)["samples_per_s"], MAX_BATCH)
    say.finish("batches")
    return batch, list(tried.values())


def _point(prepared: _Prepared, options: PlanOptions) -> dict:
    """One point of a sweep: the plan's figures, or why nothing fits."""
    batch = prepared.graph.batch_size
    samples = batch * options.world_size * options.accumulate
    point = {"hardware": options.profile.name, "gpu_mem_bytes": options.capacity_bytes,
             "batch_size": batch, "world_size": options.world_size,
             "nproc_per_node": options.ranks_per_node}
    try:
        report = _solve(prepared, options)
    except InfeasiblePlan as e:
        return {**point, "feasible": False, "resource": e.resource, "reason": str(e),
                "min_capacity_bytes": e.min_capacity_bytes, "step_s": None,
                "samples_per_s": None, "baselines": {}}
    ev, p = report.chosen, report.schedule.predicted
    return {**point, "feasible": True, "strategy": ev.plan.strategy,
            "step_s": ev.step_s, "samples_per_s": samples / ev.step_s,
            "peak_device_bytes": ev.peak_device_bytes, "host_bytes": p.host_bytes,
            "node_host_bytes": p.node_host_bytes, "scaling_efficiency": p.scaling_efficiency,
            "baselines": {name: b.step_s if b.feasible else None
                          for name, b in report.baselines.items()}}


def calibration(mf: ModelFile, graph: BlockGraph, options: PlanOptions,
                optimizer: OptimizerProfile, log: Log | None = None) -> Calibration:
    """What to plan `graph` with for `options` (karma/calibrate): calibration entered once,
    with what it needs from planning handed in (`optimizer`: the model file's, measured)."""
    roofline = build_problem(graph, options.profile, graph.dtype)

    # the model file by its absolute path: karma-run trains it from another directory
    model = ModelRef.now(str(Path(mf.path).resolve()), mf.sha256, graph.to_json(),
                         entry=mf.entry)

    def unlimited(measured_hw) -> PlanOptions:
        return PlanOptions(gpu_mem=1 << 62, hardware=measured_hw, batch_size=graph.batch_size,
                           dtype=graph.dtype)

    def keep_all(measured_hw) -> Schedule:
        options = replace(unlimited(measured_hw), strategy="keep_all")
        return make_schedule(graph, model, options, optimizer=optimizer).schedule

    def probe(measured_hw, timed: Timed) -> Probe:
        schedule = probe_schedule(graph, model, unlimited(measured_hw), timed.measured,
                                  optimizer)
        return Probe(schedule, functools.partial(fit_side_streams, schedule))

    planning = FromPlanning(tuple(b.fwd_s + b.bwd_s for b in roofline.blocks), keep_all, probe)
    return calibrate(mf, graph, options, planning, log)


def _note_to_stderr(note: str) -> None:
    """A note on the `karma` logger (karma/logs.py: INFO, or WARNING for a measurement that
    failed and was worked around), which the commands print to stderr."""
    logs.note(note)
