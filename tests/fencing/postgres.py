"""A throwaway PostgreSQL server from Debian's ``postgresql`` binaries, like mongod's harness.

``initdb`` refuses to run as root, so as root both it and ``postgres`` run as the
``postgres`` OS user; the cluster lives in a temporary directory and listens on a free
loopback port, with durability off (a test server's data is thrown away).
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

import psycopg

from django_mongolock.testing import free_port

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
    """Install Debian's ``postgresql`` with apt-get (as root) when its binaries are missing."""
    found = find_pg_bin()
    if found is not None:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise RuntimeError("no PostgreSQL server binaries: install Debian's postgresql package")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env, timeout=600)
    subprocess.run(
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", "postgresql"],
        check=True,
        env=env,
        timeout=900,
    )
    found = find_pg_bin()
    if found is None:
        raise RuntimeError("apt-get installed postgresql, but no initdb/postgres was found")
    return found


class PostgresServer:
    """One ``postgres`` process on ``127.0.0.1:port``, trust authentication, user postgres."""

    def __init__(self) -> None:
        self.bin = install_postgresql()
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="mongolock-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "postgres.log"
        self.process: subprocess.Popen[bytes] | None = None
        self._as: dict[str, Any] = {}
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(self.root, user.pw_uid, user.pw_gid)
            self._as = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}

    def start(self, timeout: float = 60.0) -> PostgresServer:
        subprocess.run(
            [
                *(str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres"),
                *("--auth=trust", "--encoding=UTF8", "--no-sync", "--no-instructions"),
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
                    *(str(self.bin / "postgres"), "-D", str(self.data), "-p", str(self.port)),
                    *("-h", "127.0.0.1", "-k", str(self.root)),
                    *("-c", "fsync=off", "-c", "synchronous_commit=off"),
                    *("-c", "full_page_writes=off", "-c", "max_connections=50"),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.root,
                **self._as,
            )
        self._wait_ready(time.monotonic() + timeout)
        return self

    def _wait_ready(self, deadline: float) -> None:
        while True:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"postgres exited at start:\n{self.log.read_text()[-3000:]}")
            try:
                with psycopg.connect(self.dsn("postgres"), connect_timeout=2):
                    return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

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

    def stop(self, timeout: float = 30.0) -> None:
        """Fast shutdown (SIGINT), then SIGKILL if it lingers; the directory is removed."""
        process = self.process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=timeout)
        shutil.rmtree(self.root, ignore_errors=True)
