"""The pytest plugin: a real replica set per session, a database per test, fixtures on it.

Loaded through the ``pytest11`` entry point ``mongolock`` (``-p no:mongolock`` turns it
off), by way of ``django_mongolock.testing``'s ``pytest_plugins``. It starts nothing until a
test asks for one of its fixtures.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from pymongo import MongoClient

from django_mongolock.manager import LockManager
from django_mongolock.testing.nodes import MongodNotFound
from django_mongolock.testing.servers import mongolock_replica_set_url

__all__ = [
    "mongolock_database",
    "mongolock_manager",
    "mongolock_settings",
    "mongolock_url",
]


@pytest.fixture(scope="session")
def mongolock_url() -> Iterator[str]:
    """URL of the session's MongoDB replica set, started on first use."""
    try:
        with mongolock_replica_set_url() as url:
            yield url
    except MongodNotFound as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def _mongolock_client(mongolock_url: str) -> Iterator[MongoClient[dict[str, Any]]]:
    client: MongoClient[dict[str, Any]] = MongoClient(mongolock_url, serverSelectionTimeoutMS=10000)
    with client:
        yield client


@pytest.fixture
def mongolock_database(_mongolock_client: MongoClient[dict[str, Any]]) -> Iterator[str]:
    """Name of a database of this test's own, dropped after it."""
    name = f"mongolock_test_{uuid.uuid4().hex[:16]}"
    yield name
    _mongolock_client.drop_database(name)


@pytest.fixture
def mongolock_manager(mongolock_url: str, mongolock_database: str) -> Iterator[LockManager]:
    """A ``LockManager`` on this test's own database, closed after the test."""
    manager = LockManager(url=mongolock_url, database=mongolock_database)
    yield manager
    manager.close()


@pytest.fixture
def mongolock_settings(
    request: pytest.FixtureRequest, mongolock_url: str, mongolock_database: str
) -> dict[str, Any]:
    """``settings.MONGOLOCK`` pointing at this test's own database (needs pytest-django).

    Other keys of the project's ``MONGOLOCK`` are kept; all is restored after the test.
    """
    if not request.config.pluginmanager.hasplugin("django"):
        pytest.fail("the mongolock_settings fixture needs pytest-django", pytrace=False)
    settings = request.getfixturevalue("settings")
    value = {
        **getattr(settings, "MONGOLOCK", {}),
        "URL": mongolock_url,
        "DATABASE": mongolock_database,
    }
    settings.MONGOLOCK = value
    return value
