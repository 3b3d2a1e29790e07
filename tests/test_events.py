"""The in-process lock events, against the real replica set: what observers are told."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from pymongo import MongoClient

from django_mongolock import (
    Lock,
    LockLost,
    LockManager,
    LockNotAcquired,
    clock,
    events,
    reasons,
    stats,
)
from django_mongolock.notices import get_notices
from django_mongolock.refresher import get_refresher
from django_mongolock.testing import MongoReplicaSet
from tests.receivers import End, ending_when_acquired
from tests.validators import refusing
from tests.waiting import Waiter


@pytest.fixture
def seen(only_listener: None) -> Iterator[list[events.Event]]:
    got: list[events.Event] = []
    unsubscribe = events.subscribe(got.append)
    yield got
    unsubscribe()


def _of(seen: list[events.Event], kind: type[events.Event]) -> list[events.Event]:
    return [e for e in seen if isinstance(e, kind)]


def _losses(seen: list[events.Event], lock: object) -> list[events.Lost]:
    """This test's lock's losses only: a lock an earlier test left to a closed manager
    may be told lost during this test's tick."""
    return [e for e in seen if isinstance(e, events.Lost) and e.lock is lock]


def _wait_for_loss(seen: list[events.Event], lock: object) -> None:
    """The deadline watch sets ``lost`` first, then posts the notices (and the event)."""
    pause = threading.Event()
    for _ in range(250):  # 5 s at most
        if _losses(seen, lock) or pause.wait(0.02):
            return


def test_acquire_and_release_are_told(manager: LockManager, seen: list[events.Event]) -> None:
    waiting = events.waiting_count()  # a waiter of an earlier test may still be waiting
    lock = manager.acquire("ev-job", ttl=10)
    assert events.held_count() == 1  # only_listener: no lock of an earlier test counts
    assert lock.release()
    mine = [e for e in seen if getattr(e, "lock", None) is lock]
    acquired, released = mine
    assert isinstance(acquired, events.AcquireFinished)
    assert (acquired.key, acquired.owner, acquired.token, acquired.outcome) == (
        "ev-job",
        lock.owner,
        lock.token,
        "acquired",
    )
    assert acquired.lock is lock
    assert acquired.source is manager
    assert acquired.waited > 0
    assert isinstance(released, events.Released)
    assert released.lock is lock
    assert released.held
    assert released.held_for is not None
    assert released.held_for >= 0
    assert events.held_count() == 0
    assert events.waiting_count() == waiting


def test_busy_and_timeout_outcomes(
    manager: LockManager, other: LockManager, seen: list[events.Event]
) -> None:
    holder = manager.acquire("ev-busy", ttl=30)
    with pytest.raises(LockNotAcquired):
        other.acquire("ev-busy", blocking=False)
    with pytest.raises(LockNotAcquired):
        other.acquire("ev-busy", timeout=0.2)
    # This test's calls only: an election or a waiter of another test may be told too.
    finished = [
        e
        for e in _of(seen, events.AcquireFinished)
        if isinstance(e, events.AcquireFinished) and e.key == "ev-busy"
    ]
    assert [e.outcome for e in finished] == ["acquired", "busy", "timeout"]
    assert finished[2].waited >= 0.2
    assert finished[1].token is None
    assert finished[1].lock is None
    assert isinstance(finished[2].error, LockNotAcquired)
    holder.release()


def test_only_an_acquisition_that_found_the_key_taken_is_contended(
    fail_points: MongoReplicaSet,
    hang: Any,
    manager: LockManager,
    other: LockManager,
    seen: list[events.Event],
) -> None:
    """A round trip the server holds up 300 ms is no wait, and the statistics do not
    count it as one (on a loaded machine a majority write alone can take that long); an
    acquisition that found the key taken waited, however soon it was handed the key."""
    client: MongoClient[Any] = MongoClient(
        fail_points.url, appname="ev-slow", w="majority", tz_aware=True, timeoutMS=10_000
    )
    slow = LockManager(client=client, database="ev_slow")
    try:
        hang("ev-slow", ms=300, times=1)
        slow.acquire("ev-slow", ttl=10).release()
        holder = other.acquire("ev-contended", ttl=30)
        waiter = Waiter(other, manager, "ev-contended", timeout=20)
        time.sleep(0.2)
        holder.release()
        waiter.join()
        with pytest.raises(LockNotAcquired), other.acquire("ev-contended", ttl=30):
            manager.acquire("ev-contended", timeout=0.1)
    finally:
        client.drop_database("ev_slow")
        slow.close()
        client.close()
    finished = [e for e in seen if isinstance(e, events.AcquireFinished)]
    [uncontended] = [e for e in finished if e.key == "ev-slow"]
    assert uncontended.waited >= 0.3
    assert not uncontended.contended
    mine = [e for e in finished if e.key == "ev-contended" and e.source is manager]
    assert [(e.outcome, e.contended) for e in mine] == [("acquired", True), ("timeout", True)]
    recorder = stats.Recorder()
    for event in finished:
        stats.observe(event, recorder)
    [[(_, slow_counts)], [(_, counts)]] = [
        list(recorder.take(source).items()) for source in (slow, manager)
    ]
    assert slow_counts.counts == {"acquired": 1}
    assert slow_counts.wait_max_ms == 0
    assert counts.counts["acquired"] == counts.counts["waited"] == 1
    assert counts.counts["timeouts"] == 1
    assert counts.wait_max_ms >= 150


@pytest.mark.parametrize("waited_first", [False, True], ids=["free", "after-waiting"])
@pytest.mark.parametrize("refusal", ["timeout", "busy"])
def test_a_receivers_own_refusal_is_told_as_its_error(
    manager: LockManager,
    other: LockManager,
    seen: list[events.Event],
    refusal: str,
    waited_first: bool,
) -> None:
    """A ``lock_acquired`` receiver whose own acquisition of another key is refused fails
    the acquisition it was told of (the key is given back), whether that one took its
    key at once or after waiting: it ended in an error, not a refusal of its own."""
    from django_mongolock.signals import lock_acquired

    blocker = other.acquire("ev-receiver-blocked", ttl=30)
    wait = 0.2 if refusal == "timeout" else 0

    def receiver(sender: object, lock: Lock, **kwargs: object) -> None:
        if lock.key == "ev-receiver":
            manager.acquire("ev-receiver-blocked", timeout=wait)

    # Taken before the receiver listens, which would fail this acquisition too.
    holder = other.acquire("ev-receiver", ttl=30) if waited_first else None
    lock_acquired.connect(receiver)
    try:
        if holder is not None:
            waiter = Waiter(other, manager, "ev-receiver", timeout=20)
            holder.release()
            error = waiter.error(30)
        else:
            with pytest.raises(LockNotAcquired) as raised:
                manager.acquire("ev-receiver", ttl=30)
            error = raised.value
    finally:
        lock_acquired.disconnect(receiver)
        blocker.release()
    assert isinstance(error, LockNotAcquired)
    assert error.key == "ev-receiver-blocked"
    assert manager.status("ev-receiver") is None  # given back
    finished = {
        e.key: e
        for e in seen
        if isinstance(e, events.AcquireFinished)
        and e.key.startswith("ev-receiver")
        and e.source is manager
    }
    inner, outer = finished["ev-receiver-blocked"], finished["ev-receiver"]
    assert inner.outcome == refusal
    assert (outer.outcome, outer.contended, outer.error) == ("error", waited_first, error)
    recorder = stats.Recorder()
    stats.observe(outer, recorder)
    [(_, counts)] = list(recorder.take(manager).items())
    assert counts.counts == {"errors": 1}


def test_async_acquire_is_told(manager: LockManager, seen: list[events.Event]) -> None:
    async def main() -> None:
        lock = await manager.aacquire("ev-async", ttl=10)
        await lock.arelease()

    asyncio.run(main())
    kinds = [type(e).__name__ for e in seen if not isinstance(e, events.RefresherTick)]
    assert kinds == ["AcquireFinished", "Released"]


def test_force_release_is_a_loss_with_its_reason(
    manager: LockManager,
    other: LockManager,
    seen: list[events.Event],
    caplog: pytest.LogCaptureFixture,
) -> None:
    lock = manager.acquire("ev-forced", ttl=30)
    assert other.force_release("ev-forced") is not None
    with caplog.at_level(logging.WARNING, "django_mongolock.lock"), pytest.raises(LockLost):
        lock.refresh()
    assert get_notices().drain(5.0)  # losses are told on a notice worker
    (loss,) = _losses(seen, lock)
    assert isinstance(loss, events.Lost)
    assert loss.reason == "force-released"
    assert loss.lock is lock
    assert loss.held_for is not None
    (record,) = [
        r
        for r in caplog.records
        if r.name == "django_mongolock.lock" and r.__dict__.get("key") == "ev-forced"
    ]
    assert record.__dict__["token"] == lock.token
    assert record.__dict__["reason"] == "force-released"
    assert not lock.release()
    assert events.held_count() == 0


def _assert_counted_as_one_loss(manager: LockManager, mine: list[events.Event]) -> None:
    """The statistics of one lock's events: one acquisition, one loss, no release."""
    recorder = stats.Recorder()
    for event in mine:
        stats.observe(event, recorder)
    [(_, counts)] = list(recorder.take(manager).items())
    assert counts.counts == {"acquired": 1, "lost": 1}
    assert events.held_count() == 0


@pytest.mark.parametrize("learnt_by", ["refresh", "release"])
def test_a_release_that_found_its_lease_ended_counts_as_the_loss_only(
    manager: LockManager, other: LockManager, seen: list[events.Event], learnt_by: str
) -> None:
    """Whether the holder learns of the loss from a refresh or from its release, the
    statistics count one loss, and neither a release nor its hold time."""
    lock = manager.acquire("ev-forced-stats", ttl=30)
    assert other.force_release("ev-forced-stats") is not None
    if learnt_by == "refresh":
        with pytest.raises(LockLost):
            lock.refresh()
        assert get_notices().drain(5.0)  # the loss told before the release
    assert not lock.release()
    assert get_notices().drain(5.0)
    mine = [e for e in seen if getattr(e, "lock", None) is lock]
    assert [type(e) for e in mine] == [
        events.AcquireFinished,
        *(
            [events.Lost, events.Released]
            if learnt_by == "refresh"
            else [events.Released, events.Lost]
        ),
    ]
    _assert_counted_as_one_loss(manager, mine)


def test_a_release_after_the_lease_lapsed_here_counts_as_the_loss_only(
    manager: LockManager, seen: list[events.Event], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lease over by this process's clock (its margin) while the server still has it:
    the release frees it, and the observers are told of one loss and no release."""
    monkeypatch.setattr(clock, "margin", lambda ttl: ttl / 2)
    lock = manager.acquire("ev-lapsed-here", ttl=4, refresh=False)
    assert lock.lost.wait(10)
    assert lock.release()  # the server's lease ran 2 s longer
    assert get_notices().drain(5.0)
    mine = [e for e in seen if getattr(e, "lock", None) is lock]
    [released] = [e for e in mine if isinstance(e, events.Released)]
    assert not released.held
    [loss] = [e for e in mine if isinstance(e, events.Lost)]
    assert loss.reason == "expired"
    _assert_counted_as_one_loss(manager, mine)


@pytest.mark.parametrize("end", ["lost", "released"])
def test_a_lock_ended_before_its_acquisition_was_told_is_not_counted_held(
    manager: LockManager, other: LockManager, seen: list[events.Event], end: End
) -> None:
    """A ``lock_acquired`` receiver that releases the lock, or during which it is lost,
    runs before the acquisition is told: the lock must not stay counted as held."""
    with ending_when_acquired(other, "ev-early", end):
        lock = manager.acquire("ev-early", ttl=30)
    assert events.held_count() == 0
    assert not lock.release()
    assert events.held_count() == 0


def test_lapsed_lease_is_expired(manager: LockManager, seen: list[events.Event]) -> None:
    lock = manager.acquire("ev-lapse", ttl=0.3, refresh=False)
    assert lock.lost.wait(5)
    _wait_for_loss(seen, lock)
    (loss,) = _losses(seen, lock)
    assert isinstance(loss, events.Lost)
    assert loss.reason == "expired"


def test_refresher_tick_is_told(manager: LockManager, seen: list[events.Event]) -> None:
    lock = manager.acquire("ev-tick", ttl=10)
    get_refresher().tick()
    assert get_notices().drain(5.0)  # ticks are told on a notice worker
    # This manager's: the ticks of other lanes may be told after it, on other workers.
    ticks = [e for e in seen if isinstance(e, events.RefresherTick) and e.source is manager]
    assert ticks
    assert ticks[-1].ok
    assert ticks[-1].leases >= 1
    assert ticks[-1].duration >= 0
    lock.release()


def test_a_failing_observer_stops_nothing(manager: LockManager, seen: list[events.Event]) -> None:
    def broken(event: events.Event) -> None:
        raise RuntimeError("observer bug")

    unsubscribe = events.subscribe(broken)
    try:
        with manager.acquire("ev-broken", ttl=10) as lock:
            assert lock.valid
    finally:
        unsubscribe()
    assert [type(e).__name__ for e in seen if not isinstance(e, events.RefresherTick)] == [
        "AcquireFinished",
        "Released",
    ]


def test_nobody_listening_is_told_nothing(manager: LockManager) -> None:
    got: list[events.Event] = []
    events.subscribe(got.append)()
    manager.acquire("ev-quiet", ttl=10).release()
    assert got == []
    with pytest.raises(TypeError):
        events.subscribe("not callable")  # type: ignore[arg-type]


def test_a_closed_manager_loses_with_refresh_failed(
    mongolock_url: str, manager: LockManager, seen: list[events.Event]
) -> None:
    closing = LockManager(mongolock_url, database=manager.database, collection=manager.collection)
    lock = closing.acquire("ev-closed", ttl=10)
    closing.close()
    get_refresher().tick()  # the lane finds its manager closed
    assert lock.lost.is_set()
    assert get_notices().drain(5.0)
    (loss,) = _losses(seen, lock)
    assert isinstance(loss, events.Lost)
    assert loss.reason == "refresh-failed"


def test_a_refresh_the_server_refuses_loses_with_refresh_failed(
    mongolock_url: str, manager: LockManager, seen: list[events.Event]
) -> None:
    lock = manager.acquire("ev-refused", ttl=1.5)
    # The server answers the refresh with an error (a document validation failure).
    with refusing(mongolock_url, manager, "ev-refused"):
        assert lock.lost.wait(5)
        _wait_for_loss(seen, lock)
    (loss,) = _losses(seen, lock)
    assert loss.reason == "refresh-failed"
    assert any(
        isinstance(e, events.RefresherTick) and e.source is manager and not e.ok for e in seen
    )
    assert reasons.refused(manager)


def _partial_ticks(
    monkeypatch: pytest.MonkeyPatch, manager: LockManager
) -> list[tuple[bool, bool]]:
    """(refusal, partial) of every tick the manager's lane reports, as it reports it."""
    told: list[tuple[bool, bool]] = []
    tick = events.tick

    def spy(source: object, *args: Any, refusal: bool = False, partial: bool = False) -> None:
        if source is manager:
            told.append((refusal, partial))
        tick(source, *args, refusal=refusal, partial=partial)

    monkeypatch.setattr(events, "tick", spy)
    return told


def _only_its_own_lost(
    seen: list[events.Event], bad: Lock, kept: list[Lock], told: list[tuple[bool, bool]]
) -> None:
    """The refused lease was lost as a refresh failure and no other lease was lost; the
    lane told of a partial refusal, never of the manager's (which every later loss of its
    leases would read as a refresh failure)."""
    (loss,) = _losses(seen, bad)
    assert loss.reason == "refresh-failed"
    assert all(not _losses(seen, lock) for lock in kept)
    assert (False, True) in told
    assert all(not refusal for refusal, _ in told)


def test_a_refused_document_costs_only_its_own_lease(
    mongolock_url: str,
    manager: LockManager,
    seen: list[events.Event],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A document the server refuses to update stops the manager's bulk refresh there;
    the lane writes the leases again one by one, so the others are kept, shared ones too."""
    told = _partial_ticks(monkeypatch, manager)
    bad = manager.acquire("ev-refused-one", ttl=1.5)
    # Keys on both sides of the refused one: update_many stops at the first refusal.
    # Kept leases of 3 s: a tick that writes 2 or 3 times in a row must fit a loaded machine.
    kept = [manager.acquire(f"ev-{side}-{n}", ttl=3.0) for side in ("a", "z") for n in range(3)]
    kept.append(manager.acquire("ev-shared", ttl=3.0, shared=True, limit=2))
    try:
        with refusing(mongolock_url, manager, "ev-refused-one"):
            assert bad.lost.wait(5)
            _wait_for_loss(seen, bad)
            # Longer than the kept leases' own ttl: only the refresher kept them alive.
            assert not threading.Event().wait(3.2)
            assert [lock.valid for lock in kept] == [True] * len(kept)
            kept[0].refresh()
            kept[-1].refresh()
    finally:
        for lock in kept:
            lock.release()
    _only_its_own_lost(seen, bad, kept, told)
    ticks = [e for e in seen if isinstance(e, events.RefresherTick) and e.source is manager]
    assert any(not tick.ok for tick in ticks)  # a partial refusal is a failed tick


def test_a_refused_shared_document_costs_only_its_own_lease(
    mongolock_url: str,
    manager: LockManager,
    seen: list[events.Event],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The shared leases' write refused, the exclusive ones' stands (and is not sent
    again): the refused shared lease lapses, the other leases are kept."""
    told = _partial_ticks(monkeypatch, manager)
    store = manager.store
    written_again: list[bool] = []
    each = store.refresh_each

    def spy(held: Any, *, shared: bool = False) -> Any:
        written_again.append(shared)
        return each(held, shared=shared)

    monkeypatch.setattr(store, "refresh_each", spy)
    bad = manager.acquire("ev-shared-refused", ttl=1.5, shared=True, limit=2)
    kept = [manager.acquire(f"ev-x-{n}", ttl=3.0) for n in range(3)]
    kept.append(manager.acquire("ev-shared-kept", ttl=3.0, shared=True, limit=2))
    try:
        with refusing(mongolock_url, manager, "ev-shared-refused"):
            assert bad.lost.wait(5)
            _wait_for_loss(seen, bad)
            assert not threading.Event().wait(3.2)  # past the kept leases' own ttl
            assert [lock.valid for lock in kept] == [True] * len(kept)
            assert written_again
            assert all(written_again)  # the shared leases only
    finally:
        for lock in kept:
            lock.release()
    _only_its_own_lost(seen, bad, kept, told)


def test_a_lease_that_lapses_while_the_server_is_unreachable(
    manager: LockManager, seen: list[events.Event]
) -> None:
    lock = manager.acquire("ev-unreachable", ttl=1.0, refresh=False)
    # What the manager's lane reports when its refresh write does not get through.
    events.tick(manager, 0.0, 0.0, 1, 0.1, ok=False)
    try:
        assert lock.lost.wait(5)
        _wait_for_loss(seen, lock)
    finally:
        events.tick(manager, 0.0, 0.0, 1, 0.1, ok=True)
    (loss,) = _losses(seen, lock)
    assert isinstance(loss, events.Lost)
    assert loss.reason == "server-unreachable"


def test_an_observer_that_blocks_on_ticks_holds_up_no_refresh(manager: LockManager) -> None:
    """Ticks are told on a notice worker: the lane goes on refreshing meanwhile."""
    release = threading.Event()

    def stuck(event: events.Event) -> None:
        if isinstance(event, events.RefresherTick):
            release.wait(10)

    unsubscribe = events.subscribe(stuck)
    try:
        lock = manager.acquire("ev-stuck-tick", ttl=3.0)
        assert not lock.lost.wait(6.0)  # two leases long: kept alive by the lane
        assert lock.valid
        lock.release()
    finally:
        release.set()
        unsubscribe()


def test_an_observer_that_blocks_on_a_loss_holds_up_no_other_loss(
    manager: LockManager, no_leftovers: None
) -> None:
    """Losses are told on a notice worker: the deadline watch marks the next lease lost on
    time while an observer of the first loss is stuck."""
    release = threading.Event()
    stuck_in: list[str] = []

    def stuck(event: events.Event) -> None:
        if isinstance(event, events.Lost) and event.lock.key.startswith("ev-stuck-"):
            stuck_in.append(event.lock.key)
            release.wait(10)

    unsubscribe = events.subscribe(stuck)
    try:
        first = manager.acquire("ev-stuck-a", ttl=0.5, refresh=False)
        second = manager.acquire("ev-stuck-b", ttl=1.5, refresh=False)
        assert first.lost.wait(5)
        deadline = second.deadline
        assert second.lost.wait(5)
        # By its own deadline, not after the observer's 10 s (a loaded machine's thread
        # switches are allowed for).
        assert clock.now() - deadline < 3.0
        # The first loss's observer runs on a notice worker: wait (bounded) for it.
        until = time.monotonic() + 5
        while "ev-stuck-a" not in stuck_in and time.monotonic() < until:
            time.sleep(0.01)
        assert "ev-stuck-a" in stuck_in
    finally:
        release.set()
        unsubscribe()


def test_only_a_lease_in_an_unanswered_refresh_sent_before_its_end_lacked_a_server() -> None:
    """A loss reads "server-unreachable" for a lease whose refresh, sent before its end,
    had no answer yet; another lease of the same manager (one taken with refresh=False)
    or a refresh sent after the end (a stalled lane) leave it "expired"."""
    source = LockManager.__new__(LockManager)  # weakly referenceable; no I/O here
    waited, other = object(), object()
    now = clock.now()
    reasons.sent(source, now - 1.0, [waited])
    try:
        assert events._reason(source, waited, reasons.LAPSED, now) == "server-unreachable"
        assert events._reason(source, other, reasons.LAPSED, now) == "expired"
        assert events._reason(source, waited, reasons.LAPSED, now - 2.0) == "expired"
    finally:
        reasons.answered(source, ok=True)
    assert events._reason(source, waited, reasons.LAPSED, now) == "expired"
    reasons.answered(source, ok=False)  # the server could not be reached
    try:
        assert events._reason(source, other, reasons.LAPSED, now) == "server-unreachable"
    finally:
        reasons.answered(source, ok=True)


def test_a_refused_refresh_reads_refresh_failed_only_for_leases_the_refresher_keeps() -> None:
    """After a refusal, a kept lease's loss reads "refresh-failed" and a refresh=False
    lease's "expired"; an unreachable server then, and a good answer after it, undo it."""
    source = LockManager.__new__(LockManager)  # weakly referenceable; no I/O here
    kept, unkept = SimpleNamespace(refreshable=True), SimpleNamespace(refreshable=False)
    now = clock.now()
    reasons.answered(source, ok=False, refused=True)
    try:
        assert reasons.refused(source)
        assert events._reason(source, kept, reasons.LAPSED, now) == "refresh-failed"
        assert events._reason(source, unkept, reasons.LAPSED, now) == "expired"
        reasons.answered(source, ok=False)  # then the server could not be reached
        assert not reasons.refused(source)
        assert events._reason(source, kept, reasons.LAPSED, now) == "server-unreachable"
        reasons.answered(source, ok=False, refused=True)
        reasons.answered(source, ok=True)
        assert not reasons.refused(source)
        assert events._reason(source, kept, reasons.LAPSED, now) == "expired"
    finally:
        reasons.answered(source, ok=True)


def test_a_lease_refused_once_and_extended_since_loses_the_mark() -> None:
    class Lease:
        pass

    kept, still = Lease(), Lease()
    reasons.refused_leases([kept, still])
    try:
        assert reasons.lease_refused(kept)
        reasons.accepted([kept, still], refused=[still])
        assert not reasons.lease_refused(kept)
        assert reasons.lease_refused(still)
    finally:
        reasons.accepted([kept, still])
    assert not reasons.lease_refused(still)
