"""A throwaway MariaDB server from Debian's ``mariadb-server`` binaries, like postgres.py.

``mariadbd`` will not run as root, so as root it runs as the ``mysql`` OS user; the data
lives in a temporary directory, the server listens on a free loopback port, and grant
tables are skipped (any user may connect: a test server's data is thrown away).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import MySQLdb  # type: ignore[import-untyped]

from django_mongolock.testing import free_port

__all__ = ["MariaDBServer"]

SERVER = Path("/usr/sbin/mariadbd")
INSTALL_DB = Path("/usr/bin/mariadb-install-db")


def install_mariadb() -> None:
    """Install Debian's ``mariadb-server`` with apt-get (as root) when it is missing."""
    if SERVER.exists() and INSTALL_DB.exists():
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise RuntimeError("no MariaDB server binaries: install Debian's mariadb-server package")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env, timeout=600)
    subprocess.run(
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", "mariadb-server"],
        check=True,
        env=env,
        timeout=900,
    )


class MariaDBServer:
    """One ``mariadbd`` on ``127.0.0.1:port``, without grant tables."""

    def __init__(self) -> None:
        install_mariadb()
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="mongolock-mariadb-"))
        self.data = self.root / "data"
        self.log = self.root / "mariadbd.log"
        self.process: subprocess.Popen[bytes] | None = None
        self._as: dict[str, Any] = {}
        if os.geteuid() == 0:
            user = pwd.getpwnam("mysql")
            os.chown(self.root, user.pw_uid, user.pw_gid)
            self._as = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}

    def start(self, timeout: float = 90.0) -> MariaDBServer:
        subprocess.run(
            [
                *(str(INSTALL_DB), "--no-defaults", f"--datadir={self.data}"),
                *("--skip-test-db", "--auth-root-authentication-method=normal"),
            ],
            check=True,
            capture_output=True,
            timeout=timeout,
            cwd=self.root,
            **self._as,
        )
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [
                    *(str(SERVER), "--no-defaults", f"--datadir={self.data}"),
                    *(f"--port={self.port}", "--bind-address=127.0.0.1"),
                    *(f"--socket={self.root / 'mariadb.sock'}", f"--pid-file={self.root / 'pid'}"),
                    *("--skip-grant-tables", "--skip-name-resolve", "--skip-log-bin"),
                    *("--innodb-flush-log-at-trx-commit=0", "--innodb-buffer-pool-size=64M"),
                    "--innodb-doublewrite=0",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.root,
                **self._as,
            )
        self._wait_ready(time.monotonic() + timeout)
        return self

    def _connect(self) -> Any:
        return MySQLdb.connect(host="127.0.0.1", port=self.port, user="root", connect_timeout=2)

    def _wait_ready(self, deadline: float) -> None:
        while True:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"mariadbd exited at start:\n{self.log.read_text()[-3000:]}")
            try:
                self._connect().close()
                return
            except MySQLdb.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

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

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM (a clean shutdown), then SIGKILL if it lingers; the directory is removed."""
        process = self.process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=timeout)
        shutil.rmtree(self.root, ignore_errors=True)
