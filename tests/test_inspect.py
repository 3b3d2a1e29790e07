"""status, list, counts and force_release: what the admin and the CLI are built on."""

from __future__ import annotations

import time

import pytest

from django_mongolock import LockManager


@pytest.fixture
def populated(manager: LockManager) -> LockManager:
    for i in range(5):
        manager.acquire(f"live-{i}", ttl=60)
    for i in range(3):
        manager.acquire(f"dead-{i}", ttl=0.05, refresh=False)
    manager.acquire("a.b*c(", ttl=60)
    manager.acquire("soon", ttl=5)
    time.sleep(0.1)
    return manager


def test_status_of_live_expired_and_missing(populated: LockManager) -> None:
    live = populated.status("live-0")
    assert live is not None
    assert (live.key, live.state, live.live) == ("live-0", "live", True)
    assert live.remaining > 50
    dead = populated.status("dead-0")
    assert dead is not None
    assert (dead.state, dead.live) == ("expired", False)
    assert dead.remaining < 0
    assert populated.status("nope") is None
    data = live.as_dict()
    assert data["key"] == "live-0"
    assert data["state"] == "live"
    assert data["token"] == live.token


def test_list_by_state(populated: LockManager) -> None:
    live = [info.key for info in populated.list("live")]
    assert live == sorted(["a.b*c(", "soon", *(f"live-{i}" for i in range(5))])
    assert [info.key for info in populated.list("expired")] == ["dead-0", "dead-1", "dead-2"]
    assert len(populated.list("all")) == 10
    with pytest.raises(ValueError, match="state"):
        populated.list("held")  # type: ignore[arg-type]


def test_list_prefix_is_literal(populated: LockManager) -> None:
    assert [info.key for info in populated.list("all", prefix="live-")] == [
        f"live-{i}" for i in range(5)
    ]
    assert [info.key for info in populated.list("all", prefix="a.b*")] == ["a.b*c("]
    assert populated.list("all", prefix="a.c") == []
    assert populated.list("all", prefix=".*") == []


def test_list_by_owner(populated: LockManager, other: LockManager) -> None:
    mine = other.acquire("other-one", ttl=30)
    found = populated.list("all", owner=mine.owner)
    assert [info.key for info in found] == ["other-one"]


def test_pagination_and_order(populated: LockManager) -> None:
    everything = [info.key for info in populated.list("all", limit=None)]
    pages = [
        [info.key for info in populated.list("all", limit=4, offset=offset)] for offset in (0, 4, 8)
    ]
    assert [len(page) for page in pages] == [4, 4, 2]
    assert [key for page in pages for key in page] == everything
    by_expiry = populated.list("all", order="expires", limit=None)
    assert [info.expires_at for info in by_expiry] == sorted(i.expires_at for i in by_expiry)
    newest = populated.list("all", order="-acquired", limit=1)
    assert newest[0].acquired_at == max(i.acquired_at for i in by_expiry)
    assert [i.key for i in populated.list("all", order="-key", limit=None)] == everything[::-1]
    with pytest.raises(ValueError, match="order"):
        populated.list("all", order="owner")  # type: ignore[arg-type]


def test_iter_locks_streams_in_batches(manager: LockManager) -> None:
    manager.store.collection.insert_many(
        [
            {"_id": f"bulk-{i:05d}", "key": f"bulk-{i:05d}", "owner": "h:1:x", "token": i}
            for i in range(2500)
        ]
    )
    stream = manager.iter_locks("all", batch_size=100)
    first = next(stream)
    assert first.key == "bulk-00000"
    assert sum(1 for _ in stream) == 2499


def test_counts(populated: LockManager) -> None:
    assert populated.counts(soon=10) == {"live": 7, "expired": 3, "expiring": 1}
    assert populated.count("live") == 7
    assert populated.count("expired", prefix="dead-") == 3


def test_force_release(populated: LockManager) -> None:
    before = populated.status("live-1")
    assert before is not None
    assert populated.force_release("live-1", token=before.token + 1) is None
    assert populated.status("live-1") is not None
    removed = populated.force_release("live-1", token=before.token)
    assert removed is not None
    assert (removed.owner, removed.token) == (before.owner, before.token)
    assert populated.status("live-1") is None
    assert populated.force_release("live-1") is None
    assert populated.force_release("dead-0") is not None


def test_counts_of_an_empty_collection(manager: LockManager) -> None:
    assert manager.counts() == {"live": 0, "expired": 0, "expiring": 0}
    assert manager.list("all") == []
