"""The refresher's way round a document the server refuses to update: one write per lease."""

from __future__ import annotations

import pytest

from django_mongolock import LockManager
from django_mongolock.exceptions import MongoLockError
from tests.validators import refusing


def test_refresh_many_stops_at_a_refused_document_and_refresh_each_does_not(
    mongolock_url: str, manager: LockManager, other: LockManager
) -> None:
    bad = [manager.acquire(key, ttl=30) for key in ("re-bad", "re-bad-2")]
    good = [manager.acquire(key, ttl=30) for key in ("re-a", "re-z")]
    shared = manager.acquire("re-shared", ttl=30, shared=True, limit=2)
    shared_bad = manager.acquire("re-shared-bad", ttl=30, shared=True, limit=2)
    freed = manager.acquire("re-freed", ttl=30)
    other.force_release("re-freed")
    # The refused ones between the others: their indexes in the bulk name them.
    order = [good[0], bad[0], freed, bad[1], good[1]]
    held = [(lock.key, lock.owner, lock.token) for lock in order]
    store = manager.store
    with refusing(mongolock_url, manager, "re-bad", "re-bad-2", "re-shared-bad"):
        with pytest.raises(MongoLockError, match="Document failed validation"):
            store.refresh_many(held)
        gone, refused = store.refresh_each(held)
        assert refused == {bad[0].owner, bad[1].owner}
        assert gone == {freed.owner}  # released by somebody else: not extended
        leases = [(lock.key, lock.owner, lock.token) for lock in (shared, shared_bad)]
        gone, refused = store.refresh_each(leases, shared=True)
        assert (gone, refused) == (set(), {shared_bad.owner})
        # "re-z" sorts after the refused keys, where update_many stopped: only the
        # one-by-one writes extended it.
        doc = store.collection.find_one({"_id": "re-z"})
        assert doc is not None
        assert doc["refreshed_at"] > doc["acquired_at"]
    for lock in (*bad, *good, shared, shared_bad):
        lock.release()


def test_refresh_each_of_nothing_writes_nothing(manager: LockManager) -> None:
    assert manager.store.refresh_each([]) == (set(), set())
