"""An unreachable server, a standalone server and credentials in URLs."""

from __future__ import annotations

import logging
import time

import pytest

from django_mongolock import LockManager, ReplicaSetRequired, ServerUnavailable


def test_unreachable_server_fails_within_the_timeout_naming_it(
    caplog: pytest.LogCaptureFixture, request: pytest.FixtureRequest
) -> None:
    caplog.set_level(logging.DEBUG)
    manager = LockManager("mongodb://alice:s3cret@127.0.0.1:9/", server_selection_timeout=0.5)
    request.addfinalizer(manager.close)
    started = time.monotonic()
    with pytest.raises(ServerUnavailable) as info:
        manager.acquire("k")
    elapsed = time.monotonic() - started
    assert elapsed < 3  # its 0.5 s, not the driver's default 30 s nor retries of it
    message = str(info.value)
    assert "127.0.0.1:9" in message
    assert "0.5s" in message
    assert "s3cret" not in message
    assert "alice" not in message
    assert "s3cret" not in caplog.text
    for call in (manager.status, manager.force_release):
        with pytest.raises(ServerUnavailable):
            call("k")
    with pytest.raises(ServerUnavailable):
        manager.list()


def test_standalone_server_is_refused(standalone: str) -> None:
    manager = LockManager(standalone, database="standalone")
    try:
        with pytest.raises(ReplicaSetRequired, match="replica set") as info:
            manager.acquire("k")
        assert "standalone" in str(info.value)
        assert manager.server_kind() == "standalone"
        client = manager.client
        assert client["standalone"]["locks"].count_documents({}) == 0
    finally:
        manager.close()


def test_replica_set_kind(manager: LockManager) -> None:
    assert manager.server_kind() == "replica set"
