"""A release hands the lock to the first waiter in line, in the release write itself.

Waiters are processes of their own (spawned), so the lock really crosses processes and
the waiter learns of it from its change stream. The documents are read back from the
server right after each release: the handoff is in the release write, not in a later
write of the waiter.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
from pymongo import MongoClient

from django_mongolock import Lock, LockManager, LockNotAcquired, acquirer, acquiring, events
from django_mongolock.astore import AsyncLockStore
from django_mongolock.info import LockInfo
from django_mongolock.queries import (
    FREED_EVENTS,
    HANDOFF_LEASE_MS,
    LINE_CHECK_MS,
    PLACE_GRACE_MS,
    head_owner,
)
from django_mongolock.store import LockStore
from django_mongolock.waiters import Wake, _LoopEvent
from django_mongolock.watcher import Watcher
from tests.commands import RecordedManager, Recorder, Sent
from tests.waiting import stream_open, streams_open

# How long a waiter in line or a test waits for anything at most (never reached when green).
BOUND = 60.0
FIRST_LEASE = HANDOFF_LEASE_MS / 1000
BEHIND_IN_LINE = 0.75 * PLACE_GRACE_MS / 1000


def wait_then_hold(
    url: str, database: str, key: str, ttl: float, hold: float, results: Any
) -> None:
    """A waiter process: block on ``key``, hold it ``hold`` seconds, release; report both.

    While inside it counts itself in the ``inside`` document, and reports how many
    holders it found there (another holder inside would be an overlap).
    """
    manager = LockManager(url, database=database, collection="locks")
    client: MongoClient[dict[str, Any]] = MongoClient(url, w="majority")
    inside = client[database]["inside"]
    try:
        lock = manager.acquire(key, ttl=ttl, timeout=BOUND)
        got = time.monotonic()
        before = inside.find_one_and_update({"_id": key}, {"$inc": {"n": 1}}, upsert=True)
        others = 0 if before is None else int(before.get("n", 0))
        time.sleep(hold)
        valid = lock.valid
        inside.update_one({"_id": key}, {"$inc": {"n": -1}})
        released = lock.release()
        results.put(
            {
                "pid": os.getpid(),
                "owner": lock.owner,
                "token": lock.token,
                "got": got,
                "others": others,
                "valid": valid,
                "released": released,
            }
        )
    except Exception as exc:  # reported to the test
        results.put({"pid": os.getpid(), "error": repr(exc)})
    finally:
        client.close()
        manager.close()


@contextmanager
def _collection(url: str, database: str) -> Iterator[Any]:
    client: MongoClient[dict[str, Any]] = MongoClient(url, tz_aware=True)
    try:
        yield client[database]["locks"]
    finally:
        client.close()


def _line(locks: Any, key: str) -> list[str]:
    """The owners of the places in ``key``'s line, not those marked lapsed."""
    doc = locks.find_one({"_id": key}) or {}
    return [place["owner"] for place in doc.get("waiters") or () if "owner" in place]


def _join(
    context: Any, url: str, database: str, key: str, locks: Any, results: Any, **kwargs: Any
) -> tuple[Any, str]:
    """Start a waiter process and wait until it has a place in line: (process, owner)."""
    before = _line(locks, key)
    process = context.Process(
        target=wait_then_hold,
        args=(url, database, key, kwargs.get("ttl", 30.0), kwargs.get("hold", 0.3), results),
    )
    process.start()
    deadline = time.monotonic() + BOUND
    while len(line := _line(locks, key)) <= len(before):
        assert time.monotonic() < deadline, "the waiter never joined the line"
        assert process.is_alive() or not results.empty(), "the waiter ended early"
        time.sleep(0.02)
    return process, line[-1]


def _results(results: Any, count: int) -> list[dict[str, Any]]:
    got = [results.get(timeout=BOUND) for _ in range(count)]
    for result in got:
        assert "error" not in result, result
    return got


def test_a_release_hands_the_lock_to_the_head_of_the_line_across_processes(
    mongolock_url: str, manager: LockManager
) -> None:
    key = "handoff-line"
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    holder = manager.acquire(key, ttl=30)
    with _collection(mongolock_url, manager.database) as locks:
        # The first holds long enough that the document is read before it hands it on,
        # and within the 2 s first lease it was handed.
        first, first_owner = _join(
            context, mongolock_url, manager.database, key, locks, results, hold=1.0
        )
        second, second_owner = _join(context, mongolock_url, manager.database, key, locks, results)
        assert _line(locks, key) == [first_owner, second_owner]
        # Both waiters' change streams are open (they wait on them, not on a timer).
        streams_open(locks, 2)
        assert holder.release()
        handed = locks.find_one({"_id": key})
        assert handed is not None
        # The release write itself made the head of the line the holder, with a greater
        # token; the second waiter keeps its place.
        assert handed["owner"] == first_owner
        assert handed["token"] > holder.token
        assert [place.get("owner") for place in handed["waiters"]] == [None, second_owner]
        by_owner = {result["owner"]: result for result in _results(results, 2)}
    for process in (first, second):
        process.join(BOUND)
        assert process.exitcode == 0
    one, two = by_owner[first_owner], by_owner[second_owner]
    # The first waiter got the very lease the release handed over, and passed it on.
    assert one["token"] == handed["token"]
    assert holder.token < one["token"] < two["token"]
    assert one["got"] < two["got"]
    assert (one["others"], two["others"]) == (0, 0)
    assert [one["valid"], two["valid"], one["released"], two["released"]] == [True] * 4


def _dead_at_the_front(
    url: str, manager: LockManager, key: str, dying: int
) -> tuple[list[str], dict[str, Any], float]:
    """``dying`` waiter processes and a live one behind them join the line of a key held
    with a 30 s lease; the dying ones are killed, then the holder releases. The dead
    owners, the document as the release left it, and how long after the release the live
    waiter got the key."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    holder = manager.acquire(key, ttl=30)
    with _collection(url, manager.database) as locks:
        dead = [_join(context, url, manager.database, key, locks, results) for _ in range(dying)]
        alive, alive_owner = _join(context, url, manager.database, key, locks, results)
        for process, _ in dead:
            os.kill(process.pid, signal.SIGKILL)
            process.join(BOUND)
        released_at = time.monotonic()
        assert holder.release()
        handed = locks.find_one({"_id": key})
        assert handed is not None
        [result] = _results(results, 1)
    alive.join(BOUND)
    assert alive.exitcode == 0
    assert result["owner"] == alive_owner
    assert holder.token < handed["token"] < result["token"]
    assert result["others"] == 0
    return [owner for _, owner in dead], handed, result["got"] - released_at


def test_a_killed_waiter_is_skipped_within_its_first_lease(
    mongolock_url: str, manager: LockManager
) -> None:
    """The release cannot know that the head of the line just died: the dead waiter is
    handed the lock with a first lease of ``HANDOFF_LEASE_MS`` (not its ttl of 30 s),
    which it never extends; the handoff wakes the waiter behind it, which takes the key
    when that lease ends."""
    dead, handed, waited = _dead_at_the_front(mongolock_url, manager, "handoff-dead", 1)
    assert handed["owner"] == dead[0]
    assert handed["expires_at"] <= handed["acquired_at"] + timedelta(seconds=FIRST_LEASE)
    # Held back by the dead waiter's first lease, not by the 30 s it asked for.
    assert waited >= FIRST_LEASE - 0.1
    assert waited < FIRST_LEASE + BEHIND_IN_LINE + 10.0


def test_dead_waiters_in_a_row_hold_the_key_back_for_the_line_check_not_a_lease(
    mongolock_url: str, manager: LockManager
) -> None:
    """Two waiters die side by side at the front of the line. The release hands the key
    to the first, names the second head (whose process is gone, so nobody looks again),
    and cuts the live waiter's place behind them to the line check: that waiter looks
    again by then, finds both dead places lapsed, and takes the key, long before the
    holder's 30 s lease it last saw would have ended."""
    dead, handed, waited = _dead_at_the_front(mongolock_url, manager, "handoff-dead-row", 2)
    assert (handed["owner"], head_owner(handed["head"])) == tuple(dead)
    assert waited >= FIRST_LEASE - 0.1
    assert waited < FIRST_LEASE + LINE_CHECK_MS / 1000 + 5.0


def test_tokens_grow_and_sections_never_overlap_through_many_handoffs(
    mongolock_url: str, manager: LockManager
) -> None:
    """Four processes take turns through handoffs; every token is greater than the last."""
    key = "handoff-many"
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    holder = manager.acquire(key, ttl=30)
    processes = []
    with _collection(mongolock_url, manager.database) as locks:
        for _ in range(4):
            process, _ = _join(
                context, mongolock_url, manager.database, key, locks, results, hold=0.05
            )
            processes.append(process)
        streams_open(locks, 4)
        assert holder.release()
        got = sorted(_results(results, 4), key=lambda result: result["got"])
    for process in processes:
        process.join(BOUND)
        assert process.exitcode == 0
    tokens = [holder.token] + [result["token"] for result in got]
    assert tokens == sorted(set(tokens))
    assert all(result["others"] == 0 and result["valid"] for result in got)


def test_a_handed_lock_is_extended_to_its_ttl(manager: LockManager, other: LockManager) -> None:
    """Its first lease is short; the refresher extends it to the ttl asked for, and a
    waiter without the refresher extends it before the acquire returns."""
    for refresh in (True, False):
        key = f"handoff-extended-{refresh}"
        holder = manager.acquire(key, ttl=30)
        box: list[Any] = []

        def wait(key: str = key, refresh: bool = refresh, box: list[Any] = box) -> None:
            box.append(other.acquire(key, ttl=30, timeout=BOUND, refresh=refresh))

        stream_open(other)  # the waiter's manager's, before it lines up
        thread = threading.Thread(target=wait)
        thread.start()
        _until(lambda key=key: bool(_status(manager, key).waiting))
        holder.release()
        thread.join(BOUND)
        [lock] = box
        assert isinstance(lock, Lock)
        assert lock.token > holder.token
        assert lock.ttl == 30
        time.sleep(FIRST_LEASE + 0.5)
        assert lock.valid
        info = _status(manager, key)
        assert info.owner == lock.owner
        assert info.remaining > 20
        assert lock.release()


def test_a_waiter_that_finds_the_lock_handed_to_it_by_its_own_attempt_keeps_it(
    manager: LockManager, other: LockManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a change stream the waiter polls: its next attempt finds the lock already
    its own, with the short first lease, and the refresher still extends it in time."""
    monkeypatch.setattr(Watcher, "ensure_running", lambda self, owner="": None)
    key = "handoff-polled"
    with _handoffs_told(key) as told:
        _, lock, handed = _handed_on(
            manager, key, lambda: other.acquire(key, ttl=30, timeout=BOUND)
        )
    assert handed.expires_at - handed.acquired_at <= timedelta(seconds=FIRST_LEASE)
    assert handed.ttl == 30
    assert (lock.owner, lock.token) == (handed.owner, handed.token)
    # Told as a handoff, though no change event named the releasing holder.
    assert [(e.from_owner, e.to_owner, e.token) for e in told] == [("", lock.owner, lock.token)]
    time.sleep(FIRST_LEASE + 0.5)
    assert lock.valid
    assert _status(manager, key).remaining > 20
    assert lock.release()


def test_a_waiter_too_slow_for_its_handed_lease_waits_on(
    manager: LockManager, other: LockManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A waiter that sleeps past its handed first lease (no change stream, a long
    sleep) is not refused when it wakes: that acquisition is over, and the wait goes on
    as a new one, which takes the free key with a new token."""
    monkeypatch.setattr(Watcher, "ensure_running", lambda self, owner="": None)
    monkeypatch.setattr(
        acquirer,
        "next_delay",
        lambda info, since, sent_at, attempt, **_: (FIRST_LEASE + 1.0, attempt),
    )
    _waits_on_as_a_new_acquisition(manager, other, "handoff-slow")


@pytest.mark.parametrize("waiter", ["thread", "coroutine"])
@pytest.mark.parametrize("stalled", ["answer", "refresh"])
def test_a_waiter_whose_attempt_finds_its_handed_lease_too_late_waits_on(
    manager: LockManager,
    other: LockManager,
    monkeypatch: pytest.MonkeyPatch,
    waiter: str,
    stalled: str,
) -> None:
    """The waiter's own attempt finds the lock handed to it, and then stalls past the
    first lease's end: its answer comes late, or (``refresh=False``: the lease is
    extended before acquire returns) the extending refresh is held up. That refresh
    finds the lease over, and the wait goes on as a new acquisition instead of failing
    before its timeout."""
    monkeypatch.setattr(Watcher, "ensure_running", lambda self, owner="": None)  # it polls
    acquire, aacquire = LockStore.acquire, AsyncLockStore.acquire
    refresh_, arefresh = LockStore.refresh, AsyncLockStore.refresh
    refresh = stalled != "refresh"
    stalls: list[str] = []
    answer_stall = FIRST_LEASE + 0.5 if stalled == "answer" else 0.0

    def handed(answer: LockInfo, arguments: dict[str, Any]) -> bool:
        request = acquirer.Request(arguments["key"], arguments["owner"], arguments["ttl"])
        if answer.owner == request.owner and acquirer.handed_over(answer, request):
            stalls.append(request.owner)
            return True
        return False

    def late_answer(self: LockStore, **arguments: Any) -> LockInfo:
        answer = acquire(self, **arguments)
        if handed(answer, arguments):
            time.sleep(answer_stall)
        return answer

    async def alate_answer(self: AsyncLockStore, **arguments: Any) -> LockInfo:
        answer = await aacquire(self, **arguments)
        if handed(answer, arguments):
            await asyncio.sleep(answer_stall)
        return answer

    def late_refresh(self: LockStore, key: str, owner: str, *args: Any, **kw: Any) -> Any:
        if owner in stalls and stalled == "refresh":
            time.sleep(FIRST_LEASE + 0.5)
        return refresh_(self, key, owner, *args, **kw)

    async def alate_refresh(
        self: AsyncLockStore, key: str, owner: str, *args: Any, **kw: Any
    ) -> Any:
        if owner in stalls and stalled == "refresh":
            await asyncio.sleep(FIRST_LEASE + 0.5)
        return await arefresh(self, key, owner, *args, **kw)

    monkeypatch.setattr(LockStore, "acquire", late_answer)
    monkeypatch.setattr(AsyncLockStore, "acquire", alate_answer)
    monkeypatch.setattr(LockStore, "refresh", late_refresh)
    monkeypatch.setattr(AsyncLockStore, "refresh", alate_refresh)
    key = f"handoff-got-late-{waiter}-{stalled}"

    def take() -> Lock:
        if waiter == "coroutine":
            return asyncio.run(other.aacquire(key, ttl=30, timeout=BOUND, refresh=refresh))
        return other.acquire(key, ttl=30, timeout=BOUND, refresh=refresh)

    _waits_on_as_a_new_acquisition(manager, other, key, take)
    # The attempt did find the lock handed to it (and no later one did).
    assert len(stalls) == 1


def _waits_on_as_a_new_acquisition(
    manager: LockManager, other: LockManager, key: str, take: Any = None
) -> None:
    """``other`` waits behind a holder of ``key`` that releases: the waiter, too late for
    the lease handed to it, ends up holding the key with a new owner id and token, which
    it took itself (no handoff is told). ``take`` is the wait (``other.acquire``)."""
    holder = manager.acquire(key, ttl=30)
    box: list[Any] = []

    def wait() -> None:
        try:
            box.append(take() if take else other.acquire(key, ttl=30, timeout=BOUND))
        except Exception as exc:  # reported to the test
            box.append(exc)

    with _handoffs_told(key) as told:
        thread = threading.Thread(target=wait)
        thread.start()
        _until(lambda: bool(_status(manager, key).waiting))
        assert holder.release()
        handed = _status(manager, key)
        assert handed.owner not in (None, holder.owner)
        thread.join(BOUND)
    [lock] = box
    assert isinstance(lock, Lock), lock
    assert lock.owner != handed.owner
    assert lock.token > handed.token
    assert told == []
    assert lock.valid
    assert lock.release()


def test_leaving_ends_a_lapsed_handed_lease_for_good(
    mongolock_url: str, manager: LockManager, other: LockManager
) -> None:
    store = other.store
    key = "handoff-lapsed"
    holder = manager.acquire(key, ttl=30)
    slow = other.new_owner()
    store.acquire(key, slow, 30.0, queue=True)
    assert holder.release()
    assert _status(manager, key).owner == slow
    time.sleep(FIRST_LEASE + 0.2)
    store.leave(key, slow)
    with _collection(mongolock_url, manager.database) as locks:
        before = locks.find_one({"_id": key})
        assert before is not None
        assert slow in before["ended"]
        # A late duplicate of one of its attempts changes nothing.
        with pytest.raises(LockNotAcquired):
            store.acquire(key, slow, 30.0, queue=True)
        assert locks.find_one({"_id": key}) == before
        # Nor once somebody else holds the key: it neither joins the line nor waits.
        third = manager.acquire(key, ttl=30, blocking=False)
        taken = locks.find_one({"_id": key})
        answer = store.acquire(key, slow, 30.0, queue=True)
        assert answer.owner == third.owner
        assert locks.find_one({"_id": key}) == taken
        assert third.release()


def test_a_waiter_that_stops_waiting_gives_back_a_lock_handed_to_it(
    mongolock_url: str, manager: LockManager, other: LockManager
) -> None:
    """Leaving the line is one write that also releases a lock a release just handed
    over (and hands it on): the key is never held by nobody."""
    key = "handoff-leave"
    holder = manager.acquire(key, ttl=30)
    store = other.store
    quitter, next_one = other.new_owner(), other.new_owner()
    for owner in (quitter, next_one):
        info = store.acquire(key, owner, 30.0, queue=True)
        assert info.owner == holder.owner
    assert holder.release()
    assert _status(manager, key).owner == quitter
    store.leave(key, quitter)
    after = _status(manager, key)
    assert after.owner == next_one
    store.leave(key, next_one)
    with _collection(mongolock_url, manager.database) as locks:
        freed = locks.find_one({"_id": key})
        assert freed is not None
        assert (freed["owner"], freed["waiters"]) == (None, [])
        # Leaving again, or leaving a line one is not in, changes nothing.
        store.leave(key, quitter)
        assert locks.find_one({"_id": key}) == freed
    assert manager.status(key) is None


def test_a_timed_out_waiter_leaves_nothing_held(manager: LockManager, other: LockManager) -> None:
    key = "handoff-timeout"
    holder = manager.acquire(key, ttl=30)
    with pytest.raises(LockNotAcquired):
        other.acquire(key, ttl=30, timeout=0.5)
    assert holder.release()
    assert manager.status(key) is None  # nobody holds it, nobody was handed it


def test_a_cancelled_async_waiter_gives_back_a_lock_handed_to_it(
    manager: LockManager, other: LockManager
) -> None:
    """Cancelled right after a release handed it the lock, the waiter's task leaves the
    line with one write that releases the lock too; the next one in line gets it."""
    key = "handoff-cancel"
    holder = manager.acquire(key, ttl=30)
    next_one = other.new_owner()

    async def scenario() -> None:
        task = asyncio.ensure_future(other.aacquire(key, ttl=30, timeout=BOUND))
        while not _status(manager, key).waiting:
            await asyncio.sleep(0.02)
        info = other.store.acquire(key, next_one, 30.0, queue=True)
        assert info.position == 1
        # Hand the lock to the task's request, then cancel it before it can take it.
        assert holder.release()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        deadline = time.monotonic() + BOUND
        while _status(manager, key).owner != next_one:
            assert time.monotonic() < deadline, _status(manager, key)
            await asyncio.sleep(0.02)

    asyncio.run(scenario())
    other.store.leave(key, next_one)
    assert manager.status(key) is None


def test_shared_waiters_are_not_handed_an_exclusive_release(
    manager: LockManager, other: LockManager
) -> None:
    """A reader first in line is woken to enter with the other readers: the release
    frees the key instead of handing it over."""
    key = "handoff-shared"
    holder = manager.acquire(key, ttl=30)
    reader = other.new_owner()
    info = other.store.acquire(key, reader, 30.0, queue=True, shared=True)
    assert info.position == 0
    assert holder.release()
    assert manager.status(key) is None  # freed, not handed to the reader
    taken = other.store.acquire(key, reader, 30.0, queue=True, shared=True)
    assert taken.as_holder(reader) is not None
    assert taken.token > holder.token
    other.store.release(key, reader, taken.token, shared=True)


def _status(manager: LockManager, key: str) -> LockInfo:
    info = manager.status(key)
    assert info is not None
    return info


def _until(condition: Any) -> None:
    deadline = time.monotonic() + BOUND
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.02)


@contextmanager
def _handoffs_told(key: str) -> Iterator[list[events.Handoff]]:
    """The handoffs of ``key`` this process's observers are told of while the block runs."""
    told: list[events.Handoff] = []
    stop = events.subscribe(
        lambda e: told.append(e) if isinstance(e, events.Handoff) and e.key == key else None
    )
    try:
        yield told
    finally:
        stop()


def _handed_on(manager: LockManager, key: str, take: Any) -> tuple[Lock, Lock, LockInfo]:
    """``manager`` takes ``key``; ``take()`` waits for it on a thread of its own; the
    holder releases once the waiter is in line. The holder, the waiter's lock, and the
    document as the release left it."""
    holder = manager.acquire(key, ttl=30)
    box: list[Any] = []
    thread = threading.Thread(target=lambda: box.append(take()))
    thread.start()
    _until(lambda: bool(_status(manager, key).waiting))
    assert holder.release()
    handed = _status(manager, key)
    thread.join(BOUND)
    [lock] = box
    assert isinstance(lock, Lock)
    return holder, lock, handed


def _writes(recorder: Recorder, database: str) -> list[Sent]:
    return [s for s in recorder.on(database, "locks") if s.name in ("findAndModify", "update")]


def test_an_uncontended_release_is_one_write_that_only_frees(
    mongolock_url: str, mongolock_database: str
) -> None:
    manager = RecordedManager(mongolock_url, database=mongolock_database, ttl=10.0)
    manager.recorder = Recorder()
    try:
        lock = manager.acquire("handoff-alone", refresh=False)
        before = len(_writes(manager.recorder, mongolock_database))
        assert lock.release() is True
        sent = _writes(manager.recorder, mongolock_database)[before:]
        # One write, and not the one that could hand the lock on: nobody is in line.
        assert [s.name for s in sent] == ["update"]
        assert sent[0].command["updates"][0]["q"]["waiters.hand"] == {"$ne": True}
        assert "$arrayElemAt" not in repr(sent[0].command)
        # Released for real: the next acquisition gets the key with a greater token.
        again = manager.acquire("handoff-alone", refresh=False, blocking=False)
        assert again.token > lock.token
        again.release()
    finally:
        manager.close()


def test_a_release_with_a_waiter_in_line_hands_over_in_its_second_write(
    mongolock_url: str, mongolock_database: str, other: LockManager
) -> None:
    manager = RecordedManager(mongolock_url, database=mongolock_database, ttl=10.0)
    manager.recorder = Recorder()
    got: list[Lock] = []
    told: list[events.Handoff] = []
    stop = events.subscribe(
        lambda e: (
            told.append(e) if isinstance(e, events.Handoff) and e.key == "handoff-line" else None
        )
    )
    try:
        lock = manager.acquire("handoff-line", refresh=False)
        stream_open(other)
        waiter = threading.Thread(
            target=lambda: got.append(other.acquire("handoff-line", ttl=10.0, timeout=BOUND))
        )
        waiter.start()
        with _collection(mongolock_url, mongolock_database) as locks:
            deadline = time.monotonic() + BOUND
            while not _line(locks, "handoff-line"):
                assert time.monotonic() < deadline, "the waiter never joined the line"
                time.sleep(0.02)
            before = len(_writes(manager.recorder, mongolock_database))
            assert lock.release() is True
            sent = _writes(manager.recorder, mongolock_database)[before:]
            doc = locks.find_one({"_id": "handoff-line"})
        # The small write matched nothing (somebody waits); the second handed the lock.
        assert [s.name for s in sent] == ["update", "update"]
        assert doc is not None
        assert doc["owner"] not in (None, lock.owner)
        assert doc["token"] > lock.token
        waiter.join(BOUND)
        assert got
        assert got[0].owner == doc["owner"]
        assert got[0].token == doc["token"]
        got[0].release()
        # Observers of the waiter's process are told who handed what to whom.
        assert [(e.from_owner, e.to_owner, e.token) for e in told] == [
            (lock.owner, got[0].owner, got[0].token)
        ]
    finally:
        stop()
        manager.close()


def test_a_handoff_the_server_logs_as_a_whole_document_reaches_the_waiter(
    mongolock_url: str, mongolock_database: str, manager: LockManager, other: LockManager
) -> None:
    """On a small new document the handing release changes about every field: the
    server logs it whole, and the change stream reports a ``replace``, not an update."""
    key = "k"  # the shortest document: the most likely to be logged whole
    told: list[events.Handoff] = []
    stop = events.subscribe(
        lambda e: told.append(e) if isinstance(e, events.Handoff) and e.key == key else None
    )
    box: list[Any] = []
    client: MongoClient[dict[str, Any]] = MongoClient(mongolock_url)
    try:
        with client[mongolock_database]["locks"].watch(FREED_EVENTS) as stream:
            holder = manager.acquire(key, ttl=30)
            stream_open(other)
            thread = threading.Thread(
                target=lambda: box.append(other.acquire(key, ttl=10, timeout=BOUND))
            )
            thread.start()
            _until(lambda: bool(_status(manager, key).waiting))
            assert holder.release()
            thread.join(BOUND)
            [lock] = box
            change = stream.try_next()
            while change is not None and change["operationType"] != "replace":
                change = stream.try_next()
        # The stream's filter let the whole-document release through ...
        assert change is not None
        assert change["fullDocument"]["owner"] == lock.owner
        # ... and the waiter took the lock from it, not from an attempt of its own.
        assert [(e.from_owner, e.to_owner, e.token) for e in told] == [
            (holder.owner, lock.owner, lock.token)
        ]
        assert lock.token > holder.token
        assert lock.release()
    finally:
        stop()
        client.close()


def test_a_handoff_learnt_after_its_first_lease_lapsed_waits_on(
    manager: LockManager, other: LockManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The waiter's change stream tells it of the handoff only after its first lease has
    lapsed (a stalled watcher): the wait goes on as a new acquisition, which takes the
    free key with a new token, instead of failing with the waiter named as the holder."""
    offer = Wake.offer

    def late_offer(self: Wake, handoff: Any) -> None:
        time.sleep(FIRST_LEASE + 0.5)
        offer(self, handoff)

    monkeypatch.setattr(Wake, "offer", late_offer)
    stream_open(other)
    _waits_on_as_a_new_acquisition(manager, other, "handoff-told-late")


def test_a_handoff_learnt_late_but_still_live_is_extended_before_it_is_returned(
    manager: LockManager, other: LockManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A handoff learnt with less than half its first lease left (here: always, by
    ``must_extend``) is extended to the ttl asked for by one refresh before acquire returns."""
    monkeypatch.setattr(acquiring, "must_extend", lambda *args, **kwargs: True)
    key = "handoff-told-late-live"
    stream_open(other)
    with _handoffs_told(key) as told:
        holder, lock, handed = _handed_on(
            manager, key, lambda: other.acquire(key, ttl=30, timeout=BOUND, refresh=False)
        )
    assert (lock.owner, lock.token) == (handed.owner, handed.token)
    assert _status(manager, key).remaining > 20  # the ttl asked for, not the first lease
    assert [(e.from_owner, e.to_owner, e.token) for e in told] == [
        (holder.owner, lock.owner, lock.token)
    ]
    assert lock.release()


@pytest.mark.parametrize(
    "waiter_of",
    [
        "the releasing manager",
        "a coroutine of the releasing manager",
        "another manager",
        "a coroutine of another manager",
    ],
)
def test_a_handoff_found_by_the_waiters_own_attempt_is_told_all_the_same(
    manager: LockManager, other: LockManager, monkeypatch: pytest.MonkeyPatch, waiter_of: str
) -> None:
    """No wake-up carries the handoff (as for a waiter of the releasing manager, woken by
    the release itself, which cannot say to whom it handed the key; here the change
    events' handoffs are kept from every waiter): the waiter's attempt finds the key
    already its own, and its observers are told of the handoff, without the releasing
    holder's name."""
    for wake in (Wake, _LoopEvent):
        monkeypatch.setattr(wake, "offer", lambda self, handoff: None)
    waiter = manager if "the releasing manager" in waiter_of else other
    key = "handoff-found-by-attempt"

    def take() -> Lock:
        if waiter_of.startswith("a coroutine"):
            return asyncio.run(waiter.aacquire(key, ttl=30, timeout=BOUND))
        return waiter.acquire(key, ttl=30, timeout=BOUND)

    stream_open(waiter)
    with _handoffs_told(key) as told:
        _, lock, handed = _handed_on(manager, key, take)
    # The release wrote the waiter in as the holder.
    assert (lock.owner, lock.token) == (handed.owner, handed.token)
    assert [(e.from_owner, e.to_owner, e.token) for e in told] == [("", lock.owner, lock.token)]
    assert lock.release()


def test_a_waiter_that_takes_a_lapsed_lock_itself_is_told_no_handoff(
    manager: LockManager, other: LockManager
) -> None:
    """The holder never releases (its lease lapses): the waiter's own attempt takes the
    free key, and that is no handoff. (This guards against telling of handoffs that
    were not: it passes as well where none found by an attempt is told.)"""
    key = "handoff-none-after-a-lapse"
    holder = manager.acquire(key, ttl=3.0, refresh=False)
    stream_open(other)
    with _handoffs_told(key) as told:
        lock = other.acquire(key, ttl=30, timeout=BOUND)
    assert lock.token > holder.token
    assert told == []
    assert lock.release()


def test_a_lock_taken_with_others_in_line_releases_in_the_handing_write_alone(
    mongolock_url: str, mongolock_database: str, other: LockManager
) -> None:
    """Taken from a line, a lock goes straight to the write that hands it on: one round
    trip, which frees the key when nobody waits any more."""
    waiter = RecordedManager(mongolock_url, database=mongolock_database, ttl=10.0)
    waiter.recorder = Recorder()
    box: list[Any] = []
    try:
        holder = other.acquire("handoff-taken-in-line", ttl=30)
        stream_open(waiter)
        thread = threading.Thread(
            target=lambda: box.append(waiter.acquire("handoff-taken-in-line", timeout=BOUND))
        )
        thread.start()
        _until(lambda: bool(_status(other, "handoff-taken-in-line").waiting))
        assert holder.release()
        thread.join(BOUND)
        [lock] = box
        assert lock.contended
        before = len(_writes(waiter.recorder, mongolock_database))
        assert lock.release() is True
        sent = _writes(waiter.recorder, mongolock_database)[before:]
        assert [s.name for s in sent] == ["update"]
        assert "waiters.hand" not in sent[0].command["updates"][0]["q"]
        assert other.status("handoff-taken-in-line") is None  # freed: nobody waits
        assert not lock.valid
    finally:
        waiter.close()
