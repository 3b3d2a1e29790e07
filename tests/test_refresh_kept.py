"""A bulk refresh over many leases is encoded once and sent as it is while they stay the same."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import bson
import pytest
from bson.raw_bson import RawBSONDocument

from django_mongolock import Lock, LockManager, queries
from django_mongolock.refresher import get_refresher
from django_mongolock.store import Kept
from tests.waiting import in_line

# Enough leases for the store to keep the encoded write (``holder._KEEP_FROM``).
MANY = 70


def _refreshed(manager: LockManager, locks: list[Lock]) -> dict[str, Any]:
    """Each lock's ``refreshed_at`` as the server stored it."""
    docs = manager.store.collection.find(
        {"_id": {"$in": [lock.key for lock in locks]}}, projection={"refreshed_at": 1}
    )
    return {doc["_id"]: doc.get("refreshed_at") for doc in docs}


def _moved(before: dict[str, Any], after: dict[str, Any]) -> set[str]:
    return {key for key, at in after.items() if at is not None and at != before.get(key)}


class _Sent:
    """Wraps a store's collection: the filter and pipeline of each ``update_many``."""

    def __init__(self, collection: Any) -> None:
        self.collection = collection
        self.writes: list[tuple[Any, list[Any]]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.collection, name)

    def update_many(self, query: Any, pipeline: list[Any], **kwargs: Any) -> Any:
        self.writes.append((query, pipeline))
        return self.collection.update_many(query, pipeline, **kwargs)


def test_the_kept_write_extends_the_same_leases_and_still_finds_the_lost_ones(
    manager: LockManager, other: LockManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second write with the same ``kept`` sends what the first encoded: every live
    lease is extended again, and a lease released by somebody else in between is reported,
    for exclusive and for shared leases alike."""
    store = manager.store
    sent = _Sent(store.collection)
    monkeypatch.setattr(store, "collection", sent)
    for shared in (False, True):
        locks = [
            manager.acquire(f"kept-{int(shared)}-{n:03d}", ttl=300, shared=shared)
            for n in range(MANY)
        ]
        held = tuple((lock.key, lock.owner, lock.token) for lock in locks)
        refresh = store.refresh_shared_many if shared else store.refresh_many
        build = queries.refresh_shared_many if shared else queries.refresh_many
        kept: Kept = {}
        before = _refreshed(manager, locks)
        time.sleep(0.01)  # the server's clock counts milliseconds
        del sent.writes[:]
        assert refresh(held, kept=kept) == set()
        assert _moved(before, _refreshed(manager, locks)) == {lock.key for lock in locks}
        [(builder, (listed, query, pipeline))] = kept.items()
        assert (builder, listed) == (build, held)
        assert isinstance(query, RawBSONDocument)
        # What is kept and sent is the write the leases build, byte for byte.
        plain_query, plain_pipeline = build(held)
        assert query.raw == bson.encode(plain_query)
        assert [stage.raw for stage in pipeline] == [bson.encode(s) for s in plain_pipeline]
        other.force_release(locks[5].key)
        before = _refreshed(manager, locks)
        time.sleep(0.01)
        assert refresh(held, kept=kept) == {locks[5].owner}
        # Both writes sent the one encoding, not one built anew.
        assert [write[0] is query for write in sent.writes] == [True, True]
        assert [write[1][0] is pipeline[0] for write in sent.writes] == [True, True]
        assert _moved(before, _refreshed(manager, locks)) == {lock.key for lock in locks} - {
            locks[5].key
        }
        # Other leases with the same ``kept``: their own write, built for them.
        fewer = held[:-1]
        assert refresh(fewer, kept=kept) == {locks[5].owner}
        assert sent.writes[-1][0] is not query
        assert kept[build][0] is fewer
        for lock in locks:
            lock.release()


def test_a_few_leases_keep_nothing(manager: LockManager) -> None:
    locks = [manager.acquire(f"kept-few-{n}", ttl=300) for n in range(3)]
    kept: Kept = {}
    held = [(lk.key, lk.owner, lk.token) for lk in locks]
    assert manager.store.refresh_many(held, kept=kept) == set()
    assert kept == {}
    for lock in locks:
        lock.release()


def test_the_refresher_encodes_its_write_again_only_when_its_leases_change(
    manager: LockManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tick sends the write its lane's last tick encoded while no lease came or went;
    a lease taken since is in the next tick's write, one released is out of it."""
    sent = _Sent(manager.store.collection)
    monkeypatch.setattr(manager.store, "collection", sent)
    locks = [manager.acquire(f"kept-lane-{n:03d}", ttl=300) for n in range(MANY)]
    lane = get_refresher().lane_of(manager)
    assert lane is not None
    lane.tick()
    batch = lane.batch
    assert batch is not None
    [(_, query, _)] = batch.kept.values()
    lane.tick()
    assert lane.batch is batch
    assert [write[0] is query for write in sent.writes] == [True, True]
    # A lease taken since the last tick: extended by the next, in a write built anew.
    late = manager.acquire("kept-lane-late", ttl=300)
    before = _refreshed(manager, [*locks, late])
    time.sleep(0.01)
    lane.tick()
    assert lane.batch is not batch
    assert sent.writes[-1][0] is not query
    assert _moved(before, _refreshed(manager, [*locks, late])) == {
        lock.key for lock in (*locks, late)
    }
    # One released: out of the next tick's write.
    assert locks[0].release()
    lane.tick()
    keys = bson.decode(sent.writes[-1][0].raw)["_id"]["$in"]
    assert sorted(keys) == sorted(lock.key for lock in (*locks[1:], late))
    for lock in (*locks[1:], late):
        assert lock.release()


def _handed(waiting: LockManager, holding: LockManager, key: str) -> Lock:
    """A lock ``waiting`` takes from a release of ``holding``'s that hands it over: it
    comes with a short first lease, which its lane extends at an early tick."""
    holder = holding.acquire(key, ttl=30)
    got: list[Lock] = []
    thread = threading.Thread(target=lambda: got.append(waiting.acquire(key, ttl=300, timeout=20)))
    thread.start()
    try:
        in_line(holding, key, 1)
    finally:
        holder.release()
        thread.join(30)
    [lock] = got
    assert lock.remaining < 10  # the first lease of a handoff
    return lock


def _extended(lock: Lock) -> None:
    """Until the lane extended ``lock``'s short first lease to its ttl (bounded)."""
    deadline = time.monotonic() + 10
    while lock.remaining < 20 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert lock.remaining >= 20


def test_an_early_tick_for_a_handed_lease_leaves_the_others_to_their_own_tick(
    manager: LockManager, other: LockManager
) -> None:
    """A lease handed over comes with a short first lease, which the lane extends at an
    early tick: the lane's other leases, whose tick is not due yet, are not written."""
    # Leases of 300 s: the lane's ticks are 100 s apart, but for the early ones.
    kept = manager.acquire("early-kept", ttl=300)
    first = _handed(manager, other, "early-first")
    _extended(first)  # the lane's first tick: every lease
    before = _refreshed(manager, [kept, first])
    second = _handed(manager, other, "early-second")
    _extended(second)  # an early tick: this lease alone
    assert _refreshed(manager, [kept, first]) == before
    get_refresher().tick()  # a tick of every lease (the refresher's own, by hand)
    assert _moved(before, _refreshed(manager, [kept, first, second])) == {
        "early-kept",
        "early-first",
        "early-second",
    }
    for lock in (kept, first, second):
        assert lock.release()


def test_an_early_tick_keeps_a_shorter_lease_at_its_own_pace(manager: LockManager) -> None:
    """A lease shorter than the lane's others is extended at early ticks of its own pace,
    which leave the longer leases to their tick."""
    kept = manager.acquire("pace-long", ttl=300)
    get_refresher().tick()  # every lease: the next such tick in 100 s
    before = _refreshed(manager, [kept])
    short = manager.acquire("pace-short", ttl=3)  # a tick every second
    taken = _refreshed(manager, [short])
    time.sleep(6.5)  # over twice its lease
    assert short.valid
    assert not short.lost.is_set()
    assert _refreshed(manager, [kept]) == before
    assert _moved(taken, _refreshed(manager, [short])) == {"pace-short"}
    for lock in (kept, short):
        assert lock.release()


@pytest.mark.parametrize("through", ["refresh", "arefresh"])
def test_a_lease_shortened_by_hand_is_kept_at_its_new_pace(
    manager: LockManager, through: str
) -> None:
    """``refresh(ttl=shorter)``: the lane, whose next tick was a third of the old lease
    away, ticks at a third of the new one, and keeps it past several of its lengths."""
    lock = manager.acquire(f"shortened-{through}", ttl=300)
    get_refresher().tick()  # the next tick of this lease in 100 s
    if through == "refresh":
        lock.refresh(ttl=2)
    else:
        asyncio.run(lock.arefresh(ttl=2))
    assert lock.ttl == 2
    taken = _refreshed(manager, [lock])
    time.sleep(5.0)  # two and a half of its leases
    assert lock.valid
    assert not lock.lost.is_set()
    assert _moved(taken, _refreshed(manager, [lock])) == {lock.key}
    assert lock.release()
