"""Wake-ups of local waiters: counted, cheap until somebody sleeps, never lost."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta

import pytest

from django_mongolock.acquirer import next_delay as _next_delay
from django_mongolock.info import LockInfo
from django_mongolock.waiters import Waiters, Wake


def test_a_wake_set_before_anybody_sleeps_is_not_lost() -> None:
    wake = Wake()
    wake.set()
    wake.set()
    assert wake.count == 2
    assert wake.wait(0) is True  # the event, built now, starts set
    wake.clear()
    assert wake.wait(0.01) is False


def test_a_wake_set_by_another_thread_ends_the_sleep() -> None:
    waiters = Waiters()
    with waiters.subscribe("k") as wake:
        woke: list[bool] = []
        sleeper = threading.Thread(target=lambda: woke.append(wake.wait(5.0)))
        started = time.monotonic()
        sleeper.start()
        time.sleep(0.05)
        waiters.notify("other-key")
        assert sleeper.is_alive()
        waiters.notify("k")
        sleeper.join(5.0)
    assert woke == [True]
    assert time.monotonic() - started < 4.0
    assert wake.count == 1
    assert len(waiters) == 0  # unsubscribed when the block ended


def _info(*, remaining: float, position: int, owner: str = "crashed") -> LockInfo:
    now = datetime.now(UTC)
    return LockInfo(
        key="k",
        owner=owner,
        token=1,
        acquired_at=now - timedelta(seconds=30),
        refreshed_at=now - timedelta(seconds=30),
        expires_at=now + timedelta(seconds=remaining),
        ttl=30.0,
        now=now,
        position=position,
    )


@pytest.mark.parametrize("streamed", [True, False], ids=["stream", "no-stream"])
def test_a_waiter_behind_another_does_not_spin_on_an_ended_lease(streamed: bool) -> None:
    """A crashed holder's lease has ended and a waiter ahead (maybe dead) keeps its place:
    trying again one millisecond after a lease end that has passed would spin."""
    info = _info(remaining=-5.0, position=1)
    since = 0.0 if streamed else None
    attempt = 0
    delays = []
    for _ in range(12):
        delay, attempt = _next_delay(info, since, 1.0, attempt, shared=False)
        delays.append(delay)
    assert min(delays[-4:]) >= 0.25, delays  # a few attempts a second at most


def test_a_waiter_sleeps_until_a_running_lease_ends() -> None:
    delay, _ = _next_delay(_info(remaining=7.0, position=0), 0.0, 1.0, 0, shared=False)
    assert 6.5 <= delay <= 7.1
