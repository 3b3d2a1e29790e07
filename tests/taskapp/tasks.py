"""``@locked`` task functions for django-tasks-db's ``db_worker`` (Django 6 and later).

Imported by the worker processes and the driver only (``tests.tasks_settings``), where the
default task backend is ``django_tasks_db.DatabaseBackend``. Each run records itself in
MongoDB's ``runs`` collection: the key, the token its lock had and the token the server
names for the key while the run holds it, the pid, and its start and end times. A run
stays busy while a ``hold-<key>`` document is in ``flags`` (at most 60 s), so that a test
ends it when it wants.
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Callable
from typing import Any, cast

from pymongo import MongoClient
from pymongo.database import Database

from django_mongolock import current_lock, locked, locks

# django.tasks has no stubs for the checker, which runs on Django 5.2 (no django.tasks).
_tasks: Any = importlib.import_module("django.tasks")
HOLD_TIMEOUT = 60.0

_clients: dict[int, MongoClient[dict[str, Any]]] = {}


def task(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    """Django's ``@task(**options)``, typed for the checker."""
    return cast("Callable[[Callable[..., Any]], Any]", _tasks.task(**options))


def database() -> Database[dict[str, Any]]:
    """The test's MongoDB database, through a client of this process."""
    pid = os.getpid()
    if pid not in _clients:
        _clients[pid] = MongoClient(os.environ["MONGOLOCK_URL"], w="majority")
    return _clients[pid][os.environ["MONGOLOCK_DATABASE"]]


def record_run(seconds: float = 0.0) -> int:
    """Record this run under the current lock, hold it as the test says; the lock's token."""
    lock = current_lock()
    assert lock is not None, "the task body runs without a current lock"
    held = locks.status(lock.key)  # what the server says while the run holds the key
    runs = database()["runs"]
    run_id = runs.insert_one(
        {
            "key": lock.key,
            "token": lock.token,
            "server_token": held.token if held is not None else None,
            "pid": os.getpid(),
            "start": time.time(),
        }
    ).inserted_id
    deadline = time.monotonic() + HOLD_TIMEOUT
    while database()["flags"].find_one({"_id": f"hold-{lock.key}"}) is not None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"hold-{lock.key} stayed for {HOLD_TIMEOUT}s")
        time.sleep(0.02)
    time.sleep(seconds)
    lock.check()  # raises LockLost if the lease was not kept
    runs.update_one({"_id": run_id}, {"$set": {"end": time.time()}})
    return lock.token


@task()
@locked("job-{n}")
def job(n: str) -> int:
    """The default policy: a busy run fails with LockNotAcquired."""
    return record_run()


@task()
@locked("job-{n}", on_busy="skip")
def job_or_skip(n: str) -> int:
    """A busy run succeeds with ``None`` without running."""
    return record_run()


@task()
@locked("job-{n}", on_busy="wait", timeout=20)
def job_or_wait(n: str) -> int:
    """A busy run waits in the worker (at most 20 s) for the lock."""
    return record_run()


@task()
@locked("job-{n}", on_busy="wait", timeout=60)
def job_in_turn(n: str, seconds: float) -> int:
    """Holds the key for ``seconds``; busy runs wait their turn (at most 60 s)."""
    return record_run(seconds)


@task()
@locked("job-{n}", on_busy="retry")
def job_or_retry(n: str) -> int:
    """A policy for Celery's bound tasks only: the task fails with a TypeError."""
    return record_run()


@task()
@locked("rebuild-{n}", on_busy="coalesce")
def rebuild(n: str) -> int:
    """A busy run leaves a request: the holder runs once more when it is done."""
    return record_run()
