"""The background refresher: one thread keeps every held lease alive and spots lost ones."""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from django_mongolock import Lock, LockManager, MongoLockError, clock, lanes
from django_mongolock import refresher as refreshing
from django_mongolock.info import Holder, LockInfo, process_of
from django_mongolock.lanes import ASIDE_SUFFIX
from django_mongolock.queries import ENDED_KEEP
from django_mongolock.refresher import Refresher, get_refresher
from tests.holder import PERMITS, SHARED
from tests.utils import ROOT

# How long a test waits for anything at most (never reached when green).
BOUND = 30.0


def _holder(url: str, database: str, key: str, ttl: float, mode: str) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.holder", url, database, key, str(ttl), mode],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    process.stdout.close()
    assert line.startswith("held "), line
    return process


@pytest.fixture
def refresher() -> Refresher:
    return get_refresher()


def test_a_lock_held_for_three_times_its_ttl_stays_held(
    manager: LockManager, other: LockManager, refresher: Refresher
) -> None:
    # A 3 s lease, ticked each second: a tick may come 1.75 s late (a loaded machine's
    # majority write and thread wake-up) before the lease would end.
    lock = manager.acquire("kept", ttl=3.0)
    assert lock.refreshable
    ticks = refresher.ticks
    deadline = clock.now() + 9.0
    while clock.now() < deadline:
        assert lock.valid
        time.sleep(0.1)
    status = manager.status("kept")
    assert status is not None
    assert (status.owner, status.token, status.live) == (lock.owner, lock.token, True)
    assert refresher.ticks - ticks >= 6  # about three ticks per lease
    assert lock.valid
    # ttl less the margin (0.25 s) less up to one tick (1 s), and room for a late one.
    assert lock.remaining > 0.5
    # The handle's view of the lease follows the refreshes.
    assert lock.expires_at > status.now
    with pytest.raises(Exception, match="held by"):
        other.acquire("kept", blocking=False)
    assert lock.release()


def test_a_released_lock_is_no_longer_refreshed(
    manager: LockManager, other: LockManager, refresher: Refresher
) -> None:
    lock = manager.acquire("once", ttl=0.3)
    assert lock in refresher.held()
    assert lock.release()
    assert lock not in refresher.held()
    # A new holder that does not refresh its own lock sees it lapse: nobody else extends it.
    successor = other.acquire("once", ttl=0.4, refresh=False)
    time.sleep(0.6)
    status = other.status("once")
    assert status is not None
    assert status.owner == successor.owner
    assert status.state == "expired"


def test_opting_out_per_lock_and_per_manager(
    manager: LockManager, mongolock_url: str, refresher: Refresher
) -> None:
    lock = manager.acquire("manual", ttl=0.3, refresh=False)
    assert not lock.refreshable
    assert lock not in refresher.held()
    with LockManager(mongolock_url, database=manager.database, refresh=False) as quiet:
        held = quiet.acquire("quiet", ttl=0.3)
        assert not held.refreshable
        assert held not in refresher.held()
        time.sleep(0.4)
        assert not held.valid
    time.sleep(0.1)
    assert not lock.valid


def test_a_force_release_is_noticed_within_one_tick(
    manager: LockManager, other: LockManager, lock_events: list[tuple[str, Any]]
) -> None:
    called: list[Lock] = []
    calls = threading.Event()

    def on_lost(lost: Lock) -> None:
        called.append(lost)
        calls.set()

    lock = manager.acquire("forced", ttl=0.6, on_lost=on_lost)
    other.force_release("forced")
    # One tick is a third of the lease (0.2 s); allow generous scheduling slack. The
    # event is set first, so protected code learns at once; the callback follows.
    assert lock.lost.wait(2.0)
    assert not lock.valid
    assert calls.wait(2.0)
    # ``lock_lost``'s receivers run as notices of their own, apart from ``on_lost``.
    until = time.monotonic() + 10
    while "lost" not in [name for name, _ in lock_events] and time.monotonic() < until:
        time.sleep(0.01)
    time.sleep(0.5)  # more ticks: still reported once
    assert called == [lock]
    assert [name for name, _ in lock_events].count("lost") == 1
    assert [event_lock for name, event_lock in lock_events if name == "lost"] == [lock]


def test_each_tick_sends_the_leases_held_then_and_lists_them_again_only_when_they_change(
    manager: LockManager, other: LockManager, refresher: Refresher, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tick reuses the last one's list of leases while none joined or left: a lease
    taken, released, found lost or garbage collected is in the next tick's write, or out."""
    store = manager.store
    me = threading.get_ident()
    sent: list[tuple[str, tuple[tuple[str, str, int], ...]]] = []
    beats: list[frozenset[str]] = []

    def spy(name: str) -> Any:
        real = getattr(store, name)

        def call(held: Any, *args: Any, **kwargs: Any) -> Any:
            # The test's ticks, not the lane's own, should it tick: its thread, and the
            # one that sends the shared leases' write beside the exclusive one.
            if threading.get_ident() == me or threading.current_thread().name == aside:
                if name == "heartbeat":
                    beats.append(held)
                else:
                    sent.append((name, held))
            return real(held, *args, **kwargs)

        return call

    aside = f"mongolock-refresher-{id(manager):x}{ASIDE_SUFFIX}"
    for name in ("refresh_many", "refresh_shared_many", "heartbeat"):
        monkeypatch.setattr(store, name, spy(name))
    # Long leases: the lane's own ticks come 100 s apart, long after the test.
    first, second = manager.acquire("batch-a", ttl=300), manager.acquire("batch-b", ttl=300)
    reader = manager.acquire("batch-s", ttl=300, shared=True)
    lane = refresher.lane_of(manager)
    assert lane is not None

    def tick() -> tuple[tuple[tuple[str, str, int], ...], ...]:
        del sent[:]
        lane.tick()
        written = dict(sent)
        return written.get("refresh_many", ()), written.get("refresh_shared_many", ())

    def leases(*locks: Lock) -> set[tuple[str, str, int]]:
        return {(lk.key, lk.owner, lk.token) for lk in locks}

    exclusive, shared = tick()
    assert (set(exclusive), set(shared)) == (leases(first, second), leases(reader))
    assert beats[-1] == {process_of(first.owner)}
    again, _ = tick()
    assert again is exclusive  # nothing changed: the same tuple, not built again
    third = manager.acquire("batch-c", ttl=300)
    assert set(tick()[0]) == leases(first, second, third)
    assert second.release()
    assert set(tick()[0]) == leases(first, third)
    # Found released by somebody else: lost at that tick, and not written again.
    other.force_release("batch-c")
    assert set(tick()[0]) == leases(first, third)
    assert third.lost.is_set()
    assert set(tick()[0]) == leases(first)
    # A handle dropped without a release leaves the lane by itself: the set shrinks.
    more = manager.acquire("batch-d", ttl=300)
    assert set(tick()[0]) == leases(first, more)
    del more
    gc.collect()
    assert set(tick()[0]) == leases(first)
    # One dropped and one taken between two ticks: as many leases, not the same ones.
    more = manager.acquire("batch-e", ttl=300)
    assert set(tick()[0]) == leases(first, more)
    del more
    gc.collect()
    fourth = manager.acquire("batch-f", ttl=300)
    assert set(tick()[0]) == leases(first, fourth)
    assert fourth.release()
    reader.release()
    assert tick() == (tuple(leases(first)), ())
    assert first.release()


def _tick_writes(
    manager: LockManager, monkeypatch: pytest.MonkeyPatch, *, meet: bool, fail: bool = False
) -> dict[str, threading.Thread]:
    """Spy on the manager's refresh writes: the thread each kind went from. With
    ``meet``, the exclusive write is sent only once the shared one is under way
    (bounded): they are in flight together, or the tick fails. With ``fail``, the shared
    one fails as against an unreachable server, once the exclusive one went through."""
    store = manager.store
    threads: dict[str, threading.Thread] = {}
    shared_started, exclusive_done = threading.Event(), threading.Event()
    for name in ("refresh_many", "refresh_shared_many"):
        real = getattr(store, name)

        def call(held: Any, *args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            threads[_name] = threading.current_thread()
            if _name == "refresh_shared_many":
                shared_started.set()
                if fail:
                    assert exclusive_done.wait(BOUND)
                    raise MongoLockError("MongoDB could not be reached")
            elif meet and not shared_started.wait(BOUND):
                raise AssertionError("the shared leases' write was not under way")
            try:
                return _real(held, *args, **kwargs)
            finally:
                exclusive_done.set()

        monkeypatch.setattr(store, name, call)
    return threads


def test_a_tick_sends_the_shared_leases_write_beside_the_exclusive_one(
    manager: LockManager, refresher: Refresher, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With both kinds held, the shared leases' write goes from a thread of its own
    while the tick's thread sends the exclusive one: both are in flight together, both
    extend their leases, and the thread ends with the tick."""
    locks = [manager.acquire("both-x", ttl=300), manager.acquire("both-s", ttl=300, shared=True)]
    lane = refresher.lane_of(manager)
    assert lane is not None
    before = [lock.expires_at for lock in locks]
    threads = _tick_writes(manager, monkeypatch, meet=True)
    lane.tick()
    assert threads["refresh_many"] is threading.current_thread()
    aside = threads["refresh_shared_many"]
    assert aside.name == lane.name + ASIDE_SUFFIX
    assert not aside.is_alive()
    assert all(lock.expires_at > was for lock, was in zip(locks, before, strict=True))
    for lock in locks:
        assert lock.release()


def test_a_tick_whose_shared_write_fails_beside_the_exclusive_one_fails(
    manager: LockManager,
    refresher: Refresher,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The shared leases' write, from its own thread, fails once the exclusive one went
    through: the tick fails as a whole, as when one write follows the other, and
    extends neither kind's lease by this process's clock (the leases end by it)."""
    locks = [manager.acquire("fail-x", ttl=300), manager.acquire("fail-s", ttl=300, shared=True)]
    lane = refresher.lane_of(manager)
    assert lane is not None
    before = [lock.expires_at for lock in locks]
    threads = _tick_writes(manager, monkeypatch, meet=False, fail=True)
    with caplog.at_level(logging.WARNING, "django_mongolock.refresher"):
        lane.tick()
    assert threads["refresh_shared_many"] is not threading.current_thread()
    assert [lock.expires_at for lock in locks] == before
    assert any("cannot refresh 2 lock(s)" in r.getMessage() for r in caplog.records)
    monkeypatch.undo()
    for lock in locks:
        assert lock.release()


@pytest.mark.parametrize("held", ["shared only", "no thread to be had"])
def test_a_tick_sends_its_writes_from_its_own_thread_otherwise(
    manager: LockManager,
    refresher: Refresher,
    monkeypatch: pytest.MonkeyPatch,
    held: str,
) -> None:
    """Shared leases alone go from the tick's thread; so do both kinds when no thread
    can start (one write after the other), and every lease is still extended."""
    locks = [manager.acquire("own-s", ttl=300, shared=True)]
    if held == "no thread to be had":
        locks.append(manager.acquire("own-x", ttl=300))

        def start(self: lanes._Aside) -> None:
            raise RuntimeError("can't start new thread")

        monkeypatch.setattr(lanes._Aside, "start", start)
    lane = refresher.lane_of(manager)
    assert lane is not None
    before = [lock.expires_at for lock in locks]
    threads = _tick_writes(manager, monkeypatch, meet=False)
    lane.tick()
    assert set(threads.values()) == {threading.current_thread()}
    assert len(threads) == len(locks)
    assert all(lock.expires_at > was for lock, was in zip(locks, before, strict=True))
    for lock in locks:
        assert lock.release()


def test_one_thread_per_manager_serves_a_thousand_locks(
    manager: LockManager, refresher: Refresher
) -> None:
    first = manager.acquire("many-0", ttl=4.0)
    lane = refresher.lane_of(manager)
    assert lane is not None
    assert lane.running

    # The notice workers (a bounded pool that any lane's tick may start) aside.
    # So are the threads other lanes start for a tick's shared leases.
    def threads() -> int:
        return sum(
            t.name != "mongolock-notices" and not t.name.endswith(ASIDE_SUFFIX)
            for t in threading.enumerate()
        )

    threads_before = threads()
    locks = [first] + [manager.acquire(f"many-{i}", ttl=4.0) for i in range(1, 1000)]
    assert threads() <= threads_before
    own = f"mongolock-refresher-{id(manager):x}"
    assert [t.name for t in threading.enumerate()].count(own) == 1
    # Longer than the lease: only refreshing keeps them (a 4 s lease leaves a bulk
    # refresh of 1,000 documents room on a loaded machine).
    time.sleep(5.0)
    assert all(lock.valid for lock in locks)
    assert manager.count("live", prefix="many-") == 1000
    # Threads of earlier tests may have ended meanwhile; none was added.
    assert threads() <= threads_before
    assert [t.name for t in threading.enumerate()].count(own) == 1
    assert refresher.lane_of(manager) is lane
    for lock in locks:
        lock.release()


def _child_touches_parent_lock(lock: Lock, url: str, database: str, queue: Any) -> None:
    child_refresher = get_refresher()
    manager = LockManager(url, database=database)
    try:
        own = manager.acquire("child-own", ttl=5)
        queue.put(
            {
                "valid": lock.valid,
                "released": lock.release(),
                "held_by_refresher": len(child_refresher.held()) - 1,
                "own_token": own.token,
                "pid": os.getpid(),
            }
        )
        own.release()
    finally:
        manager.close()


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_does_not_touch_the_parents_locks(
    manager: LockManager, mongolock_url: str
) -> None:
    # A 3 s lease, ticked each second: a fork, the child's writes and a loaded machine's
    # late tick must not end it before the check below.
    lock = manager.acquire("parent", ttl=3.0)
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(
        target=_child_touches_parent_lock, args=(lock, mongolock_url, manager.database, queue)
    )
    child.start()
    result = queue.get(timeout=60)
    child.join(timeout=60)
    assert child.exitcode == 0
    assert result["pid"] != os.getpid()
    assert result["valid"] is False
    assert result["released"] is False
    assert result["held_by_refresher"] == 0
    assert result["own_token"] > lock.token
    time.sleep(3.5)  # past the lease: the parent still refreshes it
    status = manager.status("parent")
    assert status is not None
    assert (status.owner, status.live) == (lock.owner, True)
    assert lock.valid
    assert lock.release()


def test_a_killed_holder_frees_its_lock_within_ttl_and_one_tick(
    manager: LockManager, mongolock_url: str
) -> None:
    ttl = 2.5  # a fresh process's refreshes must keep it on a loaded machine
    process = _holder(mongolock_url, manager.database, "crash", ttl, "sleep")
    try:
        time.sleep(ttl)  # refreshed meanwhile: still held
        status = manager.status("crash")
        assert status is not None
        assert status.live
        os.kill(process.pid, signal.SIGKILL)
        killed_at = clock.now()
        taken = manager.acquire("crash", timeout=10)
        waited = clock.now() - killed_at
    finally:
        process.kill()
        process.wait(timeout=30)
    assert taken.token > status.token
    # The lease ends within ttl of the kill and the waiter wakes then (one write, and
    # whatever a loaded machine adds), not a grace period (2 s) later.
    assert waited <= ttl + 1.5
    taken.release()


def test_normal_exit_releases_held_locks(manager: LockManager, mongolock_url: str) -> None:
    process = _holder(mongolock_url, manager.database, "leaver", 30, "exit")
    assert process.wait(timeout=30) == 0
    assert manager.status("leaver") is None


def test_a_lock_taken_once_the_exit_has_begun_is_the_callers_to_release(
    manager: LockManager, other: LockManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exit hook that runs after the package's own (or a daemon thread) may still take
    a lock: it is held, but no lane keeps it, and its release is the caller's."""
    monkeypatch.setattr(refreshing, "_refresher", Refresher())
    refreshing.shutdown()
    late = manager.acquire("late-at-exit", ttl=30)
    try:
        assert get_refresher().stopping
        assert get_refresher().held() == []
        assert late.valid
        status = other.status("late-at-exit")
        assert status is not None
        assert status.owner == late.owner
    finally:
        assert late.release()
    assert other.status("late-at-exit") is None


def test_normal_exit_releases_shared_leases_and_permits_in_one_write(
    manager: LockManager, mongolock_url: str
) -> None:
    """200 shared leases and 20 permits of a semaphore, beside an exclusive lock: two
    writes at exit (a write per lease would not fit the exit's 2 s on a loaded machine).
    Another process's lease on the same documents stays as it was."""
    key, ttl = "leaver-many", 60.0
    # Not refreshed, so that their entries must stay exactly as they are.
    mine = manager.acquire(f"{key}-shared-0", shared=True, ttl=ttl, refresh=False)
    permit = manager.semaphore(f"{key}-sem", limit=50).acquire(ttl=ttl, refresh=False)
    before = {
        lease.key: entry_of(manager.status(lease.key), lease.owner) for lease in (mine, permit)
    }
    args = [mongolock_url, manager.database, key, str(ttl), "exit-many"]
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.holder", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    out, _ = process.communicate(timeout=120)
    assert process.returncode == 0, out
    lines = out.splitlines()
    assert lines[0].startswith("held "), out
    assert lines[-1] == 'exit-writes ["update", "update"]', out
    assert manager.status(key) is None
    shared = manager.status(f"{key}-shared-0")
    assert shared is not None
    assert [h.owner for h in shared.holders] == [mine.owner], shared
    assert [n for n in range(1, SHARED) if manager.status(f"{key}-shared-{n}") is not None] == []
    sem = manager.status(f"{key}-sem")
    assert sem is not None
    assert [h.owner for h in sem.holders] == [permit.owner], sem
    # Each document stays (purged later), over at once where nobody is left (free for an
    # exclusive lock), its lease end the remaining holder's elsewhere; the holders that
    # left are recorded as ended (the latest 16), the one that stays is not.
    collection = manager.store.collection
    docs = {doc["_id"]: doc for doc in collection.find({"_id": {"$regex": f"^{key}-(shared|sem)"}})}
    assert len(docs) == SHARED + 1
    now = collection.database.command("hello", codec_options=collection.codec_options)["localTime"]
    for name, doc in docs.items():
        if name in (mine.key, permit.key):
            [entry] = doc["holders"]
            assert doc["expires_at"] == entry["expires_at"] > now, doc
            assert entry["owner"] not in doc["ended"], doc
            assert len(doc["ended"]) == (1 if name == mine.key else min(PERMITS, ENDED_KEEP))
        else:
            assert (doc["holders"], len(doc["ended"])) == ([], 1), doc
            assert doc["expires_at"] <= now, doc
    manager.acquire(f"{key}-shared-1", blocking=False).release()
    # The other process's leases are untouched, and still live.
    for lease in (mine, permit):
        assert entry_of(manager.status(lease.key), lease.owner) == before[lease.key]
        assert lease.valid
        assert lease.release()


class _Calls:
    """Wraps a store's collection: the name of each method called on it."""

    def __init__(self, collection: Any) -> None:
        self.collection = collection
        self.names: list[str] = []

    def __getattr__(self, name: str) -> Any:
        self.names.append(name)
        return getattr(self.collection, name)


def test_leases_extended_after_their_end_are_given_back_in_one_write_per_kind(
    manager: LockManager,
    other: LockManager,
    refresher: Refresher,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a tick does with the leases its write extended after the holders learnt of
    their end (``Lane._give_back``): it releases them, exclusive and shared each in one
    write, leaving another holder's lease of the same semaphore as it was."""
    leases = [manager.acquire("back-x", ttl=30), manager.acquire("back-s", shared=True, ttl=30)]
    leases += [manager.semaphore("back-sem", limit=5).acquire(ttl=30) for _ in range(3)]
    stays = other.semaphore("back-sem", limit=5).acquire(ttl=30)
    lane = refresher.lane_of(manager)
    assert lane is not None
    calls = _Calls(manager.store.collection)
    with monkeypatch.context() as patch:
        patch.setattr(manager.store, "collection", calls)
        lane._give_back(manager.store, leases)
    assert calls.names == ["update_many", "update_many"]
    assert manager.status("back-x") is None
    assert manager.status("back-s") is None
    sem = manager.status("back-sem")
    assert sem is not None
    assert [h.owner for h in sem.holders] == [h.owner for h in sem.live_holders] == [stays.owner]
    # Their handles find nothing left to release; the other's lease is released as usual.
    assert [lease.release() for lease in leases] == [False] * len(leases)
    assert stays.release()


def entry_of(status: LockInfo | None, owner: str) -> Holder | None:
    """``owner``'s shared lease in ``status``, if its document has it."""
    assert status is not None
    return next((holder for holder in status.holders if holder.owner == owner), None)


def test_locks_of_a_closed_manager_are_lost_not_resurrected(
    mongolock_url: str, manager: LockManager, refresher: Refresher
) -> None:
    closing = LockManager(mongolock_url, database=manager.database)
    lock = closing.acquire("orphan", ttl=0.6)
    closing.close()
    assert lock.lost.wait(2.0)
    assert closing.closed
    with pytest.raises(MongoLockError, match="closed"):
        closing.acquire("again")
    assert lock not in refresher.held()


def test_taking_locks_does_not_wake_the_refresher_unless_it_must_tick_sooner(
    manager: LockManager,
) -> None:
    own = Refresher()  # not the process's: its schedule depends on this test alone
    locks = []
    try:
        first = manager.acquire("schedule-first", ttl=30, refresh=False)
        locks.append(first)
        own.register(first)
        due = own.due
        assert due <= clock.now() + 10.0  # a third of the lease
        # Same lease, taken later: the next tick is due no sooner, so the thread sleeps on.
        later = manager.acquire("schedule-later", ttl=30, refresh=False)
        locks.append(later)
        own.register(later)
        assert own.due == due
        # A shorter lease must be refreshed sooner: the tick moves earlier.
        short = manager.acquire("schedule-short", ttl=3.0, refresh=False)
        locks.append(short)
        short.refreshable = True
        own.register(short)
        assert own.due < due
        assert own.due <= clock.now() + 1.0
        ticks = own.ticks
        deadline = clock.now() + 6.0
        while clock.now() < deadline:
            assert short.valid
            time.sleep(0.1)
        assert own.ticks - ticks >= 3
    finally:
        own.stop()
        for lock in locks:
            lock.release()


def test_the_refresher_sleeps_without_a_deadline_once_nothing_is_held(
    manager: LockManager,
) -> None:
    own = Refresher()

    def kept(key: str) -> Lock:
        # 3 s leases ticked each second: a tick may come 1.75 s late on a loaded machine.
        lock = manager.acquire(key, ttl=3.0, refresh=False)
        lock.refreshable = True
        own.register(lock)
        return lock

    try:
        kept("idle-then-busy").release()
        deadline = clock.now() + 10.0
        while own.due != float("inf") and clock.now() < deadline:
            time.sleep(0.05)
        assert own.due == float("inf")
        ticks = own.ticks
        again = kept("idle-then-busy")
        assert own.due < float("inf")
        time.sleep(10.0)  # more than three leases: kept alive by ticks of the woken thread
        assert again.valid
        assert own.ticks - ticks >= 3
        assert again.release()
    finally:
        own.stop()


def test_a_refresher_thread_that_dies_is_replaced_and_says_so(
    manager: LockManager, caplog: pytest.LogCaptureFixture
) -> None:
    own = Refresher()
    lock = manager.acquire("phoenix", ttl=2.0, refresh=False)  # room for a stall
    lock.refreshable = True
    lane = own._lane(manager)
    assert lane is not None
    original = lane._loop
    broken: list[bool] = []

    def dies_once() -> None:
        if not broken:
            broken.append(True)
            raise RuntimeError("a bug in the loop")
        original()

    lane._loop = dies_once  # type: ignore[method-assign]
    try:
        own.register(lock)
        until = clock.now() + 4.5  # more than two leases
        while clock.now() < until:
            assert lock.valid
            time.sleep(0.05)
        assert broken == [True]
        assert own.restarts == 1
        assert "ended unexpectedly; restarting it" in caplog.text
        assert lane.running
    finally:
        own.stop()
        lock.release()


def test_a_tick_extends_each_lease_by_its_own_length(
    manager: LockManager, refresher: Refresher
) -> None:
    """Leases of several lengths in one tick: each deadline moves to its own lease's end
    (the tick computes each length's deadline once), never to another length's."""
    lengths = (300.0, 60.0, 300.0, 30.0)
    locks = [manager.acquire(f"lengths-{n}", ttl=ttl) for n, ttl in enumerate(lengths)]
    lane = refresher.lane_of(manager)
    assert lane is not None
    started = clock.now()
    lane.tick()
    ended = clock.now()
    for lock, ttl in zip(locks, lengths, strict=True):
        assert started + ttl - clock.margin(ttl) <= lock.deadline <= ended + ttl - clock.margin(ttl)
    for lock in locks:
        assert lock.release()
