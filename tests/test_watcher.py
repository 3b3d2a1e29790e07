"""Waiters woken by the release through one change stream, and their fallback to back-off."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
from pymongo import MongoClient

from django_mongolock import Lock, LockManager
from django_mongolock.acquirer import BEHIND_IN_LINE
from django_mongolock.astore import AsyncLockStore
from django_mongolock.store import LockStore
from django_mongolock.testing import MongoReplicaSet
from django_mongolock.watcher import Watcher
from tests.utils import NamedManager
from tests.waiting import WOKEN_WITHIN, count_attempts, in_line, stream_open, until


def _wait_in_thread(
    manager: LockManager, key: str, timeout: float
) -> tuple[threading.Thread, list[Any]]:
    result: list[Any] = []

    def run() -> None:
        started = time.monotonic()
        try:
            lock = manager.acquire(key, timeout=timeout)
        except Exception as exc:  # reported to the test
            result.append(exc)
        else:
            result.append((lock, time.monotonic() - started, time.monotonic()))

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def test_a_waiter_wakes_on_release_without_polling(
    manager: LockManager, other: LockManager
) -> None:
    holder = manager.acquire("stream", ttl=30)
    # The stream opens first: attempts made while a slow server opens it back off, as
    # they must, and are not what this test counts.
    stream_open(other)
    attempts = count_attempts(other)
    thread, result = _wait_in_thread(other, "stream", timeout=20)
    time.sleep(2.0)
    tries_while_waiting = len(attempts)
    released_at = time.monotonic()
    assert holder.release()
    thread.join(timeout=10)
    assert not thread.is_alive()
    lock, _, acquired_at = result[0]
    assert isinstance(lock, Lock)
    assert lock.token > holder.token
    # With a healthy stream the waiter does not poll: a back-off loop would have made
    # about ten attempts in two seconds.
    assert tries_while_waiting <= 4
    assert other.watcher.events >= 1
    # Woken by the delete event, long before the holder's 30 s lease would have ended.
    assert acquired_at - released_at < WOKEN_WITHIN
    lock.release()


def test_a_release_wakes_only_the_waiters_of_that_key(
    manager: LockManager, other: LockManager
) -> None:
    first = manager.acquire("key-a", ttl=30)
    second = manager.acquire("key-b", ttl=30)
    stream_open(other)
    attempts = count_attempts(other)
    thread_a, result_a = _wait_in_thread(other, "key-a", timeout=20)
    # Its last attempt, at its timeout, comes well after the counted window.
    thread_b, result_b = _wait_in_thread(other, "key-b", timeout=8)
    in_line(manager, "key-a", 1)  # both first attempts made, and counted
    in_line(manager, "key-b", 1)
    before = len(attempts)
    first.release()
    thread_a.join(timeout=10)
    assert isinstance(result_a[0][0], Lock)
    time.sleep(0.5)
    # The release handed key-a to its waiter, which took it from the change stream
    # without another attempt; key-b's waiter was not woken.
    assert len(attempts) - before == 0
    assert result_a[0][0].token > first.token
    thread_b.join(timeout=15)
    assert isinstance(result_b[0], Exception)
    result_a[0][0].release()
    second.release()


def test_waiters_still_acquire_when_the_stream_is_down(
    manager: LockManager, other: LockManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Watcher, "ensure_running", lambda self, owner="": None)
    holder = manager.acquire("no-stream", ttl=30)
    attempts = count_attempts(other)
    started = time.monotonic()
    thread, result = _wait_in_thread(other, "no-stream", timeout=20)
    # Without the stream the waiter tries again, backing off: its first attempts come
    # fast (a waiter that took the stream for up would look again only after
    # ``BEHIND_IN_LINE``, 1.5 s), but no hammering, which would make hundreds in 1.5 s.
    until(lambda: len(attempts) >= 3, 10, "three attempts without the stream")
    assert attempts[2] - attempts[0] < 1.0
    time.sleep(max(0.0, started + 1.5 - time.monotonic()))
    assert not other.watcher.healthy
    assert len(attempts) <= 20
    holder.release()
    thread.join(timeout=10)
    lock, _, _ = result[0]
    assert isinstance(lock, Lock)
    lock.release()


def test_the_watcher_is_one_thread_shared_by_all_waiters(
    manager: LockManager, other: LockManager
) -> None:
    holder = manager.acquire("crowd", ttl=30)
    tokens: list[int] = []
    errors: list[BaseException] = []
    # Watchers of earlier tests' managers may still be winding down: count only new ones.
    watchers_before = {t for t in threading.enumerate() if t.name == "mongolock-watcher"}

    def take_and_hand_on() -> None:
        try:
            with other.lock("crowd", timeout=30) as lock:
                tokens.append(lock.token)
                time.sleep(0.05)
        except BaseException as exc:  # reported to the test
            errors.append(exc)

    threads = [threading.Thread(target=take_and_hand_on) for _ in range(5)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 10
    while (len(other.waiters) < 5 or not other.watcher.healthy) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(other.waiters) == 5
    new = [
        t
        for t in threading.enumerate()
        if t.name == "mongolock-watcher" and t not in watchers_before
    ]
    assert len(new) == 1
    holder.release()
    for thread in threads:
        thread.join(timeout=30)
    assert errors == []
    assert len(tokens) == 5
    assert tokens == sorted(tokens)
    assert tokens[0] > holder.token
    assert other.watcher.opened == 1


def _attempts_by_owner(monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, str]]:
    """When each acquire attempt of any store (sync or async) is sent from now on, and
    for which holder id."""
    attempts: list[tuple[float, str]] = []
    sync, coroutine = LockStore.acquire, AsyncLockStore.acquire

    def acquire(self: LockStore, key: str, owner: str, *args: Any, **kwargs: Any) -> Any:
        attempts.append((time.monotonic(), owner))
        return sync(self, key, owner, *args, **kwargs)

    async def aacquire(
        self: AsyncLockStore, key: str, owner: str, *args: Any, **kwargs: Any
    ) -> Any:
        attempts.append((time.monotonic(), owner))
        return await coroutine(self, key, owner, *args, **kwargs)

    monkeypatch.setattr(LockStore, "acquire", acquire)
    monkeypatch.setattr(AsyncLockStore, "acquire", aacquire)
    return attempts


@pytest.mark.parametrize("kind", ["thread", "coroutine"])
def test_a_waiter_behind_another_tries_again_as_soon_as_its_stream_fails(
    fail_points: MongoReplicaSet, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A waiter behind another sleeps on its stream until the line check; when the
    stream fails, the releases that would have woken it may go unheard (and MongoDB may
    be gone): it tries again at once, not when its timer ends."""
    database = f"stream-fails-{kind}"
    admin: MongoClient[dict[str, Any]] = MongoClient(fail_points.nodes[0].direct_url)
    holding = LockManager(fail_points.url, database=database)
    waiting = NamedManager(fail_points.url, database=database, app=database)
    results: list[Any] = []

    def wait() -> None:
        try:
            if kind == "thread":
                lock = waiting.acquire("line", ttl=30, timeout=30)
            else:
                lock = asyncio.run(waiting.aacquire("line", ttl=30, timeout=30))
            results.append(int(lock.token))
            lock.release()
        except Exception as exc:  # reported to the test
            results.append(exc)

    holder = holding.acquire("line", ttl=30)
    threads = [threading.Thread(target=wait) for _ in range(2)]
    try:
        stream_open(waiting)
        for count, thread in enumerate(threads, 1):
            thread.start()
            in_line(waiting, "line", count)
        attempts = _attempts_by_owner(monkeypatch)
        # The stream's next read fails with an error it does not resume after.
        admin.admin.command(
            "configureFailPoint",
            "failCommand",
            mode={"times": 1},
            data={"failCommands": ["getMore"], "errorCode": 2, "appName": database},
        )
        until(lambda: not waiting.watcher.healthy, 10, "the stream failed")
        failed_at = time.monotonic()
        # The head of the line tries again (the failure counts as its wake-up), and so
        # does the waiter behind it, long before it would look again by itself
        # (``BEHIND_IN_LINE`` after a wake-up that was not its turn).
        until(lambda: len({owner for _, owner in attempts}) >= 2, 10, "both waiters tried")
        # Any attempt counts only if it came after the failure: a waiter's timer would
        # not end for seconds yet.
        assert attempts[0][0] >= failed_at - 0.5, (failed_at, attempts)
        second = min(at for at, owner in attempts if owner != attempts[0][1])
        assert second - failed_at < BEHIND_IN_LINE / 2, (failed_at, attempts)
        until(lambda: waiting.watcher.healthy, 10, "the stream reopened")
        assert holder.release()
        for thread in threads:
            thread.join(timeout=30)
            assert not thread.is_alive()
        assert [type(result) for result in results] == [int, int], results
        assert holder.token < results[0] < results[1]
    finally:
        admin.admin.command("configureFailPoint", "failCommand", mode="off")
        # Nobody left waiting, then nothing left behind: a late attempt would make the
        # database again.
        holder.release()
        for thread in threads:
            if thread.is_alive():
                thread.join(timeout=30)
        holding.close()
        waiting.close()
        admin.drop_database(database)
        admin.close()
