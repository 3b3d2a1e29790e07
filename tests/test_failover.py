"""Fencing tokens and held locks across primary failovers of a three-node replica set.

The quick version of ``tests/reliability/test_failover.py``: no load, one step-down and one
kill, and the lock document deleted in between, so that only the cluster time can keep the
next token above the last one.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from django_mongolock import LockManager, LockNotAcquired
from django_mongolock.testing import MongoReplicaSet


@pytest.fixture(scope="module")
def trio() -> Iterator[MongoReplicaSet]:
    with MongoReplicaSet(3, name="failover") as replica_set:
        yield replica_set


@pytest.fixture
def failover_manager(trio: MongoReplicaSet) -> Iterator[LockManager]:
    """A manager that waits long enough for an election (seconds, with the harness's timeouts)."""
    with LockManager(trio.url, database="failover", server_selection_timeout=30) as manager:
        yield manager
        manager.client.drop_database("failover")


def test_tokens_grow_and_held_locks_survive_a_step_down_and_a_kill_of_the_primary(
    trio: MongoReplicaSet, failover_manager: LockManager
) -> None:
    manager = failover_manager
    held = manager.acquire("held", ttl=300)  # acknowledged (majority) before both failovers
    first = manager.acquire("token", ttl=60)
    assert first.release()  # no waiters: the document is deleted
    tokens = [first.token]

    for fault in ("step_down", "kill"):
        old = trio.primary()
        if fault == "step_down":
            trio.step_down(10)
        else:
            trio.kill(old, signal.SIGKILL)
        new = trio.primary(timeout=60)
        assert new is not old
        manager.store.collection.delete_many({"_id": "token"})
        lock = manager.acquire("token", ttl=60)
        assert lock.token > tokens[-1], f"after the {fault}"
        tokens.append(lock.token)
        assert lock.release()

        status = manager.status("held")
        assert status is not None, f"an acknowledged lock was lost in the {fault}"
        assert (status.owner, status.token, status.live) == (held.owner, held.token, True)
        assert held.refresh().valid
        with pytest.raises(LockNotAcquired):
            manager.acquire("held", blocking=False)

    assert tokens == sorted(set(tokens))
    assert all(token < 2**63 for token in tokens)
    assert held.release()
