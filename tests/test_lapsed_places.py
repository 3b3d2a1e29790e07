"""A place its waiter left by taking the key is marked lapsed where it stands.

A handoff changes the new holder's place and the places its cut shortens, never the
index of the places behind: its write, which every change stream on the collection
reads from the oplog, stays the same size however long the line. Lapsed places are
taken out in bulk, once there are ``COMPACT_AT`` of them and as many as live ones.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from typing import Any

import bson
from pymongo import MongoClient

from django_mongolock import LockManager
from django_mongolock.queries import COMPACT_AT, head_owner
from django_mongolock.store import LockStore
from tests.test_handoff import BEHIND_IN_LINE, BOUND, FIRST_LEASE, _collection, _join, _results


def _owners(store: LockStore, key: str) -> list[Any]:
    """The stored line: each place's owner, None for a place marked lapsed."""
    doc = store.collection.find_one({"_id": key}) or {}
    return [place.get("owner") for place in doc.get("waiters") or ()]


def _hand_on(store: LockStore, key: str) -> str:
    """Release the key as its holder: the release hands it to the first in line (the
    holder here is a waiter with no process, within its 2 s first lease)."""
    doc = store.collection.find_one({"_id": key})
    assert doc is not None
    assert store.release(key, doc["owner"], doc["token"])
    after = store.collection.find_one({"_id": key})
    assert after is not None
    assert after["token"] > doc["token"]
    return str(after["owner"])


def _handoff_entry(mongolock_url: str, store: LockStore, key: str, waiting: int) -> int:
    """The size of the oplog entry of a handoff from a line of ``waiting`` places, the
    second in a row (the first cuts the places, which joined behind a 30 s lease, to
    the line check)."""
    store.acquire(key, "holder:1:0", 30.0)
    for n in range(waiting):
        assert store.acquire(key, f"waiter:1:{n:012x}", 30.0, queue=True).position == n
    _hand_on(store, key)
    _hand_on(store, key)
    client: MongoClient[dict[str, Any]] = MongoClient(mongolock_url)
    try:
        namespace = f"{store.collection.database.name}.{store.collection.name}"
        [entry] = (
            client.local["oplog.rs"]
            .find({"ns": namespace, "o2._id": key})
            .sort("$natural", -1)
            .limit(1)
        )
    finally:
        client.close()
    assert entry["op"] == "u"
    return len(bson.encode(entry))


def test_a_handoff_writes_as_much_for_200_places_as_for_3(
    mongolock_url: str, manager: LockManager
) -> None:
    """Taking the new holder's place out would move every place behind it, and the
    server would log each moved place (9 KB for 200): every process's change stream
    reads that entry. Marked lapsed where it stands, the handoff logs the same few
    fields whatever the length of the line."""
    store = manager.store
    short = _handoff_entry(mongolock_url, store, "lapsed-short", 3)
    long = _handoff_entry(mongolock_url, store, "lapsed-long", 200)
    assert long < 1024
    assert abs(long - short) < 128
    assert _owners(store, "lapsed-long")[:3] == [None, None, "waiter:1:000000000002"]


def test_lapsed_places_are_taken_out_once_they_are_as_many_as_the_live_ones(
    manager: LockManager,
) -> None:
    """With 20 in line, 15 handoffs leave 15 lapsed places (fewer than ``COMPACT_AT``)
    ahead of 5 live ones, in line order; the 16th takes all the lapsed out at once, and
    the line goes on in the same order. A line with no live place left is empty."""
    assert COMPACT_AT == 16  # the premise of the counts below
    store = manager.store
    key = "lapsed-compaction"
    waiters = [f"waiter:1:{n:012x}" for n in range(20)]
    store.acquire(key, "holder:1:0", 30.0)
    for owner in waiters:
        store.acquire(key, owner, 30.0, queue=True)
    for n in range(15):
        assert _hand_on(store, key) == waiters[n]
    assert _owners(store, key) == [None] * 15 + waiters[15:]
    assert _hand_on(store, key) == waiters[15]
    assert _owners(store, key) == waiters[16:]
    # A waiter that joins now queues behind the others; a leaving one is marked lapsed.
    assert store.acquire(key, "late:1:0", 30.0, queue=True).position == 4
    store.leave(key, waiters[17])
    assert _owners(store, key) == [waiters[16], None, *waiters[18:], "late:1:0"]
    for owner in [waiters[16], *waiters[18:], "late:1:0"]:
        assert _hand_on(store, key) == owner
    assert _owners(store, key) == []


def test_a_dead_waiter_behind_lapsed_places_is_skipped_when_they_are_taken_out(
    mongolock_url: str, manager: LockManager
) -> None:
    """Fifteen handoffs leave their places lapsed ahead of a waiter process that is then
    killed, and of a live one behind it. The release that hands the key to the dead
    waiter takes all the lapsed places out, its own too: the live waiter is first in
    line, woken as head, and takes the key when the dead one's first lease ends, with a
    greater token, alone in its section."""
    key = "lapsed-dead"
    store = manager.store
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    holder = manager.acquire(key, ttl=30)
    passing = [f"passing:1:{n:012x}" for n in range(COMPACT_AT - 1)]
    for owner in passing:
        store.acquire(key, owner, 30.0, queue=True)
    with _collection(mongolock_url, manager.database) as locks:
        dead, dead_owner = _join(context, mongolock_url, manager.database, key, locks, results)
        alive, alive_owner = _join(context, mongolock_url, manager.database, key, locks, results)
        os.kill(dead.pid, signal.SIGKILL)
        dead.join(BOUND)
        # Renewed in place (their waiters would look again by the line check), so that
        # they outlast the handoffs below, each within its 2 s first lease.
        for owner in passing:
            assert store.acquire(key, owner, 30.0, queue=True).position == passing.index(owner)
        assert holder.release()
        for owner in passing[1:]:
            assert _hand_on(store, key) == owner
        assert _owners(store, key) == [None] * len(passing) + [dead_owner, alive_owner]
        released_at = time.monotonic()
        assert _hand_on(store, key) == dead_owner
        handed = locks.find_one({"_id": key})
        assert handed is not None
        assert head_owner(handed["head"]) == alive_owner
        assert _owners(store, key) == [alive_owner]
        [result] = _results(results, 1)
    alive.join(BOUND)
    assert alive.exitcode == 0
    assert result["owner"] == alive_owner
    assert handed["token"] < result["token"]
    assert result["others"] == 0
    waited = result["got"] - released_at
    assert FIRST_LEASE - 0.1 <= waited < FIRST_LEASE + BEHIND_IN_LINE + 10.0
