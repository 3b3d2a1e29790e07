"""Every lock operation names its key, so a sharded cluster would send it to one shard.

On a cluster sharded on the lock's key (``_id``, hashed), ``mongos`` routes an operation
to one shard only when its filter fixes the shard key: ``{"_id": key}`` or, for the bulk
refresh and release, ``{"_id": {"$in": keys}}`` (the shards of those keys). A filter
without it is broadcast to every shard. No ``mongos`` can be had here, so this checks the
filters themselves: every command the store puts on the wire is recorded by the driver's
command monitoring against a real replica set, and each one on the lock collection must
name the keys of the locks it acts on. The exceptions are named: the operator's listings
and counts, index upkeep, and the watcher's change stream (through ``mongos`` a change
stream is one cursor per shard, by design).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from django_mongolock import LockManager, LockNotAcquired
from django_mongolock.refresher import get_refresher
from tests.commands import RecordedManager, Recorder, Sent

# Commands that read the whole collection by design: the operator's listings and counts
# (admin, CLI), and index upkeep (migrate_mongolock). Named, not targeted.
LISTING_COMMANDS = frozenset({"count", "listIndexes", "createIndexes", "collMod"})
# Cursor follow-ups: they go where the cursor was opened.
CURSOR_COMMANDS = frozenset({"getMore", "killCursors"})
# Where a command keeps its filter(s).
FILTERS = {
    "findAndModify": lambda c: [c["query"]],
    "find": lambda c: [c["filter"]],
    "update": lambda c: [u["q"] for u in c["updates"]],
    "delete": lambda c: [d["q"] for d in c["deletes"]],
}


def keys_named(query: dict[str, Any]) -> set[str] | None:
    """The keys a filter fixes through ``_id`` (equality or ``$in``); None if it fixes none."""
    value = query.get("_id")
    if isinstance(value, str):
        return {value}
    if isinstance(value, dict) and set(value) == {"$in"}:
        return set(value["$in"])
    for clause in query.get("$and", ()):
        named = keys_named(clause)
        if named is not None:
            return named
    return None


def untargeted(sent: list[Sent]) -> list[Sent]:
    """Commands on the lock collection whose filter does not fix the key (exceptions aside)."""
    bad = []
    for command in sent:
        if command.name in LISTING_COMMANDS or command.name in CURSOR_COMMANDS:
            continue
        if command.name == "aggregate":
            stages = command.command["pipeline"]
            if stages and "$changeStream" in stages[0]:
                continue  # the watcher's stream
            bad.append(command)  # the counts are not expected here: see the listing test
            continue
        filters = FILTERS.get(command.name)
        if filters is None or any(keys_named(f) is None for f in filters(command.command)):
            bad.append(command)
    return bad


@pytest.fixture
def recorded(mongolock_url: str, mongolock_database: str) -> Iterator[RecordedManager]:
    manager = RecordedManager(mongolock_url, database=mongolock_database, ttl=10.0)
    manager.recorder = Recorder()  # read when the first client is built, not before
    yield manager
    manager.close()


def test_filters_are_recognised() -> None:
    assert keys_named({"_id": "a", "owner": "o"}) == {"a"}
    assert keys_named({"_id": {"$in": ["a", "b"]}, "owner": {"$in": ["o"]}}) == {"a", "b"}
    assert keys_named({"$and": [{"owner": "o"}, {"_id": "a"}]}) == {"a"}
    assert keys_named({"_id": {"$regex": "^a"}}) is None
    assert keys_named({"owner": {"$ne": None}}) is None


def test_every_holder_operation_names_its_key(
    recorded: RecordedManager, other: LockManager
) -> None:
    manager = recorded
    # Exclusive: acquire, refresh, release.
    lock = manager.acquire("targeted-a")
    lock.refresh()
    # Waiting: a place in line, the change stream, leaving the line on timeout.
    busy = other.acquire("targeted-busy")
    with pytest.raises(LockNotAcquired):
        manager.acquire("targeted-busy", timeout=0.3)
    busy.release()
    # The give-up of a stopped acquire: an upsert, which through mongos must name the key.
    manager.store.abandon("targeted-gone", manager.new_owner(), shared=True)
    # Shared holders and a semaphore.
    reader = manager.acquire("targeted-shared", shared=True)
    reader.refresh()
    semaphore = manager.semaphore("targeted-sem", limit=2)
    permit = semaphore.acquire(timeout=5)
    # The refresher's bulk refresh of exclusive and shared leases, and its heartbeat.
    get_refresher().tick()
    # A group, all or nothing.
    group = manager.acquire_group(["targeted-g1", "targeted-g2"], timeout=5)
    group.release()
    # The bulk release at exit.
    held = manager.acquire("targeted-exit")
    assert manager.store.release_many([(held.key, held.owner, held.token)]) == 1
    leaving = manager.acquire("targeted-exit-shared", shared=True)
    assert manager.store.release_shared_many([(leaving.key, leaving.owner, leaving.token)]) == 1
    # The operator's keyed calls.
    assert manager.status("targeted-a") is not None
    assert set(manager.statuses(["targeted-a", "targeted-shared"])) == {
        "targeted-a",
        "targeted-shared",
    }
    forced = manager.acquire("targeted-forced", refresh=False)
    [gone] = manager.force_release_many([(forced.key, forced.token)])
    assert gone.key == "targeted-forced"
    assert manager.force_release("targeted-a") is not None
    assert not lock.release()
    assert reader.release()
    assert permit.release()

    sent = recorded.recorder.on(manager.database, manager.collection)
    names = {command.name for command in sent}
    assert {"findAndModify", "update", "find", "aggregate"} <= names
    assert untargeted(sent) == []
    # Every key the test used was named by some command, so none slipped through unseen.
    named = set().union(
        *(
            keys_named(f) or set()
            for s in sent
            for f in FILTERS.get(s.name, lambda c: [])(s.command)
        )
    )
    assert {
        "targeted-a",
        "targeted-busy",
        "targeted-gone",
        "targeted-shared",
        "targeted-sem",
        "targeted-g1",
        "targeted-g2",
        "targeted-exit",
        "targeted-forced",
    } <= named
    # The refresher's bulk writes name every held key at once.
    bulk = [
        keys_named(u["q"]) or set()
        for s in sent
        if s.name == "update"
        for u in s.command["updates"]
        if u.get("multi")
    ]
    assert any(keys >= {"targeted-a"} for keys in bulk)
    assert any(keys >= {"targeted-shared", "targeted-sem"} for keys in bulk)
    # Heartbeats: one document per process, by its id (its own shard key).
    beats = recorded.recorder.on(manager.database, f"{manager.collection}.processes")
    assert beats
    assert all(
        keys_named(u["q"]) is not None
        for s in beats
        if s.name == "update"
        for u in s.command["updates"]
    )


def test_async_holder_operations_name_their_key(recorded: RecordedManager) -> None:
    async def main() -> None:
        lock = await recorded.aacquire("targeted-async", timeout=5)
        async with recorded.lock("targeted-async-2", timeout=5):
            pass
        assert await lock.arelease()
        await recorded.aclose()

    asyncio.run(main())
    sent = recorded.recorder.on(recorded.database, recorded.collection)
    assert sent
    assert untargeted(sent) == []


def test_the_listings_are_the_named_exceptions(recorded: RecordedManager) -> None:
    manager = recorded
    manager.ensure_indexes()
    lock = manager.acquire("listed")
    assert [info.key for info in manager.list()] == ["listed"]
    assert manager.count() == 1
    assert manager.counts()["live"] == 1
    lock.release()
    sent = recorded.recorder.on(manager.database, manager.collection)
    loose = untargeted(sent)
    # The listing (find), its count and the counts (aggregate): none names a key.
    assert {command.name for command in loose} == {"find", "aggregate"}
    assert all("$changeStream" not in str(command.command) for command in loose)
