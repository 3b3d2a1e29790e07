"""A lock write whose reply is lost is retried, and the retry must be understood.

In a failover a write can be applied and its reply lost (or carry a retryable write concern
error). pymongo then retries it, and the server answers the retry from its record of the
first attempt: the stored document, without the fields a projection computes (``$$NOW``).
The failover test meets this at random; here the server's ``failCommand`` fail point makes
it happen every time: the write is applied, its reply carries a retryable write concern
error, and the driver retries.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from pymongo import MongoClient

from django_mongolock import LockManager
from django_mongolock.testing import MongoReplicaSet
from tests.reliability.conftest import stop_and_check


@pytest.fixture(scope="module")
def testable() -> Iterator[MongoReplicaSet]:
    """A single-node replica set that accepts fail points (``enableTestCommands``)."""
    replica_set = MongoReplicaSet(
        1, name="retries", extra_args=["--setParameter", "enableTestCommands=1"]
    )
    replica_set.start()
    try:
        yield replica_set
    finally:
        stop_and_check(replica_set)


@pytest.fixture
def lose_next_reply(testable: MongoReplicaSet) -> Iterator[Any]:
    """``lose_next_reply()``: the next findAndModify is applied, then answered with a
    retryable write concern error, so that the driver retries it."""
    admin: MongoClient[dict[str, Any]] = MongoClient(testable.nodes[0].direct_url)

    def arm() -> None:
        admin.admin.command(
            "configureFailPoint",
            "failCommand",
            mode={"times": 1},
            data={
                "failCommands": ["findAndModify"],
                "writeConcernError": {"code": 6, "errmsg": "reply lost (fail point)"},
                "errorLabels": ["RetryableWriteError"],
            },
        )

    yield arm
    admin.admin.command("configureFailPoint", "failCommand", mode="off")
    admin.close()


@pytest.fixture
def retrying(testable: MongoReplicaSet) -> Iterator[LockManager]:
    with LockManager(testable.url, database="retries") as manager:
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
