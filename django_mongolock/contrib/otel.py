"""OpenTelemetry spans of this process's locks (``pip install django-mongolock[otel]``).

``install()`` subscribes one observer to ``django_mongolock.events``. Each call to
acquire becomes a ``mongolock.acquire`` span, and each hold a ``mongolock.hold`` span
from the acquisition to the release or the loss. Both are children of the span current
in the caller's thread or task when acquire returned, so a slow request's trace shows
the time it waited for a lock, and what it did while holding it, under the request.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode, TracerProvider

from django_mongolock import events

__all__ = ["LockTracing", "install", "uninstall"]

# Outcomes the caller did not want: the span's status is an error for these.
FAILED = frozenset({"timeout", "error", "cancelled"})


def _type_name(cls: type) -> str:
    """The class's fully qualified name, as the semantic conventions ask of ``error.type``
    (a builtin's plain name: ``TimeoutError``)."""
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


class LockTracing:
    """The observer that turns lock events into spans; ``close()`` unsubscribes it."""

    def __init__(self, tracer_provider: TracerProvider | None = None) -> None:
        self.tracer = trace.get_tracer("django_mongolock", tracer_provider=tracer_provider)
        self._holds: weakref.WeakKeyDictionary[Any, trace.Span] = weakref.WeakKeyDictionary()
        self._mutex = threading.Lock()
        self._unsubscribe: Callable[[], None] | None = events.subscribe(self.observe)

    def observe(self, event: events.Event) -> None:
        if isinstance(event, events.AcquireFinished):
            self._acquire(event)
        elif isinstance(event, events.Released):
            self._end_hold(event.lock, {"mongolock.lease_running": event.held}, None)
        elif isinstance(event, events.Lost):
            self._end_hold(event.lock, {"mongolock.loss_reason": event.reason}, event.detail)

    def _acquire(self, event: events.AcquireFinished) -> None:
        if event.outcome == "busy" and not trace.get_current_span().get_span_context().is_valid:
            return  # a refused try outside any trace: an election follower's, every tick
        end = time.time_ns()
        # Few attributes: the SDK checks each one, and that is most of a span's cost.
        attributes: dict[str, Any] = {
            "mongolock.key": event.key,
            "mongolock.owner": event.owner,
            "mongolock.shared": event.shared,
            "mongolock.outcome": event.outcome,
            "mongolock.wait_seconds": event.waited,
        }
        if event.token is not None:
            attributes["mongolock.token"] = event.token
        if event.error is not None and event.outcome in FAILED:
            attributes["error.type"] = _type_name(type(event.error))
        span = self.tracer.start_span(
            "mongolock.acquire",
            kind=SpanKind.INTERNAL,
            start_time=end - int(event.waited * 1e9),
            attributes=attributes,
        )
        if event.outcome in FAILED:
            span.set_status(Status(StatusCode.ERROR, str(event.error or event.outcome)))
        span.end(end_time=end)
        if event.lock is not None:
            hold = self.tracer.start_span(
                "mongolock.hold",
                kind=SpanKind.INTERNAL,
                start_time=end,
                attributes={"mongolock.key": event.key, "mongolock.token": event.lock.token},
            )
            with self._mutex:
                self._holds[event.lock] = hold

    def _end_hold(self, lock: Any, attributes: dict[str, Any], lost: str | None) -> None:
        with self._mutex:
            span = self._holds.pop(lock, None)
        if span is None:
            return  # taken before install, or already ended by its loss
        span.set_attributes(attributes)
        if lost is not None:
            span.set_status(Status(StatusCode.ERROR, f"lock lost: {lost}"))
        span.end()

    def close(self) -> None:
        """Stop observing; holds still open end now (their spans say so)."""
        unsubscribe, self._unsubscribe = self._unsubscribe, None
        if unsubscribe is not None:
            unsubscribe()
        with self._mutex:
            spans = list(self._holds.values())
            self._holds.clear()
        for span in spans:
            span.set_attribute("mongolock.tracing_closed", True)
            span.end()


_installed: LockTracing | None = None
_mutex = threading.Lock()


def install(tracer_provider: TracerProvider | None = None) -> LockTracing:
    """Trace this process's locks (once: a second call returns the same observer)."""
    global _installed
    with _mutex:
        if _installed is None:
            _installed = LockTracing(tracer_provider)
        return _installed


def uninstall() -> None:
    """Undo ``install()`` (tests, reloads)."""
    global _installed
    with _mutex:
        tracing, _installed = _installed, None
    if tracing is not None:
        tracing.close()
