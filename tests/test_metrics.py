"""Prometheus metrics of the locks, read back from a real ``prometheus_client`` registry."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from django_mongolock import Lock, LockLost, LockManager, LockNotAcquired, clock
from django_mongolock.contrib import prometheus
from django_mongolock.contrib.prometheus import LockMetrics
from django_mongolock.notices import get_notices
from django_mongolock.refresher import get_refresher


@pytest.fixture
def registry(only_listener: None) -> Iterator[CollectorRegistry]:
    # only_listener: the held-locks gauge counts the locks taken during the test only.
    registry = CollectorRegistry()
    metrics = LockMetrics(registry)
    yield registry
    metrics.close()


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    found = registry.get_sample_value(name, labels)
    return 0.0 if found is None else found


def test_acquisitions_by_outcome(
    manager: LockManager, other: LockManager, registry: CollectorRegistry
) -> None:
    waiting = value(registry, "mongolock_waiting_acquisitions")
    lock = manager.acquire("m-job", ttl=10)
    assert value(registry, "mongolock_held_locks") == 1
    with pytest.raises(LockNotAcquired):
        other.acquire("m-job", blocking=False)
    with pytest.raises(LockNotAcquired):
        other.acquire("m-job", timeout=0.1)
    lock.release()
    exclusive = {"mode": "exclusive"}
    assert value(registry, "mongolock_acquisitions_total", outcome="acquired", **exclusive) == 1
    assert value(registry, "mongolock_acquisitions_total", outcome="busy", **exclusive) == 1
    assert value(registry, "mongolock_acquisitions_total", outcome="timeout", **exclusive) == 1
    assert value(registry, "mongolock_releases_total", **exclusive) == 1
    assert value(registry, "mongolock_acquire_wait_seconds_count", outcome="timeout") == 1
    assert value(registry, "mongolock_acquire_wait_seconds_sum", outcome="timeout") >= 0.1
    assert value(registry, "mongolock_hold_seconds_count") == 1
    assert value(registry, "mongolock_held_locks") == 0
    assert value(registry, "mongolock_waiting_acquisitions") == waiting


def test_waiting_gauge_counts_a_blocked_acquire(
    manager: LockManager, other: LockManager, registry: CollectorRegistry
) -> None:
    waiting = value(registry, "mongolock_waiting_acquisitions")
    holder = manager.acquire("m-wait", ttl=10)
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(other.acquire("m-wait", timeout=10)))
    waiter.start()
    pause = threading.Event()
    for _ in range(500):  # 5 s at most
        if value(registry, "mongolock_waiting_acquisitions") >= waiting + 1 or pause.wait(0.01):
            break
    assert value(registry, "mongolock_waiting_acquisitions") == waiting + 1
    holder.release()
    waiter.join(10)
    assert got
    assert value(registry, "mongolock_waiting_acquisitions") == waiting
    assert value(registry, "mongolock_held_locks") == 1


def test_losses_by_reason_and_refresher_histograms(
    manager: LockManager, other: LockManager, registry: CollectorRegistry
) -> None:
    lock = manager.acquire("m-lost", ttl=30)
    get_refresher().tick()
    assert get_notices().drain(5.0)  # ticks and losses are told on a notice worker
    assert value(registry, "mongolock_refresh_tick_seconds_count") >= 1
    assert value(registry, "mongolock_refresh_lag_seconds_count") >= 1
    other.force_release("m-lost")
    with pytest.raises(LockLost):
        lock.refresh()
    assert get_notices().drain(5.0)
    assert value(registry, "mongolock_losses_total", reason="force-released") == 1
    assert value(registry, "mongolock_held_locks") == 0


def test_a_handoff_is_counted(
    manager: LockManager, other: LockManager, registry: CollectorRegistry
) -> None:
    holder = manager.acquire("m-handoff", ttl=10)
    got: list[Lock] = []
    waiter = threading.Thread(target=lambda: got.append(other.acquire("m-handoff", timeout=10)))
    waiter.start()
    pause = threading.Event()
    status = None
    deadline = clock.now() + 10
    while clock.now() < deadline:  # until the waiter's attempt put it in line
        status = manager.status("m-handoff")
        if (status is not None and status.waiting) or pause.wait(0.01):
            break
    assert status is not None
    assert status.waiting == 1
    assert value(registry, "mongolock_handoffs_total") == 0
    holder.release()  # hands the lock to the waiter, first in line
    waiter.join(10)
    (handed,) = got
    assert get_notices().drain(5.0)
    assert value(registry, "mongolock_handoffs_total") == 1
    assert handed.token > holder.token
    handed.release()


def test_key_label_is_opt_in_and_bounded(manager: LockManager) -> None:
    registry = CollectorRegistry()
    metrics = LockMetrics(registry, key_label=lambda key: key.split(":", 1)[0])
    try:
        manager.acquire("report:1", ttl=10).release()
        manager.acquire("report:2", ttl=10).release()
        labels = {"outcome": "acquired", "mode": "exclusive", "key": "report"}
        assert value(registry, "mongolock_acquisitions_total", **labels) == 2
        assert value(registry, "mongolock_hold_seconds_count", key="report") == 2
    finally:
        metrics.close()
    # Closed: nothing left in the registry, and later locks change nothing.
    assert b"mongolock_" not in generate_latest(registry)
    manager.acquire("report:3", ttl=10).release()
    assert b"mongolock_" not in generate_latest(registry)


def test_no_key_label_by_default(manager: LockManager, registry: CollectorRegistry) -> None:
    manager.acquire("secret-key-name", ttl=10).release()
    text = generate_latest(registry).decode()
    assert "mongolock_acquisitions_total" in text
    assert "secret-key-name" not in text


def test_install_once_and_bad_arguments() -> None:
    registry = CollectorRegistry()
    try:
        first = prometheus.install(registry)
        assert prometheus.install(registry) is first
    finally:
        prometheus.uninstall()
    assert b"mongolock_" not in generate_latest(registry)
    with pytest.raises(TypeError):
        LockMetrics(CollectorRegistry(), key_label="prefix")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="namespace"):
        LockMetrics(CollectorRegistry(), namespace="not valid")


def test_the_metrics_are_updated_off_the_callers_thread(
    manager: LockManager, only_listener: None
) -> None:
    registry = CollectorRegistry()
    metrics = LockMetrics(registry)
    applied: list[str] = []
    apply = metrics.apply

    def watched(event: object) -> None:
        applied.append(threading.current_thread().name)
        apply(event)  # type: ignore[arg-type]

    metrics.apply = watched  # type: ignore[method-assign]
    try:
        manager.acquire("m-aside", ttl=10).release()
        deadline = clock.now() + 10
        while len(applied) < 2 and clock.now() < deadline:
            threading.Event().wait(0.01)
        # The acquisition and the release, applied by the metrics' thread alone.
        assert applied == ["mongolock-metrics"] * 2
        assert value(registry, "mongolock_releases_total", mode="exclusive") == 1
        # A scrape applies what is still queued before it reads (the thread, woken by
        # the next post, now lets a minute's batch gather).
        metrics.backlog.delay = 60
        manager.acquire("m-aside", ttl=10).release()
        assert value(registry, "mongolock_releases_total", mode="exclusive") == 2
        assert applied[2:] == [threading.current_thread().name] * 2
    finally:
        metrics.close()


def test_flush_applies_what_is_queued(manager: LockManager, only_listener: None) -> None:
    registry = CollectorRegistry()
    metrics = prometheus.install(registry)
    metrics.backlog.delay = 60  # its thread would apply them a minute after the first
    try:
        manager.acquire("m-flush", ttl=10).release()
        assert len(metrics.backlog._jobs) == 2
        prometheus.flush()
        assert len(metrics.backlog._jobs) == 0
        sample = metrics.releases.labels("exclusive")._value.get()  # not through a scrape
        assert sample == 1
    finally:
        prometheus.uninstall()
    prometheus.flush()  # nothing installed: nothing to do
