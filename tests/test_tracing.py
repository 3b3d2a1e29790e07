"""OpenTelemetry spans of the locks, recorded by the real SDK's in-memory exporter."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from django_mongolock import LockLost, LockManager, LockNotAcquired, events
from django_mongolock.contrib import otel
from tests.receivers import End, ending_when_acquired


class Exporter(InMemorySpanExporter):
    """The SDK's in-memory exporter, read after the spans pending in ``tracing`` are built."""

    tracing: otel.LockTracing

    def spans(self, name: str) -> list[ReadableSpan]:
        self.tracing.flush()
        return [s for s in self.get_finished_spans() if s.name == name]


@pytest.fixture
def traced() -> Iterator[tuple[TracerProvider, Exporter]]:
    exporter = Exporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    exporter.tracing = otel.LockTracing(provider)
    yield provider, exporter
    exporter.tracing.close()
    provider.shutdown()


def named(exporter: Exporter, name: str) -> list[ReadableSpan]:
    return exporter.spans(name)


def test_acquire_and_hold_are_children_of_the_callers_span(
    manager: LockManager, traced: tuple[TracerProvider, Exporter]
) -> None:
    provider, exporter = traced
    tracer = provider.get_tracer("test")
    with (
        tracer.start_as_current_span("request") as request,
        manager.acquire("t-job", ttl=10) as lock,
    ):
        assert lock.valid
    (acquire,) = named(exporter, "mongolock.acquire")
    (hold,) = named(exporter, "mongolock.hold")
    context = request.get_span_context()
    for span in (acquire, hold):
        assert span.parent is not None
        assert span.parent.span_id == context.span_id
        assert span.context is not None
        assert span.context.trace_id == context.trace_id
    assert acquire.attributes is not None
    assert acquire.attributes["mongolock.key"] == "t-job"
    assert acquire.attributes["mongolock.outcome"] == "acquired"
    assert acquire.attributes["mongolock.token"] == lock.token
    wait = acquire.attributes["mongolock.wait_seconds"]
    assert isinstance(wait, float)
    assert wait > 0
    assert acquire.start_time is not None
    assert hold.start_time is not None
    assert acquire.end_time is not None
    assert acquire.start_time < acquire.end_time <= hold.start_time
    assert hold.attributes is not None
    assert hold.attributes["mongolock.lease_running"] is True
    assert hold.status.status_code is StatusCode.UNSET


def test_timeout_is_an_error_span_with_its_wait(
    manager: LockManager, other: LockManager, traced: tuple[TracerProvider, Exporter]
) -> None:
    _, exporter = traced
    holder = manager.acquire("t-busy", ttl=10)
    with pytest.raises(LockNotAcquired):
        other.acquire("t-busy", timeout=0.2)
    holder.release()
    failed = [
        s
        for s in named(exporter, "mongolock.acquire")
        if s.attributes and s.attributes["mongolock.outcome"] == "timeout"
    ]
    (span,) = failed
    assert span.status.status_code is StatusCode.ERROR
    assert span.attributes is not None
    assert span.attributes["error.type"] == "django_mongolock.exceptions.LockNotAcquired"
    assert span.start_time is not None
    assert span.end_time is not None
    assert span.end_time - span.start_time >= 200_000_000


@pytest.mark.parametrize("loss_told", ["before the release", "after the release"])
def test_a_lost_hold_ends_with_its_reason(
    manager: LockManager,
    other: LockManager,
    traced: tuple[TracerProvider, Exporter],
    monkeypatch: pytest.MonkeyPatch,
    loss_told: str,
) -> None:
    _, exporter = traced
    # The loss reaches the observers on a notice worker: either side of the holder's
    # release, as the threads go. Each order is made here, not left to chance.
    aside: list[events.Event] = []
    emit_aside = events._emit_aside

    def hold_the_loss(event: events.Event) -> None:
        if isinstance(event, events.Lost) and event.lock.key == "t-lost":
            aside.append(event)
        else:
            emit_aside(event)  # a tick of another lane

    monkeypatch.setattr(events, "_emit_aside", hold_the_loss)
    lock = manager.acquire("t-lost", ttl=30)
    other.force_release("t-lost")
    with pytest.raises(LockLost):
        lock.refresh()
    assert [type(e) for e in aside] == [events.Lost]
    if loss_told == "before the release":
        events._emit(aside.pop())
    assert not lock.release()
    for event in aside:
        events._emit(event)
    (hold,) = named(exporter, "mongolock.hold")
    assert hold.status.status_code is StatusCode.ERROR
    assert hold.attributes is not None
    assert hold.attributes["mongolock.loss_reason"] == "force-released"


def test_async_spans_follow_the_task(
    manager: LockManager, traced: tuple[TracerProvider, Exporter]
) -> None:
    provider, exporter = traced
    tracer = provider.get_tracer("test")

    async def one(name: str) -> int:
        with tracer.start_as_current_span(name) as parent:
            async with await manager.aacquire(name, ttl=10):
                await asyncio.sleep(0.01)
            return parent.get_span_context().span_id

    async def main() -> list[int]:
        return list(await asyncio.gather(one("t-a"), one("t-b")))

    parents = asyncio.run(main())
    spans = named(exporter, "mongolock.acquire") + named(exporter, "mongolock.hold")
    assert len(spans) == 4
    for span in spans:
        assert span.attributes is not None
        assert span.parent is not None
        expected = parents[0] if span.attributes["mongolock.key"] == "t-a" else parents[1]
        assert span.parent.span_id == expected


def test_install_once() -> None:
    try:
        assert otel.install() is otel.install()
    finally:
        otel.uninstall()


def test_a_refused_try_outside_any_trace_makes_no_span(
    manager: LockManager, other: LockManager, traced: tuple[TracerProvider, Exporter]
) -> None:
    provider, exporter = traced
    holder = manager.acquire("t-try", ttl=10)
    with pytest.raises(LockNotAcquired):
        other.acquire("t-try", blocking=False)
    with provider.get_tracer("test").start_as_current_span("job"), pytest.raises(LockNotAcquired):
        other.acquire("t-try", blocking=False)
    holder.release()
    outcomes = [
        s.attributes["mongolock.outcome"]
        for s in named(exporter, "mongolock.acquire")
        if s.attributes is not None
    ]
    assert outcomes == ["acquired", "busy"]


def test_spans_are_built_off_the_callers_thread_with_its_parent_and_times(
    manager: LockManager, traced: tuple[TracerProvider, Exporter]
) -> None:
    """The caller notes times and context; the SDK's work happens on the backlog's thread."""
    provider, exporter = traced
    built_in: list[int] = []

    class Where(SpanProcessor):
        def on_start(self, span: Span, parent_context: Context | None = None) -> None:
            built_in.append(threading.get_ident())

    provider.add_span_processor(Where())
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("request") as request:
        before = time.time_ns()
        with manager.acquire("t-where", ttl=10):
            acquired = time.time_ns()
        released = time.time_ns()
    deadline = time.monotonic() + 5
    while len(exporter.get_finished_spans()) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)  # built by the backlog's own thread, without a flush
    (acquire,) = [s for s in named(exporter, "mongolock.acquire") if _key(s) == "t-where"]
    (hold,) = [s for s in named(exporter, "mongolock.hold") if _key(s) == "t-where"]
    assert built_in[0] == threading.get_ident()  # the request span, started here
    assert threading.get_ident() not in built_in[1:]
    for span in (acquire, hold):
        assert span.parent is not None
        assert span.parent.span_id == request.get_span_context().span_id
    assert acquire.start_time is not None
    assert acquire.end_time is not None
    assert hold.start_time is not None
    assert hold.end_time is not None
    assert before <= acquire.start_time <= acquire.end_time <= acquired
    assert acquire.end_time == hold.start_time
    assert acquired <= hold.end_time <= released


def _key(span: ReadableSpan) -> object:
    return (span.attributes or {}).get("mongolock.key")


@pytest.mark.parametrize("end", ["lost", "released"])
def test_a_hold_ended_before_its_acquisition_was_told_is_one_span(
    manager: LockManager,
    other: LockManager,
    traced: tuple[TracerProvider, Exporter],
    monkeypatch: pytest.MonkeyPatch,
    end: End,
) -> None:
    """A ``lock_acquired`` receiver runs before the acquisition is told: a loss or a
    release meanwhile reaches the observer first, and still ends the one hold span."""
    _, exporter = traced
    monkeypatch.setattr(events, "_emit_aside", events._emit)  # the loss told at once
    with ending_when_acquired(other, "t-early", end):
        lock = manager.acquire("t-early", ttl=30)
    assert not lock.release()
    (acquire,) = named(exporter, "mongolock.acquire")
    (hold,) = named(exporter, "mongolock.hold")
    assert hold.parent == acquire.parent
    assert hold.start_time is not None
    assert hold.end_time is not None
    assert hold.start_time <= hold.end_time
    assert hold.attributes is not None
    if end == "lost":
        assert hold.status.status_code is StatusCode.ERROR
        assert hold.attributes["mongolock.loss_reason"] == "force-released"
    else:
        assert hold.status.status_code is StatusCode.UNSET
        assert hold.attributes["mongolock.lease_running"] is True
