"""What one key's document may hold: its line of waiters, its shared holders, its limit.

Readers in line enter together, the limit of a semaphore belongs to the key, the lists in
the document are capped far below MongoDB's 16 MB, and the refresh of shared leases finds
its documents through an index however large the collection is.
"""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from django_mongolock import LockManager, LockNotAcquired, MongoLockError, queries
from django_mongolock.exceptions import LimitConflict, LineFull
from django_mongolock.queries import MAX_HOLDERS, MAX_WAITERS
from tests.commands import RecordedManager, Recorder
from tests.waiting import in_line

# -- edge 1: readers in line enter together ------------------------------------------------------


def test_readers_waiting_behind_a_writer_enter_together(
    manager: LockManager, other: LockManager
) -> None:
    """Their leases are 30 s: one lease apart, the second reader would time out after 10 s."""
    writer = manager.acquire("catalog", ttl=30)
    got: dict[int, Any] = {}

    def read(n: int) -> None:
        try:
            got[n] = other.acquire("catalog", shared=True, ttl=30, timeout=10)
        except MongoLockError as exc:
            got[n] = exc

    readers = [threading.Thread(target=read, args=(n,)) for n in range(3)]
    for reader in readers:
        reader.start()
    in_line(manager, "catalog", 3)
    assert writer.release()
    for reader in readers:
        reader.join(30)
    assert not any(reader.is_alive() for reader in readers)
    assert all(not isinstance(lock, Exception) for lock in got.values()), got
    status = manager.status("catalog")
    assert status is not None
    assert sorted(holder.owner for holder in status.live_holders) == sorted(
        lock.owner for lock in got.values()
    )
    for lock in got.values():
        assert lock.release()


def test_semaphore_waiters_behind_a_writer_enter_together_up_to_the_limit(
    manager: LockManager, other: LockManager
) -> None:
    writer = manager.acquire("exports", ttl=30)
    slots = other.semaphore("exports", limit=2)
    got: dict[int, Any] = {}

    def take(n: int) -> None:
        try:
            got[n] = slots.acquire(ttl=30, timeout=20)
        except MongoLockError as exc:
            got[n] = exc

    takers = [threading.Thread(target=take, args=(n,)) for n in range(3)]
    for taker in takers:
        taker.start()
    in_line(manager, "exports", 3)
    assert writer.release()
    deadline = time.monotonic() + 10
    while len(got) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(got) == 2, got  # two slots, taken on the writer's release
    status = manager.status("exports")
    assert status is not None
    assert len(status.live_holders) == 2
    first = next(iter(got.values()))
    assert first.release()  # the third waiter takes the slot it frees
    for taker in takers:
        taker.join(30)
    assert not any(taker.is_alive() for taker in takers)
    assert all(not isinstance(lock, Exception) for lock in got.values()), got
    for lock in got.values():
        if lock is not first:
            assert lock.release()


def test_an_async_caller_meets_the_same_limit(manager: LockManager) -> None:
    async def conflict() -> None:
        held = await manager.aacquire("exports", shared=True, limit=2, ttl=30)
        try:
            with pytest.raises(LimitConflict, match="limit 2"):
                await manager.aacquire("exports", shared=True, limit=4, timeout=30)
        finally:
            await held.arelease()
            await manager.aclose()

    asyncio.run(conflict())


def test_a_reader_does_not_pass_a_writer_waiting_ahead(
    manager: LockManager, other: LockManager
) -> None:
    """Readers enter together only up to the first writer in line: writers do not starve."""
    reader = manager.acquire("catalog", shared=True, ttl=30)
    result: list[Any] = []
    waiting_writer = threading.Thread(
        target=lambda: result.append(other.acquire("catalog", ttl=30, timeout=20))
    )
    waiting_writer.start()
    in_line(manager, "catalog", 1)
    with pytest.raises(LockNotAcquired):
        other.acquire("catalog", shared=True, blocking=False)
    assert reader.release()
    waiting_writer.join(30)
    assert len(result) == 1
    assert result[0].owner == (manager.status("catalog") or result[0]).owner
    assert result[0].release()


# -- edge 4: the limit belongs to the key --------------------------------------------------------


def test_a_semaphore_limit_belongs_to_the_key(manager: LockManager, other: LockManager) -> None:
    three = manager.semaphore("exports", limit=3)
    five = other.semaphore("exports", limit=5)
    held = [three.acquire(ttl=30) for _ in range(3)]
    with pytest.raises(LimitConflict, match="limit 3") as refused:
        five.acquire(blocking=False)
    assert (refused.value.key, refused.value.limit, refused.value.wanted) == ("exports", 3, 5)
    # A blocking caller is refused at once rather than waiting in line for a slot.
    with pytest.raises(LimitConflict):
        five.acquire(timeout=30)
    # A shared lock without a limit would exceed it too.
    with pytest.raises(LimitConflict, match="no limit"):
        other.acquire("exports", shared=True, blocking=False)
    status = manager.status("exports")
    assert status is not None
    assert len(status.live_holders) == 3
    assert status.limit == 3
    assert not (manager.store.collection.find_one({"_id": "exports"}) or {}).get("waiters")
    for lock in held:
        assert lock.release()
    # With no live holder left, the next holder's limit is the key's.
    taken = [five.acquire(ttl=30, blocking=False) for _ in range(5)]
    with pytest.raises(LimitConflict, match="limit 5"):
        three.acquire(blocking=False)
    for lock in taken:
        assert lock.release()


def test_a_smaller_limit_conflicts_too(manager: LockManager, other: LockManager) -> None:
    """A smaller limit would not exceed the first, but the callers disagree: say so."""
    lock = manager.semaphore("exports", limit=3).acquire(ttl=30)
    with pytest.raises(LimitConflict, match="limit 3"):
        other.semaphore("exports", limit=1).acquire(blocking=False)
    assert lock.release()


def test_an_unlimited_shared_key_refuses_a_semaphore(
    manager: LockManager, other: LockManager
) -> None:
    reader = manager.acquire("catalog", shared=True, ttl=30)
    with pytest.raises(LimitConflict, match="limit 2"):
        other.semaphore("catalog", limit=2).acquire(blocking=False)
    more = other.acquire("catalog", shared=True, ttl=30, blocking=False)
    assert reader.release()
    assert more.release()


# -- edge 10: the lists in a document are capped ---------------------------------------------------


def _crowded(manager: LockManager, key: str, *, waiters: int = 0, holders: int = 0) -> None:
    """A document, written directly, whose key is held and whose lists are ``waiters`` and
    ``holders`` long (as that many live processes would leave it)."""
    later = datetime.now(UTC) + timedelta(minutes=10)
    doc: dict[str, Any] = {
        "_id": key,
        "key": key,
        "token": 1,
        "acquired_at": datetime.now(UTC),
        "refreshed_at": datetime.now(UTC),
        "expires_at": later,
        "ttl": 600.0,
        "waiters": [{"owner": f"waiter-{n}", "until": later} for n in range(waiters)],
    }
    if holders:
        entries = [
            {
                "owner": f"reader-{n}",
                "token": 1,
                "acquired_at": datetime.now(UTC),
                "expires_at": later,
                "ttl": 600.0,
            }
            for n in range(holders)
        ]
        doc.update(mode="shared", owner=None, limit=None, holders=entries)
    else:
        doc["owner"] = "somebody"
    manager.store.collection.insert_one(doc)


def test_a_full_line_refuses_a_blocking_acquire_at_once(manager: LockManager) -> None:
    _crowded(manager, "popular", waiters=MAX_WAITERS)
    with pytest.raises(LineFull, match=f"{MAX_WAITERS} waiters") as full:
        manager.acquire("popular", timeout=30)
    assert isinstance(full.value, LockNotAcquired)
    assert full.value.cap == MAX_WAITERS
    doc = manager.store.collection.find_one({"_id": "popular"})
    assert doc is not None
    assert len(doc["waiters"]) == MAX_WAITERS
    # A waiter already in line keeps (and renews) its place.
    busy = manager.store.acquire("popular", "waiter-7", 30.0, queue=True)
    assert busy.position == 7
    # A caller that does not wait is told the key is busy, as always.
    with pytest.raises(LockNotAcquired, match="somebody"):
        manager.acquire("popular", blocking=False)


def test_lapsed_places_make_room_in_a_full_line(manager: LockManager) -> None:
    _crowded(manager, "popular", waiters=MAX_WAITERS)
    manager.store.collection.update_one(
        {"_id": "popular"}, {"$set": {"waiters.0.until": datetime.now(UTC) - timedelta(seconds=1)}}
    )
    with pytest.raises(LockNotAcquired) as busy:
        manager.acquire("popular", timeout=0.2)
    assert not isinstance(busy.value, LineFull)


def test_a_full_holders_list_refuses_another_shared_holder(manager: LockManager) -> None:
    _crowded(manager, "library", holders=MAX_HOLDERS)
    with pytest.raises(LineFull, match=f"{MAX_HOLDERS} shared holders"):
        manager.acquire("library", shared=True, timeout=30)
    doc = manager.store.collection.find_one({"_id": "library"})
    assert doc is not None
    assert len(doc["holders"]) == MAX_HOLDERS
    assert not doc.get("waiters")


@pytest.mark.parametrize("blocking", [False, True])
def test_a_semaphore_larger_than_the_holders_cap_is_a_value_error_before_any_io(
    mongolock_url: str, mongolock_database: str, blocking: bool
) -> None:
    manager = RecordedManager(mongolock_url, database=mongolock_database, ttl=10.0)
    manager.recorder = Recorder()
    try:
        with pytest.raises(ValueError, match=str(MAX_HOLDERS)):
            manager.semaphore("big", limit=MAX_HOLDERS + 1).acquire(blocking=blocking)
        assert manager.recorder.on(mongolock_database, "locks") == []
        assert manager.status("big") is None
    finally:
        manager.close()


# -- edge 7: the shared refresh uses an index ----------------------------------------------


def test_the_shared_refresh_reads_no_more_than_its_own_documents(manager: LockManager) -> None:
    """One write extends every shared lease through the ``_id`` index; a read follows only
    when a lease may not have been extended (a document not modified, or a key with
    several), and reads only the leases' own documents."""
    collection = manager.store.collection
    later = datetime.now(UTC) + timedelta(minutes=10)
    collection.insert_many(
        {
            "_id": f"other-{n}",
            "key": f"other-{n}",
            "mode": "shared",
            "owner": None,
            "expires_at": later,
            "holders": [{"owner": f"reader-{n}", "token": 1, "expires_at": later, "ttl": 600.0}],
        }
        for n in range(2000)
    )
    locks = [manager.acquire(f"mine-{n}", shared=True, ttl=30, refresh=False) for n in range(3)]
    held = [(lock.key, lock.owner, lock.token) for lock in locks]
    database = collection.database

    def profiled(expected: set[str]) -> list[str]:
        database.command("profile", 0)
        database.drop_collection("system.profile")
        database.create_collection("system.profile", capped=True, size=4 * 2**20)
        database.command("profile", 2)
        try:
            assert manager.store.refresh_shared_many(held) == expected
        finally:
            database.command("profile", 0)
        ops = list(database["system.profile"].find({"ns": collection.full_name}))
        for op in ops:
            assert "COLLSCAN" not in op.get("planSummary", ""), op
            assert op.get("docsExamined", 0) <= len(held), op
        return [op["op"] for op in ops]

    assert profiled(set()) == ["update"]  # all extended: nothing to read
    # The second lease lapses (as if its holder stalled): the write leaves its document
    # as it is, and the read that follows finds it lost.
    lapsed = datetime.now(UTC) - timedelta(seconds=1)
    collection.update_one({"_id": locks[1].key}, {"$set": {"holders.0.expires_at": lapsed}})
    before = collection.find_one({"_id": locks[1].key})
    assert profiled({locks[1].owner}) == ["update", "query"]
    assert collection.find_one({"_id": locks[1].key}) == before
    # Two leases on one key beside the others, one of the two lapsed: the other's
    # extension modifies the document, and a read of that document alone tells which
    # one was lost.
    collection.update_one(
        {"_id": locks[1].key}, {"$set": {"holders.0.expires_at": later, "expires_at": later}}
    )
    pair = [manager.acquire("pair", shared=True, ttl=30, refresh=False) for _ in range(2)]
    held += [(lock.key, lock.owner, lock.token) for lock in pair]
    # Both live first: the read of that document alone finds nothing lost.
    assert profiled(set()) == ["update", "query"]
    collection.update_one(
        {"_id": "pair", "holders.owner": pair[0].owner},
        {"$set": {"holders.$.expires_at": lapsed}},
    )
    assert profiled({pair[0].owner}) == ["update", "query"]
    read = database["system.profile"].find_one({"op": "query", "ns": collection.full_name})
    assert read is not None
    assert read["docsExamined"] == 1, read
    del held[-2:]
    assert pair[1].release()
    # Beside another's lease the write extends ours alone; a listed key whose only
    # holder is now another (ours ended, and somebody took it) is left as it is.
    foreign = {"owner": "reader-x", "token": 1, "expires_at": later, "ttl": 600.0}
    collection.update_one({"_id": locks[0].key}, {"$push": {"holders": foreign}})
    gone = manager.acquire("gone", shared=True, ttl=30, refresh=False)
    held.append((gone.key, gone.owner, gone.token))
    taken = {**foreign, "owner": "reader-y", "expires_at": later - timedelta(minutes=1)}
    collection.update_one({"_id": gone.key}, {"$set": {"holders": [taken]}})
    shared_before, gone_before = (collection.find_one({"_id": k}) for k in (locks[0].key, "gone"))
    assert shared_before is not None
    assert profiled({gone.owner}) == ["update", "query"]
    assert collection.find_one({"_id": "gone"}) == gone_before
    after = collection.find_one({"_id": locks[0].key})
    assert after is not None
    mine, theirs = after["holders"]
    assert mine["owner"] == locks[0].owner
    assert mine["expires_at"] > shared_before["holders"][0]["expires_at"]
    assert theirs == shared_before["holders"][1]
    assert after["expires_at"] == theirs["expires_at"]
    del held[-1]
    assert not gone.release()
    # explain() of the query the refresh sends: the _id index, never a collection scan.
    query, _ = queries.refresh_shared_many(held)
    plan = collection.find(query).hint([("_id", 1)]).explain()
    assert "COLLSCAN" not in str(plan["queryPlanner"]["winningPlan"])
    assert plan["executionStats"]["totalDocsExamined"] == len(held)
    for lock in locks:
        assert lock.release()
