"""Prometheus metrics of the locks, read back from a real ``prometheus_client`` registry."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from django_mongolock import Lock, LockLost, LockManager, LockNotAcquired, clock, events
from django_mongolock.contrib import prometheus
from django_mongolock.contrib.prometheus import LockMetrics
from django_mongolock.notices import get_notices
from django_mongolock.refresher import get_refresher
from tests.utils import held_here


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


def _watched(metrics: LockMetrics) -> list[str]:
    """The names of the threads that apply ``metrics``' updates, in turn."""
    applied: list[str] = []
    apply = metrics.apply

    def watched(event: events.Event) -> None:
        applied.append(threading.current_thread().name)
        apply(event)

    metrics.apply = watched  # type: ignore[method-assign]
    return applied


def _releases(metrics: LockMetrics) -> float:
    """The exclusive releases counted, read from the metric itself (no registry)."""
    (family,) = metrics.releases.collect()
    return sum(s.value for s in family.samples if s.name.endswith("_total"))


def test_the_metrics_are_updated_off_the_callers_thread(
    manager: LockManager, only_listener: None
) -> None:
    registry = CollectorRegistry()
    metrics = LockMetrics(registry)
    applied = _watched(metrics)
    try:
        manager.acquire("m-aside", ttl=10).release()
        deadline = clock.now() + 10
        while len(applied) < 2 and clock.now() < deadline:
            time.sleep(0.01)
        # The acquisition and the release, applied by the metrics' thread alone.
        assert applied == ["mongolock-metrics"] * 2
        assert value(registry, "mongolock_releases_total", mode="exclusive") == 1
    finally:
        metrics.close()


@pytest.mark.parametrize("restricted", [False, True])
def test_a_scrape_applies_what_is_queued_before_it_reads(
    manager: LockManager, only_listener: None, restricted: bool
) -> None:
    registry = CollectorRegistry()
    metrics = LockMetrics(registry)
    metrics.backlog.delay = 60  # its thread would apply them a minute after the first
    applied = _watched(metrics)
    try:
        manager.acquire("m-scrape", ttl=10).release()
        assert applied == []  # queued, not applied, by the lock's caller
        name = "mongolock_releases_total"
        # A scrape of some names only (``?name[]=`` of the exporters) finds them too.
        reader = registry.restricted_registry([name]) if restricted else registry
        text = generate_latest(reader).decode()
        assert f'{name}{{mode="exclusive"}} 1.0' in text
        assert applied == [threading.current_thread().name] * 2
    finally:
        metrics.close()


def test_flush_and_close_apply_what_is_queued(manager: LockManager, only_listener: None) -> None:
    registry = CollectorRegistry()
    metrics = prometheus.install(registry)
    metrics.backlog.delay = 60
    try:
        manager.acquire("m-flush", ttl=10).release()
        assert _releases(metrics) == 0
        prometheus.flush()
        assert _releases(metrics) == 1
        manager.acquire("m-flush", ttl=10).release()
        assert _releases(metrics) == 1
    finally:
        prometheus.uninstall()  # closes the metrics: what is queued is applied
    assert _releases(metrics) == 2
    prometheus.flush()  # nothing installed: nothing to do


def test_past_the_limit_the_caller_applies_its_own_updates(
    manager: LockManager, only_listener: None
) -> None:
    metrics = LockMetrics(CollectorRegistry())
    metrics.backlog.delay = 60
    metrics.backlog.limit = 1
    applied = _watched(metrics)
    try:
        manager.acquire("m-full", ttl=10).release()  # the acquisition queued, the release not
        assert applied == [threading.current_thread().name]
        assert metrics.backlog.dropped == 0
        assert _releases(metrics) == 1
    finally:
        metrics.close()


def test_a_registry_that_refuses_the_metrics_keeps_none_of_them(
    only_listener: None,
) -> None:
    registry = CollectorRegistry()
    first = LockMetrics(registry)
    try:
        before = generate_latest(registry)
        with pytest.raises(ValueError, match="Duplicated timeseries"):
            LockMetrics(registry)  # the same names again
        assert generate_latest(registry) == before
        # The first one's collector alone: its metrics, each once.
        first_names = [family.name for family in first.collector.describe()]
        assert [family.name for family in registry.collect()] == first_names
        assert events.listening()  # the first one's observer, not a second one
    finally:
        first.close()
    assert not events.listening()
    assert b"mongolock_" not in generate_latest(registry)


def test_a_scrape_reads_the_metrics_under_the_job_lock_a_fork_waits_for(
    only_listener: None,
) -> None:
    registry = CollectorRegistry()
    metrics = LockMetrics(registry)
    held: list[bool] = []
    collect = metrics.acquisitions.collect

    def watched() -> Any:
        held.append(held_here(metrics.backlog.job))
        return collect()

    metrics.acquisitions.collect = watched  # type: ignore[method-assign]
    try:
        generate_latest(registry)
        assert held == [True]
        assert not held_here(metrics.backlog.job)  # let go after
    finally:
        metrics.close()
