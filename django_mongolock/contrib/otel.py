"""OpenTelemetry spans of this process's locks (``pip install django-mongolock[otel]``).

``install()`` subscribes one observer to ``django_mongolock.events``. Each call to
acquire becomes a ``mongolock.acquire`` span, and each hold a ``mongolock.hold`` span
from the acquisition to the release or the loss. Both are children of the span current
in the caller's thread or task when acquire returned, so a slow request's trace shows
the time it waited for a lock, and what it did while holding it, under the request.
The SDK builds them on a thread of their own, with the times noted when they happened:
the lock's caller pays microseconds, not the SDK's tens of them.
"""

from __future__ import annotations

import functools
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from opentelemetry import context, trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode, TracerProvider

from django_mongolock import events
from django_mongolock.contrib.backlog import Backlog

__all__ = ["LockTracing", "flush", "install", "uninstall"]

# Outcomes the caller did not want: the span's status is an error for these.
FAILED = frozenset({"timeout", "error", "cancelled"})


def _type_name(cls: type) -> str:
    """The class's fully qualified name, as the semantic conventions ask of ``error.type``
    (a builtin's plain name: ``TimeoutError``)."""
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


_End = tuple[int, dict[str, Any], str | None]
"""A hold's end (ns), its attributes, and the loss detail if lost."""


class LockTracing:
    """The observer that turns lock events into spans; ``close()`` unsubscribes it.

    The caller's thread only notes the times and the current context; the spans are
    built on a backlog thread (``contrib.backlog``), with those times and that context
    as their parent, a fraction of a second later. ``flush()`` builds what is pending now.
    """

    def __init__(self, tracer_provider: TracerProvider | None = None) -> None:
        self.tracer = trace.get_tracer("django_mongolock", tracer_provider=tracer_provider)
        # Each open hold's parent context and start (ns), until its release or loss.
        self._holds: weakref.WeakKeyDictionary[Any, tuple[Context, int]] = (
            weakref.WeakKeyDictionary()
        )
        # Holds that ended before their acquisition was told (a loss, or a release by a
        # ``lock_acquired`` receiver, meanwhile): the end, kept for the acquisition.
        self._ended: weakref.WeakKeyDictionary[Any, _End] = weakref.WeakKeyDictionary()
        self._mutex = threading.Lock()
        self.backlog = Backlog("mongolock-spans")
        _tracings.add(self)
        self._unsubscribe: Callable[[], None] | None = events.subscribe(self.observe)

    def observe(self, event: events.Event) -> None:
        if isinstance(event, events.AcquireFinished):
            end, parent = time.time_ns(), context.get_current()
            if event.outcome == "busy" and not _traced(parent):
                return  # a refused try outside any trace: an election follower's, every tick
            job = functools.partial(self._acquire, event, parent, end)
            if event.lock is None:
                self.backlog.post(job)
                return
            with self._mutex:  # the acquire's job before any end of its hold
                self.backlog.post(job)
                ended = self._ended.pop(event.lock, None) if self._ended else None
                if ended is None:
                    self._holds[event.lock] = (parent, end)
                    return
                at, attributes, lost = ended
                hold = (event.lock, (parent, end), max(at, end), attributes, lost)
                self.backlog.post(functools.partial(self._hold, *hold))
        elif isinstance(event, events.Released):
            if event.held:
                self._end_hold(event.lock, {"mongolock.lease_running": True}, None)
            # A release that found the lease ended comes with a ``Lost``, told on a
            # notice worker before or after this: that one ends the hold, with its reason.
        elif isinstance(event, events.Lost):
            self._end_hold(event.lock, {"mongolock.loss_reason": event.reason}, event.detail)

    def flush(self) -> None:
        """Build, in this thread, the spans of every event observed so far."""
        self.backlog.flush()

    def _acquire(self, event: events.AcquireFinished, parent: Context, end: int) -> None:
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
            context=parent,
            kind=SpanKind.INTERNAL,
            start_time=end - int(event.waited * 1e9),
            attributes=attributes,
        )
        if event.outcome in FAILED:
            span.set_status(Status(StatusCode.ERROR, str(event.error or event.outcome)))
        span.end(end_time=end)

    def _end_hold(self, lock: Any, attributes: dict[str, Any], lost: str | None) -> None:
        end = time.time_ns()
        with self._mutex:
            opened = self._holds.pop(lock, None)
            if opened is None:
                # Taken before install (its end is forgotten with the handle), or ended
                # before its acquisition was told: that builds the span.
                self._ended[lock] = (end, attributes, lost)
                return
        self.backlog.post(functools.partial(self._hold, lock, opened, end, attributes, lost))

    def _hold(
        self,
        lock: Any,
        opened: tuple[Context, int],
        end: int,
        attributes: dict[str, Any],
        lost: str | None,
    ) -> None:
        parent, start = opened
        span = self.tracer.start_span(
            "mongolock.hold",
            context=parent,
            kind=SpanKind.INTERNAL,
            start_time=start,
            attributes={"mongolock.key": lock.key, "mongolock.token": lock.token, **attributes},
        )
        if lost is not None:
            span.set_status(Status(StatusCode.ERROR, f"lock lost: {lost}"))
        span.end(end_time=end)

    def close(self) -> None:
        """Stop observing and build what is pending; holds still open end now (their
        spans say so)."""
        unsubscribe, self._unsubscribe = self._unsubscribe, None
        if unsubscribe is not None:
            unsubscribe()
        end = time.time_ns()
        with self._mutex:
            holds = list(self._holds.items())
            self._holds.clear()
            self._ended.clear()
        for lock, opened in holds:
            closing = {"mongolock.tracing_closed": True}
            self.backlog.post(functools.partial(self._hold, lock, opened, end, closing, None))
        self.backlog.close()


# Every observer, so that a forked child forgets its parent's open holds (their spans
# are the parent's to end).
_tracings: weakref.WeakSet[LockTracing] = weakref.WeakSet()


def _forget_in_child() -> None:
    for tracing in list(_tracings):
        tracing._mutex = threading.Lock()  # a parent's thread may have held it
        tracing._holds.clear()
        tracing._ended.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def _traced(parent: Context) -> bool:
    """Whether ``parent`` holds a span: the caller runs inside a trace."""
    return trace.get_current_span(parent).get_span_context().is_valid


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


def flush() -> None:
    """Build now the spans of every lock event so far (call it before the tracer
    provider's ``force_flush()`` when the spans must be exported at once)."""
    tracing = _installed
    if tracing is not None:
        tracing.flush()
