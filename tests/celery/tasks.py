"""Tasks of the test workers: each run records itself in MongoDB for the tests to check.

A run writes a ``runs`` document when it starts (pid, key, token) and completes it when it
ends, so that the tests can prove that no two runs of one key overlapped. A run may wait
for a *gate* (a document the test inserts) to stay busy for as long as a test needs.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

from celery import Task
from pymongo import MongoClient
from pymongo.collection import Collection
from pymongo.database import Database

from django_mongolock import current_lock, locked, locks
from tests.celery.app import app

GATE_TIMEOUT = 60.0
_F = TypeVar("_F", bound=Callable[..., Any])
# Celery ships no type hints: the task decorator, typed for the checker.
bound_task: Callable[[_F], _F] = app.task(bind=True)


def typed_task(**options: Any) -> Callable[[_F], _F]:
    decorate: Callable[[_F], _F] = app.task(**options)
    return decorate


_clients: dict[int, MongoClient[dict[str, Any]]] = {}


def database() -> Database[dict[str, Any]]:
    """The test's database, through a client of this process (pymongo is not fork-safe)."""
    pid = os.getpid()
    if pid not in _clients:
        _clients[pid] = MongoClient(os.environ["MONGOLOCK_URL"], w="majority")
    return _clients[pid][os.environ["MONGOLOCK_DATABASE"]]


def runs() -> Collection[dict[str, Any]]:
    return database()["runs"]


def wait_for_gate(gate: str) -> None:
    """Block until the test opens ``gate`` (bounded: a stuck test must not hang the worker)."""
    deadline = time.monotonic() + GATE_TIMEOUT
    while database()["gates"].find_one({"_id": gate}) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"gate {gate!r} was not opened within {GATE_TIMEOUT}s")
        time.sleep(0.05)


def record_run(task: Task[Any, Any], seconds: float, gate: str | None) -> dict[str, Any]:
    """Run under the current lock: announce, wait, then check the lock is still ours."""
    lock = current_lock()
    assert lock is not None, "the task body runs without a current lock"
    started = time.time()
    run_id = (
        runs()
        .insert_one(
            {
                "task": task.name,
                "task_id": task.request.id,
                "hostname": task.request.hostname,
                "pid": os.getpid(),
                "ppid": os.getppid(),
                "key": lock.key,
                "token": lock.token,
                "ttl": lock.ttl,
                "start": started,
            }
        )
        .inserted_id
    )
    if gate is not None:
        wait_for_gate(gate)
    time.sleep(seconds)
    lock.check()  # raises LockLost if the lease was not kept alive in this process
    info = locks.status(lock.key)
    assert info is not None
    ended = time.time()
    runs().update_one(
        {"_id": run_id},
        {"$set": {"end": ended, "server_token": info.token, "server_owner": info.owner}},
    )
    return {
        "key": lock.key,
        "token": lock.token,
        "owner": lock.owner,
        "server_token": info.token,
        "server_owner": info.owner,
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "held_for": ended - started,
        "ttl": lock.ttl,
        "retries": task.request.retries,
    }


@bound_task
@locked("sync-{account_id}", on_busy="skip")
def sync(
    self: Task[Any, Any], account_id: str, seconds: float = 0.0, gate: str | None = None
) -> Any:
    """Synchronise one account; a second run for it meanwhile is dropped."""
    return record_run(self, seconds, gate)


@bound_task
@locked("sync-{account_id}")
def sync_or_fail(
    self: Task[Any, Any], account_id: str, seconds: float = 0.0, gate: str | None = None
) -> Any:
    """As ``sync``, with the default policy: a busy run fails with LockNotAcquired."""
    return record_run(self, seconds, gate)


@bound_task
@locked("report-{period}", on_busy="skip")
def report(self: Task[Any, Any], period: str, seconds: float = 0.0) -> str:
    """The report of one period, once: the lock keeps runs apart, the marker keeps it once."""
    lock = current_lock()
    assert lock is not None
    periods = database()["periods"]
    if periods.find_one({"_id": period}) is not None:
        return "done already"
    record_run(self, seconds, None)
    periods.insert_one({"_id": period, "token": lock.token})
    return "ran"


@bound_task
@locked("hold-{name}")
def hold(self: Task[Any, Any], name: str, seconds: float, gate: str | None = None) -> Any:
    """Hold ``hold-<name>`` for ``seconds`` (longer than the lease: it must be refreshed)."""
    return record_run(self, seconds, gate)


@typed_task(bind=True, max_retries=30)
@locked("sync-{account_id}", on_busy="retry")
def sync_later(
    self: Task[Any, Any], account_id: str, seconds: float = 0.0, gate: str | None = None
) -> Any:
    """As ``sync``, but a busy run is retried when the holder's lease should be over."""
    return record_run(self, seconds, gate)


@bound_task
@locked("sync-{account_id}", on_busy="wait", timeout=GATE_TIMEOUT)
def sync_waiting(
    self: Task[Any, Any], account_id: str, seconds: float = 0.0, gate: str | None = None
) -> Any:
    """As ``sync``, but a busy run waits in the worker for the lock."""
    return record_run(self, seconds, gate)


@bound_task
@locked("rebuild-{index}", on_busy="coalesce")
def rebuild(self: Task[Any, Any], index: str, gate: str | None = None) -> Any:
    """Rebuild an index: requests made while a rebuild runs make one more run, not many."""
    # Only the first run waits for the gate: the extra run of the same call must not.
    first = database()["gates"].find_one_and_update(
        {"_id": f"first-{index}"}, {"$setOnInsert": {"at": time.time()}}, upsert=True
    )
    return record_run(self, 0.0, gate if first is None else None)


@bound_task
@locked("stoppable-{name}", on_lost="exit")
def stoppable(self: Task[Any, Any], name: str, seconds: float) -> str:
    """A long run that ``on_lost="exit"`` stops when its lock is lost."""
    lock = current_lock()
    assert lock is not None
    run_id = runs().insert_one({"key": lock.key, "token": lock.token, "pid": os.getpid()})
    time.sleep(seconds)
    runs().update_one({"_id": run_id.inserted_id}, {"$set": {"slept": True}})
    return "finished"


REDELIVERY_TTL = 6.0


def hold_while_flagged(flag: str) -> None:
    """Block while the test keeps ``flag`` (bounded: a stuck test must not hang the worker)."""
    deadline = time.monotonic() + GATE_TIMEOUT
    while database()["flags"].find_one({"_id": flag}) is not None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"flag {flag!r} was not removed within {GATE_TIMEOUT}s")
        time.sleep(0.05)


@typed_task(bind=True, acks_late=True, reject_on_worker_lost=True, max_retries=30)
@locked("redelivery-{name}", ttl=REDELIVERY_TTL, on_busy="retry")
def redelivered(self: Task[Any, Any], name: str, flag: str) -> Any:
    """A task the broker delivers again if its pool process dies: acknowledged only when it
    ends. Each run records itself (pid, token, start, end), then holds while ``flag``
    exists; a copy that finds the key busy is retried after the holder's lease."""
    lock = current_lock()
    assert lock is not None, "the task body runs without a current lock"
    run_id = (
        runs()
        .insert_one(
            {
                "task": self.name,
                "task_id": self.request.id,
                "hostname": self.request.hostname,
                "pid": os.getpid(),
                "ppid": os.getppid(),
                "key": lock.key,
                "owner": lock.owner,
                "token": lock.token,
                "retries": self.request.retries,
                "start": time.time(),
            }
        )
        .inserted_id
    )
    hold_while_flagged(flag)
    lock.check()  # raises LockLost if the lease was not kept alive in this process
    ended = time.time()
    runs().update_one({"_id": run_id}, {"$set": {"end": ended}})
    return {"key": lock.key, "token": lock.token, "pid": os.getpid(), "end": ended}
