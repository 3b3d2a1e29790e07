"""A task delivered again after its pool process was killed, on two real prefork workers.

The task acknowledges late (``acks_late=True``) and is handed back to the broker when its
pool process dies (``reject_on_worker_lost=True``); its lock has a 6 s lease and
``on_busy="retry"``. Its first run is killed with SIGKILL while it holds the lock. Celery
hands the task back once ``worker_lost_wait`` has passed: a copy that comes while the dead
holder's lease lives is retried after that lease; a copy that comes later takes the lock at
once. Either way the copy runs after the lease has ended, with a larger fencing token, and
never beside the first run.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from celery import Celery
from celery.result import AsyncResult

from django_mongolock import LockInfo, LockManager
from tests.celery.harness import FORK_WARNING, Jobs, Worker, results, wait_until, workers

pytestmark = pytest.mark.timeout(180)

TASK = "tests.celery.tasks.redelivered"
LEASE = 6.0  # the task's ttl (tasks.REDELIVERY_TTL; that module needs a worker's environment)
SIGKILL_LOST = "WorkerLostError('Worker exited prematurely: signal 9 (SIGKILL)"


def runs_of(jobs: Jobs, key: str) -> list[dict[str, Any]]:
    with jobs.database_client() as client:
        return list(client[jobs.database]["runs"].find({"key": key}).sort("start"))


@pytest.fixture
def manager(jobs: Jobs) -> Iterator[LockManager]:
    manager = LockManager(jobs.url, database=jobs.database)
    try:
        yield manager
    finally:
        manager.close()


@pytest.fixture
def quick_workers(jobs: Jobs) -> Iterator[list[Worker]]:
    """Two prefork workers that hand a dead pool process's task back after 0.5 s, well
    within the dead holder's lease."""
    with workers(jobs, "gamma", "delta", concurrency=2, CELERY_WORKER_LOST_WAIT="0.5") as pair:
        yield pair


@pytest.fixture
def default_workers(jobs: Jobs) -> Iterator[list[Worker]]:
    """Two prefork workers with Celery's default ``worker_lost_wait`` (10 s): longer than
    the lease, which has ended when the task comes back."""
    with workers(jobs, "epsilon", "zeta", concurrency=2) as pair:
        yield pair


@dataclass
class Killed:
    """What a test saw of a task whose first run was killed: its runs, the key's status and
    the task's states from the kill until the second run had started, and the outcome."""

    sent: AsyncResult[Any]
    first: dict[str, Any]
    second: dict[str, Any]
    killed_at: float
    seen: list[tuple[float, LockInfo | None]]
    states: set[str]
    outcome: Any
    runs: list[dict[str, Any]]

    @property
    def dead_holder(self) -> list[LockInfo]:
        token = self.first["token"]
        return [info for _, info in self.seen if info is not None and info.token == token]

    @property
    def lease_end(self) -> float:
        """The end of the killed run's last lease, as the lock recorded it."""
        return max(info.expires_at.timestamp() for info in self.dead_holder)


def kill_the_first_run(jobs: Jobs, pair: list[Worker], app: Celery, manager: LockManager) -> Killed:
    """Send the task, SIGKILL the pool process of its first run once that run holds the lock,
    and follow the key and the task until the task has run again and finished (bounded)."""
    name, flag = uuid.uuid4().hex[:8], uuid.uuid4().hex
    key = f"redelivery-{name}"
    with jobs.database_client() as client:
        client[jobs.database]["flags"].insert_one({"_id": flag})
    sent = app.send_task(TASK, kwargs={"name": name, "flag": flag})

    first = wait_until("the first run to start", lambda: runs_of(jobs, key) or None)[0]
    mains = {worker.pid for worker in pair}
    assert first["ppid"] in mains, first  # a pool process of one of the two workers
    assert first["pid"] not in mains
    assert first["retries"] == 0, first
    held = manager.status(key)
    assert held is not None
    assert held.live, held
    assert (held.token, held.owner, held.ttl) == (first["token"], first["owner"], LEASE)

    os.kill(first["pid"], signal.SIGKILL)
    killed_at = time.time()
    with jobs.database_client() as client:  # the next run does not hold
        client[jobs.database]["flags"].delete_one({"_id": flag})

    seen: list[tuple[float, LockInfo | None]] = []
    states: set[str] = set()

    def second_run() -> dict[str, Any] | None:
        info = manager.status(key)
        seen.append((time.time(), info))  # the time after the answer: the state is older
        states.add(sent.state)
        found = runs_of(jobs, key)
        return found[1] if len(found) > 1 else None

    second = wait_until("the task to run again", second_run, timeout=60.0)
    outcome = results(app, [sent])[0]
    return Killed(sent, first, second, killed_at, seen, states, outcome, runs_of(jobs, key))


def assert_delivered_again_and_run_after_the_lease(
    killed: Killed, pair: list[Worker], manager: LockManager
) -> None:
    first, second = killed.first, killed.second
    mains = {worker.pid: worker for worker in pair}

    # The task was delivered again: the same task, run in another pool process.
    assert len(killed.runs) == 2, killed.runs
    assert second["task_id"] == first["task_id"] == killed.sent.id
    assert second["pid"] != first["pid"]
    assert second["ppid"] in mains, second
    lost = mains[first["ppid"]].output()
    assert SIGKILL_LOST in lost, lost[-3000:]

    # The key showed the dead holder until its lease ended; the second run started after.
    dead = killed.dead_holder
    assert dead, killed.seen
    assert {info.owner for info in dead} == {first["owner"]}
    lease_end = killed.lease_end
    assert killed.killed_at < lease_end <= killed.killed_at + LEASE + 0.5
    while_held = [info for at, info in killed.seen if at < lease_end - 0.1]
    assert while_held, killed.seen
    assert all(info is not None and info.token == first["token"] for info in while_held)
    assert all(info is not None and info.live for info in while_held)
    assert second["start"] >= lease_end, (second["start"], lease_end)
    assert second["token"] > first["token"]

    # No two runs at once; the task succeeded with the second run's token and released.
    # (killed.runs: read again once the task had succeeded.)
    assert [run["_id"] for run in killed.runs] == [first["_id"], second["_id"]]
    assert "end" not in killed.runs[0]  # killed mid-run: it never finished
    assert killed.killed_at < lease_end <= second["start"] <= killed.runs[1]["end"]
    assert killed.sent.state == "SUCCESS"
    assert isinstance(killed.outcome, dict), killed.outcome
    assert (killed.outcome["token"], killed.outcome["pid"]) == (second["token"], second["pid"])
    after = manager.status(first["key"])
    assert after is None or not after.live, after

    # The workers' main processes stayed up.
    for worker in pair:
        assert worker.process.poll() is None, worker.output()
        assert FORK_WARNING not in worker.output()


def test_a_copy_delivered_while_the_dead_holders_lease_lives_is_retried_after_it(
    jobs: Jobs, quick_workers: list[Worker], app: Celery, manager: LockManager
) -> None:
    killed = kill_the_first_run(jobs, quick_workers, app, manager)

    assert_delivered_again_and_run_after_the_lease(killed, quick_workers, manager)
    # The copy found the key busy: retried (a new message, retries + 1), not run, not failed.
    assert "RETRY" in killed.states, killed.states
    assert "FAILURE" not in killed.states
    assert killed.second["retries"] == 1, killed.second
    # The retry's countdown is the holder's remaining lease, rounded up to whole seconds.
    assert killed.second["start"] < killed.lease_end + LEASE + 2.0, killed.second


def test_a_copy_delivered_after_the_dead_holders_lease_takes_the_lock_at_once(
    jobs: Jobs, default_workers: list[Worker], app: Celery, manager: LockManager
) -> None:
    killed = kill_the_first_run(jobs, default_workers, app, manager)

    assert_delivered_again_and_run_after_the_lease(killed, default_workers, manager)
    # Celery waited worker_lost_wait (10 s) before handing the task back: the lease had
    # ended, the copy took the lock without a retry (the original message, retries 0).
    assert killed.second["start"] >= killed.killed_at + 10.0, killed.second
    assert "RETRY" not in killed.states, killed.states
    assert killed.second["retries"] == 0, killed.second
    expired = [info for at, info in killed.seen if at > killed.lease_end + 0.1]
    assert expired, killed.seen
    # After its lease, the dead holder never shows live (the copy may hold the key by then).
    dead = killed.first["token"]
    assert all(info is None or info.token != dead or not info.live for info in expired)
