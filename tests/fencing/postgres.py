"""A throwaway PostgreSQL server from Debian's ``postgresql`` binaries.

``initdb`` and ``postgres`` refuse to run as root, so as root both run as the ``postgres`` OS
user; durability is off (a test server's data is thrown away).
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg

from tests.fencing.servers import DebianServer, apt_install

__all__ = ["PostgresServer", "find_pg_bin"]


def find_pg_bin() -> Path | None:
    """The newest ``/usr/lib/postgresql/<version>/bin`` holding initdb and postgres."""
    found = [
        path.parent
        for path in Path("/usr/lib/postgresql").glob("*/bin/initdb")
        if (path.parent / "postgres").exists()
    ]
    return max(found, key=lambda p: int(p.parent.name), default=None)


def install_postgresql() -> Path:
    """The binaries' directory, installing Debian's ``postgresql`` when they are missing."""
    found = find_pg_bin()
    if found is None:
        apt_install("postgresql")
        found = find_pg_bin()
    if found is None:
        raise RuntimeError("apt-get installed postgresql, but no initdb/postgres was found")
    return found


class PostgresServer(DebianServer):
    """One ``postgres`` process on ``127.0.0.1:port``, trust authentication, user postgres."""

    name = "pg"
    os_user = "postgres"
    stop_signal = signal.SIGINT  # a fast shutdown
    probe_errors = (psycopg.OperationalError,)

    def __init__(self) -> None:
        self.bin = install_postgresql()
        super().__init__()

    def init_command(self) -> Sequence[str]:
        return [
            *(str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres"),
            *("--auth=trust", "--encoding=UTF8", "--no-sync", "--no-instructions"),
        ]

    def server_command(self) -> Sequence[str]:
        return [
            *(str(self.bin / "postgres"), "-D", str(self.data), "-p", str(self.port)),
            *("-h", "127.0.0.1", "-k", str(self.root)),
            *("-c", "fsync=off", "-c", "synchronous_commit=off"),
            *("-c", "full_page_writes=off", "-c", "max_connections=50"),
        ]

    def probe(self) -> None:
        with psycopg.connect(self.dsn("postgres"), connect_timeout=2):
            pass

    def dsn(self, database: str) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={database}"

    def create_database(self, name: str) -> None:
        with psycopg.connect(self.dsn("postgres"), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')

    def django_settings(self, name: str) -> dict[str, Any]:
        """A ``DATABASES`` entry for database ``name`` on this server."""
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": name,
            "USER": "postgres",
            "HOST": "127.0.0.1",
            "PORT": str(self.port),
        }
