"""``@locked(on_busy="wait" | "retry" | "coalesce")``: what a busy call does instead of running."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Retry
from django.core.management.base import BaseCommand
from pymongo import MongoClient

from django_mongolock import LockManager, LockNotAcquired, MongoLockError, current_lock, locked
from django_mongolock.decorating.coalesce import Requests
from django_mongolock.queries.requests import REQUESTS_TTL_INDEX as TTL_INDEX
from django_mongolock.testing import MongoReplicaSet
from tests import coalesce_worker
from tests.utils import ROOT, finished


def wait_until(condition: Any, what: str, seconds: float = 20.0) -> None:
    ends = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < ends, f"timed out waiting for {what}"
        time.sleep(0.02)


def live(manager: LockManager, key: str) -> bool:
    info = manager.status(key)
    return info is not None and info.live


# "wait" ------------------------------------------------------------------------------------


def test_wait_runs_once_the_holder_releases(manager: LockManager, other: LockManager) -> None:
    @locked("wait-k", on_busy="wait", timeout=20, manager=manager)
    def work() -> int:
        lock = current_lock()
        assert lock is not None
        return lock.token

    holder = other.acquire("wait-k", ttl=30, blocking=False)
    released = threading.Timer(0.3, holder.release)
    released.start()
    token = work()
    released.join()
    assert token > holder.token  # ran after the holder, under a lock of its own
    assert manager.status("wait-k") is None


def test_wait_raises_when_the_timeout_passes(manager: LockManager, other: LockManager) -> None:
    @locked("wait-k", on_busy="wait", timeout=0.3, manager=manager)
    def work() -> None:
        raise AssertionError("ran while the lock was held")

    with other.lock("wait-k", ttl=30) as holder, pytest.raises(LockNotAcquired) as caught:
        work()
    assert caught.value.holder == holder.owner


def test_wait_in_a_command_exits_75_after_the_timeout(
    manager: LockManager, other: LockManager
) -> None:
    @locked("wait-cmd", on_busy="wait", timeout=0.2, manager=manager)
    class Command(BaseCommand):
        def handle(self, *args: Any, **options: Any) -> None:
            raise AssertionError("ran while the lock was held")

    from django.core.management import CommandError

    with other.lock("wait-cmd", ttl=30), pytest.raises(CommandError) as caught:
        Command().execute(verbosity=1, no_color=True, force_color=False, skip_checks=True)
    assert caught.value.returncode == 75
    assert "not run; lock 'wait-cmd' is held by" in str(caught.value)


def test_wait_in_a_coroutine_function(manager: LockManager, other: LockManager) -> None:
    import asyncio

    @locked("wait-k", on_busy="wait", timeout=20, manager=manager)
    async def work() -> int:
        lock = current_lock()
        assert lock is not None
        return lock.token

    holder = other.acquire("wait-k", ttl=30, blocking=False)
    released = threading.Timer(0.3, holder.release)
    released.start()
    token = asyncio.run(work())
    released.join()
    assert token > holder.token


def test_wait_in_a_view_answers_423_after_the_timeout(
    manager: LockManager, other: LockManager
) -> None:
    from django.http import HttpResponse
    from django.test import RequestFactory

    @locked("invoice-{pk}", on_busy="wait", timeout=0.2, manager=manager)
    def view(request: Any, pk: int) -> HttpResponse:
        return HttpResponse("rendered")

    with other.lock("invoice-3", ttl=30):
        response = view(RequestFactory().get("/"), pk=3)
    assert response.status_code == 423
    assert view(RequestFactory().get("/"), pk=3).content == b"rendered"


@pytest.mark.parametrize(
    ("options", "error", "text"),
    [
        ({"on_busy": "later"}, ValueError, "'later'"),
        ({"on_busy": "wait", "timeout": -1}, ValueError, "-1"),
        ({"on_busy": "wait", "timeout": "5"}, TypeError, "'5'"),
        ({"on_busy": "wait", "blocking": None}, TypeError, "blocking must be True or False"),
        ({"on_busy": "skip", "blocking": 0}, TypeError, "blocking must be True or False, not 0"),
    ],
)
def test_bad_policies_are_refused_naming_the_value(
    options: dict[str, Any], error: type[Exception], text: str
) -> None:
    with pytest.raises(error, match=text):
        locked("k", **options)


# "retry" -----------------------------------------------------------------------------------


@pytest.fixture
def celery_app() -> Iterator[Celery]:
    """A Celery app on kombu's in-memory transport: retry() really sends the new message."""
    app = Celery("busy-policies", broker="memory://", set_as_current=False)
    app.conf.task_default_queue = "busy-policies"
    yield app
    app.close()


def bound_sync_task(app: Celery, manager: LockManager) -> Any:
    @app.task(bind=True, max_retries=2, name="sync_account")  # type: ignore[untyped-decorator]
    @locked("sync-{account_id}", on_busy="retry", manager=manager)
    def sync_account(self: Any, account_id: int) -> int:
        lock = current_lock()
        assert lock is not None
        return lock.token

    return sync_account


def run_as_worker(task: Any, *args: Any, retries: int = 0) -> Any:
    """Run ``task`` as a worker runs a delivered message: with a request of its own."""
    task.push_request(
        id=f"task-{retries}", args=list(args), kwargs={}, retries=retries, called_directly=False
    )
    try:
        return task.run(*args)
    finally:
        task.pop_request()


def test_retry_reschedules_with_the_holders_remaining_lease(
    celery_app: Celery, manager: LockManager, other: LockManager
) -> None:
    task = bound_sync_task(celery_app, manager)
    with other.lock("sync-7", ttl=30):
        with pytest.raises(Retry) as caught:
            run_as_worker(task, 7)
        left = other.status("sync-7")
    assert left is not None
    assert 1 <= caught.value.when <= math.ceil(30)
    assert caught.value.when >= math.floor(left.remaining) - 1
    assert isinstance(caught.value.exc, LockNotAcquired)
    # The new message is on the broker, delayed, with the retry counted.
    with celery_app.connection_for_read() as connection:
        queue = connection.SimpleQueue("busy-policies")
        message = queue.get(timeout=5)
        assert message.headers["retries"] == 1
        assert message.headers["eta"] is not None
        assert message.headers["task"] == "sync_account"
        message.ack()
        queue.close()
    # Free: the task runs under its lock.
    assert run_as_worker(task, 7) > 0


def test_retry_gives_up_with_lock_not_acquired_after_max_retries(
    celery_app: Celery, manager: LockManager, other: LockManager
) -> None:
    task = bound_sync_task(celery_app, manager)
    with other.lock("sync-8", ttl=30), pytest.raises(LockNotAcquired):
        run_as_worker(task, 8, retries=2)


def test_retry_outside_a_bound_task_is_a_type_error(manager: LockManager) -> None:
    @locked("sync-{account_id}", on_busy="retry", manager=manager)
    def sync_account(account_id: int) -> None: ...

    with pytest.raises(TypeError, match=r"bound task .*sync_account\(\).*got int 7"):
        sync_account(7)

    def no_arguments() -> None: ...

    with pytest.raises(TypeError, match="takes no argument for the task"):
        locked("k", on_busy="retry")(no_arguments)


def test_retry_and_coalesce_refuse_what_cannot_run_again() -> None:
    async def coroutine() -> None: ...

    with pytest.raises(TypeError, match="coroutine or generator"):
        locked("k", on_busy="retry")(coroutine)
    with pytest.raises(TypeError, match="coroutine or generator"):
        locked("k", on_busy="coalesce")(coroutine)

    class Command(BaseCommand):
        pass

    with pytest.raises(TypeError, match="not management commands"):
        locked("k", on_busy="retry")(Command)


# "coalesce" --------------------------------------------------------------------------------


def test_coalesce_runs_once_more_however_many_requests(
    manager: LockManager, other: LockManager
) -> None:
    started = threading.Event()
    finish = threading.Event()
    runs: list[int] = []

    @locked("rebuild", on_busy="coalesce", manager=manager)
    def rebuild() -> str:
        lock = current_lock()
        assert lock is not None
        runs.append(lock.token)
        started.set()
        assert finish.wait(20)
        return "built"

    results: list[object] = []
    holder = threading.Thread(target=lambda: results.append(rebuild()))
    holder.start()
    assert started.wait(20)
    # Five busy calls, each from a thread of its own (each a holder of its own).
    busy = [threading.Thread(target=lambda: results.append(rebuild())) for _ in range(5)]
    for thread in busy:
        thread.start()
    for thread in busy:
        thread.join(20)
    assert results == [None] * 5  # returned at once, without running
    assert len(runs) == 1
    finish.set()
    holder.join(20)
    assert not holder.is_alive()
    assert results[-1] == "built"
    assert len(runs) == 2  # once more for all five, under a new lock
    assert runs[1] > runs[0]
    assert not Requests(other).pending("rebuild")
    assert manager.status("rebuild") is None


def test_coalesce_under_contention_never_strands_a_request(
    mongolock_url: str, manager: LockManager
) -> None:
    """Threads with managers of their own call at random: runs never overlap, and every
    call that returned without running is followed by a run that started after it began."""
    spans: list[tuple[float, float]] = []
    coalesced: list[float] = []
    overlaps: list[float] = []
    running = threading.Lock()
    managers = [
        LockManager(mongolock_url, database=manager.database, collection=manager.collection)
        for _ in range(4)
    ]

    def caller(own: LockManager, seed: int) -> None:
        import random

        pick = random.Random(seed)

        @locked("contended", on_busy="coalesce", manager=own)
        def work() -> str:
            if not running.acquire(blocking=False):
                overlaps.append(time.monotonic())
                return "overlapped"
            start = time.monotonic()
            time.sleep(pick.uniform(0.005, 0.03))
            spans.append((start, time.monotonic()))
            running.release()
            return "ran"

        for _ in range(15):
            began = time.monotonic()
            if work() is None:
                coalesced.append(began)
            time.sleep(pick.uniform(0, 0.02))

    try:
        threads = [
            threading.Thread(target=caller, args=(own, seed)) for seed, own in enumerate(managers)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not any(thread.is_alive() for thread in threads)
    finally:
        for own in managers:
            own.close()
    assert overlaps == [], "two runs at once"
    assert coalesced, "no call found the lock busy: the test proved nothing"
    starts = sorted(start for start, _ in spans)
    for began in coalesced:
        assert starts[-1] > began, "a request made while busy was never served"
    assert not Requests(manager).pending("contended")


def test_coalesce_without_requests_runs_once(manager: LockManager) -> None:
    runs: list[int] = []

    @locked("rebuild", on_busy="coalesce", manager=manager)
    def rebuild() -> None:
        runs.append(1)

    rebuild()
    rebuild()
    assert runs == [1, 1]


def test_a_coalescing_command_says_so_in_one_line(manager: LockManager, other: LockManager) -> None:
    from io import StringIO

    @locked("nightly", on_busy="coalesce", manager=manager)
    class Command(BaseCommand):
        def handle(self, *args: Any, **options: Any) -> None:
            raise AssertionError("ran while the lock was held")

    Command.__module__ = "myapp.management.commands.nightly"
    out = StringIO()
    with other.lock("nightly", ttl=30) as holder:
        Command(stdout=out).execute(verbosity=1, no_color=True, force_color=False, skip_checks=True)
    line = out.getvalue()
    assert line.count("\n") == 1
    assert line.startswith(f"nightly: not run now; lock 'nightly' is held by {holder.owner}")
    assert line.endswith("; it runs once more after.\n")
    assert Requests(other).pending("nightly")


def test_a_coalescing_commands_own_error_is_not_turned_into_exit_2(
    manager: LockManager,
) -> None:
    @locked("nightly", on_busy="coalesce", manager=manager)
    class Command(BaseCommand):
        def handle(self, *args: Any, **options: Any) -> None:
            raise MongoLockError("the command's own")

    with pytest.raises(MongoLockError, match="the command's own"):
        Command().execute(verbosity=1, no_color=True, force_color=False, skip_checks=True)
    assert manager.status("nightly") is None


def test_coalesce_on_a_view_is_a_type_error(manager: LockManager) -> None:
    from django.test import RequestFactory

    @locked("v", on_busy="coalesce", manager=manager)
    def view(request: Any) -> None: ...

    with pytest.raises(TypeError, match="not views"):
        view(RequestFactory().get("/"))


# "coalesce" across processes ----------------------------------------------------------------


@pytest.fixture
def runs(mongolock_url: str, mongolock_database: str) -> Iterator[Any]:
    client: MongoClient[dict[str, Any]] = MongoClient(mongolock_url)
    yield client[mongolock_database]["runs"]
    client.close()


def start_worker(url: str, database: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.coalesce_worker", url, database],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_processes_requests_make_the_holder_process_run_once_more(
    mongolock_url: str, mongolock_database: str, runs: Any, manager: LockManager
) -> None:
    runs.insert_one({"_id": "hold"})
    holder = start_worker(mongolock_url, mongolock_database)
    try:
        wait_until(lambda: runs.count_documents({"pid": holder.pid}) == 1, "the first run")
        busy = [start_worker(mongolock_url, mongolock_database) for _ in range(3)]
        for process in busy:
            code, out, err = finished(process)
            assert (code, out, err) == (0, "requested 0\n", "")
        assert runs.count_documents({"pid": {"$exists": True}}) == 1
        runs.delete_one({"_id": "hold"})
        code, out, err = finished(holder)
    finally:
        holder.kill()
    assert (code, out, err) == (0, "ran 2\n", "")
    assert runs.count_documents({"pid": holder.pid}) == 2
    assert runs.count_documents({}) == 2
    assert not Requests(manager).pending(coalesce_worker.KEY)


def test_a_request_survives_the_holder_being_killed(
    mongolock_url: str, mongolock_database: str, runs: Any, manager: LockManager
) -> None:
    runs.insert_one({"_id": "hold"})
    holder = start_worker(mongolock_url, mongolock_database)
    try:
        wait_until(lambda: runs.count_documents({"pid": holder.pid}) == 1, "the first run")
        assert finished(start_worker(mongolock_url, mongolock_database))[:2] == (
            0,
            "requested 0\n",
        )
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.communicate(timeout=20)
    requests = Requests(manager)
    assert requests.pending(coalesce_worker.KEY)  # the dead holder did not lose it
    runs.delete_one({"_id": "hold"})
    wait_until(
        lambda: not live(manager, coalesce_worker.KEY),
        "the dead holder's lease to end",
        coalesce_worker.TTL * 5,
    )
    assert requests.pending(coalesce_worker.KEY)  # nor did the lease's end
    # The next run of the key, by a new process, serves it: one run, nothing left.
    follower = start_worker(mongolock_url, mongolock_database)
    assert finished(follower) == (0, "ran 1\n", "")
    assert not requests.pending(coalesce_worker.KEY)
    assert runs.count_documents({"pid": follower.pid}) == 1


def test_requests_live_in_a_side_collection_with_a_ttl(
    mongolock_url: str, manager: LockManager
) -> None:
    requests = Requests(manager)
    requests.add("k")
    client: MongoClient[dict[str, Any]] = MongoClient(mongolock_url)
    try:
        collection = client[manager.database][manager.collection + ".requests"]
        document = collection.find_one({"_id": "k"})
        assert document is not None
        assert document["requested"] == 1
        ttl = [
            index
            for index in collection.list_indexes()
            if index.get("expireAfterSeconds") == 0 and index["name"] == TTL_INDEX
        ]
        assert len(ttl) == 1
    finally:
        client.close()


# "coalesce": a run only for a request no run has covered ------------------------------------


def pause_in(
    monkeypatch: pytest.MonkeyPatch, method: str, thread: str, *, when: Any = None
) -> tuple[threading.Event, threading.Event]:
    """Pause the thread named ``thread`` right after its first ``Requests.<method>`` (whose
    result satisfies ``when``, if given): (paused, go)."""
    paused, go = threading.Event(), threading.Event()
    original = getattr(Requests, method)

    def pausing(self: Requests, key: str) -> Any:
        result = original(self, key)
        mine = threading.current_thread().name == thread and not paused.is_set()
        if mine and (when is None or when(result)):
            paused.set()
            assert go.wait(20)
        return result

    monkeypatch.setattr(Requests, method, pausing)
    return paused, go


def recording_runs(manager: LockManager, key: str) -> tuple[Any, list[str], threading.Event]:
    """A coalescing function whose first run waits for ``finish``; ``runs`` names the
    threads that ran it, in order."""
    runs: list[str] = []
    finish = threading.Event()

    @locked(key, on_busy="coalesce", manager=manager)
    def rebuild() -> str:
        runs.append(threading.current_thread().name)
        if len(runs) == 1:
            assert finish.wait(20)
        return "built"

    return rebuild, runs, finish


def test_a_busy_call_whose_request_was_served_meanwhile_does_not_run(
    monkeypatch: pytest.MonkeyPatch, manager: LockManager
) -> None:
    paused, go = pause_in(monkeypatch, "add", "B")
    rebuild, runs, finish = recording_runs(manager, "served-meanwhile")
    results: dict[str, object] = {}
    holder = threading.Thread(target=lambda: results.update(H=rebuild()), name="H")
    holder.start()
    wait_until(lambda: runs == ["H"], "the holder's run")
    busy = threading.Thread(target=lambda: results.update(B=rebuild()), name="B")
    busy.start()
    assert paused.wait(20)  # B's request is recorded; B has not tried the lock again
    finish.set()
    holder.join(20)
    assert runs == ["H", "H"]  # the holder ran once more, for B's request
    go.set()
    busy.join(20)
    assert not holder.is_alive()
    assert not busy.is_alive()
    assert runs == ["H", "H"]  # B got the lock, found its request served, did not run
    assert results == {"H": "built", "B": None}
    assert not Requests(manager).pending("served-meanwhile")
    assert manager.status("served-meanwhile") is None


def test_a_holder_does_not_run_for_requests_another_run_served(
    monkeypatch: pytest.MonkeyPatch, manager: LockManager
) -> None:
    paused, go = pause_in(monkeypatch, "pending", "H", when=bool)
    rebuild, runs, finish = recording_runs(manager, "served-by-another")
    results: dict[str, object] = {}
    holder = threading.Thread(target=lambda: results.update(H=rebuild()), name="H")
    holder.start()
    wait_until(lambda: runs == ["H"], "the holder's run")
    busy = threading.Thread(target=lambda: results.update(B=rebuild()), name="B")
    busy.start()
    busy.join(20)
    finish.set()
    assert paused.wait(20)  # H found B's request pending, has not tried the lock again
    fresh = threading.Thread(target=lambda: results.update(C=rebuild()), name="C")
    fresh.start()
    fresh.join(20)
    assert runs == ["H", "C"]  # C's run started after B's request: it covered it
    go.set()
    holder.join(20)
    assert not holder.is_alive()
    assert not fresh.is_alive()
    assert runs == ["H", "C"]
    assert results == {"B": None, "C": "built", "H": "built"}
    assert not Requests(manager).pending("served-by-another")


def test_a_request_made_after_the_document_was_dropped_mid_run_is_not_lost(
    mongolock_url: str, manager: LockManager
) -> None:
    """The TTL monitor may drop a key's document (here: a delete stands in for it): a
    request recorded after that, on a new document, is not marked served by the run."""
    client: MongoClient[dict[str, Any]] = MongoClient(mongolock_url, tz_aware=True)
    documents = client[manager.database][manager.collection + ".requests"]
    requests = Requests(manager)
    for _ in range(3):
        requests.add("dropped")
    soon = datetime.now(UTC) + timedelta(days=1)
    documents.update_one({"_id": "dropped"}, {"$set": {"expires_at": soon}})
    kept_until: list[Any] = []
    runs: list[int] = []

    def busy_call() -> None:
        results.append(rebuild())

    @locked("dropped", on_busy="coalesce", manager=manager)
    def rebuild() -> str:
        runs.append(1)
        if len(runs) == 1:
            document = documents.find_one({"_id": "dropped"})
            assert document is not None
            kept_until.append(document["expires_at"])
            documents.delete_one({"_id": "dropped"})
            busy = threading.Thread(target=busy_call)
            busy.start()
            busy.join(20)
        return "built"

    results: list[object] = []
    try:
        results.append(rebuild())
    finally:
        client.close()
    assert results == [None, "built"]
    assert len(runs) == 2  # once more, for the request made on the new document
    assert not requests.pending("dropped")
    # The run's start kept the document from the TTL monitor for the idle expiry.
    assert kept_until[0] > soon + timedelta(days=5)


def test_a_finished_run_returns_its_result_when_the_extra_runs_acquire_fails(
    fail_points: MongoReplicaSet,
) -> None:
    """A server error on the way to the extra run does not turn the finished run into a
    failure; the request stays pending for the next run of the key."""
    admin: MongoClient[dict[str, Any]] = MongoClient(fail_points.nodes[0].direct_url)
    client: MongoClient[dict[str, Any]] = MongoClient(fail_points.url, appname="coalesce-holder")
    holding = LockManager(client=client, database="coalesce")
    busy = LockManager(fail_points.url, database="coalesce")
    runs: list[int] = []

    def fail_the_next_acquire() -> None:
        # The holder's release and serve are updates, its look for requests a find: its
        # next findAndModify is the extra run's acquire.
        admin.admin.command(
            "configureFailPoint",
            "failCommand",
            mode={"times": 1},
            data={
                "failCommands": ["findAndModify"],
                "errorCode": 2,
                "appName": "coalesce-holder",
            },
        )

    @locked("extra", on_busy="coalesce", manager=busy)
    def requested() -> str:
        raise AssertionError("ran while the lock was held")

    @locked("extra", ttl=30, on_busy="coalesce", manager=holding)
    def rebuild() -> str:
        runs.append(1)
        if len(runs) == 1:
            assert requested() is None  # a request made while this run goes on
            fail_the_next_acquire()
        return "built"

    try:
        assert rebuild() == "built"
        assert runs == [1]
        assert Requests(busy).pending("extra")  # left for the next run of the key
        assert rebuild() == "built"
        assert runs == [1, 1]
        assert not Requests(busy).pending("extra")
    finally:
        admin.admin.command("configureFailPoint", "failCommand", mode="off")
        admin.drop_database("coalesce")
        admin.close()
        holding.close()
        busy.close()
        client.close()
