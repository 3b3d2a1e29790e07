"""The observers the instrumentation workload installs beside our lock, and their removal.

A name in ``Spec.instrument`` (several joined by ``+``) installs, in the process that
builds the contender:

* ``prometheus``: ``django_mongolock.contrib.prometheus.install`` on a fresh
  ``CollectorRegistry``;
* ``otel``: ``django_mongolock.contrib.otel.install`` with an SDK ``TracerProvider`` whose
  ``BatchSpanProcessor`` hands the spans to an exporter that drops them;
* ``stats``: ``django_mongolock.stats.install()``, the contention-statistics recorder every
  process that loads the admin runs.

The observers are process-wide: whatever ``instrument`` installs, the function it returns
removes, and the next contender built in that process starts with nothing subscribed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from typing import Final

from django_mongolock import events

__all__ = ["INSTRUMENTS", "instrument", "missing"]

# Each instrument and the distributions it needs beyond the bench extra.
INSTRUMENTS: Final[dict[str, tuple[str, ...]]] = {
    "prometheus": ("prometheus_client",),
    "otel": ("opentelemetry.sdk",),
    "stats": (),
}


def _names(spec: str) -> list[str]:
    names = [name for name in spec.split("+") if name]
    unknown = [name for name in names if name not in INSTRUMENTS]
    if unknown:
        raise ValueError(f"unknown instrument(s) {unknown}: one of {', '.join(INSTRUMENTS)}")
    return names


def missing(spec: str) -> list[str]:
    """The modules ``spec``'s instruments need that are not installed here."""
    needed = [module for name in _names(spec) for module in INSTRUMENTS[name]]
    return [module for module in needed if not _importable(module)]


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def instrument(spec: str) -> Callable[[], None]:
    """Install ``spec``'s instruments in this process; returns the call that removes them.

    Raises when an observer is already subscribed: one left by an earlier contender would
    be measured with the next one.
    """
    names = _names(spec)
    if events.listening():
        raise RuntimeError("lock observers still subscribed from an earlier contender")
    undo: list[Callable[[], None]] = []
    try:
        for name in names:
            undo.append(_INSTALL[name]())
    except BaseException:
        _undo(undo)
        raise

    def uninstall() -> None:
        _undo(undo)
        undo.clear()

    return uninstall


def _undo(steps: Sequence[Callable[[], None]]) -> None:
    for step in reversed(steps):
        step()


def _prometheus() -> Callable[[], None]:
    from prometheus_client import CollectorRegistry

    from django_mongolock.contrib import prometheus

    prometheus.install(registry=CollectorRegistry())
    return prometheus.uninstall


def _otel() -> Callable[[], None]:
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )

    from django_mongolock.contrib import otel

    class Discard(SpanExporter):
        """Accepts every batch and keeps nothing: the SDK's cost without an exporter's."""

        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Discard()))
    try:
        otel.install(tracer_provider=provider)
    except BaseException:
        provider.shutdown()
        raise

    def uninstall() -> None:
        try:
            otel.uninstall()
        finally:
            provider.shutdown()

    return uninstall


def _stats() -> Callable[[], None]:
    from django_mongolock import stats

    stats.install()
    return stats.uninstall


_INSTALL: Final[dict[str, Callable[[], Callable[[], None]]]] = {
    "prometheus": _prometheus,
    "otel": _otel,
    "stats": _stats,
}
