"""``@locked`` tasks run by real database-backed workers (django-tasks-db, Django 6 and later).

Two ``python -m django db_worker`` processes claim the tasks from one PostgreSQL database
(``SELECT ... FOR UPDATE SKIP LOCKED``, as in production); a driver process with the same
settings enqueues them and reads their results. The task functions
(``tests/taskapp/tasks.py``) record each run in MongoDB: its lock's token, the token the
server names for the key meanwhile, and its start and end. Runs that must stay busy wait
while a hold flag is there. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any, TypeVar

import pytest
from pymongo import MongoClient
from pymongo.database import Database

from django_mongolock import LockManager
from django_mongolock.decorating.coalesce import Requests
from tests.fencing.postgres import PostgresServer
from tests.utils import ROOT

pytest.importorskip("django.tasks", reason="django.tasks needs Django 6")

pytestmark = pytest.mark.timeout(240)

WORKERS = ("alpha", "beta")
START_TIMEOUT = 60.0
STOP_TIMEOUT = 30.0
RESULT_TIMEOUT = 60.0
FINAL = {"SUCCESSFUL", "FAILED"}

_T = TypeVar("_T")


def wait_until(what: str, probe: Callable[[], _T | None], timeout: float = RESULT_TIMEOUT) -> _T:
    """Poll ``probe`` until it returns something true (not None, False or empty); bounded."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


@dataclass
class Setup:
    """The module's PostgreSQL database and MongoDB database, and the processes' environment."""

    url: str
    database: str
    sql: dict[str, Any]
    tmp: Path

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
            DJANGO_SETTINGS_MODULE="tests.tasks_settings",
            TASKS_DATABASE=json.dumps(self.sql),
            MONGOLOCK_URL=self.url,
            MONGOLOCK_DATABASE=self.database,
            PYTHONUNBUFFERED="1",
        )
        env.pop("COVERAGE_PROCESS_START", None)
        return env


class Driver:
    """``python -m tests.taskapp.driver``: enqueues and reads results; bounded answers."""

    def __init__(self, setup: Setup) -> None:
        self.stderr = (setup.tmp / "driver.err").open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.taskapp.driver"],
            cwd=ROOT,
            env=setup.env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            start_new_session=True,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self.broken: str | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def ask(self, request: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
        # A late answer would be read as the next request's: after a timeout, no more.
        assert self.broken is None, f"the driver is out of step since {self.broken}"
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            self.broken = f"it did not answer {request} in {timeout}s"
            raise AssertionError(f"the driver did not answer {request} in {timeout}s") from None
        if line is None:
            raise AssertionError(f"the driver ended ({self.process.wait(timeout=STOP_TIMEOUT)})")
        answer: dict[str, Any] = json.loads(line)
        assert "error" not in answer, answer
        return answer

    def enqueue(self, name: str, **kwargs: Any) -> str:
        result_id: str = self.ask({"enqueue": name, "kwargs": kwargs})["id"]
        return result_id

    def result(self, result_id: str) -> dict[str, Any]:
        return self.ask({"result": result_id})

    def final(self, result_id: str, timeout: float = RESULT_TIMEOUT) -> dict[str, Any]:
        """The result once it is SUCCESSFUL or FAILED (bounded)."""

        last: dict[str, Any] = {}

        def done() -> dict[str, Any] | None:
            last.update(self.result(result_id))
            return last if last["status"] in FINAL else None

        try:
            return wait_until(f"task {result_id} to finish", done, timeout)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; its last state: {last}") from None

    def close(self) -> None:
        if self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
        try:
            self.process.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=STOP_TIMEOUT)
        if self.process.stdout is not None:
            self.process.stdout.close()
        self.stderr.close()


def start_worker(setup: Setup, name: str) -> tuple[subprocess.Popen[bytes], Path]:
    """``db_worker`` as a process of its own session, its output in a file."""
    log = setup.tmp / f"{name}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                *(sys.executable, "-m", "django", "db_worker"),
                *("--interval", "0.1", "--no-startup-delay", "--worker-id", name, "-v", "2"),
            ],
            cwd=ROOT,
            env=setup.env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return process, log


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM (a worker finishes its task), then SIGKILL to its group if it lingers."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=STOP_TIMEOUT)


@pytest.fixture(scope="module")
def setup(mongolock_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    """A PostgreSQL server of the module's own, its database migrated by the worker settings."""
    assert find_spec("django_tasks_db"), "django-tasks-db is missing: install the test extra"
    server = PostgresServer()
    database = f"mongolock_tasks_{uuid.uuid4().hex[:12]}"
    try:
        server.start()
        server.create_database("tasks")
        setup = Setup(
            mongolock_url,
            database,
            server.django_settings("tasks"),
            tmp_path_factory.mktemp("tasks"),
        )
        migrate = subprocess.run(
            [sys.executable, "-m", "django", "migrate", "--no-input", "--verbosity", "0"],
            cwd=ROOT,
            env=setup.env(),
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert migrate.returncode == 0, migrate.stderr
        yield setup
    finally:
        server.stop()
        assert server.process is None or server.process.poll() is not None, "postgres left running"
        client: MongoClient[dict[str, Any]] = MongoClient(mongolock_url)
        client.drop_database(database)
        client.close()


@pytest.fixture(scope="module")
def workers(setup: Setup) -> Iterator[dict[str, Path]]:
    """Two ``db_worker`` processes on the same queue, ready; stopped whatever happens."""
    started: list[subprocess.Popen[bytes]] = []
    logs: dict[str, Path] = {}
    try:
        for name in WORKERS:
            process, log = start_worker(setup, name)
            started.append(process)
            logs[name] = log
        for name, process in zip(WORKERS, started, strict=True):

            def ready(process: subprocess.Popen[bytes] = process, log: Path = logs[name]) -> bool:
                if process.poll() is not None:
                    raise AssertionError(
                        f"{log.name} exited {process.returncode}:\n{log.read_text()}"
                    )
                return "Starting worker" in log.read_text()

            wait_until(f"worker {name} to start", ready, START_TIMEOUT)
        yield logs
    finally:
        for process in started:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in started:
            stop(process)


@pytest.fixture(scope="module")
def driver(setup: Setup) -> Iterator[Driver]:
    driver = Driver(setup)
    try:
        yield driver
    finally:
        driver.close()


@pytest.fixture(scope="module")
def holder(setup: Setup) -> Iterator[LockManager]:
    """The test's own manager on the workers' lock collection (another "host")."""
    manager = LockManager(setup.url, database=setup.database)
    yield manager
    manager.close()


@pytest.fixture(scope="module")
def mongo(setup: Setup) -> Iterator[Database[dict[str, Any]]]:
    client: MongoClient[dict[str, Any]] = MongoClient(setup.url, w="majority")
    yield client[setup.database]
    client.close()


def runs_of(mongo: Database[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    return list(mongo["runs"].find({"key": key}).sort("start"))


def test_a_task_runs_under_its_lock(
    workers: dict[str, Path], driver: Driver, holder: LockManager, mongo: Database[dict[str, Any]]
) -> None:
    n = uuid.uuid4().hex[:8]
    with holder.lock(f"job-{n}", ttl=30) as before:
        pass
    result = driver.final(driver.enqueue("job", n=n))

    assert result["status"] == "SUCCESSFUL", result
    (run,) = runs_of(mongo, f"job-{n}")
    assert run["token"] == run["server_token"] == result["return_value"]
    assert run["token"] > before.token
    assert "end" in run
    assert result["worker_ids"] in ([name] for name in WORKERS)  # one attempt, by a worker
    assert holder.status(f"job-{n}") is None  # released after the run


def test_skip_succeeds_without_running_while_the_key_is_held(
    workers: dict[str, Path], driver: Driver, holder: LockManager, mongo: Database[dict[str, Any]]
) -> None:
    n = uuid.uuid4().hex[:8]
    with holder.lock(f"job-{n}", ttl=30) as held:
        busy = driver.final(driver.enqueue("job_or_skip", n=n))
        assert (busy["status"], busy["return_value"]) == ("SUCCESSFUL", None)
        assert runs_of(mongo, f"job-{n}") == []

    result = driver.final(driver.enqueue("job_or_skip", n=n))
    assert result["status"] == "SUCCESSFUL", result
    (run,) = runs_of(mongo, f"job-{n}")
    assert result["return_value"] == run["token"] > held.token


def test_the_default_policy_fails_a_busy_task(
    workers: dict[str, Path], driver: Driver, holder: LockManager, mongo: Database[dict[str, Any]]
) -> None:
    n = uuid.uuid4().hex[:8]
    with holder.lock(f"job-{n}", ttl=30):
        busy = driver.final(driver.enqueue("job", n=n))
    assert busy["status"] == "FAILED", busy
    assert busy["errors"] == ["django_mongolock.exceptions.LockNotAcquired"]
    assert runs_of(mongo, f"job-{n}") == []


def test_retry_fails_the_task_with_a_type_error(
    workers: dict[str, Path], driver: Driver, mongo: Database[dict[str, Any]]
) -> None:
    n = uuid.uuid4().hex[:8]
    result = driver.final(driver.enqueue("job_or_retry", n=n))
    assert result["status"] == "FAILED", result
    assert result["errors"] == ["builtins.TypeError"]
    assert runs_of(mongo, f"job-{n}") == []


def test_wait_runs_once_the_holder_releases(
    workers: dict[str, Path], driver: Driver, holder: LockManager, mongo: Database[dict[str, Any]]
) -> None:
    n = uuid.uuid4().hex[:8]
    held = holder.acquire(f"job-{n}", ttl=30, blocking=False)
    try:
        result_id = driver.enqueue("job_or_wait", n=n)
        wait_until(
            "the task to wait in line for the key",
            lambda: (info := holder.status(f"job-{n}")) is not None and info.waiting >= 1,
        )
        assert driver.result(result_id)["status"] == "RUNNING"
        assert runs_of(mongo, f"job-{n}") == []  # it waits for the lock
    finally:
        released_at = time.time()
        held.release()

    result = driver.final(result_id)
    assert result["status"] == "SUCCESSFUL", result
    (run,) = runs_of(mongo, f"job-{n}")
    assert result["return_value"] == run["token"] > held.token
    assert run["start"] >= released_at


def test_two_workers_never_run_one_key_at_once(
    workers: dict[str, Path], driver: Driver, holder: LockManager, mongo: Database[dict[str, Any]]
) -> None:
    n = uuid.uuid4().hex[:8]
    # Held until both workers wait in line for the key: then they contend for certain.
    held = holder.acquire(f"job-{n}", ttl=60, blocking=False)
    try:
        sent = [driver.enqueue("job_in_turn", n=n, seconds=0.3) for _ in range(8)]
        wait_until(
            "both workers to wait in line for the key",
            lambda: (info := holder.status(f"job-{n}")) is not None and info.waiting == 2,
        )
    finally:
        held.release()
    deadline = time.monotonic() + 120
    results = [driver.final(result_id, max(deadline - time.monotonic(), 1.0)) for result_id in sent]

    assert [result["status"] for result in results] == ["SUCCESSFUL"] * 8, results
    done = runs_of(mongo, f"job-{n}")
    assert len(done) == 8
    assert all(run["token"] == run["server_token"] for run in done), done
    for earlier, later in itertools.pairwise(done):
        assert "end" in earlier, earlier
        assert earlier["end"] <= later["start"], f"runs overlapped: {earlier} {later}"
        assert earlier["token"] < later["token"]
    assert sorted(result["return_value"] for result in results) == [run["token"] for run in done]
    assert {worker for result in results for worker in result["worker_ids"]} == set(WORKERS)
    assert len({run["pid"] for run in done}) == 2


def test_coalesce_runs_once_more_for_the_busy_enqueues(
    workers: dict[str, Path], driver: Driver, holder: LockManager, mongo: Database[dict[str, Any]]
) -> None:
    n = uuid.uuid4().hex[:8]
    key = f"rebuild-{n}"
    mongo["flags"].insert_one({"_id": f"hold-{key}"})
    try:
        first = driver.enqueue("rebuild", n=n)
        wait_until("the first run to start", lambda: runs_of(mongo, key))
        busy = [driver.final(driver.enqueue("rebuild", n=n)) for _ in range(3)]
        assert [(b["status"], b["return_value"]) for b in busy] == [("SUCCESSFUL", None)] * 3
        assert len(runs_of(mongo, key)) == 1
        assert driver.result(first)["status"] == "RUNNING"
    finally:
        mongo["flags"].delete_one({"_id": f"hold-{key}"})

    result = driver.final(first)
    assert result["status"] == "SUCCESSFUL", result
    once, more = runs_of(mongo, key)  # exactly one more run, for the three requests
    assert once["token"] < more["token"] == result["return_value"]
    assert once["pid"] == more["pid"]  # the holder's call ran it
    assert all(run["token"] == run["server_token"] for run in (once, more))
    assert not Requests(holder).pending(key)
