"""Holder liveness (heartbeats by the refresher) and the audit trail of force releases."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from pymongo import MongoClient

from django_mongolock import LockManager, clock
from django_mongolock.info import process_of, processes_of
from django_mongolock.queries import HEARTBEAT_SLACK
from django_mongolock.refresher import get_refresher
from tests.commands import Recorder
from tests.utils import ROOT


def _holder(url: str, database: str, key: str, ttl: float) -> subprocess.Popen[str]:
    """A holder in a process of its own, refreshing ``key`` until killed."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.holder", url, database, key, str(ttl), "sleep"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    process.stdout.close()
    assert line.startswith("held "), line
    return process


def _wait_for(manager: LockManager, key: str, alive: bool | None, within: float) -> None:
    """Poll ``status(key)`` until its holder's liveness is ``alive`` (bounded)."""
    deadline = clock.now() + within
    while True:
        info = manager.status(key)
        assert info is not None
        if info.holder_alive is alive:
            return
        assert clock.now() < deadline, f"holder_alive stayed {info.holder_alive!r}"
        time.sleep(0.1)


def test_process_of_strips_the_serial() -> None:
    assert process_of("web-1:4242:00000000abcd") == "web-1:4242"
    assert process_of("my:owner:prefix:77:0000000000ff") == "my:owner:prefix:77"
    assert process_of("plain") == "plain"


def test_processes_of_parses_each_process_once_and_tells_them_apart() -> None:
    """The heartbeat's process ids, read without parsing every owner id of one process,
    are those of each owner id: also where ids start alike (a host name may hold a
    colon) or are no ``host:pid:serial`` at all."""
    owners = ["web:7:a1", "web:7:b2", "web:7:2:c3", "web:8:d4", "web:7", "web:7:", "", ":x"]
    owners += ["\0a", "plain"]
    rng = random.Random(7)
    for _ in range(2000):
        drawn = rng.choices(owners, k=rng.randint(0, 9))
        assert processes_of(drawn) == {process_of(owner) for owner in drawn}, drawn


def test_a_live_holder_process_is_alive_and_a_killed_one_is_not(
    mongolock_url: str, manager: LockManager
) -> None:
    ttl = 0.6  # ticks every 0.2 s: alive for 0.4 s + slack after the last heartbeat
    process = _holder(mongolock_url, manager.database, "job", ttl)
    try:
        _wait_for(manager, "job", True, within=10)
        info = manager.status("job")
        assert info is not None
        assert info.holder_silent_for is not None
        assert 0 <= info.holder_silent_for < 2 * ttl / 3 + HEARTBEAT_SLACK
        listed = manager.list("all")
        assert [(i.key, i.holder_alive) for i in listed] == [("job", True)]
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(10)
    # The lease ends after ttl; the heartbeat is older than its bound a few seconds later.
    _wait_for(manager, "job", False, within=2 * ttl + HEARTBEAT_SLACK + 10)
    info = manager.status("job")
    assert info is not None
    assert not info.live
    assert info.holder_silent_for is not None
    assert info.holder_silent_for > HEARTBEAT_SLACK
    assert info.as_dict()["holder_alive"] is False


def test_the_refresher_records_this_process_heartbeat(manager: LockManager) -> None:
    # A ttl long enough that the first tick (a third of it in) comes after the status.
    lock = manager.acquire("mine", ttl=3.0)
    assert manager.status("mine").holder_alive is None  # type: ignore[union-attr]
    lane = get_refresher().lane_of(manager)  # this manager's ticks, not other lanes'
    assert lane is not None
    ticks = lane.ticks
    deadline = clock.now() + 10
    while lane.ticks < ticks + 2:
        assert clock.now() < deadline
        time.sleep(0.05)
    info = manager.status("mine")
    assert info is not None
    assert info.holder_alive is True
    doc = manager.store.processes.find_one({"_id": process_of(lock.owner)})
    assert doc is not None
    assert doc["_id"] == f"{os.uname().nodename}:{os.getpid()}"
    assert doc["interval"] == pytest.approx(1.0)
    lock.release()


def test_a_holder_without_a_heartbeat_is_unknown(manager: LockManager) -> None:
    manager.acquire("quiet", ttl=30, refresh=False)
    info = manager.status("quiet")
    assert info is not None
    assert (info.holder_alive, info.holder_silent_for) == (None, None)
    assert info.as_dict()["holder_alive"] is None


def test_force_release_is_recorded_with_who_why_and_the_token(
    manager: LockManager, other: LockManager
) -> None:
    lock = other.acquire("report", ttl=30)
    info = manager.force_release("report", reason="stuck since noon", by="ops@bastion")
    assert info is not None
    assert info.token == lock.token
    history = manager.history("report")
    assert len(history) == 1
    entry = history[0]
    assert (entry.key, entry.owner, entry.token, entry.by, entry.reason, entry.expired) == (
        "report",
        lock.owner,
        lock.token,
        "ops@bastion",
        "stuck since noon",
        False,
    )
    assert abs((entry.at - info.now).total_seconds()) < 60  # server time, not a client's
    assert entry.as_dict()["at"] == entry.at.isoformat()
    second = other.acquire("report", ttl=30)
    manager.force_release("report")
    newest, oldest = manager.history("report")
    assert (newest.token, oldest.token) == (second.token, lock.token)
    assert "@" in newest.by
    assert newest.reason == ""
    assert manager.history("report", limit=1) == [newest]
    assert manager.history("other-key") == []


def test_a_force_release_that_removes_nothing_records_nothing(
    manager: LockManager, other: LockManager
) -> None:
    lock = other.acquire("k", ttl=30)
    assert manager.force_release("k", token=lock.token + 1, reason="x") is None
    assert manager.force_release("missing") is None
    assert manager.history("k") == []
    assert manager.history("missing") == []
    assert manager.status("k") is not None


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"reason": 5}, TypeError),
        ({"reason": "a\x00b"}, ValueError),
        ({"reason": "x" * 1001}, ValueError),
        ({"by": ""}, ValueError),
        ({"by": b"me"}, TypeError),
    ],
)
def test_bad_audit_text_changes_nothing(
    manager: LockManager, other: LockManager, kwargs: dict[str, object], error: type[Exception]
) -> None:
    other.acquire("k", ttl=30)
    with pytest.raises(error):
        manager.force_release("k", **kwargs)  # type: ignore[arg-type]
    assert manager.status("k") is not None
    assert manager.history("k") == []


def test_audit_retention_is_validated() -> None:
    with pytest.raises(ValueError, match="audit_retention"):
        LockManager("mongodb://localhost/", audit_retention=-1)
    assert LockManager("mongodb://localhost/", retention=7).audit_retention == 7
    assert LockManager("mongodb://localhost/", audit_retention=9).audit_retention == 9


def test_force_releases_racing_the_holders_refreshes_are_each_recorded(
    manager: LockManager, other: LockManager
) -> None:
    # Leases of 1 s are refreshed about every third of a second: each force release is sent
    # around one of those writes, so the transaction meets them.
    tokens = []
    for _ in range(30):
        lock = other.acquire("busy", ttl=1.0)
        time.sleep(random.uniform(0.25, 0.4))
        info = manager.force_release("busy", reason="race")
        if info is None:  # the lease lapsed first (a refresh held up on a loaded machine)
            assert lock.lost.wait(2.0)
            continue
        assert info.token == lock.token
        tokens.append(lock.token)
    assert len(tokens) >= 20
    assert [entry.token for entry in manager.history("busy")] == tokens[::-1]


@pytest.mark.parametrize("text", ["$$NOW", "$gt", "$", "$key", "{$ne: 1}"])
def test_audit_text_that_looks_like_an_operator_is_kept_as_text(
    manager: LockManager, other: LockManager, text: str
) -> None:
    lock = other.acquire(text, ttl=30)
    manager.force_release(text, reason=text, by=text)
    [entry] = manager.history(text)
    assert (entry.key, entry.owner, entry.reason, entry.by) == (text, lock.owner, text, text)


def test_a_page_costs_one_liveness_query_whatever_its_size(
    mongolock_url: str, manager: LockManager, other: LockManager
) -> None:
    for n in range(60):
        other.acquire(f"k{n:02}", ttl=30)
    manager.store.heartbeat({f"host-{n}:1" for n in range(3)}, 10.0)
    listener = Recorder()
    client: MongoClient[Any] = MongoClient(mongolock_url, event_listeners=[listener])
    try:
        watched = LockManager(client=client, database=manager.database)
        page = watched.list("all", limit=50)
        assert len(page) == 50
        assert [find["find"] for find in listener.named("find")] == ["locks", "locks.processes"]
        assert {info.holder_alive for info in page} == {None}  # other's process: no heartbeat
        listener.clear()
        assert watched.status("k00") is not None
        assert [find["find"] for find in listener.named("find")] == ["locks", "locks.processes"]
    finally:
        client.close()


def test_a_failing_heartbeat_is_logged_once_and_the_leases_are_kept(
    manager: LockManager, caplog: pytest.LogCaptureFixture
) -> None:
    # A validator that refuses every heartbeat document: the server answers each write
    # with an error, as it would for a missing privilege.
    database = manager.store.collection.database
    database.create_collection(
        f"{manager.collection}.processes", validator={"interval": {"$type": "string"}}
    )
    # Room for a late tick: the lease must be kept by refreshes alone.
    lock = manager.acquire("kept", ttl=3.0)
    lane = get_refresher().lane_of(manager)  # this manager's ticks, not other lanes'
    assert lane is not None
    ticks = lane.ticks
    deadline = clock.now() + 30
    while lane.ticks < ticks + 8:
        assert clock.now() < deadline
        time.sleep(0.05)
    assert lock.valid  # refreshed all along
    info = manager.status("kept")
    assert info is not None
    assert info.holder_alive is None
    # This manager's lane only: a lane of an earlier test's closed manager says so too.
    warnings = [
        r
        for r in caplog.records
        if "cannot record this process's heartbeat" in r.message
        and r.threadName == f"mongolock-refresher-{id(manager):x}"
    ]
    assert len(warnings) == 1
    lock.release()
