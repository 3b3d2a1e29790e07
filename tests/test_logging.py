"""The log lines users care about, with their fields as ``extra`` (real server, real lanes)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import pytest

from django_mongolock import LockLost, LockManager, events


def _fields(record: logging.LogRecord, *names: str) -> dict[str, object]:
    return {name: record.__dict__[name] for name in names}


def test_uncontended_acquire_logs_nothing_at_info(
    manager: LockManager, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, "django_mongolock"):
        for _ in range(3):
            manager.acquire("log-free", ttl=10).release()
    assert [r.getMessage() for r in caplog.records if r.name.startswith("django_mongolock")] == []


def test_acquired_after_waiting(
    manager: LockManager, other: LockManager, caplog: pytest.LogCaptureFixture
) -> None:
    holder = manager.acquire("log-wait", ttl=10)
    threading.Timer(0.2, holder.release).start()
    with caplog.at_level(logging.INFO, "django_mongolock.manager"):
        waiter = other.acquire("log-wait", timeout=10)
    waiter.release()
    (record,) = [r for r in caplog.records if "after waiting" in r.getMessage()]
    assert record.levelno == logging.INFO
    assert _fields(record, "key", "owner", "token", "shared") == {
        "key": "log-wait",
        "owner": waiter.owner,
        "token": waiter.token,
        "shared": False,
    }
    waited = record.__dict__["waited_seconds"]
    assert isinstance(waited, float)
    assert waited > 0.1


def test_lost_and_force_released(
    manager: LockManager, other: LockManager, caplog: pytest.LogCaptureFixture
) -> None:
    lock = manager.acquire("log-lost", ttl=30)
    other.force_release("log-lost", reason="stuck job")
    with caplog.at_level(logging.INFO, "django_mongolock"), pytest.raises(LockLost):
        lock.refresh()
    (record,) = [r for r in caplog.records if "lost" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert _fields(record, "key", "owner", "token", "reason") == {
        "key": "log-lost",
        "owner": lock.owner,
        "token": lock.token,
        "reason": "force-released",
    }


def test_a_force_release_is_logged_with_who_and_why(
    manager: LockManager, other: LockManager, caplog: pytest.LogCaptureFixture
) -> None:
    lock = manager.acquire("log-forced", ttl=30)
    with caplog.at_level(logging.INFO, "django_mongolock"):
        other.force_release("log-forced", reason="stuck job", by="ops@host")
    (record,) = [r for r in caplog.records if r.getMessage().startswith("force-released")]
    assert record.levelno == logging.INFO
    assert _fields(record, "key", "owner", "token", "by", "reason") == {
        "key": "log-forced",
        "owner": lock.owner,
        "token": lock.token,
        "by": "ops@host",
        "reason": "stuck job",
    }


@pytest.fixture
def stall_once(manager: LockManager) -> Iterator[threading.Event]:
    """An observer that holds up the first tick of ``manager``'s lane (a stalled lane)."""
    stalled = threading.Event()

    def observer(event: events.Event) -> None:
        if (
            isinstance(event, events.RefresherTick)
            and event.source is manager
            and not stalled.is_set()
        ):
            stalled.set()
            threading.Event().wait(1.0)

    unsubscribe = events.subscribe(observer)
    yield stalled
    unsubscribe()


def test_refresher_behind_schedule(
    manager: LockManager, stall_once: threading.Event, caplog: pytest.LogCaptureFixture
) -> None:
    # Ticks every 0.6 s; the stalled tick makes the next one start about 0.4 s late (the
    # warning comes past 0.3 s), while the lease (1.8 s, less its margin) still runs.
    with caplog.at_level(logging.WARNING, "django_mongolock.refresher"):
        lock = manager.acquire("log-late", ttl=1.8)
        assert stall_once.wait(5)
        found = threading.Event()
        for _ in range(100):
            if any("behind" in r.getMessage() for r in caplog.records):
                found.set()
                break
            found.wait(0.05)
    assert found.is_set()
    record = next(r for r in caplog.records if "behind" in r.getMessage())
    lag = record.__dict__["lag_seconds"]
    assert isinstance(lag, float)
    assert lag > 0.3
    assert record.__dict__["leases"] == 1
    assert record.__dict__["interval_seconds"] == pytest.approx(0.6)
    lock.release()
