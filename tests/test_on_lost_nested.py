"""``@locked(on_lost="exit")`` calls nested in the main thread, and a loss before the call."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError

from django_mongolock import Lock, LockLost, LockManager, current_lock, locked
from django_mongolock.decorators import LOST_EXIT_CODE
from django_mongolock.signals import lock_acquired


def _force_release_when(manager: LockManager, key: str, ready: threading.Event) -> threading.Thread:
    """Force-release ``key`` from another thread once ``ready`` is set (bounded wait)."""

    def run() -> None:
        assert ready.wait(20), "the inner call never started"
        manager.force_release(key)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_the_outer_calls_loss_stops_it_through_an_inner_call(
    manager: LockManager, other: LockManager
) -> None:
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN in a shell's background job
    ran: list[str] = []
    inner_started = threading.Event()
    outer_lock: list[Lock] = []

    @locked("nest-inner", ttl=10, on_lost="exit", manager=manager)
    def inner() -> str:
        inner_started.set()
        time.sleep(60)
        ran.append("inner finished")
        return "inner result"

    @locked("nest-outer", ttl=0.9, on_lost="exit", manager=manager)
    def outer() -> None:
        lock = current_lock()
        assert lock is not None
        outer_lock.append(lock)
        result = inner()
        ran.append(f"outer went on after inner returned {result!r}")

    thread = _force_release_when(other, "nest-outer", inner_started)
    with pytest.raises(LockLost) as caught:
        outer()
    thread.join(20)
    assert (caught.value.key, caught.value.token) == ("nest-outer", outer_lock[0].token)
    assert ran == []
    assert manager.status("nest-inner") is None  # the inner call let its lock go
    assert signal.getsignal(signal.SIGINT) is before


def test_a_command_whose_lock_is_lost_in_a_nested_call_exits_76(
    manager: LockManager, other: LockManager
) -> None:
    ran: list[str] = []
    inner_started = threading.Event()

    @locked("nest-inner-fn", ttl=10, on_lost="exit", manager=manager)
    def inner() -> None:
        inner_started.set()
        time.sleep(60)
        ran.append("inner finished")

    @locked("nest-command", ttl=0.9, on_lost="exit", manager=manager)
    class Command(BaseCommand):
        def handle(self, *args: Any, **options: Any) -> None:
            inner()
            ran.append("command went on")

    _force_release_when(other, "nest-command", inner_started)
    with pytest.raises(CommandError, match="lost the lock 'nest-command'") as caught:
        call_command(Command())
    assert caught.value.returncode == LOST_EXIT_CODE
    assert ran == []
    assert manager.status("nest-inner-fn") is None


def test_the_inner_calls_own_loss_stops_only_the_inner_call(
    manager: LockManager, other: LockManager
) -> None:
    ran: list[str] = []
    inner_started = threading.Event()

    @locked("own-inner", ttl=0.9, on_lost="exit", manager=manager)
    def inner() -> None:
        inner_started.set()
        time.sleep(60)

    @locked("own-outer", ttl=10, on_lost="exit", manager=manager)
    def outer() -> str:
        with pytest.raises(LockLost) as caught:
            inner()
        ran.append(caught.value.key)
        return "outer result"

    _force_release_when(other, "own-inner", inner_started)
    assert outer() == "outer result"
    assert ran == ["own-inner"]
    assert manager.status("own-outer") is None


def test_a_lock_lost_before_the_call_starts_never_runs_it(
    manager: LockManager, other: LockManager
) -> None:
    ran: list[str] = []

    def break_it(sender: Any, lock: Lock, **kwargs: Any) -> None:
        if lock.key == "lost-early":
            assert other.force_release("lost-early") is not None
            assert lock.lost.wait(10), "the loss was not noticed"

    @locked("lost-early", ttl=0.9, on_lost="exit", manager=manager)
    def work() -> None:
        ran.append("ran")

    lock_acquired.connect(break_it, weak=False)
    try:
        with pytest.raises(LockLost) as caught:
            work()
    finally:
        lock_acquired.disconnect(break_it)
    assert caught.value.key == "lost-early"
    assert ran == []
