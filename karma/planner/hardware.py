"""Hardware profiles: the numbers the planner knows about one machine.

A profile is a frozen dataclass of plain numbers; the planner reads it and never touches CUDA.
Built-in profiles live in `profiles/*.yaml`, with the source of every number in a comment;
`karma-profile -o FILE` measures this machine and writes a file in the same format, which
`load_hardware(FILE)` reads back. Rates are per second and in bytes or FLOPs (1 GB/s = 1e9 B/s);
sizes are whole bytes.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields, replace
from importlib import resources
from pathlib import Path

import yaml

from karma.errors import KarmaError
from karma.schedule import DTYPES  # a profile gives a matmul rate for each, in this order
from karma.units import format_bytes, format_number, format_seconds, parse_size
from karma.yamltext import with_comment, yaml_float, yaml_str

DEVICE_KINDS = ("cuda", "cpu")
FORMAT_VERSION = 1
"""The `version:` key of a profile file; bump it when a field changes meaning."""

_BYTE_FIELDS = ("device_mem_bytes", "host_mem_bytes", "pinned_mem_bytes")
_FLOAT_FIELDS = (
    "mem_bytes_per_s",
    "h2d_bytes_per_s",
    "d2h_bytes_per_s",
    "host_optim_bytes_per_s",
    "net_bytes_per_s",
    "net_latency_s",
)
_FRACTION_FIELDS = (
    "compute_slowdown_copy",
    "copy_slowdown_compute",
    "compute_slowdown_host",
    "host_slowdown_compute",
    "d2h_slowdown_compute",
)
"""Optional keys (older profiles lack them): 0, their default, means independent streams."""
_WAIT_FIELDS = ("side_wait_s",)  # optional too: 0, its default, means no wait
_MAX_WAIT_S = 1.0  # a scheduler's time slice is milliseconds
_OPTIONAL_FIELDS = ("devices_per_node", *_WAIT_FIELDS)  # a profile may leave them out
_MAX_SLOWDOWN = 0.95  # a stream that lost more would never finish in a useful time
_HOW_TO_FIX = "fix it in the profile, or measure this machine with karma-profile -o FILE"


class FlopRates(Mapping[str, float]):
    """Achievable dense matmul rate per dtype, in FLOP/s: read-only {"fp32": ..., "bf16": ...}.

    A Mapping rather than a dict so that a frozen `Hardware` stays immutable and hashable;
    unlike `types.MappingProxyType` it also pickles, deep-copies and survives
    `dataclasses.asdict`.
    """

    __slots__ = ("_rates",)

    def __init__(self, rates: Mapping[str, float]) -> None:
        self._rates = dict(rates)

    def __getitem__(self, dtype: str) -> float:
        try:
            return self._rates[dtype]
        except KeyError:
            raise KeyError(
                f"no matmul rate for dtype {dtype!r}; profiles give one for {', '.join(DTYPES)}"
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._rates)

    def __len__(self) -> int:
        return len(self._rates)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._rates.items())))

    def __repr__(self) -> str:
        return f"FlopRates({self._rates!r})"


@dataclass(frozen=True)
class Hardware:
    """What the planner needs to know about one machine: a node of `devices_per_node` devices
    and the host memory they share (`host_mem_bytes` and `pinned_mem_bytes` are the node's);
    rates are one device's.

    On a "cpu" machine the device is the CPU with its RAM, and the offload tier ("host") is a
    file on local disk mapped with `torch.from_file`: h2d means file tier -> RAM, d2h the reverse.
    """

    name: str
    device_kind: str  # "cuda" or "cpu"
    device_mem_bytes: int  # nominal device memory (for cpu: the RAM budget default)
    flops_per_s: Mapping[str, float]  # achievable dense matmul FLOP/s per dtype (a FlopRates)
    mem_bytes_per_s: float  # device memory bandwidth, bytes read + written per second
    h2d_bytes_per_s: float  # host -> device copy bandwidth (pinned); cpu: file tier -> RAM
    d2h_bytes_per_s: float  # device -> host copy bandwidth (pinned); cpu: RAM -> file tier
    host_mem_bytes: int  # the node's host memory the offload tier may use, all its ranks
    # together (cpu: the file tier's disk space)
    pinned_mem_bytes: int  # the node's pinned host memory the runtime may allocate (<= host)
    # host AdamW throughput, fp32 parameter bytes stepped per second by one process with the
    # node's host to itself; the node's ranks divide it (problem.py, [Note: a node's ranks
    # share its host])
    host_optim_bytes_per_s: float
    net_bytes_per_s: float  # per-rank network bandwidth for all-reduce
    net_latency_s: float  # per-message network latency
    # [Note: contention between streams] On the CPU there is no copy engine: a copy (h2d or
    # d2h) and the host optimizer run on worker threads that take cores from compute. Each
    # field is a fraction of a stream's speed lost while another stream is busy (0: independent
    # streams, as a GPU's copy engines and a GPU's host are); simulate.py runs the streams
    # at the reduced speeds while they overlap (processor sharing). karma-profile measures
    # them on the CPU by timing a matmul alone and beside a copying (or AdamW-stepping)
    # thread, and that copy (step) alone and beside the matmul (calibrate/measure_hw.py,
    # _contention).
    # The model is deliberately small: h2d and d2h busy at once cost compute what one does;
    # where the streams share cores, the busy streams' speeds add up to at most 1, which is
    # how copies and host steps slow each other (simulate.py, [Note: every stream on shared
    # cores conserves work]).
    compute_slowdown_copy: float = 0.0  # compute's speed lost while h2d or d2h copies
    copy_slowdown_compute: float = 0.0  # a copy's speed lost while compute runs
    compute_slowdown_host: float = 0.0  # compute's speed lost while a host step runs
    host_slowdown_compute: float = 0.0  # a host step's speed lost while compute runs
    # Fitted to an out-of-core probe's steps by the calibration (karma/planner/fit_contention.py,
    # [Note: side streams timed in context]), not measured by karma-profile:
    d2h_slowdown_compute: float = 0.0  # a copy to the host's, where it differs (0: as h2d's)
    side_wait_s: float = 0.0  # a side op started beside compute waits this long for a core
    # the devices of one node, which share its host memory (1 where a profile leaves it out, and
    # in a measured machine's). A cpu profile's "devices" are ranks sharing the machine and its
    # cores: any number may run on it, each on its share of the cores.
    devices_per_node: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise KarmaError(
                f"hardware name {self.name!r} must be a non-empty string, e.g. 'a100-80g'"
            )
        if self.device_kind not in DEVICE_KINDS:
            raise KarmaError(
                f"hardware {self.name!r}: device_kind {self.device_kind!r} is not known; "
                f"use 'cuda' or 'cpu'"
            )
        for field_name in _BYTE_FIELDS:
            _check_bytes(self.name, field_name, getattr(self, field_name))
        object.__setattr__(self, "flops_per_s", _checked_flops(self.name, self.flops_per_s))
        for field_name, (ok, what) in _CHECKS.items():
            value = _number(self.name, field_name, getattr(self, field_name), ok, what)
            object.__setattr__(self, field_name, value)
        if isinstance(self.devices_per_node, bool) or not isinstance(self.devices_per_node, int) \
                or self.devices_per_node < 1:
            raise KarmaError(f"hardware {self.name!r}: devices_per_node must be a whole number "
                             f"of at least 1, got {self.devices_per_node!r}; {_HOW_TO_FIX}")
        if self.pinned_mem_bytes > self.host_mem_bytes:
            raise KarmaError(
                f"hardware {self.name!r}: pinned_mem_bytes {self.pinned_mem_bytes} "
                f"({format_bytes(self.pinned_mem_bytes)}) is more than host_mem_bytes "
                f"{self.host_mem_bytes} ({format_bytes(self.host_mem_bytes)}); pinned memory is "
                f"part of host memory, so lower pinned_mem_bytes to at most host_mem_bytes"
            )

    def independent_streams(self) -> Hardware:
        """This machine as if its streams did not share cores (every contention fraction 0),
        as on a GPU, whose copy engines leave its cores alone: to time a plan as the model did
        before contention, or to plan swaps that shared cores would price out."""
        return replace(self, **dict.fromkeys(_FRACTION_FIELDS + _WAIT_FIELDS, 0.0))


def _check_bytes(hw_name: str, field_name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise KarmaError(
            f"hardware {hw_name!r}: {field_name} must be a positive whole number of bytes, "
            f"got {value!r}; {_HOW_TO_FIX}"
        )


def _number(hw_name: str, field_name: str, value: object, ok: Callable[[float], bool],
            what: str) -> float:
    """`value` as a float, if it is a number that `ok` accepts; else an error that says it
    must be `what`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or not ok(value):
        raise KarmaError(f"hardware {hw_name!r}: {field_name} must be {what}, got {value!r}; "
                         f"{_HOW_TO_FIX}")
    return float(value)


def _positive_float(hw_name: str, field_name: str, value: object) -> float:
    return _number(hw_name, field_name, value, lambda v: v > 0, "a positive number")


_CHECKS = {  # field -> (accepts, what it must be)
    **dict.fromkeys(_FLOAT_FIELDS, (lambda v: v > 0, "a positive number")),
    **dict.fromkeys(_FRACTION_FIELDS, (lambda v: 0 <= v <= _MAX_SLOWDOWN,
                                       f"a fraction from 0 to {_MAX_SLOWDOWN}")),
    **dict.fromkeys(_WAIT_FIELDS, (lambda v: 0 <= v < _MAX_WAIT_S,
                                   f"a number of seconds from 0 to under {_MAX_WAIT_S:g}")),
}


def _checked_flops(hw_name: str, rates: object) -> FlopRates:
    if not isinstance(rates, Mapping):
        raise KarmaError(
            f"hardware {hw_name!r}: flops_per_s must map each dtype to FLOP/s, e.g. "
            f"{{fp32: 1.95e+13, bf16: 2.5e+14}}, got {rates!r}"
        )
    missing = [dtype for dtype in DTYPES if dtype not in rates]
    unknown = [dtype for dtype in rates if dtype not in DTYPES]
    if missing or unknown:
        problem = f"lacks {missing}" if missing else f"has unknown dtypes {unknown}"
        raise KarmaError(
            f"hardware {hw_name!r}: flops_per_s {problem}; give exactly {', '.join(DTYPES)}"
        )
    return FlopRates(
        {dtype: _positive_float(hw_name, f"flops_per_s.{dtype}", rates[dtype]) for dtype in DTYPES}
    )


# ---------------------------------------------------------------------------------------------
# Loading


def builtin_names() -> list[str]:
    """Names of the built-in profiles (the stems of profiles/*.yaml), sorted."""
    directory = resources.files(__package__) / "profiles"
    return sorted(p.name[: -len(".yaml")] for p in directory.iterdir() if p.name.endswith(".yaml"))


def load_hardware(name_or_path: str) -> Hardware:
    """A built-in profile by name ("a100-80g") or a profile YAML file by path."""
    builtins = builtin_names()
    if name_or_path in builtins:
        resource = resources.files(__package__) / "profiles" / f"{name_or_path}.yaml"
        return hardware_from_yaml(resource.read_text(encoding="utf-8"), f"built-in {name_or_path}")
    path = Path(name_or_path)
    if not path.is_file():
        if path.suffix in (".yaml", ".yml") or "/" in name_or_path or path.exists():
            raise KarmaError(
                f"hardware file '{name_or_path}' does not exist or is not a file; give a "
                f"built-in name ({', '.join(builtins)}) or a YAML file "
                f"(karma-profile -o FILE writes one)"
            )
        close = difflib.get_close_matches(name_or_path, builtins, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise KarmaError(
            f"unknown hardware '{name_or_path}'{hint}; use one of {', '.join(builtins)} "
            f"or a YAML file (karma-profile -o FILE writes one)"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise KarmaError(f"cannot read hardware file '{path}': {e}") from e
    return hardware_from_yaml(text, str(path))


def hardware_from_yaml(text: str, source: str = "<text>") -> Hardware:
    """Parse a profile written by `dump_hardware` or by hand; `source` names it in errors."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise KarmaError(
            f"{source} is not valid YAML ({e}); karma-profile -o FILE writes a valid profile"
        ) from e
    keys = ["version", *(f.name for f in fields(Hardware))]
    if not isinstance(data, dict):
        raise KarmaError(
            f"{source}: a hardware profile is a mapping with keys {', '.join(keys)}, "
            f"got {type(data).__name__}; karma-profile -o FILE writes one"
        )
    required = [key for key in keys if key not in _FRACTION_FIELDS + _OPTIONAL_FIELDS]
    missing = [key for key in required if key not in data]
    if missing:
        raise KarmaError(
            f"{source}: missing key {', '.join(map(repr, missing))}; a hardware profile needs "
            f"all of {', '.join(required)}"
        )
    unknown = [key for key in data if key not in keys]
    if unknown:
        raise KarmaError(
            f"{source}: unknown key {', '.join(map(repr, unknown))}; the keys are {', '.join(keys)}"
        )
    if data["version"] != FORMAT_VERSION:
        raise KarmaError(
            f"{source}: version {data['version']!r} is not supported; this karma reads "
            f"version {FORMAT_VERSION} (re-run karma-profile -o FILE to write a current profile)"
        )
    values = {key: _coerce(source, key, data[key]) for key in keys[1:] if key in data}
    try:
        return Hardware(**values)
    except KarmaError as e:
        raise KarmaError(f"{source}: {e}") from None


def _coerce(source: str, key: str, value: object) -> object:
    """Accept what people write by hand: "16G" for bytes, "12e12" (a string to YAML) for rates."""
    if key in _BYTE_FIELDS and isinstance(value, str):
        return parse_size(value, what=f"{source}: {key}")
    if key in _FLOAT_FIELDS or key in _FRACTION_FIELDS or key in _WAIT_FIELDS:
        return _float_text(source, key, value)
    if key == "flops_per_s" and isinstance(value, dict):
        return {dtype: _float_text(source, f"flops_per_s.{dtype}", v) for dtype, v in value.items()}
    return value


def _float_text(source: str, key: str, value: object) -> object:
    if not isinstance(value, str):
        return value
    try:
        return float(value)
    except ValueError:
        raise KarmaError(f"{source}: {key} {value!r} is not a number; write e.g. 1.2e+13") from None


# ---------------------------------------------------------------------------------------------
# Writing

_HEADER = "# karma hardware profile; each field is described in karma/planner/hardware.py"
_COMMENT_COLUMN = 36


def dump_hardware(hw: Hardware) -> str:
    """YAML for `hw`: fixed key order, plain types, a unit comment per number.

    `hardware_from_yaml(dump_hardware(hw)) == hw` holds exactly: floats are written with the
    shortest digits that read back to the same float. The contention fractions are left out
    when 0 (their default), as is the side streams' wait, so a GPU's profile reads as it did
    before they existed.
    """
    lines = [_HEADER, f"version: {FORMAT_VERSION}"]
    for f in fields(Hardware):
        value = getattr(hw, f.name)
        if f.name in _FRACTION_FIELDS:
            if value != 0:
                lines.append(_with_comment(f"{f.name}: {yaml_float(value)}",
                                           f"{format_number(100 * value)}% of its speed lost"))
        elif f.name in _WAIT_FIELDS:
            if value != 0:
                lines.append(_with_comment(f"{f.name}: {yaml_float(value)}",
                                           format_seconds(value)))
        elif f.name == "flops_per_s":
            lines.append("flops_per_s:")
            for dtype in DTYPES:
                tflops = f"{format_number(value[dtype] / 1e12)} TFLOP/s"
                lines.append(_with_comment(f"  {dtype}: {yaml_float(value[dtype])}", tflops))
        elif f.name in _BYTE_FIELDS:
            lines.append(_with_comment(f"{f.name}: {value}", format_bytes(value)))
        elif f.name == "devices_per_node":
            if value != 1:
                lines.append(_with_comment(f"{f.name}: {value}", "sharing the host memory"))
        elif f.name == "net_latency_s":
            lines.append(_with_comment(f"{f.name}: {yaml_float(value)}", format_seconds(value)))
        elif f.name in _FLOAT_FIELDS:
            rate = f"{format_number(value / 1e9)} GB/s"
            lines.append(_with_comment(f"{f.name}: {yaml_float(value)}", rate))
        else:
            lines.append(f"{f.name}: {yaml_str(value)}")
    return "\n".join(lines) + "\n"


def _with_comment(line: str, comment: str) -> str:
    return with_comment(line, comment, _COMMENT_COLUMN)
