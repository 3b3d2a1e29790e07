"""Election callbacks: in the order of the events, on a worker of their own, unbreakable."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

from django_mongolock import Election, LockManager


def _wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_demotion_runs_after_a_slow_on_elected(manager: LockManager, other: LockManager) -> None:
    calls: list[str] = []
    electing = threading.Event()
    demoted = threading.Event()

    def on_elected(election: Election) -> None:
        calls.append("elected")
        electing.set()
        time.sleep(1.0)  # still running when the term ends
        calls.append("elected done")

    def on_demoted(election: Election) -> None:
        calls.append("demoted")
        demoted.set()

    election = manager.elect("ordered", ttl=0.6, on_elected=on_elected, on_demoted=on_demoted)
    try:
        assert electing.wait(10)
        other.force_release("ordered")
        # The demotion is noticed within a tick, while on_elected still sleeps ...
        assert _wait_for(lambda: election.terms >= 2 or not election.is_leader, 5)
        # ... and its callback waits for it.
        assert demoted.wait(10)
    finally:
        election.stop()
    assert calls[:3] == ["elected", "elected done", "demoted"]


def test_callbacks_run_off_the_refresher_and_survive_errors_and_exits(
    manager: LockManager, other: LockManager
) -> None:
    threads: list[str] = []
    events: list[str] = []
    done = threading.Event()
    failures = iter([RuntimeError("elected fails"), SystemExit(1)])

    def on_elected(election: Election) -> None:
        threads.append(threading.current_thread().name)
        events.append("elected")
        raise next(failures)

    def on_demoted(election: Election) -> None:
        threads.append(threading.current_thread().name)
        events.append("demoted")
        if len(events) >= 4:
            done.set()
        sys.exit(2)  # ends neither the worker's queue nor the election

    election = manager.elect("sturdy", ttl=0.6, on_elected=on_elected, on_demoted=on_demoted)
    try:
        assert _wait_for(lambda: election.terms >= 1)
        other.force_release("sturdy")
        assert _wait_for(lambda: election.terms >= 2)
        other.force_release("sturdy")
        assert done.wait(10)
        # Still campaigning after on_demoted's sys.exit(): a later term's on_elected runs.
        assert _wait_for(lambda: len(events) >= 5)
    finally:
        election.stop()
    assert events[:4] == ["elected", "demoted", "elected", "demoted"]
    assert all(name == "mongolock-election-callbacks" for name in threads)


def test_a_blocking_callback_delays_only_its_own_election(manager: LockManager) -> None:
    release = threading.Event()
    other_elected = threading.Event()
    stuck = manager.elect("stuck", ttl=5, on_elected=lambda e: release.wait(30))
    try:
        assert _wait_for(lambda: stuck.terms == 1)
        free = manager.elect("free", ttl=5, on_elected=lambda e: other_elected.set())
        try:
            assert other_elected.wait(10)
        finally:
            free.stop()
    finally:
        release.set()
        stuck.stop()


def test_stop_steps_down_and_announces_it(manager: LockManager) -> None:
    demoted = threading.Event()
    election = manager.elect("lapsed", ttl=5, on_demoted=lambda e: demoted.set())
    assert _wait_for(lambda: election.terms == 1)
    election.stop()
    assert demoted.wait(10)
    assert manager.status("lapsed") is None
