"""The names of the locks under test, as the report and its targets print them."""

from __future__ import annotations

from typing import Final

__all__ = [
    "CONTENTION_PAGE",
    "DOCS_PAGE",
    "DOCS_PLOT",
    "FLOOR",
    "FLOOR_POLL_10",
    "FLOOR_POLL_100",
    "FLOOR_TTL",
    "INSTRUMENTED",
    "KEY_PAGE",
    "OURS",
    "OURS_TRY",
    "PLOT_NAME",
    "REDIS",
]

OURS: Final = "django-mongolock"
OURS_TRY: Final = "django-mongolock (blocking=False)"
FLOOR: Final = "floor (raw pymongo)"
FLOOR_TTL: Final = "floor + TTL index (reference)"
FLOOR_POLL_10: Final = "floor, polling every 10 ms"
FLOOR_POLL_100: Final = "floor, polling every 100 ms"
REDIS: Final = "python-redis-lock"

# The instrumentation workload's contenders: our lock and what is subscribed to its events
# (``Spec.instrument``, see ``benchmarks.instruments``); the first is the baseline.
INSTRUMENTED: Final[tuple[tuple[str, str], ...]] = (
    ("nothing subscribed", ""),
    ("Prometheus metrics", "prometheus"),
    ("OpenTelemetry spans", "otel"),
    ("metrics and spans", "prometheus+otel"),
    ("contention statistics (admin)", "stats"),
)

PLOT_NAME: Final = "handoff-waits.png"
DOCS_PAGE: Final = "docs/benchmarks.md"
DOCS_PLOT: Final = "docs/img/handoff-waits.png"

# The admin's pages that read the statistics, as the admin workload names them.
CONTENTION_PAGE: Final = "contention (charts)"
KEY_PAGE: Final = "a key's page (line, hour, history)"
