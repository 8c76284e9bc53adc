"""Byte sizes and durations: read and written one way for every front-end, profile and message."""

from __future__ import annotations

import re

GiB = 2**30
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "B": 1, "K": 1000, "KB": 1000, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9,
               "T": 10**12, "TB": 10**12, "KI": 2**10, "KIB": 2**10, "MI": 2**20, "MIB": 2**20,
               "GI": 2**30, "GIB": 2**30, "TI": 2**40, "TIB": 2**40}  # fmt: skip


def parse_size(value: object) -> int:
    """Bytes from an int or a string like "4GiB", "512MiB", "3GB" (binary units need the i)."""
    if isinstance(value, bool):
        raise ValueError("expected a size, got a boolean")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("a size cannot be negative")
        return value
    if not isinstance(value, str):
        raise ValueError(f"expected a size such as \"4GiB\", got {type(value).__name__}")
    m = _SIZE_RE.match(value)
    if not m:
        raise ValueError(f"expected a size such as \"4GiB\", got {value!r}")
    return int(float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "").upper()])


def format_bytes(n: float | None, none: str = "-") -> str:
    """1536 -> "1.5 KiB"; whole bytes below 1 KiB; `none` stands in for an unknown size."""
    if n is None:
        return none
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def format_gib(n: float) -> str:
    """Always GiB with two decimals: the budget's arithmetic lines compare terms of one unit."""
    return f"{n / GiB:.2f} GiB"


_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)([hms])")
_DURATION_SECONDS = {"h": 3600, "m": 60, "s": 1}


def parse_duration(value: object) -> float | None:
    """Seconds from "15s", "5m", "1h30m", a bare number of seconds, or None for "never"."""
    if isinstance(value, bool):
        raise ValueError("expected a duration, got a boolean")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and value.strip().lower() == "never":
        return None
    elif isinstance(value, str) and re.fullmatch(r"\s*\d+(\.\d+)?\s*", value):
        seconds = float(value)
    elif isinstance(value, str) and re.fullmatch(r"(\d+(\.\d+)?[hms])+", value.strip()):
        seconds = sum(float(n) * _DURATION_SECONDS[u] for n, u in _DURATION_PART.findall(value))
    else:
        raise ValueError(f"expected a duration such as \"15s\", \"5m\", \"1h30m\" or \"never\", got {value!r}")
    if seconds < 0:
        raise ValueError("a duration cannot be negative")
    return seconds


def format_duration(seconds: float | None, none: str = "-") -> str:
    """42 -> "42s", 125 -> "2m05s", 7300 -> "2h01m"."""
    if seconds is None:
        return none
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
