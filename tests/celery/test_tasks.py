"""Locked Celery tasks on two real prefork workers: never two runs of a key at once.

Runs record their start and end (and the lock's token) in MongoDB; busy runs follow the
task's ``on_busy`` policy. Runs that must stay busy wait for a gate the test opens, so that
no outcome depends on how fast the workers are.
"""

from __future__ import annotations

import itertools
import uuid
from typing import Any

import pytest
from celery import Celery

from django_mongolock import LockLost, LockManager
from tests.celery.harness import FORK_WARNING, Jobs, Worker, results, wait_until

pytestmark = pytest.mark.timeout(180)


def sent_runs(jobs: Jobs, **query: Any) -> list[dict[str, Any]]:
    with jobs.database_client() as client:
        return list(client[jobs.database]["runs"].find(query).sort("start"))


def open_gate(jobs: Jobs, gate: str) -> None:
    with jobs.database_client() as client:
        client[jobs.database]["gates"].insert_one({"_id": gate})


def started(jobs: Jobs, key: str) -> dict[str, Any] | None:
    found = sent_runs(jobs, key=key)
    return found[0] if found else None


def test_a_burst_never_runs_one_account_twice_at_once(
    jobs: Jobs, two_workers: list[Worker], app: Celery
) -> None:
    accounts = [f"acct-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    sent = [
        app.send_task("tests.celery.tasks.sync", kwargs={"account_id": account, "seconds": 0.2})
        for _ in range(8)
        for account in accounts
    ]
    outcomes = results(app, sent)

    assert not [o for o in outcomes if isinstance(o, BaseException)], outcomes
    ran = [o for o in outcomes if o is not None]
    for account in accounts:
        done = sent_runs(jobs, key=f"sync-{account}")
        assert done, f"no run of {account}"
        for earlier, later in itertools.pairwise(done):
            assert "end" in earlier, earlier
            assert earlier["end"] <= later["start"], f"runs overlapped: {earlier} {later}"
            assert earlier["token"] < later["token"]
    assert len(ran) == sum(len(sent_runs(jobs, key=f"sync-{a}")) for a in accounts)
    burst = [run for a in accounts for run in sent_runs(jobs, key=f"sync-{a}")]
    assert {run["hostname"].split("@")[0] for run in burst} <= {"alpha", "beta"}


def test_skip_drops_the_runs_that_find_the_account_busy(
    jobs: Jobs, two_workers: list[Worker], app: Celery
) -> None:
    account, gate = f"acct-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    kwargs = {"account_id": account}
    first = app.send_task("tests.celery.tasks.sync", kwargs={**kwargs, "gate": gate})
    holder = wait_until("the first run to start", lambda: started(jobs, f"sync-{account}"))

    busy = [app.send_task("tests.celery.tasks.sync", kwargs=kwargs) for _ in range(6)]
    assert results(app, busy) == [None] * 6  # dropped, not failed, not queued
    open_gate(jobs, gate)

    (outcome,) = results(app, [first])
    assert outcome["token"] == holder["token"]
    assert len(sent_runs(jobs, key=f"sync-{account}")) == 1


def test_raise_fails_the_busy_runs_with_lock_not_acquired(
    jobs: Jobs, two_workers: list[Worker], app: Celery
) -> None:
    account, gate = f"acct-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    first = app.send_task(
        "tests.celery.tasks.sync_or_fail", kwargs={"account_id": account, "gate": gate}
    )
    wait_until("the first run to start", lambda: started(jobs, f"sync-{account}"))

    busy = [
        app.send_task("tests.celery.tasks.sync_or_fail", kwargs={"account_id": account})
        for _ in range(3)
    ]
    failures = results(app, busy)
    open_gate(jobs, gate)

    assert [type(f).__name__ for f in failures] == ["LockNotAcquired"] * 3
    assert all(f"sync-{account}" in str(f) for f in failures), failures
    assert [r.state for r in busy] == ["FAILURE"] * 3
    assert isinstance(results(app, [first])[0], dict)


def test_retry_runs_the_busy_task_once_the_holder_is_done(
    jobs: Jobs, two_workers: list[Worker], app: Celery
) -> None:
    account, gate = f"acct-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    first = app.send_task("tests.celery.tasks.sync", kwargs={"account_id": account, "gate": gate})
    holder = wait_until("the first run to start", lambda: started(jobs, f"sync-{account}"))

    later = app.send_task("tests.celery.tasks.sync_later", kwargs={"account_id": account})
    wait_until("the busy task to be retried", lambda: later.state == "RETRY")
    assert sent_runs(jobs, key=f"sync-{account}") == [holder]  # not run while busy
    open_gate(jobs, gate)

    held, retried = results(app, [first, later])
    assert retried["retries"] >= 1, retried
    assert retried["token"] > held["token"]
    done = sent_runs(jobs, key=f"sync-{account}")
    assert [run["task"] for run in done] == [
        "tests.celery.tasks.sync",
        "tests.celery.tasks.sync_later",
    ]
    assert done[0]["end"] <= done[1]["start"]


def test_wait_runs_the_busy_task_in_the_worker_after_the_holder(
    jobs: Jobs, two_workers: list[Worker], app: Celery
) -> None:
    account, gate = f"acct-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    first = app.send_task("tests.celery.tasks.sync", kwargs={"account_id": account, "gate": gate})
    holder = wait_until("the first run to start", lambda: started(jobs, f"sync-{account}"))

    waiting = app.send_task("tests.celery.tasks.sync_waiting", kwargs={"account_id": account})
    wait_until("the busy task to start waiting", lambda: waiting.state == "STARTED")
    assert sent_runs(jobs, key=f"sync-{account}") == [holder]  # waiting, not running
    open_gate(jobs, gate)

    held, waited = results(app, [first, waiting])
    assert waited["retries"] == 0
    assert waited["token"] > held["token"]
    done = sent_runs(jobs, key=f"sync-{account}")
    assert [run["task_id"] for run in done] == [first.id, waiting.id]
    assert done[0]["end"] <= done[1]["start"]


def test_coalesce_makes_one_more_run_for_many_requests(
    jobs: Jobs, two_workers: list[Worker], app: Celery
) -> None:
    index, gate = f"idx-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    first = app.send_task("tests.celery.tasks.rebuild", kwargs={"index": index, "gate": gate})
    wait_until("the first run to start", lambda: started(jobs, f"rebuild-{index}"))

    busy = [app.send_task("tests.celery.tasks.rebuild", kwargs={"index": index}) for _ in range(6)]
    assert results(app, busy) == [None] * 6  # recorded, answered at once
    open_gate(jobs, gate)

    assert isinstance(results(app, [first])[0], dict)
    done = sent_runs(jobs, key=f"rebuild-{index}")
    assert len(done) == 2, done  # the holder's run and one more, not seven
    assert done[0]["end"] <= done[1]["start"]
    assert done[0]["token"] < done[1]["token"]
    assert done[0]["task_id"] == done[1]["task_id"] == first.id


def test_on_lost_exit_stops_the_task_when_its_lock_is_lost(
    jobs: Jobs, two_workers: list[Worker], app: Celery
) -> None:
    name = uuid.uuid4().hex[:8]
    sent = app.send_task("tests.celery.tasks.stoppable", kwargs={"name": name, "seconds": 40})
    run = wait_until("the run to start", lambda: started(jobs, f"stoppable-{name}"))
    manager = LockManager(jobs.url, database=jobs.database)
    try:
        assert manager.force_release(f"stoppable-{name}", reason="test") is not None
    finally:
        manager.close()

    (error,) = results(app, [sent])
    # Celery's JSON result keeps the error's class and args, and rebuilds it from them.
    assert type(error) is LockLost, error
    assert error.key == f"stoppable-{name}"
    assert f"lock 'stoppable-{name}'" in str(error)
    assert "is lost" in str(error)
    assert "slept" not in sent_runs(jobs, _id=run["_id"])[0]  # cut short, not run to the end
    # The pool child survived the stop and takes the next task.
    again = app.send_task("tests.celery.tasks.stoppable", kwargs={"name": name, "seconds": 0})
    assert results(app, [again]) == ["finished"]


def test_the_task_reaches_its_lock_and_token(
    jobs: Jobs, two_workers: list[Worker], app: Celery
) -> None:
    account = f"acct-{uuid.uuid4().hex[:8]}"
    outcomes = []
    for _ in range(2):  # one after the other: two holders, two tokens
        sent = app.send_task("tests.celery.tasks.sync", kwargs={"account_id": account})
        outcomes.extend(results(app, [sent]))

    for outcome in outcomes:
        assert outcome["key"] == f"sync-{account}"
        # current_lock() inside the task is the lock the server records as held.
        assert outcome["token"] == outcome["server_token"]
        assert outcome["owner"] == outcome["server_owner"]
        assert outcome["pid"] != outcome["ppid"]  # in a pool child, not the worker's parent
    assert outcomes[0]["token"] < outcomes[1]["token"]


def test_a_schedule_runs_once_per_period_on_two_workers(
    jobs: Jobs, two_workers: list[Worker], app: Celery
) -> None:
    # What beat on two hosts (or two beats) does: the same period enqueued several times.
    periods = [f"daily-{uuid.uuid4().hex[:6]}-{day}" for day in range(3)]
    sent = {
        period: [
            app.send_task("tests.celery.tasks.report", kwargs={"period": period, "seconds": 0.1})
            for _ in range(6)
        ]
        for period in periods
    }
    for period in periods:
        outcomes = results(app, sent[period])
        assert outcomes.count("ran") == 1, outcomes
        assert set(outcomes) <= {"ran", "done already", None}, outcomes
        assert len(sent_runs(jobs, key=f"report-{period}")) == 1


def test_the_workers_logged_no_fork_warning(
    jobs: Jobs, two_workers: list[Worker], app: Celery
) -> None:
    sent = [
        app.send_task("tests.celery.tasks.sync", kwargs={"account_id": uuid.uuid4().hex})
        for _ in range(8)
    ]
    assert all(isinstance(outcome, dict) for outcome in results(app, sent))
    for worker in two_workers:
        assert worker.process.poll() is None, worker.output()
        assert FORK_WARNING not in worker.output()
