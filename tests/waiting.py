"""Bounded waits on what a manager's waiters see: their line, their change stream."""

from __future__ import annotations

import time

from django_mongolock import LockManager


def in_line(manager: LockManager, key: str, count: int, timeout: float = 20.0) -> None:
    """Wait (bounded) until ``count`` waiters are in ``key``'s line."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        doc = manager.store.collection.find_one({"_id": key}, projection={"waiters": 1})
        if doc is not None and len(doc.get("waiters") or ()) >= count:
            return
        time.sleep(0.02)
    raise AssertionError(f"{count} waiters did not join the line of {key!r} in {timeout:g}s")


def stream_open(manager: LockManager, timeout: float = 60.0) -> None:
    """Open ``manager``'s change stream before its waiter's first attempt, so that the
    waiter sleeps on it rather than backing off while the stream opens (bounded)."""
    manager.watcher.ensure_running()
    deadline = time.monotonic() + timeout
    while manager.watcher.healthy_since() is None:
        assert time.monotonic() < deadline, f"the change stream did not open in {timeout:g}s"
        time.sleep(0.02)
