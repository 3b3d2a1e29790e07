"""Fork safety as deployed: a Celery prefork worker and gunicorn ``--preload``.

In both, the parent imports the project and takes a lock before it forks (so it has a
client and a refresher thread): the children must build their own, never warn that a
MongoClient was opened before the fork, keep their own locks alive past the lease, leave
the parent's lock alone, and a SIGKILLed child's lock must end with its lease.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from django_mongolock import LockInfo, LockManager
from django_mongolock.testing import free_port
from tests.celery.harness import (
    FORK_WARNING,
    ROOT,
    STOP_TIMEOUT,
    Jobs,
    client_app,
    results,
    wait_until,
    workers,
)

pytestmark = pytest.mark.timeout(180)

TTL = 2.0
# The lease plus one refresher tick (a third of the lease), and room for a loaded machine's
# clocks and scheduling: the bound on how long a SIGKILLed holder's lock can outlive it.
KILL_BOUND = TTL + TTL / 3 + 0.5
HOLD = 3 * TTL  # a hold this long is only possible if the child refreshes its lease


@pytest.fixture
def jobs(mongolock_url: str, mongolock_database: str, tmp_path: Path) -> Iterator[Jobs]:
    jobs = Jobs(mongolock_url, mongolock_database, tmp_path, ttl=TTL)
    yield jobs
    jobs.drop()


def owner_pid(owner: str) -> int:
    """The pid in an owner id ``host:pid:random``."""
    return int(owner.rsplit(":", 2)[-2])


def holder_pid(manager: LockManager, key: str) -> int | None:
    """The pid of the live holder of ``key``, if any."""
    info = manager.status(key)
    return owner_pid(info.owner) if info is not None and info.live else None


def live(manager: LockManager, keys: list[str]) -> list[LockInfo] | None:
    """The live locks of ``keys``, when all of them are held."""
    found = [manager.status(key) for key in keys]
    held = [info for info in found if info is not None and info.live]
    return held if len(held) == len(keys) else None


def parent_token(output: str, key: str) -> tuple[int, int] | None:
    """The parent's pid and token, from the line it prints once it holds ``key``."""
    match = re.search(rf"parent (\d+) holds {re.escape(key)} with token (\d+)", output)
    return (int(match.group(1)), int(match.group(2))) if match else None


def assert_freed_after_kill(manager: LockManager, key: str, pid: int) -> None:
    """SIGKILL ``pid``, the holder of ``key``: its lease ends within KILL_BOUND."""
    os.kill(pid, signal.SIGKILL)
    killed = datetime.now(UTC)
    info = manager.status(key)
    assert info is not None
    assert owner_pid(info.owner) == pid
    assert (info.expires_at - killed).total_seconds() <= KILL_BOUND, info
    with manager.lock(key, timeout=4 * KILL_BOUND) as taken:  # and it can be taken
        assert taken.token > info.token


def test_a_celery_prefork_worker(jobs: Jobs, manager: LockManager) -> None:
    parent_key = f"worker-parent-{uuid.uuid4().hex[:8]}"
    names = [uuid.uuid4().hex[:8] for _ in range(4)]
    with (
        workers(jobs, "prefork", concurrency=4, MONGOLOCK_PARENT_KEY=parent_key) as (worker,),
        client_app(jobs) as app,
    ):
        pid, token = wait_until(
            "the parent's lock", lambda: parent_token(worker.output(), parent_key)
        )
        assert pid == worker.pid
        sent = [
            app.send_task("tests.celery.tasks.hold", kwargs={"name": n, "seconds": HOLD})
            for n in names
        ]
        outcomes = results(app, sent)
        for outcome in outcomes:
            assert isinstance(outcome, dict), outcome
            assert outcome["ppid"] == worker.pid != outcome["pid"]
            assert outcome["ttl"] == TTL
            assert outcome["held_for"] >= HOLD > TTL  # and check() found it still held
            assert outcome["token"] == outcome["server_token"]
            assert owner_pid(outcome["owner"]) == outcome["pid"]

        # The parent's lock outlived several leases: its refresher runs on after the fork.
        info = manager.status(parent_key)
        assert info is not None
        assert info.live
        assert (info.token, owner_pid(info.owner)) == (token, worker.pid)

        # A child killed mid-task: its lock ends with its lease, the pool goes on.
        victim = f"victim-{uuid.uuid4().hex[:8]}"
        doomed = app.send_task("tests.celery.tasks.hold", kwargs={"name": victim, "seconds": 60})
        child = wait_until(
            "the task to take its lock", lambda: holder_pid(manager, f"hold-{victim}")
        )
        assert child != worker.pid
        assert_freed_after_kill(manager, f"hold-{victim}", child)
        assert type(results(app, [doomed])[0]).__name__ == "WorkerLostError"
        after = app.send_task("tests.celery.tasks.hold", kwargs={"name": victim, "seconds": 0})
        assert isinstance(results(app, [after])[0], dict)

        assert worker.stop() == 0, worker.output()
    output = worker.output()
    assert FORK_WARNING not in output, output
    # A clean stop gave the parent's lock back; the children never released it.
    info = manager.status(parent_key)
    assert info is None or not info.live


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        with error:  # an error response holds its connection until closed
            return error.code, error.read().decode()


def test_gunicorn_with_preload(jobs: Jobs, manager: LockManager) -> None:
    parent_key = f"gunicorn-parent-{uuid.uuid4().hex[:8]}"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = jobs.tmp / "gunicorn.log"
    with log.open("wb") as out:
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gunicorn",
                "--preload",
                "--workers=4",
                f"--bind=127.0.0.1:{port}",
                "--timeout=60",
                "tests.celery.wsgi:application",
            ],
            cwd=ROOT,
            env=jobs.env(MONGOLOCK_PARENT_KEY=parent_key),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:

        def output() -> str:
            return log.read_text(errors="replace")

        wait_until(
            "gunicorn to serve",
            lambda: server.poll() is None and _answers(f"{base}/invoices/0/render/"),
            timeout=60,
        )
        master, token = wait_until("the master's lock", lambda: parent_token(output(), parent_key))
        assert master == server.pid, output()

        # Three slow renders at once, in three workers: each holds its lock for 3 leases.
        answers: dict[int, tuple[int, str]] = {}

        def render(pk: int) -> None:
            answers[pk] = get(f"{base}/invoices/{pk}/render/?seconds={HOLD}")

        threads = [threading.Thread(target=render, args=(pk,)) for pk in range(1, 4)]
        for thread in threads:
            thread.start()
        keys = [f"invoice-{pk}" for pk in range(1, 4)]
        holders = wait_until("three renders to hold their locks", lambda: live(manager, keys))
        # Each worker extends its own lease (same holder, same token, a later end).
        wait_until(
            "the workers to refresh their leases",
            lambda: (
                (now := live(manager, keys)) is not None
                and all(
                    (n.owner, n.token) == (h.owner, h.token)
                    and (n.expires_at - n.acquired_at).total_seconds() > TTL + 0.1
                    for n, h in zip(now, holders, strict=True)
                )
            ),
        )
        # A second request for a busy invoice, answered by the fourth worker, is refused.
        assert get(f"{base}/invoices/1/render/")[0] == 423
        for thread in threads:
            thread.join(timeout=60)
        for pk, holder in zip(range(1, 4), holders, strict=True):
            assert owner_pid(holder.owner) != master
            status, body = answers[pk]
            assert status == 200, body
            assert f"fencing token {holder.token}" in body
            after = manager.status(f"invoice-{pk}")
            assert after is None or not after.live  # released by the worker at the end
        assert all(h.ttl == TTL for h in holders)

        info = manager.status(parent_key)
        assert info is not None
        assert info.live
        assert (info.token, owner_pid(info.owner)) == (token, master)

        # A worker killed mid-request: the lock ends with its lease.
        slow = threading.Thread(target=_answers, args=(f"{base}/invoices/9/render/?seconds=30",))
        slow.start()
        child = wait_until("the request to take its lock", lambda: holder_pid(manager, "invoice-9"))
        assert child != master
        assert_freed_after_kill(manager, "invoice-9", child)
        slow.join(timeout=60)
        assert _answers(f"{base}/invoices/9/render/")  # a new worker serves it

        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=STOP_TIMEOUT) == 0, output()
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=STOP_TIMEOUT)
    text = log.read_text(errors="replace")
    assert FORK_WARNING not in text, text
    info = manager.status(parent_key)
    assert info is None or not info.live


def _answers(url: str) -> bool:
    try:
        return get(url)[0] == 200
    except OSError:
        return False
