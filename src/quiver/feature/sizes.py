"""Byte capacities for feature tiers: ``parse_bytes("2G") == 2 * 1024**3``."""

from __future__ import annotations

import re

__all__ = ["parse_bytes"]

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_bytes(value, name: str = "capacity") -> int:
    """Parse a byte count: an int, or a string like ``"512M"``, ``"2G"``, ``"1.5GiB"``, ``"100"``.

    Units are binary (``K`` = 1024 bytes), as in torch-quiver's ``device_cache_size``.

    Args:
        value: non-negative int, or string of a non-negative number with an optional unit
            ``B``, ``K``, ``M``, ``G`` or ``T`` (optionally followed by ``B`` / ``iB``).
        name: what the value configures, for the error message.

    Raises:
        ValueError: on negative numbers, unknown units or anything unparsable.
    """
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a byte count like 2G or 512M, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{name} must be >= 0 bytes, got {value}")
        return value
    if isinstance(value, float):
        if not value >= 0 or value != value or value == float("inf"):
            raise ValueError(f"{name} must be a finite byte count >= 0, got {value}")
        return int(value)
    if isinstance(value, str):
        m = _PATTERN.match(value)
        if m:
            return int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    raise ValueError(f"{name} must be a byte count like 2G, 512M or 1048576 (>= 0), got {value!r}")
