"""Min / median / max over repeats: the one summary every benchmark reports.

A measured quantity ``key`` of a result row is stored three ways, side by side in the row:
``row[key]`` is the median (what ratios and plots use), ``row["spread"][key]`` is ``[min, max]``
and ``row["runs"][key]`` is every repeat's raw value, in the order measured. Best-of is never
reported: on a shared machine the best run is the least representative one.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any


def summary(values: Sequence[float]) -> dict[str, float]:
    """``{"min", "median", "max", "n"}`` of the repeats (``n`` is how many there were)."""
    if not values:
        raise ValueError("no repeats to summarise")
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def measured(row: dict[str, Any], key: str, values: Sequence[float]) -> dict[str, Any]:
    """Put ``values`` (every repeat of ``key``) into ``row``: median, [min, max] and the raw runs."""
    s = summary(values)
    row[key] = s["median"]
    row.setdefault("spread", {})[key] = [s["min"], s["max"]]
    row.setdefault("runs", {})[key] = list(values)
    return row


def bounds(row: Mapping[str, Any], key: str) -> tuple[float, float] | None:
    """``(min, max)`` of ``key`` in ``row``, or None when the row has no repeats of it."""
    pair = (row.get("spread") or {}).get(key)
    return (float(pair[0]), float(pair[1])) if pair else None


def _num(value: float, digits: int) -> str:
    if abs(value) >= 100:
        return f"{value:.1f}"
    return f"{value:.{digits}f}"


def cell(row: Mapping[str, Any], key: str, digits: int = 3, scale: float = 1.0) -> str:
    """The table cell of ``key``: median with the spread, ``1.234 [1.200–1.301]`` (median alone
    when every repeat gave the same value or there was one)."""
    median = float(row[key]) * scale
    pair = bounds(row, key)
    if pair is None or pair[0] == pair[1]:
        return _num(median, digits)
    return f"{_num(median, digits)} [{_num(pair[0] * scale, digits)}–{_num(pair[1] * scale, digits)}]"
