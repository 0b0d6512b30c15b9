"""Reading a schedule: YAML text or a file, each field checked, then every invariant.

    schedule = load_schedule("schedule.yaml")    # or a Path, or the YAML text itself

The types and the writer are karma/schedule.py's; the semantic checks (each block's
operations match its decisions, the memory bound holds stage by stage, ...) are
karma/schedule_check.py's. Every failure is one ScheduleFileError that names the key, op or
block and the fix.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import yaml

from karma.schedule import (
    ACT_CHOICES,
    CALIBRATIONS,
    DTYPES,
    HOST_OPTIMIZERS,
    HOST_STATES,
    KEPT_CHOICES,
    MODEL_FUNCTIONS,
    OP_KINDS,
    OPTIM_CHOICES,
    READABLE_VERSIONS,
    SCHEDULE_VERSION,
    STATUSES,
    STREAMS,
    WEIGHT_CHOICES,
    BlockEntry,
    Buffer,
    ModelRef,
    Op,
    Predicted,
    Schedule,
    ScheduleFileError,
    TrainConfig,
)
from karma.schedule_check import validate
from karma.selective_policy import parse_policy
from karma.yamltext import yaml_value

_FIX = "re-plan with karma-plan to write a valid schedule"


def load_schedule(text_or_path: str | Path, source: str | None = None) -> Schedule:
    """Read and validate a schedule from a file (a Path, or a str ending in .yaml or .yml
    without a newline) or from YAML text. `source` names it in errors (default: the path,
    or "schedule"). Raises ScheduleFileError naming the key and the fix, or the op or block
    and the rule it breaks (karma/schedule_check.py: every invariant the runtime relies on).
    """
    if isinstance(text_or_path, Path) or (
            isinstance(text_or_path, str) and "\n" not in text_or_path
            and text_or_path.endswith((".yaml", ".yml"))):
        path = Path(text_or_path)
        source = source or str(text_or_path)
        text = _read(path)
    elif isinstance(text_or_path, str):
        text, source = text_or_path, source or "schedule"
    else:
        raise TypeError(f"load_schedule takes YAML text or a path, not "
                        f"{type(text_or_path).__name__}")
    data = _parse(text, source)
    try:
        schedule = _schedule_from(data)
        _check_references(schedule)
    except _Invalid as e:
        raise ScheduleFileError(f"{source}: {e}") from None
    validate(schedule, source)
    return schedule


def _read(path: Path) -> str:
    if not path.exists():
        raise ScheduleFileError(f"schedule file '{path}' does not exist; give the path of a "
                                "schedule written by karma-plan")
    if not path.is_file():
        raise ScheduleFileError(f"schedule file '{path}' is not a file; give the path of a "
                                "schedule written by karma-plan")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ScheduleFileError(f"schedule file '{path}' is not text ({e}); give the path of a "
                                "schedule written by karma-plan") from e
    except OSError as e:
        raise ScheduleFileError(f"cannot read schedule file '{path}': {e}") from e


class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """yaml.safe_load that rejects a key given twice (PyYAML would keep the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                if key_node.value in seen:
                    raise yaml.constructor.ConstructorError(
                        "while reading a mapping", node.start_mark,
                        f"key {key_node.value!r} is given twice", key_node.start_mark)
                seen.add(key_node.value)
        return super().construct_mapping(node, deep)


def _parse(text: str, source: str) -> dict:
    try:
        data = yaml.load(text, Loader=_Loader)  # noqa: S506 - a safe loader
    except yaml.MarkedYAMLError as e:
        problem = (e.problem or str(e)).strip().splitlines()[0]
        where = f" (line {e.problem_mark.line + 1})" if e.problem_mark is not None else ""
        raise ScheduleFileError(f"{source} is not valid YAML: {problem}{where}; {_FIX}") from None
    except yaml.YAMLError as e:
        problem = str(e).strip().splitlines()[0]
        raise ScheduleFileError(f"{source} is not valid YAML: {problem}; {_FIX}") from None
    if not isinstance(data, dict):
        hint = (" (to read a file, pass a pathlib.Path or a name ending in .yaml)"
                if isinstance(data, str) and "\n" not in text.strip() else "")
        raise ScheduleFileError(
            f"{source}: a schedule is a YAML mapping that starts with "
            f"'karma_schedule: {SCHEDULE_VERSION}', got {_show(data)}{hint}; {_FIX}")
    if "karma_schedule" not in data:
        raise ScheduleFileError(f"{source}: missing key karma_schedule (the version); is this "
                                f"a karma schedule? {_FIX}")
    version = data["karma_schedule"]
    if isinstance(version, bool) or version not in READABLE_VERSIONS:
        raise ScheduleFileError(
            f"{source}: karma_schedule: {_show(version)} is not supported by this karma (reads "
            f"versions {', '.join(map(str, READABLE_VERSIONS))}); re-plan it with this karma's "
            "karma-plan, with the flags it was planned with")
    return _up_to_date(data)


def _up_to_date(data: dict) -> dict:
    """An older schedule's data in this version's keys: version 1 called the predicted time
    of a step `iteration_s`."""
    if data["karma_schedule"] == 1:
        data = {**data, "karma_schedule": SCHEDULE_VERSION}
        predicted = data.get("predicted")
        if isinstance(predicted, dict):
            data["predicted"] = {("step_s" if k == "iteration_s" else k): v
                                 for k, v in predicted.items()}
    return data


class _Invalid(Exception):
    """A check failed; the message starts with the key path and ends with the fix."""


_Check = Callable[[object, str], object]  # (value, key path) -> the value as the dataclass holds it


def _show(v: object) -> str:
    """A value as the YAML file spells it, for messages."""
    if isinstance(v, dict):
        return "a mapping"
    if isinstance(v, list):
        return "a list"
    return yaml_value(v) if v is None or isinstance(v, bool) else repr(v)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _integer(minimum: int = 0, what: str = "a whole number") -> _Check:
    def check(v, path):
        if isinstance(v, bool) or not isinstance(v, int):
            raise _Invalid(f"{path}: {_show(v)} is not {what}; write an integer, e.g. {minimum}")
        if v < minimum:
            raise _Invalid(f"{path}: {v} is below {minimum}; {_FIX}")
        return v
    return check


def _number(v, path) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise _Invalid(f"{path}: {_show(v)} is not a number of seconds (finite, 0 or more), "
                       "e.g. 0.00123")
    return float(v)


def _text(choices: tuple[str, ...] | None = None, what: str = "") -> _Check:
    def check(v, path):
        if not isinstance(v, str):
            raise _Invalid(f"{path}: {_show(v)} is not a string; {_FIX}")
        if choices is not None and v not in choices:
            raise _Invalid(f"{path}: {v!r} is not {what}; use one of {', '.join(choices)}")
        return v
    return check


def _list(item: _Check) -> _Check:
    def check(v, path):
        if not isinstance(v, list):
            raise _Invalid(f"{path}: expected a list, got {_show(v)}; {_FIX}")
        return tuple(item(x, f"{path}[{k}]") for k, x in enumerate(v))
    return check


def _pairs(key: _Check, value: _Check) -> _Check:
    """A mapping, held as a tuple of (key, value) pairs in file order."""
    def check(v, path):
        if not isinstance(v, dict):
            raise _Invalid(f"{path}: expected a mapping, got {_show(v)}; {_FIX}")
        return tuple((key(k, f"{path} key"), value(x, _join(path, str(k)))) for k, x in v.items())
    return check


def _optional_op(v, path):
    return None if v is None else _integer(0, "an op id or null")(v, path)


def _optional_number(v, path) -> float | None:
    return None if v is None else _number(v, path)


def _clip_norm(v, path):
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise _Invalid(f"{path}: {_show(v)} is not a positive number; give the largest global "
                       "gradient norm (e.g. 1.0), or null for no clipping")
    return float(v)


def _flag(what: str) -> _Check:
    def check(v, path):
        if not isinstance(v, bool):
            raise _Invalid(f"{path}: {_show(v)} is not true or false ({what}); {_FIX}")
        return v
    return check


def _policy(v, path) -> str:
    text = _text()(v, path)
    try:
        parse_policy(text)
    except ValueError as e:
        raise _Invalid(f"{path}: {e}") from None
    return text


def _hardware_value(v, path):
    if isinstance(v, dict):
        return {_text()(k, f"{path} key"): _hardware_value(x, _join(path, str(k)))
                for k, x in v.items()}
    if isinstance(v, list):
        return tuple(_hardware_value(x, f"{path}[{k}]") for k, x in enumerate(v))
    if v is not None and not isinstance(v, (str, int, float)):
        raise _Invalid(f"{path}: {_show(v)} is not a plain value; {_FIX}")
    if isinstance(v, float) and not math.isfinite(v):  # which dump_schedule cannot write
        raise _Invalid(f"{path}: {_show(v)} is not a finite number; a hardware profile's "
                       f"rates and sizes are finite, e.g. 1.0e+10; {_FIX}")
    return v


def _record(cls, spec: dict[str, _Check], what: str, optional: tuple[str, ...] = ()) -> _Check:
    """A mapping with the keys of `spec` (those in `optional` may be left out: the
    dataclass's default), checked and turned into `cls`."""
    def check(v, path):
        where = path or "the schedule"
        if not isinstance(v, dict):
            raise _Invalid(f"{where}: {what} is a mapping, got {_show(v)}; {_FIX}")
        for key in spec:
            if key not in v and key not in optional:
                raise _Invalid(f"missing key {_join(path, key)}; {_FIX}")
        unknown = [k for k in v if k not in spec]
        if unknown:
            s = "s" if len(unknown) > 1 else ""
            raise _Invalid(f"{where}: unknown key{s} {', '.join(map(repr, unknown))}; {what} "
                           f"has the keys {', '.join(spec)}")
        return cls(**{key: check_value(v[key], _join(path, key))
                      for key, check_value in spec.items() if key in v})
    return check


_COUNT = _integer(0)
_NAMES = _list(_text())
_OP = _record(Op, {
    "id": _COUNT, "kind": _text(OP_KINDS, "an op kind"), "block": _COUNT, "stage": _COUNT,
    "stream": _text(STREAMS, "a stream"), "dur_s": _number, "bytes": _COUNT,
    "deps": _list(_COUNT), "uses": _NAMES,
}, "an op")
_BUFFER = _record(Buffer, {
    "name": _text(), "block": _COUNT, "bytes": _COUNT, "alloc": _optional_op,
    "free": _optional_op,
}, "a buffer")
_BLOCK = _record(BlockEntry, {
    "index": _COUNT, "name": _text(), "act": _text(ACT_CHOICES, "an act choice"),
    "weights": _text(WEIGHT_CHOICES, "a weights choice"),
    "optim": _text(OPTIM_CHOICES, "an optim choice"), "param_bytes": _COUNT,
    "act_bytes": _COUNT, "modules": _NAMES, "params": _NAMES, "shared_params": _NAMES,
    "policy": _policy, "kept": _text(KEPT_CHOICES, "where a selective block's kept outputs wait"),
    "with_next": _flag("whether the block recomputes with the next one"),
}, "a block", optional=("policy", "kept", "with_next"))
_SCHEDULE = _record(lambda karma_schedule, **fields: Schedule(version=karma_schedule, **fields), {
    "karma_schedule": _COUNT,
    "model": _record(ModelRef, {
        "path": _text(), "sha256": _text(), "ir_sha256": _text(), "graph_sha256": _text(),
        "env": _pairs(_text(), _text()), "plan_command": _text(),
        "entry": _pairs(_text(MODEL_FUNCTIONS, "a model function"), _text()),
    }, "model", optional=("graph_sha256", "plan_command", "entry")),
    "config": _record(TrainConfig, {
        "batch_size": _integer(1), "dtype": _text(DTYPES, "a dtype"),
        "world_size": _integer(1), "seed": _integer(0), "capacity_bytes": _integer(1),
        "accumulate": _integer(1), "clip_grad_norm": _clip_norm,
        "host_state": _text(HOST_STATES, "a host state"), "nproc_per_node": _integer(1),
        "host_optimizer": _text(HOST_OPTIMIZERS, "a host optimizer"),
    }, "config", optional=("accumulate", "clip_grad_norm", "host_state",
                           "nproc_per_node", "host_optimizer")),  # optional keys
    "hardware": _pairs(_text(), _hardware_value),
    "strategy": _text(),
    "status": _text(STATUSES, "a solver status"),
    "solve_s": _number,
    "predicted": _record(Predicted, {
        "step_s": _number, "lower_bound_s": _number, "peak_device_bytes": _COUNT,
        "stage_peak_bytes": _COUNT, "host_bytes": _COUNT, "pinned_bytes": _COUNT,
        "busy_s": _pairs(_text(STREAMS, "a stream"), _number),
        "scaling_efficiency": _number, "ideal_s": _optional_number,
        "calibration": _text(CALIBRATIONS, "a calibration"),
        "node_host_bytes": _COUNT, "node_pinned_bytes": _COUNT,
    }, "predicted", optional=("ideal_s", "calibration", "node_host_bytes",
                              "node_pinned_bytes")),
    "blocks": _list(_BLOCK),
    "ops": _list(_OP),
    "buffers": _list(_BUFFER),
}, "a schedule")


def _schedule_from(data: dict) -> Schedule:
    return _SCHEDULE(data, "")


def _check_references(s: Schedule) -> None:
    """Ids number their lists; every block, op and dependency an entry names exists."""
    n_blocks, n_ops = len(s.blocks), len(s.ops)
    if not s.blocks:
        raise _Invalid(f"blocks: the list is empty; a schedule has at least one block; {_FIX}")

    def block_ref(path: str, b: int) -> None:
        if b >= n_blocks:
            raise _Invalid(f"{path}: {b} is not a block; blocks are numbered 0..{n_blocks - 1}")

    for i, b in enumerate(s.blocks):
        if b.index != i:
            raise _Invalid(f"blocks[{i}].index: {b.index} is not its position in the list ({i}); "
                           "blocks are numbered 0, 1, 2, ... in forward order")
    for i, op in enumerate(s.ops):
        if op.id != i:
            raise _Invalid(f"ops[{i}].id: {op.id} is not its position in the list ({i}); ids "
                           "number the ops 0, 1, 2, ... in issue order")
        block_ref(f"ops[{i}].block", op.block)
        for d in op.deps:
            if d >= i:
                earlier = f"ids 0..{i - 1}" if i else "op 0 has none"
                raise _Invalid(f"ops[{i}].deps: {d} is not an earlier op; an op waits only for "
                               f"ops listed before it ({earlier}): list the op it waits for "
                               "before it, or re-plan with karma-plan")
    seen: dict[str, int] = {}
    for i, b in enumerate(s.buffers):
        if b.name in seen:
            raise _Invalid(f"buffers[{i}].name: {b.name!r} is also buffers[{seen[b.name]}]; "
                           f"buffer names are unique; {_FIX}")
        seen[b.name] = i
        block_ref(f"buffers[{i}].block", b.block)
        for key, ref in (("alloc", b.alloc), ("free", b.free)):
            if ref is not None and ref >= n_ops:
                raise _Invalid(f"buffers[{i}].{key}: {ref} is not an op; use an op id "
                               f"0..{n_ops - 1}, or null (the whole replay)")
