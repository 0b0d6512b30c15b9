"""What to plan for: one frozen `PlanOptions`, made once and checked once.

    options = PlanOptions(gpu_mem="16G", hardware="v100-16g", batch_size=8, world_size=4)
    report = karma.api.plan_report("examples/gpt.py", options)
    PlanOptions(gpu_mem="800M").hardware     # no hardware named: this machine's, e.g. "cpu"

karma-plan makes it from its flags (cli/plan.py), `karma.plan` from its keyword arguments;
every later stage (tracing, calibration, the pipeline, the capacity questions) reads it
whole. A sweep or a batch search varies one field with `dataclasses.replace`, which checks
the new value again. Each field's comment names its karma-plan flag. A bad value is a
KarmaError that names the option, its flag and the fix.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field, fields

from karma.errors import KarmaError
from karma.planner.baselines import BASELINES
from karma.planner.hardware import Hardware, load_hardware
from karma.schedule import DTYPES, HOST_OPTIMIZERS, HOST_STATES
from karma.units import parse_size

STRATEGIES = ("ilp", *BASELINES)
# how the machine and the model's blocks are measured (--remeasure, --no-measure):
# cached: measured where the profile is this machine, once, then read from the cache;
# fresh: measured again, and cached; estimate: the roofline estimate from the profile's rates
MEASURES = ("cached", "fresh", "estimate")
# a batch size searched for (--batch-size max|best, karma.api.choose_batch): the largest that
# fits, or the one of most samples per second
BATCH_CHOICES = ("max", "best")


@dataclass(frozen=True)
class PlanOptions:
    """Everything a plan is asked for, beside the model."""

    gpu_mem: int | str | None = None  # device memory budget (--gpu-mem); bytes, or "16G"
    # a built-in profile, a karma-profile file (--hardware); None: this machine's, chosen once
    # here (_this_machine) and said in `machine_notes`
    hardware: str | Hardware | None = None
    # samples per step and rank (--batch-size); None: the model file's; max or best (one of
    # BATCH_CHOICES): searched, the largest that fits or the one of most samples per second
    batch_size: int | str | None = None
    world_size: int = 1  # ranks (--world-size)
    nproc_per_node: int | None = None  # ranks per node (--nproc-per-node); None: the profile's
    host_mem: int | str | None = None  # the node's host memory (--host-mem); None: the profile's
    host_state: str = "auto"  # auto | sharded | replicated (--host-state)
    dtype: str = "fp32"  # fp32, or bf16 mixed precision (--dtype)
    accumulate: int = 1  # micro-batches per optimizer step (--accumulate)
    clip_grad_norm: float | None = None  # clip gradients to this global norm (--clip-grad-norm)
    strategy: str = "ilp"  # ilp or a baseline (--strategy)
    seed: int = 0  # the training seed the schedule records (--seed)
    time_limit_s: float = 60.0  # the ILP's time limit (--time-limit)
    gap: float = 0.01  # the relative optimality gap at which the ILP stops (--gap)
    blocks: str | None = None  # module paths whose calls are blocks, a regex (--blocks)
    measure: str = "cached"  # one of MEASURES (--remeasure: fresh, --no-measure: estimate)
    # the kernel host-stepped blocks step with, one of HOST_OPTIMIZERS (--host-optimizer):
    # torch's fused CPU kernel where it is the same optimizer, or the model file's as given
    host_optimizer: str = "fused"
    # whether a block may recompute selectively (--no-selective: not; karma/selective_policy.py,
    # [Note: selective recompute])
    selective: bool = True
    # whether two recomputing blocks may recompute under one checkpoint (--no-pairs: not;
    # [Note: a checkpoint over two blocks] in karma/schedule.py)
    pairs: bool = True
    # derived and checked in __post_init__
    profile: Hardware = field(init=False, repr=False, compare=False)  # `hardware`, loaded
    # ranks per node: nproc_per_node, or the profile's default where it is None
    ranks_per_node: int = field(init=False, repr=False)
    # where `hardware` was None: the lines that say which hardware was chosen for this machine
    # (and what of it is a guess), for the caller to print; () where it was given, as it is
    # to a copy that dataclasses.replace makes
    machine_notes: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _set = object.__setattr__
        if self.gpu_mem is not None:
            _set(self, "gpu_mem", _size(self.gpu_mem, "the memory budget", "gpu_mem",
                                        "--gpu-mem", "16G"))
        if self.host_mem is not None:
            _set(self, "host_mem", _size(self.host_mem, "the node's host memory", "host_mem",
                                         "--host-mem", "384G"))
        if self.batch_size is not None and not _whole(self.batch_size) \
                and self.batch_size not in BATCH_CHOICES:
            raise KarmaError(f"batch_size {self.batch_size!r} (--batch-size) must be a whole "
                             "number of samples, 1 or more (e.g. 8), or max or best")
        if self.strategy not in STRATEGIES:
            raise KarmaError(f"strategy {self.strategy!r} (--strategy) is not a strategy; use "
                             f"one of {', '.join(STRATEGIES)}")
        if not _number(self.time_limit_s) or not self.time_limit_s > 0 \
                or not _number(self.gap) or not 0 <= self.gap < 1:
            raise KarmaError(f"the time limit {self.time_limit_s!r} s (--time-limit) must be "
                             f"positive and the gap {self.gap!r} (--gap) in [0, 1), e.g. 60 "
                             "and 0.01")
        if not _whole(self.seed, 0):
            raise KarmaError(f"seed {self.seed!r} (--seed) must be a whole number, 0 or more")
        if self.blocks is not None and not isinstance(self.blocks, str):
            raise KarmaError(f"blocks {self.blocks!r} (--blocks) must be a regular expression "
                             "of module paths, e.g. 'h\\.\\d+'")
        if self.host_state not in ("auto", *HOST_STATES):
            raise KarmaError(f"host_state {self.host_state!r} (--host-state) is not one karma "
                             "knows; use auto, sharded or replicated")
        if self.host_optimizer not in HOST_OPTIMIZERS:
            raise KarmaError(f"host_optimizer {self.host_optimizer!r} (--host-optimizer) is not "
                             f"one karma knows; use {' or '.join(HOST_OPTIMIZERS)}")
        if self.measure not in MEASURES:
            raise KarmaError(f"measure {self.measure!r} is not a way to measure; use one of "
                             f"{', '.join(MEASURES)} (--remeasure: fresh, --no-measure: "
                             "estimate)")
        _check_training(self.dtype, self.accumulate, self.clip_grad_norm)
        _set(self, "machine_notes", ())
        if self.hardware is None:
            hardware, notes = _this_machine()
            _set(self, "hardware", hardware)
            _set(self, "machine_notes", notes)
        profile = self.hardware if isinstance(self.hardware, Hardware) \
            else load_hardware(self.hardware)
        _set(self, "profile", profile)
        _set(self, "ranks_per_node", _ranks_per_node(profile, self.world_size,
                                                     self.nproc_per_node))

    def check_plannable(self) -> None:
        """Raise unless a plan can be made: a budget is given (a block graph needs none, a
        budget sweep gives its own)."""
        if self.gpu_mem is None:
            raise KarmaError("--gpu-mem is required to plan, e.g. --gpu-mem 16G (or use "
                             "--print-ir to see the block graph)")

    def plan_command(self, model: str) -> str:
        """The karma-plan command that plans `model` (the path as given) with these options,
        without -o: --hardware always (its default may change), --gpu-mem and --batch-size
        where given, every other option where it is not its default."""
        flags = {  # each option's flag, in this order; measure, selective, pairs: switches
            "gpu_mem": "--gpu-mem", "batch_size": "--batch-size", "world_size": "--world-size",
            "nproc_per_node": "--nproc-per-node", "host_mem": "--host-mem",
            "host_state": "--host-state", "dtype": "--dtype", "accumulate": "--accumulate",
            "clip_grad_norm": "--clip-grad-norm", "strategy": "--strategy", "seed": "--seed",
            "time_limit_s": "--time-limit", "gap": "--gap", "blocks": "--blocks",
            "measure": None, "host_optimizer": "--host-optimizer", "selective": None,
            "pairs": None}
        defaults = {f.name: f.default for f in fields(PlanOptions)}
        hardware = self.hardware if isinstance(self.hardware, str) else self.hardware.name
        args = ["karma-plan", model, "--hardware", hardware]
        for name, flag in flags.items():
            value = getattr(self, name)
            if value is None or (value == defaults[name] and name not in ("gpu_mem",
                                                                           "batch_size")):
                continue
            if name == "measure":
                args.append("--no-measure" if value == "estimate" else "--remeasure")
            elif name == "selective":
                args.append("--no-selective")
            elif name == "pairs":
                args.append("--no-pairs")
            elif name in ("gpu_mem", "host_mem"):  # exactly, in the largest unit that divides
                unit, power = next((u, k) for u, k in (("T", 4), ("G", 3), ("M", 2), ("K", 1),
                                                       ("", 0)) if value % 1024 ** k == 0)
                args += [flag, f"{value // 1024 ** power}{unit}"]
            else:
                args += [flag, str(value)]
        return " ".join(map(shlex.quote, args))

    @property
    def searches_batch(self) -> bool:
        """Whether the batch is to be searched (max or best)."""
        return self.batch_size in BATCH_CHOICES

    @property
    def capacity_bytes(self) -> int:
        """The budget in bytes."""
        self.check_plannable()
        return self.gpu_mem


def _this_machine() -> tuple[str | Hardware, tuple[str, ...]]:
    """The hardware of this machine (the `cpu` profile without a GPU, else the local GPU's,
    karma/calibrate/machine.py: the one place that asks torch about the device), and the
    lines that say so."""
    from karma.calibrate.machine import this_machine

    machine = this_machine()
    notes = (f"planning for this machine: {machine.chosen}; give --hardware NAME to plan for "
             "another",)
    return machine.hardware, notes + ((machine.guess,) if machine.guess else ())


def _whole(n: object, least: int = 1) -> bool:
    return not isinstance(n, bool) and isinstance(n, int) and n >= least


def _number(x: object) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x)


def _size(value: int | str, what: str, name: str, flag: str, example: str) -> int:
    nbytes = value if _whole(value, 0) else parse_size(str(value), flag)
    if nbytes <= 0:
        raise KarmaError(f"{what} {value!r} ({name}, {flag}) must be more than zero, e.g. "
                         f"{example}")
    return nbytes


def _check_training(dtype: str, accumulate: int, clip_grad_norm: float | None) -> None:
    """The training options (dtype, accumulate, clip_grad_norm) a schedule can ask for."""
    if dtype == "fp16":
        raise KarmaError("fp16 (--dtype fp16) is not supported: it needs a loss scaler, whose "
                         "skipped steps no plan can predict, and bf16 has fp32's range without "
                         "one; use --dtype bf16")
    if dtype not in DTYPES:
        raise KarmaError(f"dtype {dtype!r} (--dtype) is not a training dtype; use fp32, or bf16 "
                         "for mixed precision")
    if not _whole(accumulate):
        raise KarmaError(f"accumulate {accumulate!r} (--accumulate) must be a whole number of "
                         "micro-batches per optimizer step, 1 or more (1: no accumulation)")
    if clip_grad_norm is not None and (isinstance(clip_grad_norm, bool) or not isinstance(
            clip_grad_norm, (int, float)) or not math.isfinite(clip_grad_norm)
            or clip_grad_norm <= 0):
        raise KarmaError(f"clip_grad_norm {clip_grad_norm!r} (--clip-grad-norm) must be a "
                         "positive number, the largest global gradient norm (e.g. 1.0); leave "
                         "it out for no clipping")


def _ranks_per_node(hw: Hardware, world_size: int, nproc_per_node: int | None) -> int:
    """Ranks per node (default the profile's devices_per_node, capped by world_size; on a cpu
    profile every rank, as ranks started on one machine are), checked to divide the ranks
    and fit the node's devices."""
    if not _whole(world_size):
        raise KarmaError(f"world_size {world_size!r} (--world-size) must be a whole number of "
                         "ranks, 1 or more")
    given = nproc_per_node is not None
    k = nproc_per_node if given else world_size if hw.device_kind == "cpu" else min(
        hw.devices_per_node, world_size)
    if not _whole(k):
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
    return k
