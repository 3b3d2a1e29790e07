"""Wake-ups of local waiters: counted, cheap until somebody sleeps, never lost."""

from __future__ import annotations

import threading
import time

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
