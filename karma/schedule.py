"""The schedule: the one contract between the planner and the runtime.

A schedule is the ordered list of operations of one *replay*, each on a stream, with its
dependencies, plus the buffers those operations fill and free, each block's
decisions, the predicted figures, the hardware profile, the training configuration, the
fingerprints of the model file, of the model it builds and of its IR, and the karma-plan
command that planned it. It is written as YAML (`dump_schedule`) and read
back with validation (`load_schedule`, in schedule_load.py). Both the planner and the runtime
import this module; it imports neither.

Times: a *step* is one optimizer update; with gradient accumulation (config.accumulate N) it
replays the op list once per micro-batch, N replays, and the update's ops run in the last one
(see [Note: the training options' contract]). Its predicted time is `predicted.step_s`.

Streams: `compute` (forward, backward, recompute, loss, device optimizer step), `h2d`
(host-to-device copies: swap-in, weight fetch, weight upload), `d2h` (device-to-host copies:
swap-out, gradients to the host), `net` (all-reduce, reduce-scatter, and with sharded host
state the all-gather of the stepped shards), `host` (host optimizer step): STREAM_OF_KIND.

Host state (config.host_state): `replicated`, every rank keeps the fp32 master weights,
gradients and optimizer state of every host-stepped block; `sharded`, on several ranks each
keeps 1/N of them (dim 0 of each parameter cut in N equal parts, the last ones padded): a
host-stepped block's gradients are reduce-scattered (all-reduced with clipping, whose norms
need each gradient whole), each rank steps its shard, and an all-gather (on the net stream,
after the host step, outside the stage barrier) writes the stepped shards into the whole
weights the blocks upload or fetch from, one copy per node.

Stages: a replay is cut into stages (a prologue, one per block's forward, one per
block's backward, an epilogue and an update stage). An operation on `compute`, `h2d`, `d2h` or
`net` starts only when every operation of the earlier stages on those streams has finished;
within a stage each stream runs its operations back to back. `host` operations and the
weight uploads of the update stage follow their own dependencies.
"""

from __future__ import annotations

import hashlib
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from karma.errors import KarmaError
from karma.units import format_bytes, format_number, format_seconds
from karma.yamltext import (
    flow_list,
    flow_map,
    round_digits,
    with_comment,
    wrapped_list,
    yaml_float,
    yaml_int,
    yaml_str,
    yaml_value,
)

SCHEDULE_VERSION = 2
# versions this karma reads; an older one is brought up to date as it loads (schedule_load.py)
READABLE_VERSIONS = (1, 2)

STREAMS = ("compute", "h2d", "d2h", "net", "host")
BARRIER_STREAMS = ("compute", "h2d", "d2h", "net")
# on a barrier stream but no barrier: an all-gather waits for its host step, which the end
# of a stage must not wait for; it takes its turn on the network's stream all the same
UNBARRIERED_KINDS = ("all_gather",)


def is_barrier(stream: str, kind: str) -> bool:
    """Whether an op of `kind` on `stream` ends with its stage (the module docstring)."""
    return stream in BARRIER_STREAMS and kind not in UNBARRIERED_KINDS


# Every op kind and the stream it runs on: the engine runs compute kinds on the compute
# thread and sends the others to their stream's worker by op.stream; the checker holds
# every op to its kind's stream.
STREAM_OF_KIND = {
    "forward": "compute",  # run a block's forward (saving, swapping or dropping its activations)
    "loss": "compute",  # loss_fn(output, targets), then the start of backward
    "recompute": "compute",  # run a block's forward again to rebuild its activations
    "backward": "compute",  # a block's backward
    # copy a block's saved activations (a selective block's kept outputs) to the host; frees
    # them on the device
    "swap_out": "d2h",
    "swap_in": "h2d",  # copy them back before the block's backward (its recompute)
    "fetch": "h2d",  # copy a block's weights from the host into device buffers
    "grads_to_host": "d2h",  # copy a block's gradients to the host; frees them on the device
    "allreduce": "net",  # average a block's gradients over ranks
    "reduce_scatter": "net",  # average them, each rank keeping its shard (sharded host state)
    "device_step": "compute",  # optimizer step of a block's parameters on the device
    "host_step": "host",  # optimizer step of a block's parameters on the host
    "all_gather": "net",  # gather the stepped shards into the block's whole weights (sharded)
    "upload": "h2d",  # copy a block's updated weights back to their device buffers
}
OP_KINDS = tuple(STREAM_OF_KIND)

# [Note: the training options' contract] With gradient accumulation (config.accumulate N)
# the op list is replayed once per micro-batch and the ops of LAST_MICRO_BATCH_KINDS run only
# in the last replay of an optimizer step (the others skip them). With clipping
# (config.clip_grad_norm) every optimizer step comes after every op that makes a gradient
# final, and the ops of DEFERRED_KINDS may run on into the next step, each block's
# before that block's weights are next used.
LAST_MICRO_BATCH_KINDS = ("allreduce", "reduce_scatter", "device_step", "host_step",
                          "all_gather", "upload")
DEFERRED_KINDS = ("host_step", "all_gather", "upload")
# after which a block's gradients are final
GRAD_KINDS = ("backward", "allreduce", "reduce_scatter", "grads_to_host")
EXCHANGE_KINDS = ("allreduce", "reduce_scatter")  # a block's gradients averaged over ranks
OPTIMIZER_STEP_KINDS = ("device_step", "host_step")

# a block's decisions (BlockEntry.act, .weights, .optim)
ACT_CHOICES = ("keep", "swap", "recompute", "selective")
# selective: what the ops of BlockEntry.policy return is kept, the rest recomputed
# (karma/selective_policy.py, [Note: selective recompute])
RECOMPUTE_ACTS = ("recompute", "selective")  # the acts whose backward a recompute precedes
# where what a selective block keeps waits for its backward (BlockEntry.kept): on the device,
# or swapped out to the host after its forward and back before its recompute
KEPT_CHOICES = ("device", "host")
WEIGHT_CHOICES = ("resident", "streamed")
OPTIM_CHOICES = ("device", "host")
DTYPES = ("fp32", "bf16")  # config.dtype: fp32, or bf16 mixed precision
STATUSES = ("optimal", "time-limit", "heuristic", "fallback")
HOST_STATES = ("replicated", "sharded")
# the kernel of host-stepped blocks' optimizers (runtime/params/host_optimizer.py, [Note: the
# host optimizer's kernel]): torch's fused CPU kernel where it is the same optimizer, or the
# model file's optimizer as given
HOST_OPTIMIZERS = ("fused", "as-given")
CALIBRATIONS = ("measured",)  # predicted.calibration; left out: the roofline estimate


def is_sharded(host_state: str, world_size: int) -> bool:
    """Whether host-stepped blocks keep 1/N of their host state on each rank (the module
    docstring): host state sharded, on more than one rank."""
    return host_state == "sharded" and world_size > 1


# --- buffer names ---------------------------------------------------------------------------
# A buffer is named KIND.BLOCK[@WHERE]: act.3 (block 3's saved activations), act.3@in (swapped
# in), act.3@re (recomputed), ckpt.3 (a recompute block's input), sac.3 (what a selective
# block keeps: its policy's outputs; sac.3@in, swapped back in), grad.3, opt.3 (device
# optimizer state), steptmp.3 and hoststep.3 (an optimizer step's temporaries), artmp.3 (an
# all-reduce's flat buffer), w.3 (resident weights) and the fetched weights below; `process`
# (PROCESS_BUFFER). Only the weight buffers are read back: a fetch fills the one its `uses`
# names, and the runtime finds the parameters behind it by its name.

FETCH_PHASES = ("fwd", "bwd")  # which of the user's passes a fetch of weights is for
# a host optimizer step's temporaries in private memory (CPU backend): hoststep.BLOCK
HOST_TEMP_PREFIX = "hoststep."
_WEIGHTS = re.compile(r"w\.(\d+)@([fb])(\d*)$")
_RESIDENT = re.compile(r"w\.(\d+)$")


@dataclass(frozen=True)
class WeightBuffer:
    """Fetched weights: `owner`'s weights in device buffers for `user`'s forward (phase
    "fwd", kept through the backward for the last block) or its backward ("bwd")."""

    owner: int
    phase: str  # one of FETCH_PHASES
    user: int

    @property
    def name(self) -> str:
        """w.OWNER@fUSER or w.OWNER@bUSER, USER left out when it is the owner: "w.3@f",
        "w.0@b5" (block 5's backward reads block 0's weights: tied)."""
        user = "" if self.user == self.owner else str(self.user)
        return f"w.{self.owner}@{self.phase[0]}{user}"

    @classmethod
    def parse(cls, name: str) -> WeightBuffer | None:
        """The fetched weights `name` holds; None for any other buffer."""
        m = _WEIGHTS.match(name)
        if m is None:
            return None
        owner = int(m[1])
        return cls(owner, "fwd" if m[2] == "f" else "bwd", int(m[3]) if m[3] else owner)


def resident_weights(block: int) -> str:
    """The buffer of a block's resident weights on the device: "w.3"."""
    return f"w.{block}"


def resident_owner(name: str) -> int | None:
    """The block whose resident weights buffer `name` is ("w.3": 3); None for any other."""
    m = _RESIDENT.match(name)
    return int(m[1]) if m else None


@dataclass(frozen=True)
class Op:
    """One operation of the replay."""

    id: int  # index in the schedule's op list (the list is in issue order)
    kind: str  # one of OP_KINDS
    block: int  # the block it acts for
    stage: int
    stream: str  # one of STREAMS
    dur_s: float  # predicted duration
    bytes: int  # bytes moved (copies) or 0
    deps: tuple[int, ...]  # ops that must finish before this one starts (earlier ids)
    uses: tuple[str, ...] = ()  # buffers that must be resident when it starts


# The CPU backend's process outside its tensors while it trains (thread pools, small tensors,
# Python objects), measured when the blocks were timed and planned alive all step
# (karma/calibrate/in_context.py, [Note: the process's own memory])
PROCESS_BUFFER = "process"


@dataclass(frozen=True)
class Buffer:
    """Device memory that an operation allocates and a later one frees."""

    name: str  # e.g. "act.3", "w.3@f", "grad.3"; PROCESS_BUFFER (see buffer names above)
    block: int
    bytes: int
    alloc: int | None  # op whose start allocates it; None: allocated before the replay
    free: int | None  # op whose end frees it; None: it outlives the replay


# the model file protocol's functions, by their names in a model file (karma/modelfile.py)
MODEL_FUNCTIONS = ("build_model", "example_batch", "loss_fn", "make_optimizer",
                   "make_scheduler", "batches", "eval_batches")


@dataclass(frozen=True)
class ModelRef:
    """Which model the schedule was planned for, and how."""

    path: str  # the model file as given to karma-plan (relative paths stay relative)
    sha256: str  # fingerprint of the model file's bytes
    ir_sha256: str  # fingerprint of the block graph's JSON
    env: tuple[tuple[str, str], ...]  # KARMA_* environment variables the model file read
    # fingerprint of the model the file builds (karma/fingerprint.py): a file whose bytes
    # differ but whose model does not still runs the schedule. None (the key left out): not
    # recorded; the bytes must match
    graph_sha256: str | None = None
    # the karma-plan command that planned it, without -o (PlanOptions.plan_command); None
    # (the key left out): not recorded, or a model object (planned with karma.plan)
    plan_command: str | None = None
    # a model object's functions by where they import from (karma/model_object.py: their
    # names in `path`, or "module:name"; "": not importable again); None (the key left out):
    # a model file
    entry: tuple[tuple[str, str], ...] | None = None

    @classmethod
    def now(cls, path: str, sha256: str, ir_json: str,
            env: tuple[tuple[str, str], ...] | None = None, *, graph_sha256: str | None = None,
            plan_command: str | None = None,
            entry: tuple[tuple[str, str], ...] | None = None) -> ModelRef:
        """The reference a plan made in this process records: the model file, its hash, its
        block graph's JSON hashed, the KARMA_* environment the model file was loaded with
        (`env`; default: now, model_env), the fingerprint of the model it builds
        (karma/fingerprint.py, model_ref), the command that planned it and a model
        object's entry."""
        return cls(path, sha256, hashlib.sha256(ir_json.encode()).hexdigest(),
                   model_env() if env is None else env, graph_sha256, plan_command, entry)

    def replan_command(self, schedule_path: str | Path | None) -> str:
        """The command that plans the schedule again into `schedule_path` (None:
        SCHEDULE.yaml): the karma-plan command it records (where none is, the model's path
        and "..."), after the KARMA_* environment it was planned under. A model object's:
        karma.plan and save."""
        out = "SCHEDULE.yaml" if schedule_path is None else str(schedule_path)
        if self.entry is not None:
            return f"karma.plan(karma.model(...), ...).save({out!r})"
        out = shlex.quote(out)
        env = [f"{key}={shlex.quote(value)}" for key, value in self.env]
        command = self.plan_command or f"karma-plan {shlex.quote(self.path)} ..."
        return " ".join([*env, command, "-o", out])


# karma's own settings, read by the runtime where it runs: not the model's, so not recorded
# with it (a schedule planned under KARMA_TIER_DIR=/tmp must not put every run's tier there)
KARMA_SETTINGS = ("KARMA_CHAOS", "KARMA_CPU_CACHE", "KARMA_TIER_DIR", "KARMA_CALIBRATING")


def model_env() -> tuple[tuple[str, str], ...]:
    """The KARMA_* environment variables now, karma's own settings left out: what a model
    file may read (KARMA_GPT=medium), recorded in the schedule and set again by karma-run."""
    import os

    return tuple(sorted((k, v) for k, v in os.environ.items()
                        if k.startswith("KARMA_") and k not in KARMA_SETTINGS))


@dataclass(frozen=True)
class TrainConfig:
    """How training runs."""

    batch_size: int  # samples per step and rank
    dtype: str  # fp32 | bf16
    world_size: int
    seed: int
    capacity_bytes: int  # device memory budget (--gpu-mem)
    accumulate: int = 1  # micro-batches per optimizer step (--accumulate)
    clip_grad_norm: float | None = None  # max global gradient norm (--clip-grad-norm)
    host_state: str = "replicated"  # replicated | sharded (the module docstring)
    nproc_per_node: int = 1  # ranks per node (--nproc-per-node): they share its host memory
    host_optimizer: str = "fused"  # HOST_OPTIMIZERS (--host-optimizer)

    @property
    def sharded(self) -> bool:
        """Whether host-stepped blocks keep sharded host state (is_sharded)."""
        return is_sharded(self.host_state, self.world_size)

    def training_text(self) -> str:
        """'bf16 mixed precision, 4 micro-batches per step, clip at norm 1' and the like."""
        parts = ["bf16 mixed precision" if self.dtype == "bf16" else self.dtype]
        if self.accumulate > 1:
            parts.append(f"{self.accumulate} micro-batches per step")
        if self.clip_grad_norm is not None:
            parts.append(f"clip at norm {self.clip_grad_norm:g}")
        if self.host_optimizer == "as-given":
            parts.append("host steps with the optimizer as given")
        return ", ".join(parts)


@dataclass(frozen=True)
class Predicted:
    """What the planner's simulator predicts for one optimizer step (its micro-batches)."""

    step_s: float  # one optimizer step as the runtime runs it
    lower_bound_s: float  # the stream bound: max over streams of their busy time
    peak_device_bytes: int  # simulated peak of allocated buffers
    stage_peak_bytes: int  # the planner's bound: the largest sum of buffers live in a stage
    host_bytes: int  # per rank: its own, and its share of what the node's ranks share
    pinned_bytes: int  # per rank, likewise
    busy_s: tuple[tuple[str, float], ...]  # (stream, seconds busy)
    scaling_efficiency: float  # one rank's step time over this one's (1.0 on one rank)
    # the ideal: the same training with unlimited device memory (keep_all: nothing moved,
    # recomputed or offloaded); step_s / ideal_s is the price of the budget. None: not
    # recorded (the key is optional).
    ideal_s: float | None = None
    # "measured": the block times were measured on the planning machine (karma/calibrate);
    # None (the key left out): the roofline estimate
    calibration: str | None = None
    # per node: what its nproc_per_node ranks hold together (None: not recorded; optional)
    node_host_bytes: int | None = None
    node_pinned_bytes: int | None = None

    @property
    def price_of_budget(self) -> float | None:
        return self.step_s / self.ideal_s if self.ideal_s else None


@dataclass(frozen=True)
class BlockEntry:
    """One block: what it is (from the IR) and what the plan does with it."""

    index: int
    name: str
    modules: tuple[str, ...]
    params: tuple[str, ...]  # parameters it owns
    shared_params: tuple[str, ...]  # parameters it uses that an earlier block owns
    act: str  # keep | swap | recompute | selective
    weights: str  # resident | streamed
    optim: str  # device | host
    param_bytes: int
    act_bytes: int
    policy: str = ""  # a selective block's policy (karma/selective_policy.py); "" otherwise
    kept: str = "device"  # a selective block's: where what it keeps waits (KEPT_CHOICES)
    # recomputed with the next block, in one checkpoint over both ([Note: a checkpoint over
    # two blocks])
    with_next: bool = False


# [Note: a checkpoint over two blocks] A recompute or selective block with `with_next` runs
# its forward and the next block's under one non-reentrant checkpoint: what it returns to
# the next block is not held from the next block's forward to its backward (as a block's
# input is when that block recomputes alone); both blocks run again, this one first, just
# before the next block's backward, where the next block's input is made once more. So its
# recompute moves one stage earlier and its outputs leave the device one stage after its
# forward, for no extra compute. The next block must recompute too (its act recompute or
# selective) and take no tensor from an earlier block but this one; each is one call of its
# module (nothing of its caller's runs between them), this one's weights resident, what a
# selective one keeps on the device; two blocks a checkpoint at most (the next block has
# no with_next). The runtime
# (karma/runtime/replay/pair.py) and the planner (karma/planner/pairs.py, lowering.py) follow it.


@dataclass(frozen=True)
class Schedule:
    """A complete schedule: load it with load_schedule, write it with dump_schedule."""

    model: ModelRef
    config: TrainConfig
    hardware: tuple[tuple[str, object], ...]  # the hardware profile's fields, plain values
    strategy: str
    status: str  # optimal | time-limit | heuristic | fallback
    solve_s: float
    predicted: Predicted
    blocks: tuple[BlockEntry, ...]
    ops: tuple[Op, ...]
    buffers: tuple[Buffer, ...]
    version: int = SCHEDULE_VERSION

    @property
    def process_bytes(self) -> int:
        """What the plan counts for the process outside its tensors (0: nothing measured)."""
        return sum(b.bytes for b in self.buffers if b.name == PROCESS_BUFFER)

    def save(self, path: str | Path) -> None:
        """Write the schedule's YAML to `path` atomically (load it with load_schedule)."""
        from karma.fileio import write_text_atomic

        write_text_atomic(path, dump_schedule(self))


class ScheduleFileError(KarmaError):
    """A schedule that cannot be read: a missing file, broken YAML, or an invalid schedule."""


# --- writing -------------------------------------------------------------------------------

_HEADER = (
    "# karma schedule: the operations of one training step, planned by karma-plan and",
    "# replayed by karma-run. Check and summarize it with `karma-inspect FILE` (add --plot",
    "# FILE.png for its memory timeline and streams). Fields: karma/schedule.py. Bytes are",
    "# whole bytes, times seconds.",
)
_COMMENT_COLUMN = 40
_SECONDS_DIGITS = 6  # significant digits of every time in the file


def dump_schedule(s: Schedule) -> str:
    """`s` as YAML: the version key first, a fixed key order, one line per op and buffer.

    The text is the same for the same schedule on every run and machine. Times are rounded
    to 6 significant digits (hardware numbers are written exactly), so `load_schedule` of the
    text equals `s` when its times are already rounded; load(dump(load(dump(s)))) always
    equals load(dump(s)).
    """
    return "\n".join([*_HEADER, f"karma_schedule: {yaml_int(s.version)}", *_plan_lines(s),
                      *_block_lines(s.blocks), *_op_lines(s.ops),
                      *_buffer_lines(s.buffers)]) + "\n"


def _plan_lines(s: Schedule) -> list[str]:
    """The model, the config, the hardware, the strategy and what it predicts."""
    m, c, p = s.model, s.config, s.predicted
    lines = ["model:"]
    lines += _scalar_lines([("path", m.path), ("sha256", m.sha256), ("ir_sha256", m.ir_sha256)])
    if m.graph_sha256 is not None:
        lines += _scalar_lines([("graph_sha256", m.graph_sha256)])
    lines.append(f"  env: {flow_map(m.env, None)}")
    if m.plan_command is not None:
        lines += _scalar_lines([("plan_command", m.plan_command)])
    if m.entry is not None:
        lines.append(f"  entry: {flow_map(m.entry, None)}")
    lines.append("config:")
    lines += _scalar_lines([("batch_size", c.batch_size), ("dtype", c.dtype),
                            ("world_size", c.world_size), ("seed", c.seed),
                            ("capacity_bytes", c.capacity_bytes),
                            ("accumulate", c.accumulate),
                            ("clip_grad_norm", c.clip_grad_norm),
                            ("host_state", c.host_state),
                            ("nproc_per_node", c.nproc_per_node),
                            ("host_optimizer", c.host_optimizer)], digits=None)
    lines.append("hardware:" + ("" if s.hardware else " {}"))
    lines += _scalar_lines(s.hardware, digits=None)
    lines += _scalar_lines([("strategy", s.strategy), ("status", s.status),
                            ("solve_s", s.solve_s)], indent="")
    lines.append("predicted:")
    lines += _scalar_lines([("step_s", p.step_s), ("lower_bound_s", p.lower_bound_s),
                            ("peak_device_bytes", p.peak_device_bytes),
                            ("stage_peak_bytes", p.stage_peak_bytes),
                            ("host_bytes", p.host_bytes), ("pinned_bytes", p.pinned_bytes)])
    lines.append(f"  busy_s: {flow_map(p.busy_s, _SECONDS_DIGITS)}")
    lines += _scalar_lines([("scaling_efficiency", p.scaling_efficiency),
                            ("ideal_s", p.ideal_s)])
    if p.calibration is not None:
        lines += _scalar_lines([("calibration", p.calibration)])
    if p.node_host_bytes is not None:
        lines += _scalar_lines([("node_host_bytes", p.node_host_bytes),
                                ("node_pinned_bytes", p.node_pinned_bytes)])
    return lines


def _section(key: str, entries: tuple, comment: str) -> list[str]:
    """A list's comment line and its key (`key: []` when it is empty)."""
    return [f"# {key}: {comment}", f"{key}:" + ("" if entries else " []")]


def _block_lines(blocks: tuple[BlockEntry, ...]) -> list[str]:
    lines = _section("blocks", blocks, "each block's decisions (act: keep | swap | recompute | "
                     "selective, with its policy and, if not on the device, where it keeps the "
                     "policy's outputs: kept: host; with_next: true where it recomputes in one "
                     "checkpoint with the next block; weights: resident | streamed; optim: "
                     "device | host)")
    for b in blocks:
        policy = f"policy: {yaml_str(b.policy)}, " if b.policy else ""
        if b.kept != "device":
            policy += f"kept: {yaml_str(b.kept)}, "
        if b.with_next:
            policy += "with_next: true, "
        lines.append(f"  - {{index: {yaml_int(b.index)}, name: {yaml_str(b.name)}, "
                     f"act: {yaml_str(b.act)}, {policy}weights: {yaml_str(b.weights)}, "
                     f"optim: {yaml_str(b.optim)}, param_bytes: {yaml_int(b.param_bytes)}, "
                     f"act_bytes: {yaml_int(b.act_bytes)},")
        lines += wrapped_list("     modules: ", b.modules, ",")
        lines += wrapped_list("     params: ", b.params, ",")
        lines += wrapped_list("     shared_params: ", b.shared_params, "}")
    return lines


def _op_lines(ops: tuple[Op, ...]) -> list[str]:
    lines = _section("ops", ops, "in issue order; an op starts when its stream is free and "
                     "its deps have finished")
    for o in ops:
        lines.append(f"  - {{id: {yaml_int(o.id)}, kind: {yaml_str(o.kind)}, "
                     f"block: {yaml_int(o.block)}, stage: {yaml_int(o.stage)}, "
                     f"stream: {yaml_str(o.stream)}, "
                     f"dur_s: {yaml_float(o.dur_s, _SECONDS_DIGITS)}, "
                     f"bytes: {yaml_int(o.bytes)}, deps: {flow_list(o.deps)}, "
                     f"uses: {flow_list(o.uses)}}}")
    return lines


def _buffer_lines(buffers: tuple[Buffer, ...]) -> list[str]:
    lines = _section("buffers", buffers, "device memory allocated when op `alloc` starts "
                     "(null: before the replay) and freed when op `free` ends (null: never)")
    for b in buffers:
        lines.append(f"  - {{name: {yaml_str(b.name)}, block: {yaml_int(b.block)}, "
                     f"bytes: {yaml_int(b.bytes)}, alloc: {yaml_value(b.alloc, None)}, "
                     f"free: {yaml_value(b.free, None)}}}")
    return lines


def round_seconds(x: float) -> float:
    """`x` as the schedule file holds it: 6 significant digits.

    The planner can round op durations with it before simulating, so that a file's
    predicted figures match a re-simulation of its ops (karma-inspect checks that) up to the
    rounding of the figures alone.
    """
    return round_digits(x, _SECONDS_DIGITS)


def schedule_sha256(s: Schedule) -> str:
    """Fingerprint of the schedule's YAML text: ranks compare it before training together."""
    return hashlib.sha256(dump_schedule(s).encode("utf-8")).hexdigest()


def _scalar_lines(pairs, digits: int | None = _SECONDS_DIGITS, indent: str = "  ") -> list[str]:
    """`key: value` lines, with the value in readable units as a comment where it helps."""
    return [with_comment(f"{indent}{yaml_str(key)}: {yaml_value(value, digits)}",
                         _unit_comment(key, value), _COMMENT_COLUMN)
            for key, value in pairs]


def _unit_comment(key: str, value: object) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if key.endswith("_bytes") and isinstance(value, int):
        return format_bytes(value)
    if key.endswith("_bytes_per_s"):
        return f"{format_number(value / 1e9)} GB/s"
    if key.endswith("_s"):
        return format_seconds(value)
    return None
