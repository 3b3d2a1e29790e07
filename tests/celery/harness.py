"""Start and stop real Celery workers (prefork pool) on kombu's MongoDB transport.

The broker and the result backend are databases of the test's own replica set; each worker
is a ``celery -A tests.celery.app worker`` process with its output in a file that the tests
read (for the pool's startup and for warnings). Every wait is bounded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

from celery import Celery
from celery.result import AsyncResult
from pymongo import MongoClient

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT = 60.0
STOP_TIMEOUT = 30.0
RESULT_TIMEOUT = 60.0
FORK_WARNING = "MongoClient opened before fork"
BROADCAST = "messages.broadcast"

_T = TypeVar("_T")


def with_database(url: str, name: str) -> str:
    """``url`` with ``name`` as its database path (kombu and Celery read it from there)."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{name}", parts.query, parts.fragment))


def wait_until(what: str, probe: Callable[[], _T | None], timeout: float = 30.0) -> _T:
    """Poll ``probe`` until it returns something other than None or False; bounded."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value is not None and value is not False:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


@dataclass
class Jobs:
    """One test's broker, result backend and lock database, and the environment of workers."""

    url: str
    database: str
    tmp: Path
    ttl: float = 30.0
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def broker_url(self) -> str:
        return with_database(self.url, f"{self.database}_broker")

    @property
    def backend_url(self) -> str:
        return with_database(self.url, f"{self.database}_results")

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
            DJANGO_SETTINGS_MODULE="tests.celery.settings",
            MONGOLOCK_URL=self.url,
            MONGOLOCK_DATABASE=self.database,
            MONGOLOCK_TTL=str(self.ttl),
            CELERY_BROKER_URL=self.broker_url,
            CELERY_RESULT_BACKEND=self.backend_url,
            # Every warning shown, once per place: the fork warning must be seen if it happens.
            PYTHONWARNINGS="default",
            PYTHONUNBUFFERED="1",
        )
        env.pop("COVERAGE_PROCESS_START", None)
        env.update(self.extra_env)
        env.update(extra)
        return env

    def database_client(self) -> MongoClient[dict[str, Any]]:
        return MongoClient(self.url, w="majority")

    def prepare_broker(self) -> None:
        """Create kombu's broadcast collection once: workers started together each check
        for it and create it, and all but one fail with CollectionInvalid."""
        with self.database_client() as client:
            broker = client[f"{self.database}_broker"]
            if BROADCAST not in broker.list_collection_names():
                broker.create_collection(BROADCAST, capped=True, size=100_000)

    def drop(self) -> None:
        with self.database_client() as client:
            for name in (self.database, f"{self.database}_broker", f"{self.database}_results"):
                client.drop_database(name)


@contextmanager
def client_app(jobs: Jobs) -> Iterator[Celery]:
    """A Celery app that only sends tasks (by name) and reads their results."""
    app = Celery("mongolock_tests_client", broker=jobs.broker_url, backend=jobs.backend_url)
    app.conf.update(
        broker_transport_options={"polling_interval": 0.05},
        broker_connection_retry_on_startup=True,
        task_serializer="json",
        result_serializer="json",
    )
    try:
        yield app
    finally:
        # The MongoDB result backend keeps a client of its own, which app.close() leaves
        # open (it would be closed by the garbage collector, during some later test).
        client = getattr(app.backend, "_connection", None)
        if client is not None:
            client.close()
        app.close()


@dataclass
class Worker:
    """A running ``celery worker`` process (a prefork pool) and its output file."""

    name: str
    process: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        def ready() -> bool:
            if self.process.poll() is not None:
                raise AssertionError(
                    f"worker {self.name} exited with {self.process.returncode}:\n{self.output()}"
                )
            return " ready." in self.output()

        wait_until(f"worker {self.name} to be ready", ready, timeout)

    def stop(self) -> int:
        """Warm shutdown (SIGTERM: finish the running tasks), bounded; the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=STOP_TIMEOUT)
                raise AssertionError(
                    f"worker {self.name} did not stop within {STOP_TIMEOUT}s:\n{self.output()}"
                ) from None
        return self.process.returncode


def start_worker(jobs: Jobs, name: str, *, concurrency: int = 4, **env: str) -> Worker:
    """Start ``celery worker --pool=prefork`` as a process of its own session."""
    log = jobs.tmp / f"{name}-{uuid.uuid4().hex[:6]}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "tests.celery.app",
                "worker",
                "--pool=prefork",
                f"--concurrency={concurrency}",
                "--hostname",
                f"{name}@%h",
                "--loglevel=INFO",
                # No broadcast chatter between workers: less polling on two cores.
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ],
            cwd=ROOT,
            env=jobs.env(**env),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Worker(name, process, log)


@contextmanager
def workers(jobs: Jobs, *names: str, concurrency: int = 4, **env: str) -> Iterator[list[Worker]]:
    """Workers started together, ready on entry, stopped (and killed if need be) on exit."""
    jobs.prepare_broker()
    started = [start_worker(jobs, name, concurrency=concurrency, **env) for name in names]
    try:
        for worker in started:
            worker.wait_ready()
        yield started
    finally:
        for worker in started:
            if worker.process.poll() is None:
                worker.process.send_signal(signal.SIGTERM)
        for worker in started:
            try:
                worker.process.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                os.killpg(worker.process.pid, signal.SIGKILL)
                worker.process.wait(timeout=STOP_TIMEOUT)
        for worker in started:  # children of a killed parent, if any were left
            with suppress(ProcessLookupError):
                os.killpg(worker.process.pid, signal.SIGKILL)


def results(
    app: Celery, sent: list[AsyncResult[Any]], timeout: float = RESULT_TIMEOUT
) -> list[Any]:
    """Every task's outcome: its return value, or the exception it failed with."""
    deadline = time.monotonic() + timeout
    outcomes = []
    for result in sent:
        left = max(deadline - time.monotonic(), 0.1)
        outcomes.append(result.get(timeout=left, propagate=False, interval=0.05))
    return outcomes
