"""Byte sizes as people write them in config files and as we print them."""
from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str) -> int:
    """``4096``, ``"4KiB"``, ``"1.5 GiB"`` or ``"2GB"`` -> bytes. Raises ValueError."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must not be negative: {value}")
        return value
    if not isinstance(value, str):
        raise ValueError(f"not a size: {value!r}")
    m = _SIZE.match(value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {value!r} (examples: 4096, \"64MiB\", \"2GiB\")")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def align_down(n: int, alignment: int) -> int:
    return n // alignment * alignment
