"""The backlog that runs an observer's work off the caller's thread."""

from __future__ import annotations

import functools
import logging
import multiprocessing
import os
import threading
import time

import pytest

from django_mongolock.contrib import backlog as backlog_module
from django_mongolock.contrib.backlog import Backlog
from tests.utils import held_here


def _note(seen: list[tuple[int, int]], number: int) -> None:
    seen.append((number, threading.get_ident()))


def test_jobs_run_in_order_on_the_backlogs_thread() -> None:
    backlog = Backlog("test-backlog", delay=0.01)
    seen: list[tuple[int, int]] = []
    done = threading.Event()
    try:
        for number in range(50):
            backlog.post(functools.partial(_note, seen, number))
        backlog.post(done.set)
        assert done.wait(5)
    finally:
        backlog.close()
    assert [n for n, _ in seen] == list(range(50))
    assert threading.get_ident() not in {ident for _, ident in seen}


def test_a_post_after_the_thread_fell_asleep_wakes_it() -> None:
    """The thread sleeps with nothing to do; every later post must still run."""
    backlog = Backlog("test-backlog", delay=0.001)
    pause = threading.Event()
    try:
        for number in range(200):
            ran = threading.Event()
            backlog.post(ran.set)
            assert ran.wait(5), "a job posted to a sleeping backlog never ran"
            if number % 2:  # every other post finds the thread asleep; the rest, racing it
                until = time.monotonic() + 5
                while not backlog._asleep and time.monotonic() < until:
                    pause.wait(0.001)
                assert backlog._asleep
    finally:
        backlog.close()


def _occupy(backlog: Backlog) -> threading.Event:
    """Keep the backlog's thread busy with one job until the returned gate is set."""
    gate = threading.Event()
    started = threading.Event()

    def block() -> None:
        started.set()
        gate.wait(10)

    backlog.post(block)
    assert started.wait(5)
    return gate


def test_flush_returns_once_every_job_queued_before_it_has_run() -> None:
    backlog = Backlog("test-backlog", delay=0.01)
    ran: list[int] = []
    try:
        gate = _occupy(backlog)  # the thread is busy with the first job
        backlog.post(lambda: ran.append(1))
        gate.set()
        backlog.flush()
        assert ran == [1]
    finally:
        backlog.close()


def test_past_the_limit_jobs_are_dropped_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    backlog = Backlog("test-backlog", limit=3)
    ran: list[int] = []
    try:
        gate = _occupy(backlog)
        with caplog.at_level(logging.WARNING, "django_mongolock.contrib"):
            for number in range(5):
                backlog.post(functools.partial(ran.append, number))
        gate.set()
        backlog.flush()
    finally:
        backlog.close()
    assert ran == [0, 1, 2]
    assert backlog.dropped == 2
    assert [r.getMessage() for r in caplog.records if r.name == "django_mongolock.contrib"] == [
        "test-backlog: more than 3 jobs waiting; dropping"
    ]


def test_a_failing_job_is_logged_and_the_next_ones_run(caplog: pytest.LogCaptureFixture) -> None:
    backlog = Backlog("test-backlog", delay=0.01)
    done = threading.Event()

    def fail() -> None:
        raise ValueError("boom")

    try:
        with caplog.at_level(logging.ERROR, "django_mongolock.contrib"):
            backlog.post(fail)
            backlog.post(done.set)
            assert done.wait(5)
    finally:
        backlog.close()
    assert any(r.exc_info and r.exc_info[0] is ValueError for r in caplog.records)


def test_close_runs_the_queue_ends_the_thread_and_refuses_more() -> None:
    backlog = Backlog("test-backlog", delay=10)
    ran: list[int] = []
    backlog.post(lambda: ran.append(1))
    thread = backlog._thread
    assert thread is not None
    backlog.close()
    assert ran == [1]
    thread.join(5)
    assert not thread.is_alive()
    backlog.post(lambda: ran.append(2))
    backlog.flush()
    assert ran == [1]


def _child(backlog: Backlog, result: multiprocessing.Queue[object]) -> None:
    ran = threading.Event()
    backlog.post(ran.set)
    result.put((ran.wait(5), backlog.dropped))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX-only")
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded")
def test_a_forked_child_runs_its_own_jobs_not_the_parents() -> None:
    backlog = Backlog("test-backlog", delay=0.01, limit=1)
    gate = _occupy(backlog)
    backlog.post(lambda: None)  # fills the parent's queue (limit 1)
    context = multiprocessing.get_context("fork")
    result: multiprocessing.Queue[object] = context.Queue()
    child = context.Process(target=_child, args=(backlog, result))
    try:
        child.start()
        child.join(10)
        assert child.exitcode == 0
        # The child's queue started empty (nothing dropped) and its own thread ran the job.
        assert result.get(timeout=10) == (True, 0)
    finally:
        if child.is_alive():
            child.kill()
        gate.set()
        backlog.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_thread_ended_by_its_job_is_started_again_by_the_next_post() -> None:
    backlog = Backlog("test-backlog", delay=0.5)
    ran = threading.Event()

    def leave() -> None:
        raise SystemExit  # ends the thread, as it would any thread

    try:
        backlog.post(leave)
        first = backlog._thread
        assert first is not None
        first.join(5)
        assert not first.is_alive()
        backlog.post(ran.set)
        assert ran.wait(5)
    finally:
        backlog.close()


def test_past_the_limit_a_run_backlog_runs_the_job_in_the_posting_thread() -> None:
    # The thread lets a minute's batch gather before it runs one, and runs no job
    # meanwhile (a job under way would hold the job lock the poster's job waits for).
    backlog = Backlog("test-backlog", limit=1, overflow="run", delay=60)
    seen: list[tuple[int, int]] = []
    here = threading.get_ident()
    try:
        backlog.post(functools.partial(_note, seen, 1))  # queued: the limit is reached
        backlog.post(functools.partial(_note, seen, 2))  # run now, here
        assert seen == [(2, here)]
        backlog.flush()
    finally:
        backlog.close()
    assert seen == [(2, here), (1, here)]
    assert backlog.dropped == 0


def test_a_job_run_by_its_poster_waits_for_the_job_under_way() -> None:
    """Past the limit the poster's job waits for the thread's job under way: the two
    never update one library's state at once outside its own locks, and a fork waits
    for either."""
    backlog = Backlog("test-backlog", limit=1, overflow="run")
    seen: list[tuple[int, int]] = []
    try:
        gate = _occupy(backlog)
        backlog.post(functools.partial(_note, seen, 1))  # queued: the limit is reached
        poster = threading.Thread(target=backlog.post, args=(functools.partial(_note, seen, 2),))
        poster.start()
        poster.join(0.2)
        assert poster.is_alive()  # its job waits for the one under way
        assert seen == []
        gate.set()
        poster.join(5)
        assert not poster.is_alive()
        backlog.flush()
    finally:
        backlog.close()
    assert sorted(n for n, _ in seen) == [1, 2]


def test_an_unknown_overflow_is_refused() -> None:
    with pytest.raises(ValueError, match="overflow must be 'drop' or 'run'"):
        Backlog("test-backlog", overflow="block")  # type: ignore[arg-type]


def _take(lock: threading.Lock, result: multiprocessing.Queue[object]) -> None:
    result.put(lock.acquire(timeout=3))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX-only")
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded")
def test_a_fork_waits_for_the_job_under_way_to_let_go_of_its_lock() -> None:
    """A job holds its library's lock (a metric's, say) for a moment: a child forked then
    must not inherit it held, or its first update of that metric would never return."""
    backlog = Backlog("test-backlog", delay=0.001)
    library = threading.Lock()
    holding = threading.Event()

    def update() -> None:
        with library:
            holding.set()
            time.sleep(0.3)

    context = multiprocessing.get_context("fork")
    result: multiprocessing.Queue[object] = context.Queue()
    child = context.Process(target=_take, args=(library, result))
    try:
        backlog.post(update)
        assert holding.wait(5)
        child.start()  # while the job holds the lock
        assert result.get(timeout=10) is True
        child.join(10)
        assert child.exitcode == 0
        ran = threading.Event()
        backlog.post(ran.set)  # the parent's backlog goes on after the fork
        assert ran.wait(5)
    finally:
        if child.is_alive():
            child.kill()
        backlog.close()


def test_a_fork_waits_for_one_job_not_the_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backlog_module, "FORK_WAIT", 30.0)  # longer than any bounded wait here
    backlog = Backlog("test-backlog", delay=0.001)
    ran: list[int] = []
    started = threading.Event()

    def slow(number: int) -> None:
        started.set()
        time.sleep(0.02)
        ran.append(number)

    try:
        for number in range(100):  # a batch of two seconds
            backlog.post(functools.partial(slow, number))
        assert started.wait(5)
        backlog_module._before_fork()  # as os.fork() does first
        try:
            assert held_here(backlog.job)
            paused = len(ran)
            assert paused < 50  # it did not wait for the batch to end
            time.sleep(0.1)  # five jobs' time: none runs while the fork holds them off
            assert len(ran) == paused
        finally:
            backlog_module._after_fork_in_parent()
        backlog.flush()  # the batch goes on after the fork
        assert ran == list(range(100))
    finally:
        backlog.close()


def test_two_threads_forking_at_once_leave_the_backlog_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(backlog_module, "FORK_WAIT", 0.05)
    backlog = Backlog("test-backlog", delay=0.001)
    second_done = threading.Event()

    def second() -> None:
        backlog_module._before_fork()  # gives up waiting for the first fork's lock
        backlog_module._after_fork_in_parent()  # and gives back only what it took
        second_done.set()

    try:
        backlog_module._before_fork()
        try:
            other = threading.Thread(target=second)
            other.start()
            assert second_done.wait(5)
            assert held_here(backlog.job)  # still the first's
        finally:
            backlog_module._after_fork_in_parent()
        other.join(5)
        ran = threading.Event()
        backlog.post(ran.set)
        assert ran.wait(5)
        assert not _held_elsewhere(backlog)
    finally:
        backlog.close()


def _held_elsewhere(backlog: Backlog) -> bool:
    """Whether another thread than this one could not take the backlog's job lock."""
    free: list[bool] = []

    def take() -> None:
        got = backlog.job.acquire(timeout=0.5)
        free.append(got)
        if got:
            backlog.job.release()

    other = threading.Thread(target=take)
    other.start()
    other.join(5)
    return free != [True]


def test_a_fork_made_inside_a_fork_hook_gives_back_its_own_locks() -> None:
    """Another library's fork hook may fork: the inner fork's hooks run inside the outer
    one's, and each gives back what it took."""
    backlog = Backlog("test-backlog", delay=0.001)
    try:
        backlog_module._before_fork()  # the outer fork
        backlog_module._before_fork()  # a fork made by a hook of the outer one
        backlog_module._after_fork_in_parent()  # the inner one is done
        assert _held_elsewhere(backlog)  # the outer fork still holds it
        backlog_module._after_fork_in_parent()
        assert not _held_elsewhere(backlog)
        ran = threading.Event()
        backlog.post(ran.set)
        assert ran.wait(5)
    finally:
        backlog.close()


def test_a_job_that_forks_does_not_wait_for_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backlog_module, "FORK_WAIT", 30.0)
    backlog = Backlog("test-backlog", delay=0.001)
    done = threading.Event()

    def forks() -> None:
        backlog_module._before_fork()  # as os.fork() would, from this job
        backlog_module._after_fork_in_parent()
        done.set()

    try:
        backlog.post(forks)
        assert done.wait(10), "the fork waited for the job that made it"
        ran = threading.Event()
        backlog.post(ran.set)
        assert ran.wait(5)
    finally:
        backlog.close()
