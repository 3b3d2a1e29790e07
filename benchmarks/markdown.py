"""Table cells and tables of the markdown report."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

__all__ = ["change", "median", "pct", "span", "table", "x"]


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


def span(
    values: Sequence[float], digits: int = 0, cell: Callable[[float], str] | None = None
) -> str:
    """A figure measured once per round: its median, then its range, ``12 (10 to 15)``."""
    show = cell or (lambda value: f"{value:,.{digits}f}")
    return f"{show(median(values))} ({show(min(values))} to {show(max(values))})"
