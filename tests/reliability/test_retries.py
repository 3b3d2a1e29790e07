"""A lock write whose reply is lost is retried, and the retry must be understood.

In a failover a write can be applied and its reply lost (or carry a retryable write concern
error). pymongo then retries it, and the server answers the retry from its record of the
first attempt: the stored document, without the fields a projection computes (``$$NOW``).
An acquisition is sent as a plain command and retried by the store itself: the same
request finds the lease it already took. The failover test meets all this at random; here
the server's ``failCommand`` fail point makes it happen every time: the write is applied,
and its reply carries a write concern error.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from pymongo import MongoClient

from django_mongolock import (
    LockManager,
    LockNotAcquired,
    MongoLockError,
    ServerUnavailable,
    queries,
)
from django_mongolock.testing import MongoReplicaSet
from tests.utils import NamedManager

# The app name of the manager the fail point is for.
APP = "retries"


@pytest.fixture
def lose_next_reply(fail_points: MongoReplicaSet) -> Iterator[Any]:
    """``lose_next_reply()``: the next findAndModify of the ``retrying`` manager is
    applied, then answered with a retryable write concern error, so that the driver
    retries it (no other client of the shared fail-point set meets it)."""
    admin: MongoClient[dict[str, Any]] = MongoClient(fail_points.nodes[0].direct_url)

    def arm(code: int = 6, times: int = 1) -> None:
        admin.admin.command(
            "configureFailPoint",
            "failCommand",
            mode={"times": times},
            data={
                "failCommands": ["findAndModify", "update"],
                "writeConcernError": {"code": code, "errmsg": "reply lost (fail point)"},
                "errorLabels": ["RetryableWriteError"],
                "appName": APP,
            },
        )

    yield arm
    admin.admin.command("configureFailPoint", "failCommand", mode="off")
    admin.close()


@pytest.fixture
def retrying(fail_points: MongoReplicaSet) -> Iterator[LockManager]:
    with NamedManager(fail_points.url, app=APP, database="retries") as manager:
        yield manager
        manager.client.drop_database("retries")


def test_a_retried_acquire_returns_the_lock_it_took(
    retrying: LockManager, lose_next_reply: Any
) -> None:
    lose_next_reply()
    lock = retrying.acquire("job", ttl=30)
    status = retrying.status("job")
    assert status is not None
    assert (status.owner, status.token) == (lock.owner, lock.token)
    assert lock.release()


def test_a_retried_shared_acquire_holds_one_lease(
    retrying: LockManager, lose_next_reply: Any
) -> None:
    lose_next_reply()
    lock = retrying.acquire("job", ttl=30, shared=True)
    doc = retrying.store.collection.find_one({"_id": "job"})
    assert doc is not None
    assert [entry["owner"] for entry in doc["holders"]] == [lock.owner]
    assert lock.release()


def test_a_retried_acquire_in_line_keeps_one_place(
    retrying: LockManager, lose_next_reply: Any
) -> None:
    holder = retrying.acquire("job", ttl=30)
    # Lately busy: the first request of the next acquire is the one that joins the line,
    # and its reply is the one lost.
    retrying.waiters.found_busy("job")
    lose_next_reply()
    with pytest.raises(LockNotAcquired):
        retrying.acquire("job", timeout=0.3)
    assert holder.release()
    lose_next_reply()
    waiter = retrying.acquire("job", timeout=5)
    doc = retrying.store.collection.find_one({"_id": "job"})
    assert doc is not None
    assert doc["owner"] == waiter.owner
    assert doc["waiters"] == []
    assert waiter.release()


def test_an_acquire_whose_write_concern_fails_twice_is_an_error(
    retrying: LockManager, lose_next_reply: Any
) -> None:
    lose_next_reply(times=2)  # HostUnreachable, twice: the server cannot serve writes now
    with pytest.raises(ServerUnavailable, match="reply lost"):
        retrying.acquire("job", ttl=30)
    assert retrying.status("job") is None  # whatever the two attempts took, given back


def test_an_acquire_whose_write_concern_cannot_be_met_is_not_retried(
    retrying: LockManager, lose_next_reply: Any
) -> None:
    lose_next_reply(code=100)  # UnsatisfiableWriteConcern: sending it again cannot help
    with pytest.raises(MongoLockError, match="reply lost"):
        retrying.acquire("job", ttl=30)
    # The write was applied before its write concern failed: the lease it took was
    # given back at once, so the key is free now rather than when that lease ends.
    assert retrying.status("job") is None
    lock = retrying.acquire("job", ttl=30, blocking=False)
    assert lock.release()


def test_a_shared_acquire_whose_write_concern_fails_gives_its_lease_back(
    retrying: LockManager, lose_next_reply: Any
) -> None:
    reader = retrying.acquire("job", ttl=30, shared=True)
    lose_next_reply(times=2)
    with pytest.raises(MongoLockError, match="reply lost"):
        retrying.acquire("job", ttl=30, shared=True)
    status = retrying.status("job")
    assert status is not None
    assert [holder.owner for holder in status.holders] == [reader.owner]
    assert reader.release()
    writer = retrying.acquire("job", ttl=30, blocking=False)
    assert writer.release()


def test_a_retried_refresh_extends_the_lease(retrying: LockManager, lose_next_reply: Any) -> None:
    lock = retrying.acquire("job", ttl=30)
    lose_next_reply()
    assert lock.refresh(ttl=60) is lock
    assert lock.valid
    assert lock.release()


@pytest.mark.parametrize("shared", [False, True], ids=["exclusive", "shared"])
def test_a_retried_release_reports_a_live_lock_released_not_lost(
    retrying: LockManager, lose_next_reply: Any, shared: bool
) -> None:
    lock = retrying.acquire("job", ttl=30, shared=shared)
    lose_next_reply()
    assert lock.release() is True
    assert not lock.lost.is_set()


def test_a_retried_force_release_returns_the_removed_lock(
    retrying: LockManager, lose_next_reply: Any
) -> None:
    lock = retrying.acquire("job", ttl=30)
    lose_next_reply()
    removed = retrying.force_release("job")
    assert removed is not None
    assert removed.token == lock.token


def test_without_a_lost_reply_each_operation_answers_normally(retrying: LockManager) -> None:
    """The same calls with the fail point off: what the tests above expect of a retry."""
    lock = retrying.acquire("job", ttl=30)
    assert lock.refresh(ttl=60) is lock
    assert lock.release() is True
    assert not lock.lost.is_set()
    again = retrying.acquire("job", ttl=30)
    removed = retrying.force_release("job")
    assert removed is not None
    assert removed.token == again.token


# -- one acquisition, however often its request arrives --------------------------------------


def _send_again(manager: LockManager, key: str, owner: str, ttl: float, **kind: Any) -> Any:
    """The same acquire request once more, as a late duplicate of it would reach the server."""
    store = manager.store
    op = queries.acquire(owner, ttl, **kind)
    reply = store.collection.database.command(op.command(store.collection.name, key))
    return reply["value"]


@pytest.mark.parametrize("shared", [False, True], ids=["exclusive", "shared"])
def test_a_late_duplicate_of_an_acquire_cannot_take_the_key_after_its_release(
    retrying: LockManager, shared: bool
) -> None:
    store = retrying.store
    owner = retrying.new_owner()
    info = store.acquire("job", owner, 30.0, shared=shared)
    mine = info.as_holder(owner) if shared else info
    assert mine is not None
    assert store.release("job", owner, mine.token, shared=shared)
    _send_again(retrying, "job", owner, 30.0, shared=shared, queue=True)
    assert retrying.status("job") is None  # freed, and still free
    doc = store.collection.find_one({"_id": "job"})
    assert doc is not None
    assert not doc.get("waiters")  # nor did the duplicate join the line
    assert owner in doc["ended"]
    lock = retrying.acquire("job", ttl=30, blocking=False)
    assert lock.release()


def test_a_late_duplicate_cannot_take_the_key_after_a_release_that_found_it_ended(
    retrying: LockManager,
) -> None:
    store = retrying.store
    owner = retrying.new_owner()
    info = store.acquire("job", owner, 0.2)
    time.sleep(0.4)
    before = store.collection.find_one({"_id": "job"})
    assert store.release("job", owner, info.token) is False  # its lease had ended
    _send_again(retrying, "job", owner, 30.0)
    assert store.collection.find_one({"_id": "job"}) == before


@pytest.mark.parametrize("shared", [False, True], ids=["exclusive", "shared"])
def test_a_retry_that_finds_its_lease_ended_returns_no_lease(
    retrying: LockManager, shared: bool
) -> None:
    """The retry arrives after the lease its first send took has ended: the acquisition
    is over. It neither returns that ended lease nor takes a second one."""
    store = retrying.store
    owner = retrying.new_owner()
    store.acquire("job", owner, 0.2, shared=shared)
    time.sleep(0.4)
    before = store.collection.find_one({"_id": "job"})
    with pytest.raises(LockNotAcquired, match=r"ended .* before its reply came back"):
        store.acquire("job", owner, 30.0, shared=shared, queue=True)
    assert store.collection.find_one({"_id": "job"}) == before
    # A new acquisition takes the key as usual.
    lock = retrying.acquire("job", ttl=30, shared=shared, blocking=False)
    assert lock.release()


def test_a_retried_acquire_whose_first_send_took_the_lock_and_lost_the_reply_late(
    retrying: LockManager, lose_next_reply: Any
) -> None:
    """The first send is applied and its reply lost; the lock is released; a third copy of
    the request (delivered late) changes nothing."""
    lose_next_reply()
    lock = retrying.acquire("job", ttl=30)
    assert lock.release()
    _send_again(retrying, "job", lock.owner, 30.0)
    assert retrying.status("job") is None
    doc = retrying.store.collection.find_one({"_id": "job"})
    assert doc is not None
    assert doc["token"] == lock.token
