"""A throwaway MariaDB server from Debian's ``mariadb-server`` binaries.

``mariadbd`` will not run as root, so as root it runs as the ``mysql`` OS user; grant tables
are skipped (any user may connect: a test server's data is thrown away).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import MySQLdb  # type: ignore[import-untyped]

from tests.fencing.servers import DebianServer, apt_install

__all__ = ["MariaDBServer"]

SERVER = Path("/usr/sbin/mariadbd")
INSTALL_DB = Path("/usr/bin/mariadb-install-db")


class MariaDBServer(DebianServer):
    """One ``mariadbd`` on ``127.0.0.1:port``, without grant tables."""

    name = "mariadb"
    os_user = "mysql"
    probe_errors = (MySQLdb.OperationalError,)

    def __init__(self) -> None:
        if not (SERVER.exists() and INSTALL_DB.exists()):
            apt_install("mariadb-server")
        super().__init__()

    def init_command(self) -> Sequence[str]:
        return [
            *(str(INSTALL_DB), "--no-defaults", f"--datadir={self.data}"),
            *("--skip-test-db", "--auth-root-authentication-method=normal"),
        ]

    def server_command(self) -> Sequence[str]:
        return [
            *(str(SERVER), "--no-defaults", f"--datadir={self.data}"),
            *(f"--port={self.port}", "--bind-address=127.0.0.1"),
            *(f"--socket={self.root / 'mariadb.sock'}", f"--pid-file={self.root / 'pid'}"),
            *("--skip-grant-tables", "--skip-name-resolve", "--skip-log-bin"),
            *("--innodb-flush-log-at-trx-commit=0", "--innodb-buffer-pool-size=64M"),
            "--innodb-doublewrite=0",
        ]

    def _connect(self) -> Any:
        return MySQLdb.connect(host="127.0.0.1", port=self.port, user="root", connect_timeout=2)

    def probe(self) -> None:
        self._connect().close()

    def create_database(self, name: str) -> None:
        conn = self._connect()
        try:
            conn.cursor().execute(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4")
        finally:
            conn.close()

    def django_settings(self, name: str) -> dict[str, Any]:
        """A ``DATABASES`` entry for database ``name`` on this server."""
        return {
            "ENGINE": "django.db.backends.mysql",
            "NAME": name,
            "USER": "root",
            "HOST": "127.0.0.1",
            "PORT": str(self.port),
            "OPTIONS": {"charset": "utf8mb4"},
        }
