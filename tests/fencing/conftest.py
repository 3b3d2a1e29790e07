"""Fixtures of the fenced-write tests: a PostgreSQL server, and the database aliases they use.

The aliases (``fence_sqlite``, a file so that another process sees it, ``fence_pg`` and
``fence_mysql``, on MariaDB)
are added to Django's connections only for the test that asks for one, and removed after
it, so the rest of the suite, and pytest-django's own test databases, never see them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.core.management import call_command
from django.db import connections

from tests.fencing.mariadb import MariaDBServer
from tests.fencing.postgres import PostgresServer
from tests.fencingapp.models import Archive, Entry, Note, Report, Team

ALIASES = ("fence_sqlite", "fence_pg", "fence_mysql")


@contextlib.contextmanager
def registered(alias: str, config: dict[str, Any]) -> Iterator[str]:
    """``alias`` usable through Django's connections while the block runs."""
    full = connections.configure_settings(
        {"default": dict(settings.DATABASES["default"]), alias: dict(config)}
    )[alias]
    connections.settings[alias] = full
    try:
        yield alias
    finally:
        with contextlib.suppress(AttributeError):
            connections[alias].close()
            del connections[alias]
        del connections.settings[alias]


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL server of the session's own, stopped (and checked stopped) at the end."""
    server = PostgresServer()
    try:
        server.start()
        yield server
    finally:
        server.stop()
        assert server.process is None or server.process.poll() is not None, "postgres left running"


@pytest.fixture(scope="session")
def mariadb() -> Iterator[MariaDBServer]:
    """A MariaDB server of the session's own, stopped (and checked stopped) at the end."""
    server = MariaDBServer()
    try:
        server.start()
        yield server
    finally:
        server.stop()
        assert server.process is None or server.process.poll() is not None, "mariadbd left running"


@pytest.fixture(scope="session")
def fence_databases(
    postgres: PostgresServer,
    mariadb: MariaDBServer,
    tmp_path_factory: pytest.TempPathFactory,
    django_db_blocker: Any,
) -> dict[str, dict[str, Any]]:
    """The aliases' settings, their databases created and migrated once for the session."""
    sqlite_file: Path = tmp_path_factory.mktemp("fencing") / "fencing.sqlite3"
    postgres.create_database("fencing")
    mariadb.create_database("fencing")
    databases = {
        "fence_sqlite": {"ENGINE": "django.db.backends.sqlite3", "NAME": str(sqlite_file)},
        "fence_pg": postgres.django_settings("fencing"),
        "fence_mysql": mariadb.django_settings("fencing"),
    }
    with django_db_blocker.unblock():
        for alias, config in databases.items():
            with registered(alias, config):
                call_command("migrate", "fencingapp", database=alias, verbosity=0)
    return databases


@pytest.fixture(params=ALIASES)
def db_alias(
    request: pytest.FixtureRequest,
    fence_databases: dict[str, dict[str, Any]],
    django_db_blocker: Any,
) -> Iterator[str]:
    """One of the SQL aliases, usable during the test; its rows are deleted after it."""
    alias: str = request.param
    with django_db_blocker.unblock(), registered(alias, fence_databases[alias]):
        try:
            yield alias
        finally:
            for model in (Report, Entry, Team, Archive, Note):
                model.objects.using(alias).all().delete()
