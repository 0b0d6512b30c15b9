"""Sizes and durations as people type and read them: "16G" in, "15.9 GiB" and "312 ms" out.

All byte units are binary: K, M, G and T mean 1024, 1024**2, 1024**3 and 1024**4, with or
without a trailing "B" or "iB" ("16G", "16GB" and "16GiB" are the same size).
"""

from __future__ import annotations

import re
from decimal import Decimal

from karma.errors import KarmaError

_SIZE = re.compile(r"(?P<number>\d+(?:\.\d+)?)\s*(?:(?P<unit>[KMGT])(?:i?B|i)?|B)?", re.IGNORECASE)
_UNIT_POWER = {"K": 1, "M": 2, "G": 3, "T": 4}
_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def parse_size(text: str, what: str | None = None) -> int:
    """Bytes in `text`: "16G", "512M", "1.5T", "16GiB" or a plain integer of bytes.

    `what` names where the text came from (a flag such as "--gpu-mem") for the error message.
    A fractional size is rounded down to whole bytes ("0.1K" is 102).
    """
    match = _SIZE.fullmatch(text.strip()) if isinstance(text, str) else None
    if match is not None:
        number = Decimal(match["number"])
        unit = match["unit"]
        if unit is not None:
            return int(number * 1024 ** _UNIT_POWER[unit.upper()])
        if number == number.to_integral_value():
            return int(number)
    prefix = f"{what} " if what else ""
    raise KarmaError(f"{prefix}{text!r} is not a size; use a number with K, M, G or T, e.g. 16G")


def format_number(x: float) -> str:
    """`x` with about three significant digits and no exponent: 1750, 15.9, 1.24, 0.083."""
    magnitude = abs(x)
    if magnitude >= 100:
        return f"{x:.0f}"
    if magnitude >= 10:
        return f"{x:.1f}"
    if magnitude >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def format_bytes(n: int | float) -> str:
    """A byte count in binary units: "512 B", "1.50 KiB", "15.9 GiB"."""
    value = float(n)
    for unit in _BYTE_UNITS:
        if abs(value) < 1024 or unit == _BYTE_UNITS[-1]:
            break
        value /= 1024
    if unit == "B":
        return f"{int(n)} B"
    return f"{format_number(value)} {unit}"


def format_seconds(s: float) -> str:
    """A duration in the unit that reads best: "1.24 s", "312 ms", "45.0 us", "800 ns"."""
    if s < 0:
        return "-" + format_seconds(-s)
    if s == 0:
        return "0 s"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if s >= scale:
            return f"{format_number(s / scale)} {unit}"
    return f"{format_number(s / 1e-9)} ns"
