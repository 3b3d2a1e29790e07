"""Bounded waits on what a manager's waiters see: their line, their change stream."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from django_mongolock import LockManager
from django_mongolock.watcher import Watcher


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


def until(check: Callable[[], object], timeout: float, what: str) -> float:
    """Poll ``check`` until true (bounded); how long it took."""
    started = time.monotonic()
    deadline = started + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g} s"
        time.sleep(0.02)
    return time.monotonic() - started


def streaming_as(watcher: Watcher, role: str) -> Callable[[], bool]:
    """Whether ``watcher`` has a healthy stream in ``role`` ("leader", "follower", "own")."""
    return lambda: watcher.role == role and watcher.healthy


def lead_and_follow(make: Callable[[], LockManager]) -> tuple[LockManager, LockManager]:
    """Two managers from ``make`` (``shared_stream`` on): the first leads, the second
    follows it (bounded)."""
    leading, following = make(), make()
    leading.watcher.ensure_running()
    until(streaming_as(leading.watcher, "leader"), 30, "leading")
    following.watcher.ensure_running()
    until(streaming_as(following.watcher, "follower"), 30, "following")
    return leading, following


def count_attempts(manager: LockManager) -> list[float]:
    """Record the time of every acquire attempt ``manager``'s store makes from now on."""
    store = manager.store
    attempts: list[float] = []
    real: Callable[..., Any] = store.acquire

    def acquire(*args: Any, **kwargs: Any) -> Any:
        attempts.append(time.monotonic())
        return real(*args, **kwargs)

    store.acquire = acquire  # type: ignore[method-assign]
    return attempts
