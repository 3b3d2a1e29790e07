"""The log lines users care about, with their fields as ``extra`` (real server, real lanes)."""

from __future__ import annotations

import logging
import time

import pytest

from django_mongolock import LockLost, LockManager, clock, events
from tests.waiting import Waiter


def _fields(record: logging.LogRecord, *names: str) -> dict[str, object]:
    return {name: record.__dict__[name] for name in names}


def _ours(
    records: list[logging.LogRecord], manager: LockManager, key: str
) -> list[logging.LogRecord]:
    """The package's records but those of other keys and of other managers' refresher
    lanes, which any lane of the process (another test's included) may write meanwhile."""
    own_lane = f"mongolock-refresher-{id(manager):x}"
    return [
        r
        for r in records
        if r.name.startswith("django_mongolock")
        and not (
            (r.threadName or "").startswith("mongolock-refresher-") and r.threadName != own_lane
        )
        and r.__dict__.get("key", key) == key
    ]


def test_uncontended_acquire_logs_nothing_at_info(
    manager: LockManager, caplog: pytest.LogCaptureFixture, no_leftovers: None
) -> None:
    with caplog.at_level(logging.INFO, "django_mongolock"):
        for _ in range(3):
            manager.acquire("log-free", ttl=10).release()
    assert [r.getMessage() for r in _ours(caplog.records, manager, "log-free")] == []


def test_acquired_after_waiting(
    manager: LockManager, other: LockManager, caplog: pytest.LogCaptureFixture
) -> None:
    holder = manager.acquire("log-wait", ttl=10)
    with caplog.at_level(logging.INFO, "django_mongolock.manager"):
        waiting = Waiter(manager, other, "log-wait", timeout=20)
        time.sleep(0.2)
        holder.release()
        waiter, _ = waiting.join()
    (record,) = [
        r
        for r in caplog.records
        if "after waiting" in r.getMessage() and r.__dict__.get("key") == "log-wait"
    ]
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
    (record,) = [r for r in _ours(caplog.records, manager, "log-lost") if "lost" in r.getMessage()]
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


def test_refresher_behind_schedule(manager: LockManager, caplog: pytest.LogCaptureFixture) -> None:
    """What a lane reports after a tick that started 0.4 s late, on an interval of 0.6 s."""
    with caplog.at_level(logging.WARNING, "django_mongolock.refresher"):
        events.tick(manager, clock.now(), 0.4, 1, 0.6, ok=True)
        events.tick(manager, clock.now(), 0.2, 1, 0.6, ok=True)  # within half an interval
    # A real lane that runs late meanwhile reports its own lag, not these.
    behind = [r for r in caplog.records if "behind" in r.getMessage()]
    told = [r for r in behind if r.__dict__["interval_seconds"] == pytest.approx(0.6)]
    assert [r for r in told if r.__dict__["lag_seconds"] == 0.2] == []
    (record,) = [r for r in told if r.__dict__["lag_seconds"] == 0.4]
    assert record.levelno == logging.WARNING
    assert record.__dict__["lag_seconds"] == 0.4
    assert record.__dict__["leases"] == 1
    assert record.__dict__["interval_seconds"] == pytest.approx(0.6)
