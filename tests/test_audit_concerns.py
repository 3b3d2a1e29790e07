"""A force release and its audit record are majority-durable whatever the client's concerns."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from pymongo import MongoClient, monitoring

from django_mongolock import LockManager


class _Commands(monitoring.CommandListener):
    """The commands the client sent, by name, as the server received them."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []
        self._mutex = threading.Lock()

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        with self._mutex:
            self.sent.append((event.command_name, dict(event.command)))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass

    def named(self, name: str) -> list[dict[str, Any]]:
        with self._mutex:
            return [command for sent, command in self.sent if sent == name]


@pytest.fixture
def w1(mongolock_url: str) -> Iterator[tuple[MongoClient[dict[str, Any]], _Commands]]:
    """A client of the user's own, writing with w=1 and reading local, with a listener."""
    commands = _Commands()
    client: MongoClient[dict[str, Any]] = MongoClient(
        mongolock_url, w=1, readConcernLevel="local", event_listeners=[commands]
    )
    yield client, commands
    client.close()


def test_force_release_commits_with_majority_on_a_w1_client(
    w1: tuple[MongoClient[dict[str, Any]], _Commands], mongolock_database: str
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
            command
            for command in commands.sent
            if "startTransaction" in command[1] and command[1].get("lsid") == commit.get("lsid")
        ]
        assert first[1]["readConcern"]["level"] == "majority"
        [entry] = manager.history("durable")
        assert (entry.token, entry.reason, entry.by) == (lock.token, "w1 client", "ops@host")
    finally:
        manager.close()
