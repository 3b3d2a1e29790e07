"""``@locked(..., on_lost=...)`` and ``@locked(..., reentrant=True)``, against the real server."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from django.views import View

from django_mongolock import Lock, LockLost, LockManager, current_lock, locked
from django_mongolock.decorators import BUSY_EXIT_CODE, LOST_EXIT_CODE
from tests.utils import ROOT, without_slow_server_warnings


def _force_release_when_held(manager: LockManager, key: str) -> threading.Thread:
    """Force-release ``key`` from another thread as soon as somebody holds it."""

    def run() -> None:
        deadline = time.monotonic() + 20
        while manager.status(key) is None:
            assert time.monotonic() < deadline, f"nobody took {key!r}"
            time.sleep(0.02)
        manager.force_release(key)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


# -- a real manage.py process -------------------------------------------------------------------


def test_a_command_whose_lock_is_lost_exits_76_with_the_key_and_token(
    mongolock_url: str, mongolock_database: str, other: LockManager
) -> None:
    env = {
        **os.environ,
        "MONGOLOCK_URL": mongolock_url,
        "MONGOLOCK_DATABASE": mongolock_database,
    }
    process = subprocess.Popen(
        [sys.executable, "manage.py", "nightly_sync", "--seconds", "120", "--no-color"],
        cwd=ROOT,
        env={**env, "DJANGO_SETTINGS_MODULE": "tests.nightly_settings"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        first = process.stdout.readline()  # printed once the lock is held
        assert first.startswith("nightly-sync: holding lock 'nightly-sync', fencing token "), first
        token = int(first.rsplit(" ", 1)[1])
        removed = other.force_release("nightly-sync")
        assert removed is not None
        assert removed.token == token
        out, err = process.communicate(timeout=30)  # far less than the 120 s of work
    finally:
        process.kill()
        process.wait()
    assert process.returncode == LOST_EXIT_CODE, (out, err)
    assert "done" not in out
    last = without_slow_server_warnings(err).rstrip().splitlines()[-1]
    assert last.startswith(
        f"CommandError: nightly_sync: stopped; lost the lock 'nightly-sync' "
        f"(owner {removed.owner}, fencing token {token}): "
    ), err
    assert f"Exit status {LOST_EXIT_CODE} means the lock was lost" in err
    assert "Traceback" not in err
    assert other.status("nightly-sync") is None


def test_the_command_runs_to_the_end_when_its_lock_stays(
    mongolock_url: str, mongolock_database: str
) -> None:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.nightly_settings",
        "MONGOLOCK_URL": mongolock_url,
        "MONGOLOCK_DATABASE": mongolock_database,
    }
    result = subprocess.run(
        [sys.executable, "manage.py", "nightly_sync", "--seconds", "0.2", "--no-color"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (result.returncode, without_slow_server_warnings(result.stderr)) == (0, "")
    assert "nightly-sync: done (token " in result.stdout
    assert LOST_EXIT_CODE not in (0, 1, 2, BUSY_EXIT_CODE)


# -- in this process: the main thread is interrupted ---------------------------------------------


def test_a_command_in_the_main_thread_is_interrupted(
    manager: LockManager, other: LockManager
) -> None:
    @locked("lost-command", ttl=0.9, on_lost="exit", manager=manager)
    class Command(BaseCommand):
        def handle(self, *args: Any, **options: Any) -> None:
            time.sleep(60)

    _force_release_when_held(other, "lost-command")
    with pytest.raises(CommandError, match="stopped; lost the lock 'lost-command'") as caught:
        call_command(Command())
    assert caught.value.returncode == LOST_EXIT_CODE
    assert isinstance(caught.value.__cause__, LockLost)
    assert manager.status("lost-command") is None


def test_a_function_in_the_main_thread_raises_lock_lost(
    manager: LockManager, other: LockManager
) -> None:
    import signal

    # What SIGINT did before: Python's default_int_handler, or SIG_IGN in a process
    # started in the background by a shell without job control.
    before = signal.getsignal(signal.SIGINT)
    seen: list[Lock] = []

    @locked("lost-function", ttl=0.9, on_lost="exit", manager=manager)
    def work() -> None:
        lock = current_lock()
        assert lock is not None
        seen.append(lock)
        try:
            time.sleep(60)
        except Exception:  # the usual catch-all does not swallow the stop
            pytest.fail("the stop was caught as an Exception")

    _force_release_when_held(other, "lost-function")
    with pytest.raises(LockLost) as caught:
        work()
    assert (caught.value.key, caught.value.token) == ("lost-function", seen[0].token)
    # Ctrl+C means what it meant before once the call is over: the handler was put back.
    assert signal.getsignal(signal.SIGINT) is before


def test_the_calls_own_lock_lost_is_reported_the_same_way(
    manager: LockManager, other: LockManager
) -> None:
    @locked("lost-refresh", ttl=10, on_lost="exit", manager=manager)
    class Command(BaseCommand):
        def handle(self, *args: Any, **options: Any) -> None:
            lock = current_lock()
            assert lock is not None
            other.force_release("lost-refresh")
            lock.refresh()  # finds out in the main thread itself

    with pytest.raises(CommandError, match="lost-refresh") as caught:
        call_command(Command())
    assert caught.value.returncode == LOST_EXIT_CODE


def test_outside_the_main_thread_the_loss_is_reported_when_the_call_returns(
    manager: LockManager, other: LockManager
) -> None:
    finished: list[bool] = []
    errors: list[BaseException] = []

    @locked("lost-thread", ttl=0.9, on_lost="exit", manager=manager)
    def work() -> None:
        lock = current_lock()
        assert lock is not None
        other.force_release("lost-thread")
        assert lock.lost.wait(10)
        finished.append(True)

    def run() -> None:
        try:
            work()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(20)
    assert not thread.is_alive()
    assert finished == [True]
    assert len(errors) == 1
    assert isinstance(errors[0], LockLost)


def test_a_call_that_keeps_its_lock_returns_its_result(manager: LockManager) -> None:
    @locked("kept", on_lost="exit", manager=manager)
    def work(x: int) -> int:
        return x * 2

    assert work(21) == 42
    assert manager.status("kept") is None


def test_on_lost_callable_is_called_with_the_lock(manager: LockManager, other: LockManager) -> None:
    called: list[Lock] = []
    done = threading.Event()

    def on_lost(lock: Lock) -> None:
        called.append(lock)
        done.set()

    @locked("lost-callback", ttl=0.9, on_lost=on_lost, manager=manager)
    def work() -> int:
        other.force_release("lost-callback")
        assert done.wait(10)
        lock = current_lock()
        assert lock is not None
        return lock.token

    token = work()
    assert [lock.token for lock in called] == [token]


def test_on_lost_exit_is_refused_where_it_cannot_stop_the_call(manager: LockManager) -> None:
    with pytest.raises(ValueError, match="on_lost must be"):
        locked("bad", on_lost="raise")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="coroutine or generator"):

        @locked("bad", on_lost="exit")
        async def coroutine() -> None:
            pass

    with pytest.raises(TypeError, match="management command"):

        @locked("bad", on_lost="exit")
        class Page(View):
            pass

    with pytest.raises(TypeError, match="reentrant"):
        locked("bad", reentrant="yes")  # type: ignore[arg-type]


def test_reentrant_passes_through(manager: LockManager) -> None:
    @locked("re-decorated", reentrant=True, manager=manager)
    def outer() -> tuple[int, int]:
        lock = current_lock()
        assert lock is not None
        return lock.token, inner()

    @locked("re-decorated", reentrant=True, manager=manager)
    def inner() -> int:
        lock = current_lock()
        assert lock is not None
        assert lock.holds == 2
        return lock.token

    first, second = outer()
    assert first == second
    assert manager.status("re-decorated") is None
