"""A bulk force release: each lock only at its token, with its audit record, in a few round
trips for the whole selection (one transaction per 200 locks), not a few for each lock."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from pymongo import MongoClient

from django_mongolock import LockInfo, LockManager, MongoLockError
from django_mongolock.testing import MongoReplicaSet
from tests.commands import Recorder

LOCKS = 250  # two transactions: 200 and 50


@pytest.fixture
def recorded(mongolock_url: str, mongolock_database: str) -> Iterator[tuple[LockManager, Recorder]]:
    """A manager whose client writes w=1 (the release must still commit at majority) and
    reports every command it sends."""
    commands = Recorder()
    client: MongoClient[dict[str, Any]] = MongoClient(
        mongolock_url, w=1, event_listeners=[commands]
    )
    manager = LockManager(client=client, database=mongolock_database)
    manager.ensure_indexes()
    yield manager, commands
    manager.close()
    client.close()


def test_many_locks_go_in_one_transaction_per_chunk_each_at_its_token(
    recorded: tuple[LockManager, Recorder], manager: LockManager
) -> None:
    bulk, commands = recorded
    held = [manager.acquire(f"bulk/{n:03}", ttl=60, refresh=False) for n in range(LOCKS)]
    picked = [(lock.key, lock.token) for lock in held]
    # One changed hands since it was picked, one is gone, one is picked twice.
    assert manager.force_release("bulk/007") is not None
    retaken = manager.acquire("bulk/007", ttl=60, refresh=False)
    assert manager.force_release("bulk/011") is not None
    picked.append(picked[0])
    commands.clear()

    released = bulk.force_release_many(picked, reason="cleanup", by="ops@bastion")

    expected = [
        (key, token) for key, token in picked[:LOCKS] if key not in {"bulk/007", "bulk/011"}
    ]
    assert [(info.key, info.token) for info in released] == expected
    assert [info.owner for info in released] == [
        lock.owner for lock in held if lock.key not in {"bulk/007", "bulk/011"}
    ]
    # Each transaction: a read, a delete and the audit records, then the commit.
    commits = commands.named("commitTransaction")
    assert len(commits) == 2
    assert all(commit["writeConcern"]["w"] == "majority" for commit in commits)
    lock_commands = commands.on(bulk.database, bulk.collection)
    assert sorted(sent.name for sent in lock_commands) == ["delete"] * 2 + ["find"] * 2
    audit = commands.on(bulk.database, f"{bulk.collection}.audit")
    assert [sent.name for sent in audit] == ["update"] * 2
    assert len(commands.sent) == 8  # no getMore
    # What is left: the lock retaken since, nothing else.
    now = manager.statuses(key for key, _ in picked)
    assert list(now) == ["bulk/007"]
    assert now["bulk/007"].token == retaken.token
    # One audit record per released lock, none for the two left alone.
    for info in released[:5] + released[-5:]:
        [entry] = manager.history(info.key)
        assert (entry.token, entry.owner, entry.by, entry.reason) == (
            info.token,
            info.owner,
            "ops@bastion",
            "cleanup",
        )
    assert len(manager.history("bulk/007")) == 1  # the single release above, no more
    assert manager.history("bulk/007")[0].token == held[7].token
    assert bulk.force_release_many([]) == []


def test_bad_input_releases_nothing(manager: LockManager) -> None:
    lock = manager.acquire("bulk/kept", ttl=60, refresh=False)
    with pytest.raises(TypeError, match="token must be an int"):
        manager.force_release_many([("bulk/kept", lock.token), ("bulk/other", "7")])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="must not be empty"):
        manager.force_release_many([("bulk/kept", lock.token), ("", 1)])
    with pytest.raises(TypeError, match="reason must be a str"):
        manager.force_release_many([("bulk/kept", lock.token)], reason=None)  # type: ignore[arg-type]
    info = manager.status("bulk/kept")
    assert info is not None
    assert info.token == lock.token
    assert manager.history("bulk/kept") == []


def test_a_lock_that_changes_hands_while_the_release_runs_is_left_to_its_new_holder(
    fail_points: MongoReplicaSet, hang: Any
) -> None:
    """The delete runs in the read's snapshot: a lock retaken after the read makes it a
    write conflict, and the transaction runs again from the read."""
    commands = Recorder()
    client: MongoClient[dict[str, Any]] = MongoClient(
        fail_points.url, appname="bulk-release", event_listeners=[commands]
    )
    bulk = LockManager(client=client, database="bulk_release")
    other = LockManager(fail_points.url, database="bulk_release")
    try:
        held = [other.acquire(f"moving/{n}", ttl=60, refresh=False) for n in range(3)]
        hang("bulk-release", ms=5000, times=1, commands=("delete",))
        result: list[Any] = []

        def release() -> None:
            try:
                result.append(bulk.force_release_many([(lock.key, lock.token) for lock in held]))
            except BaseException as exc:  # reported by the assertion below
                result.append(exc)

        worker = threading.Thread(target=release)
        worker.start()
        for _ in range(100):  # the delete is sent, and held by the server
            if commands.named("delete"):
                break
            worker.join(0.05)
        assert commands.named("delete")
        assert other.force_release("moving/1") is not None
        retaken = other.acquire("moving/1", ttl=60, refresh=False)
        worker.join(15)
        assert not worker.is_alive()
        [released] = result
        assert isinstance(released, list), released
        assert [info.key for info in released] == ["moving/0", "moving/2"]
        assert len(commands.named("find")) == 2  # read again after the conflict
        info = other.status("moving/1")
        assert info is not None
        assert (info.token, info.owner) == (retaken.token, retaken.owner)
        assert len(other.history("moving/1")) == 1  # the retake's release only
        assert other.status("moving/0") is None
        assert other.status("moving/2") is None
    finally:
        other.client.drop_database("bulk_release")
        bulk.close()
        other.close()
        client.close()


def _fail_deletes(
    fail_points: MongoReplicaSet, app: str, mode: Any, code: int, *labels: str
) -> None:
    admin: MongoClient[dict[str, Any]] = MongoClient(fail_points.nodes[0].direct_url)
    try:
        admin.admin.command(
            "configureFailPoint",
            "failCommand",
            mode=mode,
            data={
                "failCommands": ["delete"],
                "errorCode": code,
                "errorLabels": list(labels),
                "appName": app,
            },
        )
    finally:
        admin.close()


@pytest.fixture
def failing(fail_points: MongoReplicaSet, hang: Any) -> Iterator[tuple[LockManager, Recorder]]:
    """A manager named ``bulk-failing`` on the fail point server, recording its commands
    (``hang`` switches the fail point off after the test)."""
    commands = Recorder()
    client: MongoClient[dict[str, Any]] = MongoClient(
        fail_points.url, appname="bulk-failing", event_listeners=[commands]
    )
    manager = LockManager(client=client, database="bulk_failing")
    yield manager, commands
    client.drop_database("bulk_failing")
    manager.close()
    client.close()


def test_a_release_that_keeps_conflicting_is_split_in_two(
    fail_points: MongoReplicaSet, failing: tuple[LockManager, Recorder]
) -> None:
    """A write conflict in every attempt (as live holders refreshing their locks between
    the read and the delete would make) releases the locks in two halves, not an error."""
    bulk, commands = failing
    held = [bulk.acquire(f"busy/{n}", ttl=60, refresh=False) for n in range(6)]
    _fail_deletes(fail_points, "bulk-failing", {"times": 5}, 112, "TransientTransactionError")
    commands.clear()
    released = bulk.force_release_many([(lock.key, lock.token) for lock in held])
    assert [info.key for info in released] == [lock.key for lock in held]
    assert len(commands.named("commitTransaction")) == 2  # one for each half
    assert len(commands.named("find")) == 5 + 2
    assert bulk.statuses(lock.key for lock in held) == {}
    assert all(len(bulk.history(lock.key)) == 1 for lock in held)


def test_locks_released_before_a_failed_transaction_stay_released_and_logged(
    fail_points: MongoReplicaSet,
    failing: tuple[LockManager, Recorder],
    caplog: pytest.LogCaptureFixture,
) -> None:
    bulk, _ = failing
    held = [bulk.acquire(f"part/{n:03}", ttl=60, refresh=False) for n in range(LOCKS)]
    reported: list[LockInfo] = []
    # The first transaction's delete goes through, every later one is refused.
    _fail_deletes(fail_points, "bulk-failing", {"skip": 1}, 2)
    with (
        caplog.at_level(logging.INFO, logger="django_mongolock.manager"),
        pytest.raises(MongoLockError),
    ):
        bulk.force_release_many(
            [(lock.key, lock.token) for lock in held], on_released=reported.append
        )
    first = [lock.key for lock in held[:200]]
    assert sorted(info.key for info in reported) == first
    assert bulk.statuses(first) == {}
    assert set(bulk.statuses(lock.key for lock in held[200:])) == {lock.key for lock in held[200:]}
    logged = [r.key for r in caplog.records if r.getMessage().startswith("force-released")]  # type: ignore[attr-defined]
    assert sorted(logged) == first
    assert len(bulk.history(first[0])) == 1
    assert bulk.history(held[-1].key) == []


def test_only_write_conflicts_split_a_transaction(
    fail_points: MongoReplicaSet, failing: tuple[LockManager, Recorder]
) -> None:
    """Only write conflicts split a transaction: a transient error of another kind on
    every attempt (as a server out of reach gives) fails the call after those attempts,
    instead of trying ever smaller parts."""
    bulk, commands = failing
    held = [bulk.acquire(f"away/{n}", ttl=60, refresh=False) for n in range(6)]
    _fail_deletes(fail_points, "bulk-failing", {"times": 5}, 2, "TransientTransactionError")
    commands.clear()
    with pytest.raises(MongoLockError):
        bulk.force_release_many([(lock.key, lock.token) for lock in held])
    assert commands.named("commitTransaction") == []
    assert len(commands.named("find")) == 5
    assert set(bulk.statuses(lock.key for lock in held)) == {lock.key for lock in held}
