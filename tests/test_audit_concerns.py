"""A force release and its audit record are majority-durable whatever the client's concerns."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from pymongo import MongoClient

from django_mongolock import LockManager
from tests.commands import Recorder


@pytest.fixture
def w1(mongolock_url: str) -> Iterator[tuple[MongoClient[dict[str, Any]], Recorder]]:
    """A client of the user's own, writing with w=1 and reading local, with a listener."""
    commands = Recorder()
    client: MongoClient[dict[str, Any]] = MongoClient(
        mongolock_url, w=1, readConcernLevel="local", event_listeners=[commands]
    )
    yield client, commands
    client.close()


def test_force_release_commits_with_majority_on_a_w1_client(
    w1: tuple[MongoClient[dict[str, Any]], Recorder], mongolock_database: str
) -> None:
    client, commands = w1
    manager = LockManager(client=client, database=mongolock_database)
    try:
        manager.ensure_indexes()
        lock = manager.acquire("durable", ttl=30, refresh=False)
        info = manager.force_release("durable", reason="w1 client", by="ops@host")
        assert info is not None
        assert info.token == lock.token
        [commit] = commands.named("commitTransaction")
        assert commit["writeConcern"]["w"] == "majority"
        [first] = [
            sent.command
            for sent in commands.sent
            if "startTransaction" in sent.command and sent.command.get("lsid") == commit.get("lsid")
        ]
        assert first["readConcern"]["level"] == "majority"
        [entry] = manager.history("durable")
        assert (entry.token, entry.reason, entry.by) == (lock.token, "w1 client", "ops@host")
    finally:
        manager.close()
