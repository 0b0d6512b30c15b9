"""Plain values as YAML text that reads back the same: the writers of karma's YAML artifacts.

The schedule (schedule.py) and the hardware profile (planner/hardware.py) are written line by
line, in a fixed key order with unit comments, so that they diff cleanly; these are the pieces
both write with. Every text here loads with `yaml.safe_load` as the value it was made from.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from decimal import Decimal
from functools import lru_cache

import yaml

_PLAIN = re.compile(r"[A-Za-z0-9_/][A-Za-z0-9_./@+-]*")


def yaml_value(v: object, digits: int | None = None) -> str:
    """A plain value as YAML flow text; floats rounded to `digits` significant digits."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return yaml_int(v)
    if isinstance(v, float):
        return yaml_float(v, digits)
    if isinstance(v, str):
        return yaml_str(v)
    if isinstance(v, Mapping):
        return flow_map(v.items(), digits)
    if isinstance(v, (tuple, list)):
        return flow_list(v, digits)
    raise TypeError(f"{v!r} ({type(v).__name__}) is not a plain value YAML text can hold")


def flow_map(pairs, digits: int | None = None) -> str:
    return "{" + ", ".join(f"{yaml_str(k)}: {yaml_value(v, digits)}" for k, v in pairs) + "}"


def flow_list(items, digits: int | None = None) -> str:
    return "[" + ", ".join(yaml_value(v, digits) for v in items) + "]"


def wrapped_list(prefix: str, names: tuple[str, ...], end: str, width: int = 100) -> list[str]:
    """`prefix[a, b, ...]end` as a flow list wrapped before `width` columns."""
    lines, line = [], prefix + "["
    for k, name in enumerate(names):
        last = k == len(names) - 1
        item = yaml_str(name) + ("" if last else ", ")
        room = width - (len("]" + end) if last else 1)  # what closes the line after the item
        if len(line) + len(item.rstrip()) > room and not line.endswith("["):
            lines.append(line.rstrip())
            line = " " * (len(prefix) + 1)
        line += item
    return [*lines, line + "]" + end]


def with_comment(line: str, comment: str | None, column: int) -> str:
    """`line`, and `# comment` starting at `column` (or one space after a longer line)."""
    return f"{line.ljust(column - 1)} # {comment}" if comment else line


def yaml_int(n: int) -> str:
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"{n!r} is not an int")
    return str(n)


def round_digits(x: float, digits: int) -> float:
    return float(f"{x:.{digits}g}")


def yaml_float(x: float, digits: int | None = None) -> str:
    """`x` (rounded to `digits` significant digits) as text YAML reads back as the same float.

    Shortest digits; an exponent outside [0.001, 1e6), written with a dot and a signed
    exponent ("1.2e+13", "4.5e-05"): PyYAML reads "1e-05" or "1.2e13" as strings.
    """
    x = float(x)
    if not math.isfinite(x):
        raise ValueError(f"{x} cannot be written as YAML text; times, rates and sizes are finite")
    if digits is not None:
        x = round_digits(x, digits)
    if x == 0 or 1e-3 <= abs(x) < 1e6:
        text = repr(x)
        return text if "." in text else text + ".0"
    mantissa, exponent = f"{Decimal(repr(x)).normalize():E}".split("E")
    if "." not in mantissa:
        mantissa += ".0"
    return f"{mantissa}e{int(exponent):+03d}"


@lru_cache(maxsize=4096)
def yaml_str(text: str) -> str:
    """`text` bare when YAML reads it back as the same string, else JSON-quoted (valid YAML)."""
    if not isinstance(text, str):
        raise TypeError(f"{text!r} is not a str")
    if _PLAIN.fullmatch(text) and _resolves_to_str(text):
        return text
    return json.dumps(text)


def _resolves_to_str(text: str) -> bool:
    tag = yaml.resolver.Resolver().resolve(yaml.ScalarNode, text, (True, False))
    return tag == "tag:yaml.org,2002:str"
