"""A blocking acquire's first request: without a place in line, unless the key was lately busy.

The server parses an acquire that queues (its line's expressions) more slowly than one
that does not, and an uncontended acquire never needs the line. So a blocking acquire of
a key this process has not lately found busy first asks without queueing, in one round
trip; only a busy key costs a second request, which joins the line. A key found busy is
remembered for a while (``BUSY_FOR``, from the last time it was), and a blocking acquire
of it meanwhile joins the line at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from django_mongolock import LockManager, LockNotAcquired, clock, waiters
from django_mongolock.waiters import Waiters
from tests.commands import RecordedManager, Recorder


@pytest.fixture
def recorded(mongolock_url: str, manager: LockManager) -> Iterator[RecordedManager]:
    """A manager on the test's collection whose every command is recorded."""
    made = RecordedManager(mongolock_url, database=manager.database, collection=manager.collection)
    made.recorder = Recorder()  # read when the first client is built, not before
    yield made
    made.close()


def acquires(recorded: RecordedManager, since: int = 0) -> list[bool]:
    """The acquire commands sent on the lock collection (from the ``since``-th on): for
    each, whether it asked for a place in line."""
    sent = recorded.recorder.on(recorded.database, recorded.collection)
    return [
        "position" in s.command.get("fields", {})
        for s in sent
        if s.name == "findAndModify" and s.command.get("upsert")
    ][since:]


def waiting_in_line(manager: LockManager, key: str) -> int:
    status = manager.status(key)
    return 0 if status is None else status.waiting


def test_an_uncontended_blocking_acquire_sends_one_request_without_the_line(
    recorded: RecordedManager,
) -> None:
    for _ in range(3):
        with recorded.acquire("first-free", timeout=5):
            pass
    assert acquires(recorded) == [False, False, False]
    assert not recorded.waiters.lately_busy("first-free")


def test_a_busy_key_joins_the_line_with_a_second_request_then_with_the_first(
    recorded: RecordedManager, other: LockManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    holder = other.acquire("first-busy", ttl=30)
    try:
        with pytest.raises(LockNotAcquired):
            recorded.acquire("first-busy", timeout=0.3)
        sent = acquires(recorded)
        assert sent[:2] == [False, True], sent
        assert all(sent[1:]), sent  # every attempt after the first keeps its place
        assert recorded.waiters.lately_busy("first-busy")
        before = len(sent)
        with pytest.raises(LockNotAcquired):
            recorded.acquire("first-busy", timeout=0.3)
        assert all(acquires(recorded, before)), acquires(recorded, before)
        assert acquires(recorded, before)[0] is True
    finally:
        holder.release()
    # Lately busy: the next acquires queue at once, free as the key is now, until the
    # memory of the busy key has aged; then they ask without the line again.
    before = len(acquires(recorded))
    for _ in range(2):
        with recorded.acquire("first-busy", timeout=5):
            pass
    assert acquires(recorded, before) == [True, True]
    monkeypatch.setattr(waiters, "BUSY_FOR", 0.0)
    assert not recorded.waiters.lately_busy("first-busy")
    with recorded.acquire("first-busy", timeout=5):
        pass
    assert acquires(recorded, before) == [True, True, False]


def test_a_coroutine_waits_in_the_line_its_second_request_joined(
    recorded: RecordedManager, other: LockManager
) -> None:
    """The async acquire does the same, and its second request's place is a real one:
    the key's line counts it, and the holder's release lets it take the key."""
    holder = other.acquire("first-handed", ttl=30)
    got: list[Any] = []

    async def wait() -> None:
        lock = await recorded.aacquire("first-handed", timeout=20)
        got.append(lock.token)
        await lock.arelease()

    async def main() -> None:
        waiting = asyncio.ensure_future(wait())
        deadline = clock.now() + 10
        while not waiting_in_line(recorded, "first-handed"):
            assert clock.now() < deadline, "the waiter never joined the line"
            await asyncio.sleep(0.02)
        holder.release()
        await asyncio.wait_for(waiting, 20)

    try:
        asyncio.run(main())
    finally:
        holder.release()
    assert len(got) == 1
    assert got[0] > holder.token
    assert acquires(recorded)[:2] == [False, True]


def test_a_key_found_busy_stays_remembered_when_the_second_request_takes_it(
    recorded: RecordedManager, other: LockManager
) -> None:
    """Freed between the two requests: the key was busy a moment ago, so the next
    acquire still joins the line with its first request."""
    holder = other.acquire("first-freed", ttl=30)
    store = recorded.store
    real = store.acquire

    def acquire(*args: Any, **kwargs: Any) -> Any:
        info = real(*args, **kwargs)
        if not kwargs["queue"]:
            holder.release()  # after the first request found the key busy
        return info

    store.acquire = acquire  # type: ignore[method-assign]
    try:
        with recorded.acquire("first-freed", timeout=5):
            pass
    finally:
        store.acquire = real  # type: ignore[method-assign]
        holder.release()
    assert acquires(recorded) == [False, True]
    assert recorded.waiters.lately_busy("first-freed")


def test_a_wait_keeps_the_key_remembered_until_it_ends(
    recorded: RecordedManager, other: LockManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key stays busy for as long as a waiter waits on it: its memory counts from the
    wait's end, not from the first request."""
    monkeypatch.setattr(waiters, "BUSY_FOR", 0.8)
    holder = other.acquire("first-waited", ttl=30)
    try:
        with pytest.raises(LockNotAcquired):
            recorded.acquire("first-waited", timeout=1.5)
        assert recorded.waiters.lately_busy("first-waited")
    finally:
        holder.release()


def test_a_request_without_the_line_takes_a_free_key_only_when_nobody_is_in_line(
    manager: LockManager,
) -> None:
    """A request without a place in line writes the line as empty when it takes the key:
    so it may take the key only when no live place is left, whatever its owner. Its own
    place at the head of the line does not make a free key its own (a request for the
    head's turn queues); lapsed places do not hold it back, and are cleared."""
    key = "first-no-line"
    store = manager.store
    holder = manager.acquire(key, ttl=30)
    head, behind = "web.1:1:00000000000a", "web.1:1:00000000000b"
    for place, owner in enumerate((head, behind)):
        assert store.acquire(key, owner, 30.0, queue=True).position == place
    assert holder.release()  # handed to the head: free the key by hand, line kept
    store.collection.update_one(
        {"_id": key},
        [
            {
                "$set": {
                    "owner": None,
                    "expires_at": "$$NOW",
                    "waiters": [
                        {"owner": head, "until": {"$add": ["$$NOW", 30_000]}, "at": "$$NOW"},
                        {"owner": behind, "until": {"$add": ["$$NOW", 30_000]}, "at": "$$NOW"},
                    ],
                }
            }
        ],
    )
    before = store.collection.find_one({"_id": key})
    assert before is not None
    for owner in (head, behind, "web.1:1:00000000000c"):
        answer = store.acquire(key, owner, 30.0)
        assert (answer.owner, answer.waiting) == ("", 2), owner
    assert store.collection.find_one({"_id": key}) == before  # nothing written

    # The head asks for its turn with its place: it takes the key, the line kept.
    taken = store.acquire(key, head, 30.0, queue=True)
    assert (taken.owner, taken.waiting) == (head, 1)
    assert store.release(key, head, taken.token, contended=True)

    # Only lapsed places left: a request without the line takes the key and clears them.
    store.collection.update_one(
        {"_id": key},
        [{"$set": {"owner": None, "expires_at": "$$NOW", "waiters.until": None}}],
    )
    mine = store.acquire(key, "web.1:1:00000000000d", 30.0)
    assert (mine.owner, mine.waiting) == ("web.1:1:00000000000d", 0)
    doc = store.collection.find_one({"_id": key})
    assert doc is not None
    assert doc["waiters"] == []
    assert doc["token"] > taken.token


def test_the_keys_lately_found_busy_are_bounded_in_number_and_in_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [1000.0]
    monkeypatch.setattr(clock, "now", lambda: now[0])
    registry = Waiters()
    for n in range(waiters.BUSY_KEYS + 1):
        registry.found_busy(f"k{n}")
    assert not registry.lately_busy("k0")  # the oldest gave way
    assert registry.lately_busy("k1")
    assert registry.lately_busy(f"k{waiters.BUSY_KEYS}")
    now[0] += waiters.BUSY_FOR - 1
    registry.found_busy("k1")  # busy again: remembered from now
    now[0] += 1
    assert not registry.lately_busy("k2")
    assert registry.lately_busy("k1")
