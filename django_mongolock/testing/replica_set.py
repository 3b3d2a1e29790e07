"""A replica set of local ``mongod`` processes, with the faults tests need: kill, pause,
restart, step down.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from typing import Any, Final

import pymongo
from bson import ObjectId
from pymongo import MongoClient
from pymongo.errors import AutoReconnect, OperationFailure, PyMongoError

from django_mongolock.testing.nodes import (
    _HOW_TO_GET_A_SERVER,
    LOOPBACK,
    MongodNotFound,
    MongoNode,
    NodeProcesses,
    ReplicaSetError,
    find_mongod,
    free_port,
)

__all__ = ["MongoReplicaSet"]

# The sizes mongod accepts at startup: a WiredTiger cache of 0.25 to 10,000 GB, and an
# oplog of at least 1 MB, parsed as a 32-bit int.
_CACHE_GB: Final = (0.25, 10_000)
_OPLOG_MB: Final = (1, 2**31 - 1)
# The tests' cache and oplog sizes, for a local set and the Docker fallback alike.
_TEST_CACHE_GB: Final = 0.25
_TEST_OPLOG_MB: Final = 128

_ALREADY_INITIALIZED = 23
_STOPPING_SIGNALS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGQUIT})


def _check_size(
    name: str, value: object, bounds: tuple[float, float], kinds: tuple[type, ...]
) -> None:
    """``value`` is None (mongod's own default) or a number of ``kinds`` within
    ``bounds``: mongod would refuse anything else only once it was started."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, kinds):
        kind = "an int or a float" if float in kinds else "an int"
        raise TypeError(f"{name} must be {kind} or None, not {type(value).__name__}")
    least, most = bounds
    if not least <= value <= most:  # type: ignore[operator]  # NaN fails it too
        raise ValueError(
            f"{name} must be between {least} and {most:,} (or None for mongod's default), "
            f"not {value!r}"
        )


class MongoReplicaSet(NodeProcesses):
    """A replica set of local ``mongod`` processes for tests, on loopback ports only.

    Each node gets its own temporary directory (removed by :meth:`stop`) unless ``dbpaths``
    are given, which are kept. A single node is enough for lock semantics (majority writes need
    a replica set, not several machines); three nodes let tests fail over.

    Nodes start with small-footprint flags and, for several nodes, a 2 s election timeout, so
    that a killed primary is replaced within seconds. The footprint: a 0.25 GB WiredTiger
    cache (``cache_size_gb``, 0.25 to 10,000) and a 128 MB oplog (``oplog_size_mb``, at
    least 1; it is sized when the oplog is made, so kept ``dbpaths`` keep theirs). None
    leaves either to mongod, which sizes it for the machine as on a production server;
    ``extra_args`` must not repeat an option given this way (mongod refuses to start).

    The first node is made primary at start (it gets a higher priority, then all priorities
    are made equal) so that tests begin from a known state and a later election is never
    undone by a priority takeover; pass ``priorities`` to keep the ones you give.

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
        cache_size_gb: float | None = _TEST_CACHE_GB,
        oplog_size_mb: int | None = _TEST_OPLOG_MB,
    ) -> None:
        if nodes < 1:
            raise ValueError(f"a replica set needs at least one node, not {nodes!r}")
        _check_size("cache_size_gb", cache_size_gb, _CACHE_GB, (int, float))
        _check_size("oplog_size_mb", oplog_size_mb, _OPLOG_MB, (int,))
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
        self._cache_size_gb = cache_size_gb
        self._oplog_size_mb = oplog_size_mb
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
