"""Checks of spec values: each returns the value or raises a ValueError naming the key."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np


def number(where: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}: {key} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{where}: {key} must be finite, got {value!r}")
    return float(value)


def positive(where: str, key: str, value: Any) -> float:
    v = number(where, key, value)
    if v <= 0:
        raise ValueError(f"{where}: {key} must be > 0, got {value!r}")
    return v


def non_negative(where: str, key: str, value: Any) -> float:
    v = number(where, key, value)
    if v < 0:
        raise ValueError(f"{where}: {key} must be >= 0, got {value!r}")
    return v


def int_at_least(where: str, key: str, value: Any, minimum: int) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where}: {key} must be an int >= {minimum}, got {value!r}")
    return value


def choice(where: str, key: str, value: Any, options: Sequence[str]) -> str:
    if value not in options:
        raise ValueError(f"{where}: {key} must be one of {list(options)}, got {value!r}")
    return value


def value_range(where: str, key: str, value: Any, *, integer: bool) -> tuple[float, float]:
    """A number or a ``[lo, hi]`` pair (drawn uniformly per client) as ``(lo, hi)``."""

    def check(v: Any) -> float:
        return float(int_at_least(where, key, v, 0)) if integer else non_negative(where, key, v)

    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != 2:
            raise ValueError(f"{where}: {key} must be a number or [lo, hi], got {value!r}")
        lo, hi = check(value[0]), check(value[1])
        if lo > hi:
            raise ValueError(f"{where}: {key} range must have lo <= hi, got {value!r}")
        return lo, hi
    v = check(value)
    return v, v


def count_matrix(key: str, value: Any, rows: int) -> np.ndarray:
    """A read-only int64 copy of ``value``, a 2-D array of integers >= 0 with ``rows`` rows
    and at least one column."""
    arr = np.asarray(value)
    if arr.ndim != 2 or arr.shape[0] != rows or arr.shape[1] < 1:
        raise ValueError(
            f"{key} must have shape [num_clients, num_classes] = [{rows}, >= 1], "
            f"got {list(arr.shape)}"
        )
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{key} must hold integers (example counts), got dtype {arr.dtype}")
    if arr.size and arr.min() < 0:
        raise ValueError(f"{key} must be >= 0, got a minimum of {arr.min()}")
    out = arr.astype(np.int64, copy=True)
    out.setflags(write=False)
    return out


def fraction_count(where: str, fraction: float, n: int) -> int:
    """round(fraction * n), halves up, so 0.25 of 20 is 5 and 0.5 of 1 is 1."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"{where}: fraction must be in [0, 1], got {fraction!r}")
    return min(n, math.floor(fraction * n + 0.5))


def plain(value: Any) -> Any:
    """``value`` with numpy scalars, tuples and infinities made JSON-friendly."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
