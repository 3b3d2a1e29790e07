"""Table cells and tables of the markdown report."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["change", "median", "pct", "table", "x"]


def x(value: float, digits: int = 2) -> str:
    return "n/a" if math.isnan(value) else f"{value:.{digits}f}x"


def pct(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value * 100:.1f} %"


def change(value: float) -> str:
    """A relative change, signed: ``+1.2 %``."""
    return "n/a" if math.isnan(value) else f"{value * 100:+.1f} %"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines.extend("| " + " | ".join(row) + " |" for row in rows)
    return [*lines, ""]


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
