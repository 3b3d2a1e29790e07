"""Fixtures of the fault tests: real replica sets, and lock clients in processes of their own.

These tests take minutes, so ``pytest`` alone (the main suite) does not collect them: they
run when asked for by path, as ``make test-reliability`` does (``pytest tests/reliability``).
Every replica set they start is stopped at the end, and the session checks that no mongod
outlived it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pymongo
import pytest
from pymongo import MongoClient
from pymongo.errors import PyMongoError

from django_mongolock.testing import MongoReplicaSet, ReplicaSetError
from tests.reliability.agents import RESOURCE
from tests.reliability.fenced import FencedResource
from tests.reliability.proxy import TcpProxy
from tests.utils import ROOT, stop_and_check

HERE = Path(__file__).resolve().parent

SLACK = 1.5
"""Seconds of scheduling delay allowed on top of any promised bound: the tests run beside
three mongod processes and several agents on a small shared machine."""


MEASUREMENTS: dict[str, dict[str, Any]] = {}
"""What the tests measured, by test: shown after the run and saved to ``REPORT``."""
REPORT = ROOT / "build" / "reliability" / "measurements.json"


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Leave the fault tests out unless a path inside this directory was asked for."""
    for arg in config.args:
        asked = Path(config.invocation_params.dir, arg.split("::", 1)[0]).resolve()
        if asked == HERE or HERE in asked.parents:
            return None
    return True


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not MEASUREMENTS:
        return
    terminalreporter.section("reliability measurements")
    for test, values in MEASUREMENTS.items():
        terminalreporter.write_line(test)
        for name, value in values.items():
            shown = f"{value:.3f}" if isinstance(value, float) else str(value)
            terminalreporter.write_line(f"    {name}: {shown}")
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(json.dumps(MEASUREMENTS, indent=2, sort_keys=True) + "\n")
    terminalreporter.write_line(f"saved to {REPORT.relative_to(ROOT)}")


Record = Callable[..., None]


@pytest.fixture
def record(request: pytest.FixtureRequest) -> Record:
    """``record(name=value, ...)``: keep figures measured by this test for the summary."""

    def keep(**values: Any) -> None:
        MEASUREMENTS.setdefault(request.node.nodeid, {}).update(values)

    return keep


# -- replica sets ---------------------------------------------------------------------------------


def members_healthy(replica_set: MongoReplicaSet) -> bool:
    """One writable primary, every member a primary or a secondary, none paused or down."""
    if any(node.paused or not node.running for node in replica_set.nodes):
        return False
    try:
        primary = replica_set.primary(timeout=0.5)
    except ReplicaSetError:
        return False
    client: MongoClient[dict[str, Any]]
    try:
        with (
            MongoClient(primary.direct_url, serverSelectionTimeoutMS=2000) as client,
            pymongo.timeout(2),
        ):
            status = client.admin.command("replSetGetStatus")
    except PyMongoError:
        return False
    return all(member["state"] in (1, 2) for member in status["members"])


def heal(replica_set: MongoReplicaSet, timeout: float = 90.0) -> None:
    """Resume paused members, restart dead ones, and wait until the whole set is healthy."""
    for node in replica_set.nodes:
        if node.paused and node.running:
            replica_set.kill(node, signal.SIGCONT)
        if not node.running:
            replica_set.restart(node)
    deadline = time.monotonic() + timeout
    while not members_healthy(replica_set):
        if time.monotonic() > deadline:
            raise ReplicaSetError(f"{replica_set!r} did not become healthy in {timeout:g}s")
        time.sleep(0.2)


@pytest.fixture(scope="session")
def cluster() -> Iterator[MongoReplicaSet]:
    """A three-node replica set on loopback ports, shared by the tests of the session."""
    replica_set = MongoReplicaSet(3, name="reliability")
    replica_set.start()
    try:
        yield replica_set
    finally:
        stop_and_check(replica_set)


@pytest.fixture(scope="module")
def lone() -> Iterator[MongoReplicaSet]:
    """A single-node replica set of the module's own (a test may stop and start it)."""
    replica_set = MongoReplicaSet(1, name="lone")
    replica_set.start()
    try:
        yield replica_set
    finally:
        stop_and_check(replica_set)


@pytest.fixture
def replica_set(cluster: MongoReplicaSet) -> Iterator[MongoReplicaSet]:
    """The shared set, healthy before the test and made healthy again after it."""
    heal(cluster)
    yield cluster
    heal(cluster)


@pytest.fixture
def database_set(cluster: MongoReplicaSet) -> MongoReplicaSet:
    """The set ``database`` is on: the shared one, unless a module names its own."""
    return cluster


@pytest.fixture
def database(database_set: MongoReplicaSet) -> Iterator[str]:
    """A database of the test's own, dropped after it (the set made healthy first)."""
    name = f"reliability_{uuid.uuid4().hex[:12]}"
    yield name
    heal(database_set)
    client: MongoClient[dict[str, Any]]
    with MongoClient(database_set.url, serverSelectionTimeoutMS=30000) as client:
        client.drop_database(name)


@pytest.fixture
def resource(cluster: MongoReplicaSet, database: str) -> Iterator[FencedResource]:
    """The test's view of the fenced resource the agents write to."""
    client: MongoClient[dict[str, Any]]
    with MongoClient(cluster.url, serverSelectionTimeoutMS=30000, tz_aware=True) as client:
        yield FencedResource(client[database][RESOURCE])


def agent_config(replica_set: MongoReplicaSet, database: str, **extra: Any) -> dict[str, Any]:
    """What every agent needs: where the locks are, and its server selection timeout."""
    return {"url": replica_set.url, "database": database, "sst": 5.0, **extra}


# -- agents ---------------------------------------------------------------------------------------


class Agent:
    """A lock client in a process of its own (``tests.reliability.agents``), driven by JSON lines.

    A reader thread collects everything the process prints; every wait is bounded. The agent
    leads a process group of its own, so that signals reach it also through a ``prefix``
    such as ``faketime``, which runs it as a child.
    """

    def __init__(
        self,
        role: str,
        config: dict[str, Any],
        *,
        name: str,
        log_dir: Path,
        prefix: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.stderr_path = log_dir / f"{name}.stderr"
        self.messages: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        self._seq = 0
        with open(self.stderr_path, "wb") as stderr:
            self.process = subprocess.Popen(
                [
                    *prefix,
                    sys.executable,
                    "-m",
                    "tests.reliability.agents",
                    role,
                    json.dumps(config),
                ],
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                start_new_session=True,
            )
        self._reader = threading.Thread(target=self._read, name=f"agent-{name}", daemon=True)
        self._reader.start()

    def __repr__(self) -> str:
        return f"<Agent {self.name} pid {self.process.pid}>"

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            try:
                message = json.loads(line)
            except ValueError:
                message = {"event": "garbage", "line": line}
            with self._cond:
                self.messages.append(message)
                self._cond.notify_all()
        with self._cond:
            self.messages.append({"event": "eof"})
            self._cond.notify_all()

    def stderr(self) -> str:
        """The tail of what the process wrote to stderr (for failure messages)."""
        return self.stderr_path.read_text(errors="replace")[-4000:]

    def wait_for(
        self, predicate: Callable[[dict[str, Any]], bool], timeout: float, what: str = ""
    ) -> dict[str, Any]:
        """The first message, printed so far or within ``timeout``, that ``predicate`` accepts."""
        deadline = time.monotonic() + timeout
        with self._cond:
            seen = 0
            while True:
                for message in self.messages[seen:]:
                    if predicate(message):
                        return message
                    if message.get("event") in ("crash", "eof"):
                        raise AssertionError(
                            f"{self!r} ended waiting for {what}: {message}\n{self.stderr()}"
                        )
                seen = len(self.messages)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"{self!r}: no {what or 'message'} within {timeout:g}s\n{self.stderr()}"
                    )
                self._cond.wait(left)

    def event(self, kind: str, timeout: float, **match: Any) -> dict[str, Any]:
        """The first event of ``kind`` whose fields equal ``match``."""
        return self.wait_for(
            lambda m: m.get("event") == kind and all(m.get(k) == v for k, v in match.items()),
            timeout,
            f"event {kind!r}",
        )

    def events(self, kind: str) -> list[dict[str, Any]]:
        with self._cond:
            return [m for m in self.messages if m.get("event") == kind]

    def send(self, op: str, **args: Any) -> int:
        """Send a command to an ``rpc`` agent; returns its number for :meth:`reply`."""
        self._seq += 1
        self.write_line(json.dumps({"op": op, "seq": self._seq, **args}))
        return self._seq

    def reply(self, seq: int, timeout: float) -> dict[str, Any]:
        return self.wait_for(lambda m: m.get("reply") == seq, timeout, f"reply {seq}")

    def call(self, op: str, *, wait: float = 30.0, **args: Any) -> dict[str, Any]:
        """Send a command and wait up to ``wait`` seconds for its reply."""
        return self.reply(self.send(op, **args), wait)

    def write_line(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def finish(self, timeout: float = 30.0, *, command: str | None = None) -> int:
        """Ask the agent to end (``command``, then end of input) and wait for its exit code."""
        assert self.process.stdin is not None
        if command is not None:
            self.write_line(command)
        self.process.stdin.close()
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self!r} did not exit within {timeout:g}s") from None
        self._reader.join(timeout)
        return code

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the agent's process group (the agent and any wrapper around it)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, sig)

    def cleanup(self) -> None:
        """End the agent (end of input first, then SIGKILL to its group); close its pipes."""
        if self.process.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(self.process.pid, signal.SIGCONT)
                assert self.process.stdin is not None
                self.process.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(5)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(30)
        self._reader.join(30)
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None and not stream.closed:
                with contextlib.suppress(BrokenPipeError):
                    stream.close()


Spawn = Callable[..., Agent]


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Spawn]:
    """``spawn(role, config, name=..., prefix=(), env=None)``: start an agent; all are reaped."""
    started: list[Agent] = []

    def start(
        role: str,
        config: dict[str, Any],
        *,
        name: str,
        prefix: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> Agent:
        agent = Agent(role, config, name=name, log_dir=tmp_path, prefix=prefix, env=env)
        started.append(agent)
        return agent

    yield start
    for agent in started:
        agent.cleanup()


# -- network faults -------------------------------------------------------------------------------


class NetAgent(Agent):
    """An agent of ``tests.reliability.netagent``: the network fault tests' lock client."""

    def __init__(self, role: str, config: dict[str, Any], *, name: str, log_dir: Path) -> None:
        self.name = name
        self.stderr_path = log_dir / f"{name}.stderr"
        self.messages = []
        self._cond = threading.Condition()
        self._seq = 0
        with open(self.stderr_path, "wb") as stderr:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tests.reliability.netagent", role, json.dumps(config)],
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                start_new_session=True,
            )
        self._reader = threading.Thread(target=self._read, name=f"agent-{name}", daemon=True)
        self._reader.start()


NetSpawn = Callable[..., NetAgent]


@contextlib.contextmanager
def net_agents(log_dir: Path) -> Iterator[NetSpawn]:
    """``spawn(role, config, name=...)`` for network fault agents; all are reaped at the end."""
    started: list[NetAgent] = []

    def start(role: str, config: dict[str, Any], *, name: str) -> NetAgent:
        agent = NetAgent(role, config, name=name, log_dir=log_dir)
        started.append(agent)
        return agent

    try:
        yield start
    finally:
        for agent in started:
            agent.cleanup()


@pytest.fixture(scope="module")
def proxy(lone: MongoReplicaSet) -> Iterator[TcpProxy]:
    """A :class:`TcpProxy` in front of the module's single-node set, passing traffic at first."""
    node = lone.nodes[0]
    with TcpProxy((node.host, node.port), name="lone-link") as link:
        yield link


@pytest.fixture
def net_spawn(tmp_path: Path) -> Iterator[NetSpawn]:
    """``net_spawn(role, config, name=...)``: a ``tests.reliability.netagent`` process."""
    with net_agents(tmp_path) as start:
        yield start
