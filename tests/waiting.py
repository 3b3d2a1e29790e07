"""Bounded waits on what a manager's waiters see: their line, their change stream."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from django_mongolock import Lock, LockManager
from django_mongolock.watcher import Watcher


def in_line(
    manager: LockManager,
    key: str,
    count: int,
    timeout: float = 20.0,
    failed: Callable[[], object] = lambda: None,
) -> None:
    """Wait (bounded) until ``count`` waiters are in ``key``'s line; fail at once with
    what ``failed()`` returns once that is not None (a waiter's error)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (error := failed()) is not None:
            raise AssertionError(f"a waiter on {key!r} failed, in line or not: {error!r}")
        doc = manager.store.collection.find_one({"_id": key}, projection={"waiters": 1})
        places = (doc or {}).get("waiters") or ()
        if sum("owner" in place for place in places) >= count:  # not those marked lapsed
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


def streams_open(collection: Any, count: int, timeout: float = 60.0) -> None:
    """Wait (bounded) until the server has at least ``count`` change streams open on
    ``collection`` (a pymongo collection), for waiters in other processes, whose
    managers a test cannot ask. Every change-stream cursor on the namespace counts
    (idle ones too, between two of a stream's getMores, and those of a killed process
    until the server times them out): use it where only the waiters open streams.
    Needs the ``inprog`` privilege (the test servers run without access control)."""
    admin = collection.database.client.admin
    namespace = f"{collection.database.name}.{collection.name}"
    stages = [
        {"$currentOp": {"allUsers": True, "idleCursors": True}},
        {
            "$match": {
                "ns": namespace,
                "cursor.originatingCommand.pipeline.0.$changeStream": {"$exists": True},
            }
        },
    ]
    until(
        lambda: len(list(admin.aggregate(stages))) >= count,
        timeout,
        f"{count} change stream(s) open on {namespace}",
    )


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


# The holder's lease in ``Wait``; a waiter woken by the stream is woken long before.
LEASE = 30.0
# How soon after a release a waiter woken by the stream must hold the lock (generous: a
# loaded machine); polling would find it free too, which the attempt count rules out.
WOKEN_WITHIN = 10.0
# How long a waiter on a healthy stream is watched before the release: a waiter that
# polled instead (back-off capped at half a second) would try about ten times in it.
QUIET = 2.0
QUIET_ATTEMPTS = 3


class Waiter:
    """A thread of ``waiting`` blocked on ``key``, which ``holding`` holds; built once
    the waiter is in line, so a release from then on is one it has to wait for (a
    release before its first attempt would find it no waiter at all)."""

    def __init__(
        self, holding: LockManager, waiting: LockManager, key: str, timeout: float = LEASE
    ) -> None:
        self.result: list[Any] = []
        self.thread = threading.Thread(target=self._run, args=(waiting, key, timeout))
        self.thread.start()
        in_line(holding, key, 1, failed=self._failure)

    def _failure(self) -> Exception | None:
        return next((r for r in self.result if isinstance(r, Exception)), None)

    def _run(self, waiting: LockManager, key: str, timeout: float) -> None:
        try:
            lock = waiting.acquire(key, timeout=timeout)
        except Exception as exc:  # reported to the test by ``join``
            self.result.append(exc)
            return
        self.result.append((lock, time.monotonic()))
        lock.release()

    def _outcome(self, timeout: float) -> Any:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the waiter is still waiting"
        [outcome] = self.result
        return outcome

    def join(self, timeout: float = LEASE + 10) -> tuple[Lock, float]:
        """The lock the waiter got (released since) and when it got it (bounded)."""
        outcome = self._outcome(timeout)
        assert not isinstance(outcome, Exception), outcome
        lock, acquired_at = outcome
        return lock, acquired_at

    def error(self, timeout: float = LEASE + 10) -> Exception:
        """What the waiter's acquisition raised (bounded): ``join``'s counterpart for a
        waiter that must fail."""
        outcome = self._outcome(timeout)
        assert isinstance(outcome, Exception), f"the waiter got the lock: {outcome}"
        return outcome


class Wait:
    """A ``Waiter`` of ``waiting`` blocked on ``key``, which ``holding`` holds for ``LEASE``.

    Every acquire attempt of ``waiting``'s store is counted, so that a waiter woken by
    the stream can be told from one that polls.
    """

    def __init__(self, holding: LockManager, waiting: LockManager, key: str) -> None:
        self.waiting = waiting
        self.attempts = count_attempts(waiting)
        self.holder = holding.acquire(key, ttl=LEASE)
        self.waiter = Waiter(holding, waiting, key)

    def woken_by_release(self, role: str) -> Any:
        """Watch the waiter sleep, release, and check the stream woke it at once; the
        lock it got (released since)."""
        watcher = self.waiting.watcher
        assert streaming_as(watcher, role)(), (watcher.role, watcher.healthy)
        before, events = len(self.attempts), watcher.events
        time.sleep(QUIET)  # a window to count attempts in, not an assertion
        quiet = len(self.attempts) - before
        released_at = time.monotonic()
        assert self.holder.release()
        lock, acquired_at = self.waiter.join()
        assert lock.token > self.holder.token
        # Woken by the event of the release, long before the lease would have ended,
        # and without polling for it.
        assert acquired_at - released_at < WOKEN_WITHIN
        assert quiet <= QUIET_ATTEMPTS, f"{quiet} attempts in {QUIET:g} s: the waiter polled"
        assert watcher.events > events
        assert watcher.role == role
        return lock
