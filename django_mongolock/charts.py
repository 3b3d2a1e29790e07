"""Charts drawn on the server as inline SVG: no JavaScript, no build step, no library.

Bars per minute, stacked by series; colours come from CSS classes (``admin.css``) so the
admin's light and dark themes apply. Each bar carries a ``<title>`` (the browser shows it
on hover), and every chart has a text alternative; the pages add a table of the same
numbers for readers without images.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Final

from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

__all__ = ["Series", "bar_chart", "sparkline"]

_AXIS: Final = 34  # room for the value labels on the left
_FOOT: Final = 16  # room for the time labels below


@dataclass(frozen=True, slots=True)
class Series:
    """One stacked part of the bars: a label, a CSS class, and a value per minute."""

    label: str
    css: str
    values: Sequence[float]


def _number(value: float) -> str:
    return f"{value:,.0f}" if value >= 10 or value == int(value) else f"{value:.1f}"


def bar_chart(
    minutes: Sequence[datetime],
    series: Sequence[Series],
    *,
    title: str,
    unit: str = "",
    width: int = 640,
    height: int = 140,
) -> SafeString:
    """Stacked bars, one per minute, with the top value and the first and last minutes."""
    count = len(minutes)
    stacks = [sum(s.values[i] for s in series) for i in range(count)]
    top = max(stacks, default=0) or 1
    plot_w, plot_h = width - _AXIS, height - _FOOT
    step = plot_w / max(count, 1)
    bar_w = max(1.0, step - 1)
    parts = [
        f'<svg class="mongolock-chart" role="img" viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}" aria-label="{escape(title)}">',
        f"<title>{escape(title)}</title>",
        f'<line class="mongolock-axis" x1="{_AXIS}" y1="{plot_h}" x2="{width}" y2="{plot_h}"/>',
        f'<text class="mongolock-tick" x="{_AXIS - 4}" y="10" text-anchor="end">'
        f"{escape(_number(top))}</text>",
        f'<text class="mongolock-tick" x="{_AXIS - 4}" y="{plot_h}" text-anchor="end">0</text>',
    ]
    for i, minute in enumerate(minutes):
        x = _AXIS + i * step
        base = float(plot_h)
        label = [f"{minute:%H:%M}"]
        for s in series:
            value = s.values[i]
            if not value:
                continue
            h = value / top * (plot_h - 12)
            base -= h
            label.append(f"{s.label}: {_number(value)}{unit}")
            parts.append(
                f'<rect class="{escape(s.css)}" x="{x:.1f}" y="{base:.1f}" '
                f'width="{bar_w:.1f}" height="{h:.1f}"><title>{escape(", ".join(label))}'
                "</title></rect>"
            )
            label = [f"{minute:%H:%M}"]
    if minutes:
        parts.append(
            f'<text class="mongolock-tick" x="{_AXIS}" y="{height - 3}">'
            f"{minutes[0]:%H:%M}</text>"
            f'<text class="mongolock-tick" x="{width}" y="{height - 3}" text-anchor="end">'
            f"{minutes[-1]:%H:%M} UTC</text>"
        )
    parts.append("</svg>")
    return mark_safe("".join(parts))  # every text above is escaped


def sparkline(
    values: Sequence[float], *, label: str, width: int = 120, height: int = 22
) -> SafeString:
    """A small bar strip of one key's minutes, for a table cell."""
    top = max(values, default=0) or 1
    step = width / max(len(values), 1)
    bars = "".join(
        f'<rect x="{i * step:.1f}" y="{height - v / top * height:.1f}" '
        f'width="{max(1.0, step - 0.5):.1f}" height="{v / top * height:.1f}"/>'
        for i, v in enumerate(values)
        if v
    )
    return mark_safe(  # the label is escaped, the rest are numbers
        f'<svg class="mongolock-spark" role="img" viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}" aria-label="{escape(label)}">'
        f'<line class="mongolock-axis" x1="0" y1="{height}" x2="{width}" y2="{height}"/>'
        f"{bars}</svg>"
    )
