"""OpenTelemetry spans of the locks, recorded by the real SDK's in-memory exporter."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from django_mongolock import LockLost, LockManager, LockNotAcquired
from django_mongolock.contrib import otel


@pytest.fixture
def traced() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing = otel.LockTracing(provider)
    yield provider, exporter
    tracing.close()
    provider.shutdown()


def named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def test_acquire_and_hold_are_children_of_the_callers_span(
    manager: LockManager, traced: tuple[TracerProvider, InMemorySpanExporter]
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
    manager: LockManager, other: LockManager, traced: tuple[TracerProvider, InMemorySpanExporter]
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


def test_a_lost_hold_ends_with_its_reason(
    manager: LockManager, other: LockManager, traced: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    _, exporter = traced
    lock = manager.acquire("t-lost", ttl=30)
    assert named(exporter, "mongolock.hold") == []  # open while held
    other.force_release("t-lost")
    with pytest.raises(LockLost):
        lock.refresh()
    assert not lock.release()
    (hold,) = named(exporter, "mongolock.hold")
    assert hold.status.status_code is StatusCode.ERROR
    assert hold.attributes is not None
    assert hold.attributes["mongolock.loss_reason"] == "force-released"


def test_async_spans_follow_the_task(
    manager: LockManager, traced: tuple[TracerProvider, InMemorySpanExporter]
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
    manager: LockManager, other: LockManager, traced: tuple[TracerProvider, InMemorySpanExporter]
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
