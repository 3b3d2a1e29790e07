"""The holder knows first: loss notices by the holder's own bound of its lease end.

A server that hangs a holder's refresh (the ``failCommand`` fail point blocks that
client's writes, on the session's fail-point replica set: ``fail_points``), user
callbacks that raise, exit or block, and forks while a lock's mutex is held.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import pymongo
import pytest
from pymongo import MongoClient, monitoring

from django_mongolock import (
    Lock,
    LockLost,
    LockManager,
    LockNotAcquired,
    MongoLockError,
    ServerUnavailable,
    clock,
)
from django_mongolock import refresher as refreshing
from django_mongolock.deadlines import Deadlines
from django_mongolock.notices import EAGER, Notices
from django_mongolock.recipes.election import Election
from django_mongolock.recipes.group import LockGroup
from django_mongolock.refresher import get_refresher
from django_mongolock.signals import lock_lost, lock_released
from django_mongolock.testing import MongoReplicaSet
from tests.utils import NamedManager
from tests.validators import refusing
from tests.waiting import in_line


def _manager(fail_points: MongoReplicaSet, database: str, app: str) -> LockManager:
    client: MongoClient[Any] = MongoClient(
        fail_points.url, appname=app, w="majority", tz_aware=True, timeoutMS=10_000
    )
    return LockManager(client=client, database=database)


def _close(*managers: LockManager) -> None:
    """Close the managers and the clients they were given."""
    for manager in managers:
        client = manager.client
        manager.close()
        client.close()


@contextlib.contextmanager
def _given(fail_points: MongoReplicaSet, app: str, **options: Any) -> Iterator[LockManager]:
    """A manager on a client of its own named ``app`` (built with ``options``), its
    limit 1.5 s, on a database of its own that is dropped after."""
    client: MongoClient[Any] = MongoClient(fail_points.url, appname=app, **options)
    manager = LockManager(client=client, database=app.replace("-", "_"))
    try:
        assert manager.store.timeout == 1.5
        yield manager
    finally:
        manager.client.drop_database(manager.database)
        _close(manager)


class Timeline:
    """When each notice of one lock arrived, on ``clock.now()``'s scale."""

    def __init__(self, lock: Lock) -> None:
        self.lock = lock
        self.at: dict[str, float] = {}
        self.done = threading.Event()
        lock.on_lost = lambda _: self._seen("on_lost")
        threading.Thread(target=self._wait_for_event, daemon=True).start()

    def _wait_for_event(self) -> None:
        if self.lock.lost.wait(30):
            self._seen("event")

    def _seen(self, what: str) -> None:
        self.at.setdefault(what, clock.now())
        if len(self.at) >= 3:
            self.done.set()

    def signal(self, sender: Any, lock: Lock, **kwargs: Any) -> None:
        if lock is self.lock:
            self._seen("signal")


def test_a_hung_refresh_does_not_delay_the_loss_notices(
    fail_points: MongoReplicaSet, hang: Any, request: pytest.FixtureRequest
) -> None:
    database = f"hung_{request.node.name[-20:]}"
    holder = _manager(fail_points, database, "hung-holder")
    contender = _manager(fail_points, database, "contender")
    try:
        lock = holder.acquire("report", ttl=1.5)
        timeline = Timeline(lock)
        lock_lost.connect(timeline.signal, weak=False)
        try:
            hang("hung-holder")
            taken = contender.acquire("report", timeout=20)
            taken_at = clock.now()
            assert timeline.done.wait(10), timeline.at
        finally:
            lock_lost.disconnect(timeline.signal)
        # Every notice came before another process held the key, none before the bound.
        assert set(timeline.at) == {"event", "signal", "on_lost"}
        for what, at in timeline.at.items():
            assert lock.deadline <= at < taken_at, (what, at, lock.deadline, taken_at)
        assert taken.token > lock.token
        # Healed: the old holder never acts as holder again.
        server_admin: MongoClient[dict[str, Any]] = MongoClient(fail_points.nodes[0].direct_url)
        server_admin.admin.command("configureFailPoint", "failCommand", mode="off")
        server_admin.close()
        assert not lock.valid
        with pytest.raises(LockLost):
            lock.refresh()
        assert not lock.release()
        status = contender.status("report")
        assert status is not None
        assert (status.owner, status.live) == (taken.owner, True)
        taken.release()
    finally:
        holder.client.drop_database(database)
        _close(holder, contender)


def test_a_hung_server_connection_does_not_lapse_another_managers_locks(
    fail_points: MongoReplicaSet, hang: Any, manager: LockManager
) -> None:
    database = "hung_isolated"
    hung = _manager(fail_points, database, "hung-one")
    try:
        doomed = hung.acquire("doomed", ttl=1.0)
        kept = manager.acquire("kept-elsewhere", ttl=2.0)
        hang("hung-one")
        until = clock.now() + 6.5  # more than three leases of the kept lock
        while clock.now() < until:
            assert kept.valid
            time.sleep(0.05)
        assert doomed.lost.is_set()
        status = manager.status("kept-elsewhere")
        assert status is not None
        assert (status.owner, status.live) == (kept.owner, True)
        assert kept.release()
    finally:
        hung.client.drop_database(database)
        _close(hung)


def test_callbacks_that_raise_exit_or_block_stop_no_other_notice(
    manager: LockManager, other: LockManager
) -> None:
    signalled: list[str] = []
    called: list[str] = []
    release_blocker = threading.Event()

    def record(sender: Any, lock: Lock, **kwargs: Any) -> None:
        if lock.key.startswith("cb-"):  # not a lock an earlier test left to a closed manager
            signalled.append(lock.key)

    def misbehave(sender: Any, lock: Lock, **kwargs: Any) -> None:
        if lock.key == "cb-raises":
            raise RuntimeError("receiver failed")
        if lock.key == "cb-exits":
            sys.exit(3)

    def on_lost(lock: Lock) -> None:
        called.append(lock.key)
        if lock.key == "cb-blocks":
            release_blocker.wait(30)

    lock_lost.connect(misbehave, weak=False)
    lock_lost.connect(record, weak=False)
    try:
        blocks = manager.acquire("cb-blocks", ttl=0.6, on_lost=on_lost)
        locks = [blocks] + [
            manager.acquire(key, ttl=0.6, on_lost=on_lost) for key in ("cb-raises", "cb-exits")
        ]
        # 2 s: the refresher's ticks have room for a stalled thread or server.
        kept = manager.acquire("cb-kept", ttl=2.0)
        # The first notice blocks forever in its callback; the others must still come.
        other.force_release("cb-blocks")
        assert blocks.lost.wait(5)
        for key in ("cb-raises", "cb-exits"):
            other.force_release(key)
        for lock in locks:
            assert lock.lost.wait(5), lock
        # on_lost and each lock_lost receiver are notices of their own: wait for all.
        deadline = clock.now() + 5
        while (len(called) < 3 or len(signalled) < 3) and clock.now() < deadline:
            time.sleep(0.02)
        assert sorted(called) == ["cb-blocks", "cb-exits", "cb-raises"]
        assert sorted(signalled) == ["cb-blocks", "cb-exits", "cb-raises"]
        # The refresher lives on: a fourth lock outlives two of its leases.
        until = clock.now() + 4.5
        while clock.now() < until:
            assert kept.valid
            time.sleep(0.05)
        assert kept.release()
    finally:
        release_blocker.set()
        lock_lost.disconnect(misbehave)
        lock_lost.disconnect(record)


def test_an_exit_inside_a_campaign_does_not_end_the_refresher(manager: LockManager) -> None:
    from django_mongolock.signals import lock_acquired

    def exit_on_election(sender: Any, lock: Lock, **kwargs: Any) -> None:
        if lock.key == "exit-election":
            sys.exit(4)

    kept = manager.acquire("exit-kept", ttl=2.0)  # room for a stalled thread or server
    lock_acquired.connect(exit_on_election, weak=False)
    election = manager.elect("exit-election", ttl=0.6)
    try:
        until = clock.now() + 4.5  # more than two leases
        while clock.now() < until:
            assert kept.valid
            time.sleep(0.05)
        lane = get_refresher().lane_of(manager)
        assert lane is not None
        assert lane.running
    finally:
        lock_acquired.disconnect(exit_on_election)
        election.stop()
        kept.release()


def test_a_blocked_notice_gets_another_worker() -> None:
    notices = Notices()
    blocker = threading.Event()
    quick = threading.Event()
    notices.post(lambda: blocker.wait(30))
    notices.post(quick.set)
    try:
        # Nothing supervises this private runner: do what the deadline watch does.
        deadline = clock.now() + 5
        while not quick.is_set() and clock.now() < deadline:
            notices.supervise(clock.now())
            time.sleep(0.02)
        assert quick.is_set()
        assert notices.started == 2
    finally:
        blocker.set()
    assert notices.drain(5)


def test_many_losses_at_once_use_few_threads() -> None:
    notices = Notices()
    ran: list[int] = []
    for i in range(500):
        notices.post(lambda i=i: ran.append(i))  # type: ignore[misc]
    assert notices.drain(10)
    assert sorted(ran) == list(range(500))
    assert notices.started <= EAGER


class _Due:
    """A lease for the watch alone: what it marks and announces goes to ``log``."""

    def __init__(self, number: int, deadline: float, log: list[tuple[str, int]]) -> None:
        self.number, self.deadline, self.log = number, deadline, log
        self.marked = False

    @property
    def over(self) -> bool:
        return self.marked

    def lapse(self, now: float) -> bool:
        if self.marked or now < self.deadline:
            return False
        self.marked = True
        self.log.append(("mark", self.number))
        return True

    def announce_lapse(self) -> None:
        self.log.append(("announce", self.number))


def test_a_mass_loss_marks_every_lease_before_any_notice_goes_out() -> None:
    """Leases that end together: the last is marked lost as soon as the first, not
    after the others' notices (a log line and signal calls each)."""
    log: list[tuple[str, int]] = []
    deadlines = Deadlines()
    at = clock.now() + 1.0
    leases = [_Due(n, at, log) for n in range(2000)]
    try:
        for lease in leases:
            deadlines.watch(lease)
        assert clock.now() < at, "the leases were not all watched before they ended"
        ends = time.monotonic() + 30
        while len(log) < 2 * len(leases) and time.monotonic() < ends:
            time.sleep(0.01)
    finally:
        deadlines.stop()
    assert len(log) == 2 * len(leases)
    kinds = [kind for kind, _ in log]
    assert kinds == ["mark"] * len(leases) + ["announce"] * len(leases)


def test_a_lock_that_is_not_refreshed_is_announced_lost_at_its_deadline(
    manager: LockManager, other: LockManager
) -> None:
    lock = manager.acquire("unkept", ttl=0.8, refresh=False)
    assert lock.lost.wait(5)
    noticed = clock.now()
    assert noticed >= lock.deadline
    assert not lock.valid
    taken = other.acquire("unkept", timeout=5)
    assert taken.token > lock.token
    taken.release()


def _child_uses_a_lock_whose_mutex_was_held(lock: Lock, queue: Any) -> None:
    manager = cast(LockManager, lock.backend)
    own = manager.acquire("forked-child-own", ttl=5, blocking=False)
    queue.put(
        {
            "valid": lock.valid,
            "lost": lock.lost.is_set(),
            "released": lock.release(),
            "refresher": len(get_refresher()) - 1,
            "own": own.token > lock.token and own.release(),
            "pid": os.getpid(),
        }
    )


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_fork_while_lock_and_manager_mutexes_are_held_does_not_deadlock_the_child(
    manager: LockManager,
) -> None:
    lock = manager.acquire("forked-mutex", ttl=5)
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    # As the refresher, a notice worker or another acquiring thread may hold them at the fork.
    with lock._mutex, manager._connection._build_mutex, manager._connection._astores_mutex:
        child = context.Process(target=_child_uses_a_lock_whose_mutex_was_held, args=(lock, queue))
        child.start()
    try:
        result = queue.get(timeout=30)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
    assert result == {
        "valid": False,
        "lost": True,
        "released": False,
        "refresher": 0,
        "own": True,
        "pid": result["pid"],
    }
    assert result["pid"] != os.getpid()
    assert lock.valid
    assert lock.release()


def test_the_clock_keeps_counting_through_suspend_where_it_can() -> None:
    if sys.platform.startswith("linux"):
        assert clock.now is clock._boottime
        assert abs(clock.now() - time.clock_gettime(time.CLOCK_BOOTTIME)) < 1.0
    assert clock.margin(3.0) == pytest.approx(0.25)
    assert clock.margin(30.0) == pytest.approx(0.3)
    assert clock.margin(60.0) == pytest.approx(0.6)
    assert clock.margin(0.4) == pytest.approx(0.1)


def test_a_refresh_to_a_shorter_lease_counts_before_its_answer(
    fail_points: MongoReplicaSet, hang: Any
) -> None:
    """The server may apply a shorter lease whose answer never comes: count with it."""
    holder = _manager(fail_points, "shorter", "shortening")
    try:
        lock = holder.acquire("shorter", ttl=30)
        hang("shortening")
        sent = clock.now()
        with pytest.raises(MongoLockError), pymongo.timeout(0.3):
            lock.refresh(ttl=1.0)
        assert lock.ttl == 1.0
        assert lock.deadline <= sent + 1.0
        assert lock.lost.wait(5)  # by the short lease, not the 30 s one
    finally:
        holder.client.drop_database("shorter")
        _close(holder)


def test_a_shorter_refresh_moves_the_loss_notice_earlier(
    manager: LockManager, other: LockManager
) -> None:
    lock = manager.acquire("shortened", ttl=30, refresh=False)
    lock.refresh(ttl=1.0)
    assert lock.lost.wait(5)
    noticed = clock.now()
    taken = other.acquire("shortened", timeout=10)
    assert noticed < clock.now()
    assert taken.token > lock.token
    taken.release()


def test_a_blocking_receiver_holds_back_neither_on_lost_nor_other_locks(
    manager: LockManager, other: LockManager
) -> None:
    """Twenty leases end together while a lock_lost receiver blocks: each holder's
    on_lost still comes before another client can take its key."""
    release_blocker = threading.Event()
    on_lost_at: dict[str, float] = {}

    def blocks(sender: Any, lock: Lock, **kwargs: Any) -> None:
        release_blocker.wait(30)

    def on_lost(lock: Lock) -> None:
        on_lost_at[lock.key] = clock.now()

    lock_lost.connect(blocks, weak=False)
    try:
        keys = [f"crowd-{i}" for i in range(20)]
        locks = [manager.acquire(key, ttl=1.0, refresh=False, on_lost=on_lost) for key in keys]
        taken_at: dict[str, float] = {}
        for key in keys:
            taken = other.acquire(key, timeout=10)
            taken_at[key] = clock.now()
            taken.release()
        assert all(lock.lost.is_set() for lock in locks)
        assert sorted(on_lost_at) == sorted(keys)
        late = {
            key: taken_at[key] - on_lost_at[key] for key in keys if on_lost_at[key] >= taken_at[key]
        }
        assert late == {}
    finally:
        release_blocker.set()
        lock_lost.disconnect(blocks)


def test_a_blocking_lock_acquired_receiver_does_not_stall_the_refresher(
    manager: LockManager,
) -> None:
    from django_mongolock.signals import lock_acquired

    release_blocker = threading.Event()

    def blocks_for_the_election(sender: Any, lock: Lock, **kwargs: Any) -> None:
        if lock.key == "slow-election":
            release_blocker.wait(30)

    # Leases with room for a late tick on a loaded machine: only a refresher held up by
    # the receiver ends them.
    kept = manager.acquire("slow-kept", ttl=2.0)
    lock_acquired.connect(blocks_for_the_election, weak=False)
    election = manager.elect("slow-election", ttl=3.0)
    try:
        until = clock.now() + 7.0  # more than three leases of the kept lock
        while clock.now() < until:
            assert kept.valid
            time.sleep(0.05)
        assert election.is_leader
    finally:
        release_blocker.set()
        lock_acquired.disconnect(blocks_for_the_election)
        election.stop()
        kept.release()


def test_a_failing_lock_released_receiver_does_not_break_release(
    manager: LockManager,
) -> None:
    def fails(sender: Any, lock: Lock, **kwargs: Any) -> None:
        sys.exit(5)

    group = manager.acquire_group(["rel-a", "rel-b", "rel-c"], ttl=5)
    lone = manager.acquire("rel-lone", ttl=5)
    lock_released.connect(fails, weak=False)
    try:
        assert lone.release()
        group.release()
    finally:
        lock_released.disconnect(fails)
    for key in ("rel-a", "rel-b", "rel-c", "rel-lone"):
        status = manager.status(key)
        assert status is None or not status.live, key


def test_stop_waits_for_a_campaign_under_way(
    fail_points: MongoReplicaSet, hang: Any, manager: LockManager
) -> None:
    """An attempt that wins after stop() gives its lock back before stop() returns."""
    campaigner = _manager(fail_points, "stopwait", "campaigner")
    observer = _manager(fail_points, "stopwait", "observer")
    try:
        hang("campaigner", ms=1500)
        election = campaigner.elect("stop-wait", ttl=30)
        time.sleep(0.5)  # the first attempt is on its way, held by the server
        election.stop()
        # Without waiting, the attempt would win after stop() returned, and hold the key
        # (its give-back held by the server too) while nobody leads.
        until = clock.now() + 3.5
        while clock.now() < until:
            status = observer.status("stop-wait")
            assert status is None or not status.live, status
            time.sleep(0.05)
        assert not election.is_leader
    finally:
        observer.client.drop_database("stopwait")
        _close(campaigner, observer)


@contextlib.contextmanager
def _at_exit(
    fail_points: MongoReplicaSet, monkeypatch: pytest.MonkeyPatch, database: str, app: str
) -> Iterator[tuple[LockManager, LockManager, Callable[[int], None]]]:
    """A refresher of the test's own (the exit stops it for good); a manager named
    ``app``, whose commands the test has the server hold, and another; and a wait for
    the server to hold one more command than the ``held`` it is given."""
    monkeypatch.setattr(refreshing, "_refresher", refreshing.Refresher())
    stuck = _manager(fail_points, database, app)
    other = _manager(fail_points, database, f"{app}-other")
    server_admin: MongoClient[dict[str, Any]] = MongoClient(fail_points.nodes[0].direct_url)

    def entered(held: int) -> None:
        server_admin.admin.command(
            "waitForFailPoint", "failCommand", timesEntered=held + 1, maxTimeMS=20_000
        )

    try:
        yield stuck, other, entered
    finally:
        server_admin.close()
        other.client.drop_database(database)
        _close(stuck, other)


def _exit(hang: Any, app: str, *, wait: bool) -> None:
    """The interpreter's exit hook; with ``wait``, a bounded wait for its lanes' threads
    after it (the process would have ended then). The server holds ``app``'s commands no
    more; every lane's thread has ended."""
    lanes = list(refreshing.get_refresher()._lanes.values())
    assert lanes
    refreshing.shutdown()
    for lane in lanes:
        lane.join(10 if wait else 0)
    alive = [lane for lane in lanes if lane._thread and lane._thread.is_alive()]
    hang(app, ms=0, times=0)
    assert not alive


def _assert_not_led(observer: LockManager, election: Election) -> None:
    status = observer.status(election.key)
    assert status is None or not status.live, status
    assert not election.is_leader


def test_exit_leaves_the_releases_half_its_time_when_a_lane_is_stuck(
    fail_points: MongoReplicaSet, hang: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server holds every write 0.7 s; exit comes as a tick starts its three (the
    exclusive and the shared refresh, the heartbeat: 2.1 s). The lane's stop takes half
    the exit's 2 s, and the release, with the other half, frees the lock. Waiting for the
    whole tick would leave it 0.2 s: it would time out, and the lock stay held."""
    with _at_exit(fail_points, monkeypatch, "stuckexit", "stuck-lane") as (stuck, other, entered):
        # Referenced: kept by the lane.
        lock = stuck.acquire("stuck-exit", ttl=12)
        _lease = stuck.acquire("stuck-exit-shared", ttl=12, shared=True)
        # The lane's first tick (a third of the ttl in) sends its first refresh, held.
        entered(hang("stuck-lane", ms=700, commands=("update",)))
        _exit(hang, "stuck-lane", wait=True)
        assert other.status("stuck-exit") is None
        assert not lock.release()  # released already, by the exit


def test_a_lane_stuck_at_exit_starts_no_campaign_after_the_releases(
    fail_points: MongoReplicaSet, hang: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server holds the lane's writes 0.7 s as exit comes; the election's key is
    freed meanwhile. The tick under way goes on after the exit's releases: a campaign
    then would win a lease nobody refreshes or releases, held until its ttl runs out."""
    app = "stuck-campaigner"
    with _at_exit(fail_points, monkeypatch, "stuckcampaign", app) as (stuck, other, entered):
        blocker = other.acquire("stuck-elected", ttl=30)
        # Referenced: kept by the lane, whose ticks then refresh it, then campaign.
        kept = stuck.acquire("stuck-kept", ttl=12)
        election = stuck.elect("stuck-elected", ttl=12)
        try:
            # Refreshes and heartbeats are held; an acquire (findAndModify) is not.
            entered(hang(app, ms=700, commands=("update",)))
            assert blocker.release()
            _exit(hang, app, wait=True)
            assert other.status("stuck-kept") is None
            assert not kept.release()  # released already, by the exit
            _assert_not_led(other, election)
        finally:
            election.stop()


def test_a_campaign_under_way_at_exit_gives_back_what_it_wins(
    fail_points: MongoReplicaSet, hang: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server holds the campaign's acquire 1.2 s, past the exit's 1 s wait for the
    lane, and the key is free by then. The exit waits for the lane with the rest of its
    2 s, and the lease the campaign wins is given back before the process would end,
    not left held, unrefreshed, until its ttl runs out (no lane of a stopped refresher
    keeps it)."""
    app = "late-campaigner"
    with _at_exit(fail_points, monkeypatch, "latecampaign", app) as (stuck, other, entered):
        given_back: list[int] = []

        def gives_back(sender: Any, lock: Lock, **kwargs: Any) -> None:
            if lock.key == "late-elected":
                given_back.append(int(lock.token))

        blocker = other.acquire("late-elected", ttl=30)
        election = stuck.elect("late-elected", ttl=6)
        lock_released.connect(gives_back, weak=False)
        try:
            # A campaign the server takes before this finds the key held; the one it
            # holds (the first, or the next tick's 2 s on) finds it free. Only that
            # one: the give-back, a findAndModify too, goes at once.
            held = hang(app, ms=1200, times=1, commands=("findAndModify",))
            assert blocker.release()
            entered(held)
            _exit(hang, app, wait=False)
            _assert_not_led(other, election)
            # It did win, and gave the key back: the lease of a token of its own.
            assert any(token != int(blocker.token) for token in given_back), given_back
        finally:
            lock_released.disconnect(gives_back)
            election.stop()


def test_an_acquire_answered_late_is_bounded_again_by_a_refresh(
    fail_points: MongoReplicaSet, hang: Any
) -> None:
    """The server holds the acquire for 2 s of a 3 s lease: bounded from its request, the
    lease would end 0.75 s after the answer; a refresh sent at once bounds it anew."""
    late = _manager(fail_points, "late", "late-acquirer")
    try:
        hang("late-acquirer", ms=2000, times=1)
        lock = late.acquire("late", ttl=3.0)
        until = clock.now() + 3.5  # past the bound from the first request
        while clock.now() < until:
            assert lock.valid
            time.sleep(0.05)
        assert lock.release()
    finally:
        late.client.drop_database("late")
        _close(late)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_release_that_hands_the_lock_on_ends_within_one_timeout(
    fail_points: MongoReplicaSet, hang: Any, kind: str
) -> None:
    """A release is one operation: its two writes (the small one, which finds a waiter in
    line, then the one that hands the lock on) share one timeout."""
    database = f"slow_release_{kind}"
    releasing = NamedManager(
        fail_points.url, database=database, app="slow-release", server_selection_timeout=3.0
    )
    waiting = _manager(fail_points, database, "slow-release-waiter")
    results: list[Any] = []

    def wait() -> None:
        try:
            taken = waiting.acquire("handed", ttl=30, timeout=20)
            results.append(int(taken.token))
            taken.release()
        except MongoLockError as exc:  # reported to the test
            results.append(exc)

    thread = threading.Thread(target=wait)
    try:
        # No refresher: its writes would meet the fail point meant for the release.
        lock = releasing.acquire("handed", ttl=3, refresh=False)
        thread.start()
        in_line(waiting, "handed", 1)
        # Each write held back for most of the timeout: together, well past it.
        hang("slow-release", ms=2600, times=2)
        started = clock.now()
        release = lock.release if kind == "sync" else lambda: asyncio.run(lock.arelease())
        with pytest.raises(ServerUnavailable):
            release()
        took = clock.now() - started
        assert 3.0 <= took <= 4.5  # not 5.2 s, both writes in full
        # The second write was cut short, before or after the server applied it: the
        # waiter gets the lock, handed on or when the lease the release left ends.
        thread.join(timeout=30)
        assert not thread.is_alive()
        assert [type(result) for result in results] == [int], results
        assert results[0] > lock.token
    finally:
        if thread.is_alive():
            releasing.store.collection.delete_many({})
            thread.join(timeout=30)
        waiting.client.drop_database(database)
        releasing.close()
        _close(waiting)


@pytest.mark.parametrize("operation", ["acquire", "release"])
def test_a_client_given_keeps_its_own_time_limit(
    fail_points: MongoReplicaSet, hang: Any, operation: str
) -> None:
    """A manager given a client bounds each lock operation by that client's ``timeoutMS``,
    not by its (longer) server selection timeout: a lock call never waits longer than a
    call of the client it was given would."""
    with _given(fail_points, f"given-{operation}", timeoutMS=1500) as manager:
        lock = manager.acquire("other", ttl=30, refresh=False)  # the client's first round trips
        # Held back far past the client's limit, well within the server selection timeout.
        hang(f"given-{operation}", ms=6000, times=1)
        call = lock.release if operation == "release" else lambda: manager.acquire("limited")
        started = clock.now()
        with pytest.raises(ServerUnavailable, match=r"within 1\.5s"):
            call()
        took = clock.now() - started
        assert 1.5 <= took <= 1.5 + 3.0  # not 6 s: the write would have gone through


@pytest.mark.parametrize(
    ("options", "limit"),
    [
        ({"timeoutMS": 1500}, 1.5),
        ({"timeoutMS": 1500, "serverSelectionTimeoutMS": 500}, 1.5),
        ({}, 30.0),  # pymongo's default server selection timeout
        ({"serverSelectionTimeoutMS": 2500}, 2.5),
        ({"timeoutMS": 0, "serverSelectionTimeoutMS": 2500}, 2.5),  # 0: no limit of its own
    ],
)
def test_the_time_limit_of_a_given_client(options: dict[str, Any], limit: float) -> None:
    """A client's ``timeoutMS`` when it sets one, else its server selection timeout:
    never no limit at all."""
    client: MongoClient[Any] = MongoClient("mongodb://127.0.0.1:1/", connect=False, **options)
    manager = LockManager(client=client)
    try:
        assert manager.store.timeout == limit
    finally:
        _close(manager)


@pytest.mark.parametrize("operation", ["refresh", "shared release", "leave the line"])
def test_every_holder_call_of_a_given_client_is_bounded(
    fail_points: MongoReplicaSet, hang: Any, operation: str
) -> None:
    """A given client without ``timeoutMS`` sets no limit on a write of its own: a refresh
    by hand, a shared release and leaving the line are bounded by its server selection
    timeout, like an acquire, rather than waiting as long as the server holds them."""
    app = f"unbounded-{operation.replace(' ', '-')}"
    with _given(fail_points, app, serverSelectionTimeoutMS=1500) as manager:
        lock = manager.acquire("held", ttl=30, refresh=False, shared=operation == "shared release")
        calls: dict[str, Callable[[], object]] = {
            "refresh": lock.refresh,
            "shared release": lock.release,
            "leave the line": lambda: manager.store.leave("held", "a-waiter"),
        }
        hang(app, ms=6000, times=1)
        started = clock.now()
        with pytest.raises(ServerUnavailable, match=r"within 1\.5s"):
            calls[operation]()
        took = clock.now() - started
        assert 1.5 <= took <= 1.5 + 3.0  # not 6 s: the client alone would have waited


def test_the_give_back_after_a_refused_acquire_is_bounded(
    fail_points: MongoReplicaSet, hang: Any
) -> None:
    """An acquire the server answers with an error may still have been applied, so what
    the owner got is given back: that write is bounded by the operation limit too, on a
    given client without ``timeoutMS``, rather than waiting as long as the server holds
    it. The server refuses the acquire (a validator), then holds its next ``update``."""
    app = "given-back"
    with _given(fail_points, app, serverSelectionTimeoutMS=1500) as manager:
        manager.acquire("other", ttl=30, refresh=False)  # the collection, for its validator
        with refusing(fail_points.url, manager, "refused"):
            hang(app, ms=6000, times=1, commands=("update",))
            started = clock.now()
            with pytest.raises(MongoLockError, match="Document failed validation"):
                manager.acquire("refused", blocking=False, refresh=False)
            took = clock.now() - started
        assert 1.5 <= took <= 1.5 + 3.0  # not 6 s: the give-back would have waited


def test_a_group_release_tries_every_lock_within_one_limit(
    fail_points: MongoReplicaSet, hang: Any
) -> None:
    """A release the server refuses stops none of the others, and its failure is raised
    after them; once the releases have spent the operation limit, each of the rest gets
    half a second rather than a limit of its own. Either way no lock of the group is
    refreshed after."""
    app = "group-release"
    with _given(fail_points, app, serverSelectionTimeoutMS=1500) as manager:
        keys = ["g-a", "g-b", "g-c", "g-d"]
        # The server refuses the first release it gets (g-d's: the last taken goes first).
        group = manager.acquire_group(keys, ttl=30, refresh=False)
        _fail_once(fail_points, app, "update")
        with pytest.raises(MongoLockError, match="BadValue"):
            group.release()
        assert [manager.status(key) for key in keys[:3]] == [None] * 3
        assert not set(group.locks.values()) & set(get_refresher().held())
        # The server holds every release: one limit, then half a second each (3 s in
        # all), not one limit each (6 s).
        keys = ["h-a", "h-b", "h-c", "h-d"]
        group = manager.acquire_group(keys, ttl=30)
        hang(app, ms=6000, commands=("update",))
        started = clock.now()
        with pytest.raises(ServerUnavailable):
            group.release()
        took = clock.now() - started
        assert 1.5 <= took <= 1.5 + 3.0
        assert all(lock.released for lock in group.locks.values())
        assert not set(group.locks.values()) & set(get_refresher().held())


def test_a_failed_groups_give_back_does_not_wait_a_limit_per_key(
    fail_points: MongoReplicaSet, hang: Any
) -> None:
    """A group that finds its last key busy gives back the four it took; with the server
    holding those releases, that takes one operation limit and half a second for each
    of the rest (3 s), not one limit each (6 s), and the four are refreshed no more."""
    app = "group-give-back"
    with _given(fail_points, app, serverSelectionTimeoutMS=1500) as manager:
        rival = _manager(fail_points, manager.database, "group-rival")
        try:
            busy = rival.acquire("k-e", ttl=30)
            before = set(get_refresher().held())
            hang(app, ms=6000, commands=("update",))
            started = clock.now()
            with pytest.raises(LockNotAcquired):
                manager.acquire_group(["k-a", "k-b", "k-c", "k-d", "k-e"], blocking=False)
            took = clock.now() - started
            assert 1.5 <= took <= 1.5 + 3.0
            assert set(get_refresher().held()) <= before  # none of the four
            assert busy.release()
        finally:
            _close(rival)


def test_an_interrupted_group_release_still_gives_up_the_rest(
    fail_points: MongoReplicaSet, hang: Any
) -> None:
    """Ctrl-C (a real SIGINT) while the server holds the first release of a group: the
    KeyboardInterrupt goes on, but only after the other locks were released, so that
    none of them is left held and refreshed."""
    app = "group-interrupted"
    manager = _manager(fail_points, "group_interrupted", app)  # a 10 s limit
    try:
        keys = ["i-a", "i-b", "i-c", "i-d"]
        group = manager.acquire_group(keys, ttl=30)
        # i-d's release (it goes first) is held 10 s: the signal comes 9.5 s before that.
        hang(app, ms=10_000, times=1, commands=("update",))
        interrupt = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
        interrupt.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                group.release()
        finally:
            interrupt.cancel()
            interrupt.join(5)
        rest = [group.locks[key] for key in keys[:3]]
        assert all(lock.released for lock in rest)
        assert manager.statuses(keys[:3]) == {}
        assert not set(rest) & set(get_refresher().held())
    finally:
        manager.client.drop_database("group_interrupted")
        _close(manager)


def _release_group_in_child(group: LockGroup, manager: LockManager, parent: int) -> None:
    """Exit 0 if a forked child's release of its parent's group writes nothing and builds
    no client of its own (the manager's store is still the parent's)."""
    held = group.release()
    os._exit(0 if not held and manager._connection._pid == parent else 1)


def test_a_group_released_in_a_forked_child_builds_no_client(manager: LockManager) -> None:
    group = manager.acquire_group(["f-a", "f-b"], ttl=30)
    assert manager.store is not None  # the parent's client is built
    child = multiprocessing.get_context("fork").Process(
        target=_release_group_in_child, args=(group, manager, os.getpid())
    )
    child.start()
    child.join(30)
    if child.is_alive():
        child.kill()
    assert child.exitcode == 0
    assert set(manager.statuses(["f-a", "f-b"])) == {"f-a", "f-b"}  # still the parent's
    assert group.release()


def _fail_once(fail_points: MongoReplicaSet, app: str, command: str) -> None:
    """The server answers the next ``command`` of the clients named ``app`` with an
    error, at once (the ``hang`` fixture turns the fail point off after the test)."""
    admin: MongoClient[dict[str, Any]] = MongoClient(fail_points.nodes[0].direct_url)
    try:
        admin.admin.command(
            "configureFailPoint",
            "failCommand",
            mode={"times": 1},
            data={
                "failCommands": [command],
                "errorCode": 2,  # BadValue
                "appName": app,
            },
        )
    finally:
        admin.close()


@contextlib.contextmanager
def _rivalled(
    fail_points: MongoReplicaSet, app: str, keys: list[str]
) -> Iterator[tuple[LockManager, _Attempts, list[Election]]]:
    """A manager on a client named ``app`` whose acquires are recorded, and a rival that
    leads ``keys``; the elections put in the list given are stopped after."""
    database = app.replace("-", "_")
    attempts = _Attempts()
    client: MongoClient[Any] = MongoClient(
        fail_points.url,
        appname=app,
        w="majority",
        tz_aware=True,
        timeoutMS=10_000,
        event_listeners=[attempts],
    )
    manager = LockManager(client=client, database=database)
    rival = _manager(fail_points, database, f"{app}-rival")
    elections: list[Election] = []
    try:
        for key in keys:
            rival.acquire(key, ttl=60)
        yield manager, attempts, elections
    finally:
        for election in elections:
            election.stop()
        rival.client.drop_database(database)
        _close(manager, rival)


class _Attempts(monitoring.CommandListener):
    """The keys of the acquires (``findAndModify``) a client started."""

    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.sent: list[str] = []  # in order, repeats included

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name == "findAndModify":
            self.keys.add(event.command["query"]["_id"])
            self.sent.append(event.command["query"]["_id"])

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


def test_many_campaigns_make_no_refresh_late(fail_points: MongoReplicaSet, hang: Any) -> None:
    """Forty elections whose keys another process leads campaign on every tick, and the
    server holds each campaign 0.1 s: 4 s of campaigns a tick, past the end of a 3 s
    lease that the same lane keeps. A tick starts no campaign after half its interval
    and the rest go first on the next: the lease stays held for 6 s at least, and until
    every election has campaigned (bounded)."""
    keys = [f"lead-{n:02d}" for n in range(40)]
    with _rivalled(fail_points, "many-campaigns", keys) as (manager, attempts, elections):
        lock = manager.acquire("kept", ttl=3.0)
        hang("many-campaigns", ms=100, commands=("findAndModify",))
        elections += [manager.elect(key, ttl=30) for key in keys]
        started = clock.now()
        while clock.now() < started + 6.0 or not attempts.keys >= set(keys):
            assert lock.valid, "a lease of the lane ended while its elections campaigned"
            assert clock.now() < started + 40.0, f"not every election campaigned: {attempts.keys}"
            time.sleep(0.1)
        assert not lock.lost.is_set()
        assert not any(election.is_leader for election in elections)


def test_elections_stopped_during_a_tick_make_none_campaign_twice_or_skip_a_tick(
    fail_points: MongoReplicaSet, hang: Any
) -> None:
    """Six elections campaign on every tick (every 6 s; the server holds each campaign
    0.3 s). While the first of a tick campaigns, one that has not campaigned yet stops,
    and then the first one: the four left campaign once each in that tick, none twice
    and none left for the next."""
    keys = [f"stop-{n}" for n in range(6)]
    with _rivalled(fail_points, "stopped-campaigns", keys) as (manager, attempts, elections):
        hang("stopped-campaigns", ms=300, commands=("findAndModify",))
        elections += [manager.elect(key, ttl=18) for key in keys]
        started = clock.now()
        while not attempts.keys >= set(keys):  # the first ticks
            assert clock.now() < started + 30.0, f"not every election campaigned: {attempts.sent}"
            time.sleep(0.05)
        while True:  # between two ticks: no campaign for a second
            seen = len(attempts.sent)
            time.sleep(1.0)
            if len(attempts.sent) == seen:
                break
            assert clock.now() < started + 45.0, "the campaigns never paused"
        attempts.sent.clear()
        while not attempts.sent:  # the next tick's first campaign
            assert clock.now() < started + 60.0, "no tick after the pause"
            time.sleep(0.01)
        first, tick = attempts.sent[0], clock.now()
        [campaigning] = [e for e in elections if e.key == first]
        waiting = next(e for e in elections if e.key != first)
        waiting.stop()
        campaigning.stop()  # after its campaign: it has had its turn in this tick
        left = {e.key for e in elections} - {first, waiting.key}
        while not set(attempts.sent) >= left:
            # The next tick comes 6 s after this one began.
            assert clock.now() < tick + 5.5, f"not every election campaigned: {attempts.sent}"
            time.sleep(0.05)
        time.sleep(0.5)  # a second round of this tick would have begun by now
        assert clock.now() < tick + 5.5
        assert sorted(attempts.sent) == sorted({first} | left)
