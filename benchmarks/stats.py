"""Order statistics and the small summaries the report prints."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["ms", "quantile", "ratio", "row", "spread", "summary", "table"]


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, interpolating linearly; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summary(values: Sequence[float]) -> dict[str, float]:
    """p50, p99, max and count of a sample (seconds stay seconds)."""
    return {
        "p50": quantile(values, 0.5),
        "p99": quantile(values, 0.99),
        "max": max(values) if values else math.nan,
        "n": float(len(values)),
    }


def spread(values: Iterable[float]) -> dict[str, Any]:
    """Median, min and max of one figure measured once per round."""
    sample = [v for v in values if not math.isnan(v)]
    if not sample:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "rounds": []}
    return {
        "median": statistics.median(sample),
        "min": min(sample),
        "max": max(sample),
        "rounds": sample,
    }


def ratio(value: float, floor: float) -> float:
    """``value / floor``, NaN when either is missing or the floor is zero."""
    if math.isnan(value) or math.isnan(floor) or floor == 0:
        return math.nan
    return value / floor


def ms(seconds: float, digits: int = 2) -> str:
    """Seconds as milliseconds for a table cell."""
    if math.isnan(seconds):
        return "n/a"
    return f"{seconds * 1000:.{digits}f} ms"


def row(name: str, values: Sequence[float]) -> str:
    """A table row of the probes: ``name``, the p50 and p90 of ``values`` (seconds) in
    ms, and how many there were."""
    p50, p90 = quantile(values, 0.5), quantile(values, 0.9)
    return f"| {name} | {p50 * 1e3:.3f} ms | {p90 * 1e3:.3f} ms | {len(values)} |"


def table(first: str, times: Mapping[str, Sequence[float]]) -> str:
    """A probe's table: a ``row`` for each name in ``times``, under a header whose first
    column is headed ``first``."""
    lines = [f"| {first} | p50 | p90 | n |", "|---|---|---|---|"]
    return "\n".join(lines + [row(name, values) for name, values in times.items()])
