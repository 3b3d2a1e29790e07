"""``@locked`` on Django's task functions (``django.tasks``, Django 6 and later).

Run through the backend Django ships that executes tasks (``ImmediateBackend``, the
default ``TASKS``): ``enqueue()`` runs the task in the caller's thread, under its lock,
and the result tells what the busy policy did.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, cast

import pytest

from django_mongolock import LockManager, current_lock, locked
from django_mongolock.decorating.coalesce import Requests

tasks = pytest.importorskip("django.tasks", reason="django.tasks needs Django 6")

pytestmark = pytest.mark.usefixtures("mongolock_settings")


def task(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    """Django's ``@task(**options)``, typed for the checker (django.tasks has no stubs here)."""
    return cast("Callable[[Callable[..., Any]], Any]", tasks.task(**options))


Successful: Any = tasks.TaskResultStatus.SUCCESSFUL
Failed: Any = tasks.TaskResultStatus.FAILED

started = threading.Event()
finish = threading.Event()
runs: list[int] = []


@task()
@locked("report-{day}")
def report(day: str) -> int:
    lock = current_lock()
    assert lock is not None
    return lock.token


@task()
@locked("report-{day}", on_busy="skip")
def report_or_skip(day: str) -> str:
    return f"built {day}"


@task()
@locked("report-{day}", on_busy="wait", timeout=20)
def report_or_wait(day: str) -> int:
    lock = current_lock()
    assert lock is not None
    return lock.token


@task()
@locked("report-{day}", on_busy="wait", timeout=20)
async def areport_or_wait(day: str) -> int:
    lock = current_lock()
    assert lock is not None
    return lock.token


@task(takes_context=True)
@locked("sync-{account_id}", on_busy="skip")
def sync(context: Any, account_id: int) -> list[Any]:
    lock = current_lock()
    assert lock is not None
    return [lock.key, context.attempt]


@task()
@locked("rebuild", on_busy="coalesce")
def rebuild() -> int:
    lock = current_lock()
    assert lock is not None
    runs.append(lock.token)
    started.set()
    assert finish.wait(20)
    return len(runs)


@task(takes_context=True)
@locked("sync-{account_id}", on_busy="retry")
def sync_or_retry(context: Any, account_id: int) -> None: ...


def test_a_task_runs_under_its_lock(manager: LockManager) -> None:
    result = report.enqueue(day="2026-11-24")
    assert result.status == Successful
    assert result.return_value > 0
    assert manager.status("report-2026-11-24") is None


def test_busy_fails_the_task_with_lock_not_acquired(other: LockManager) -> None:
    with other.lock("report-2026-11-24", ttl=30):
        result = report.enqueue(day="2026-11-24")
    assert result.status == Failed
    assert result.errors[0].exception_class_path == ("django_mongolock.exceptions.LockNotAcquired")


def test_skip_succeeds_without_running(other: LockManager) -> None:
    with other.lock("report-2026-11-24", ttl=30):
        result = report_or_skip.enqueue("2026-11-24")
    assert result.status == Successful
    assert result.return_value is None
    assert report_or_skip.enqueue("2026-11-24").return_value == "built 2026-11-24"


@pytest.mark.parametrize("function", ["report_or_wait", "areport_or_wait"])
def test_wait_runs_once_the_holder_releases(other: LockManager, function: str) -> None:
    holder = other.acquire("report-2026-11-24", ttl=30, blocking=False)
    released = threading.Timer(0.3, holder.release)
    released.start()
    result = globals()[function].enqueue("2026-11-24")
    released.join()
    assert result.status == Successful
    assert result.return_value > holder.token


def test_the_key_reads_the_arguments_after_the_context(other: LockManager) -> None:
    result = sync.enqueue(account_id=7)
    assert (result.status, result.return_value) == (Successful, ["sync-7", 1])
    with other.lock("sync-7", ttl=30):
        assert sync.enqueue(account_id=7).return_value is None


def test_coalesce_runs_the_task_once_more(manager: LockManager) -> None:
    runs.clear()
    started.clear()
    finish.clear()
    results: list[Any] = []
    holder = threading.Thread(target=lambda: results.append(rebuild.enqueue()))
    holder.start()
    assert started.wait(20)
    for _ in range(3):
        busy = rebuild.enqueue()
        assert (busy.status, busy.return_value) == (Successful, None)
    assert len(runs) == 1
    finish.set()
    holder.join(20)
    assert not holder.is_alive()
    assert results[0].status == Successful
    assert results[0].return_value == 2  # one more run for the three requests
    assert not Requests(manager).pending("rebuild")


def test_retry_is_for_celery_tasks_only(other: LockManager) -> None:
    result = sync_or_retry.enqueue(account_id=9)
    assert result.status == Failed
    assert result.errors[0].exception_class_path == "builtins.TypeError"
    assert "on_busy='retry' needs a bound task" in result.errors[0].traceback
