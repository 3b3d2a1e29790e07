"""Edge cases of the manager: async clients per event loop, waiters that are cancelled or
interrupted, callbacks checked up front, and lock_acquired receivers that fail."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from types import FrameType
from typing import Any

import pytest
from pymongo import AsyncMongoClient

from django_mongolock import Lock, LockManager
from django_mongolock.acquiring import ABANDONED as cleanups
from django_mongolock.astore import AsyncLockStore
from django_mongolock.info import LockInfo
from django_mongolock.lanes import Lane
from django_mongolock.refresher import get_refresher
from django_mongolock.signals import lock_acquired
from django_mongolock.store import LockStore

# How long the tests wait for anything at most (never reached when green).
BOUND = 60.0


def _line(manager: LockManager, key: str) -> list[str]:
    """The owners waiting in ``key``'s line, as stored (lapsed places included)."""
    doc = manager.client[manager.database][manager.collection].find_one({"_id": key})
    return [] if doc is None else [place["owner"] for place in doc.get("waiters", [])]


def _until_in_line(manager: LockManager, key: str) -> None:
    """Wait (bounded) until somebody waits in ``key``'s line."""
    deadline = time.monotonic() + BOUND
    while not _line(manager, key):
        assert time.monotonic() < deadline, "nobody joined the line"
        time.sleep(0.01)


def _async_clients() -> int:
    gc.collect()
    return sum(1 for obj in gc.get_objects() if type(obj) is AsyncMongoClient)


# -- one async client per event loop, dropped with it ------------------------------------------


def test_a_closed_loop_leaves_no_async_client_behind(manager: LockManager) -> None:
    async def once() -> None:
        lock = await manager.aacquire("per-loop", ttl=10)
        assert await lock.arelease()

    asyncio.run(once())
    before = _async_clients()
    for _ in range(50):
        asyncio.run(once())
    assert manager._connection._astores == {}
    assert _async_clients() <= before


def test_a_loop_closed_without_finalizing_is_forgotten_on_next_use(manager: LockManager) -> None:
    async def once() -> None:
        lock = await manager.aacquire("bare-loop", ttl=10)
        assert await lock.arelease()

    loop = asyncio.new_event_loop()
    loop.run_until_complete(once())
    store = manager._connection._astores[loop][0]
    # Closed without shutdown_asyncgens(): the closer never runs, so the client is closed
    # here by hand (its own loop is the only one it can be closed on).
    loop.run_until_complete(store.close())
    loop.close()
    asyncio.run(once())
    assert loop not in manager._connection._astores
    assert manager._connection._astores == {}


# -- a waiter that stops waiting leaves the line -----------------------------------------------


@pytest.mark.parametrize("moment", ["in-attempt", "asleep"])
def test_a_cancelled_async_waiter_leaves_the_line(
    manager: LockManager, other: LockManager, moment: str
) -> None:
    holder = manager.acquire("cancelled", ttl=30)

    async def main() -> None:
        task = asyncio.ensure_future(other.aacquire("cancelled", timeout=30))
        if moment == "in-attempt":
            await asyncio.sleep(0)  # the first attempt is on its way to the server
        else:
            while not _line(manager, "cancelled"):
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.1)  # asleep until a release wakes it
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert _line(manager, "cancelled") == []
    assert holder.release()
    # Nobody is ahead: a newcomer gets the key at once.
    newcomer = manager.acquire("cancelled", blocking=False)
    assert newcomer.release()


def test_a_waiter_cancelled_twice_still_leaves_the_line(
    manager: LockManager, other: LockManager
) -> None:
    holder = manager.acquire("twice", ttl=30)

    async def main() -> None:
        task = asyncio.ensure_future(other.aacquire("twice", timeout=30))
        while not _line(manager, "twice"):
            await asyncio.sleep(0.02)
        task.cancel()
        deadline = time.monotonic() + 10
        while not cleanups and time.monotonic() < deadline:
            await asyncio.sleep(0)  # until the leave is on its way
        assert cleanups
        task.cancel()  # ... and cancelled while it leaves
        with pytest.raises(asyncio.CancelledError):
            await task
        # The leave goes on in the background.
        deadline = time.monotonic() + 10
        while _line(manager, "twice") and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    asyncio.run(main())
    assert _line(manager, "twice") == []
    assert holder.release()
    manager.acquire("twice", blocking=False).release()


class _Interrupted(KeyboardInterrupt):
    """A Ctrl-C sent to this test's waiting thread only."""


@pytest.fixture
def interrupt_main_in() -> Iterator[Callable[[float], threading.Timer]]:
    """Raise _Interrupted in the main thread (a signal handler) after some seconds."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise _Interrupted

    previous = signal.signal(signal.SIGUSR1, handler)
    timers: list[threading.Timer] = []

    def arm(seconds: float) -> threading.Timer:
        timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGUSR1))
        timers.append(timer)
        timer.start()
        return timer

    yield arm
    for timer in timers:
        timer.cancel()
        timer.join()
    signal.signal(signal.SIGUSR1, previous)


def test_an_interrupted_sync_waiter_leaves_the_line(
    manager: LockManager,
    other: LockManager,
    interrupt_main_in: Callable[[float], threading.Timer],
) -> None:
    assert threading.current_thread() is threading.main_thread()
    holder = manager.acquire("interrupted", ttl=30)
    interrupt_main_in(0.5)
    with pytest.raises(_Interrupted):
        other.acquire("interrupted", timeout=30)
    assert _line(manager, "interrupted") == []
    assert holder.release()
    manager.acquire("interrupted", blocking=False).release()


@pytest.mark.parametrize("waiter", ["thread", "coroutine"])
@pytest.mark.parametrize(
    ("shared", "waited"),
    [(True, True), (True, False), (False, False)],
    ids=["reader-in-line", "reader", "writer"],
)
def test_a_caller_stopped_while_its_late_lease_is_extended_gives_it_back(
    manager: LockManager,
    other: LockManager,
    monkeypatch: pytest.MonkeyPatch,
    waiter: str,
    shared: bool,
    waited: bool,
) -> None:
    """An attempt (the first, or a waiting reader's after the holder's release) takes
    the lock, but its answer comes so late that the lease is extended before acquire
    returns; the caller is stopped (Ctrl-C, a cancelled task) just after the server
    applied that refresh. The lease is given back, not left to block others until its
    end."""
    key = f"stopped-{waiter}-{shared}-{waited}"
    ttl = 8.0
    answer_stall = ttl / 2 + 0.1  # past half the lease: the answer counts as late
    refreshed: list[str] = []
    acquire, aacquire = LockStore.acquire, AsyncLockStore.acquire
    refresh, arefresh = LockStore.refresh, AsyncLockStore.refresh

    def took(store: Any, answer: LockInfo, arguments: dict[str, Any]) -> bool:
        if isinstance(store, LockStore) and store is not other.store:
            return False  # the test's own acquisitions (only ``other`` uses coroutines)
        owner: str = arguments["owner"]
        if arguments["shared"]:
            return answer.as_holder(owner) is not None
        return answer.owner == owner

    def late_answer(self: LockStore, **arguments: Any) -> LockInfo:
        answer = acquire(self, **arguments)
        if took(self, answer, arguments):
            time.sleep(answer_stall)
        return answer

    async def alate_answer(self: AsyncLockStore, **arguments: Any) -> LockInfo:
        answer = await aacquire(self, **arguments)
        if took(self, answer, arguments):
            await asyncio.sleep(answer_stall)
        return answer

    def stopped_refresh(self: LockStore, key: str, owner: str, *args: Any, **kw: Any) -> Any:
        assert refresh(self, key, owner, *args, **kw) is not None  # applied...
        refreshed.append(owner)
        raise _Interrupted  # ... and then the caller is stopped

    async def astopped_refresh(
        self: AsyncLockStore, key: str, owner: str, *args: Any, **kw: Any
    ) -> Any:
        assert await arefresh(self, key, owner, *args, **kw) is not None
        refreshed.append(owner)
        await asyncio.sleep(BOUND)  # cancelled here
        raise AssertionError("not cancelled")

    monkeypatch.setattr(LockStore, "acquire", late_answer)
    monkeypatch.setattr(AsyncLockStore, "acquire", alate_answer)
    monkeypatch.setattr(LockStore, "refresh", stopped_refresh)
    monkeypatch.setattr(AsyncLockStore, "refresh", astopped_refresh)
    holder = manager.acquire(key, ttl=30) if waited else None  # the reader waits behind it

    async def cancelled_reader() -> None:
        task = asyncio.ensure_future(other.aacquire(key, ttl=ttl, shared=shared, timeout=BOUND))
        deadline = time.monotonic() + BOUND
        while not refreshed:
            assert time.monotonic() < deadline
            assert not task.done()
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        while cleanups:  # the give-back runs as a task of its own
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)

    def interrupted_reader() -> None:
        with pytest.raises(_Interrupted):
            other.acquire(key, ttl=ttl, shared=shared, timeout=BOUND)

    def release_when_in_line() -> None:
        if holder is not None:
            _until_in_line(manager, key)
            assert holder.release()

    releaser = threading.Thread(target=release_when_in_line)
    releaser.start()
    if waiter == "coroutine":
        asyncio.run(cancelled_reader())
    else:
        interrupted_reader()
    releaser.join(BOUND)
    [owner] = refreshed
    doc = manager.client[manager.database][manager.collection].find_one({"_id": key})
    assert doc is not None
    assert owner not in [h["owner"] for h in doc.get("holders") or []]
    assert doc["owner"] != owner
    assert _line(manager, key) == []
    # Nothing is left in a writer's way.
    manager.acquire(key, blocking=False).release()


def _document(manager: LockManager, key: str) -> dict[str, Any] | None:
    doc: dict[str, Any] | None = manager.client[manager.database][manager.collection].find_one(
        {"_id": key}
    )
    return doc


@pytest.mark.parametrize("shared", [False, True], ids=["writer", "reader"])
@pytest.mark.parametrize("state", ["missing", "free", "held"])
def test_an_attempt_that_reaches_the_server_after_its_caller_gave_up_changes_nothing(
    manager: LockManager, other: LockManager, state: str, shared: bool
) -> None:
    """A caller stopped while its attempt is still on its way gives up first; the server
    applies the attempt after that: it takes no lease and no place in line, on a key
    whose document does not exist yet, is free, or is held."""
    key = f"late-attempt-{state}-{shared}"
    holder = manager.acquire(key, ttl=30) if state == "held" else None
    if state == "free":
        manager.acquire(key, ttl=30).release()
    owner = other.new_owner()
    other.store.abandon(key, owner, shared=shared)
    before = _document(manager, key)
    assert before is not None
    assert before["ended"][0] == owner
    if state == "missing":
        # Made free and already ended, as a released document: no lock to list, the
        # TTL index purges it.
        assert set(before) == {"_id", "key", "waiters", "ended", "expires_at"}
        assert manager.status(key) is None
        assert manager.list("all", prefix=key) == []
    answer = other.store.acquire(key, owner, 30.0, queue=True, shared=shared)
    assert answer.as_holder(owner) is None if shared else answer.owner != owner
    assert _document(manager, key) == before
    assert holder is None or holder.release()
    manager.acquire(key, blocking=False).release()


@pytest.mark.parametrize("shared", [False, True], ids=["writer", "reader"])
def test_giving_up_undoes_an_attempt_the_server_applied_before(
    manager: LockManager, other: LockManager, shared: bool
) -> None:
    """The other order: the attempt took the key (or a shared lease) before the give-up
    came. The give-up frees it, and names the acquisition in ``ended`` once."""
    key = f"applied-before-{shared}"
    owner = other.new_owner()
    taken = other.store.acquire(key, owner, 30.0, queue=True, shared=shared)
    mine = taken.as_holder(owner) if shared else taken
    assert mine is not None
    assert mine.owner == owner
    other.store.abandon(key, owner, shared=shared)
    doc = _document(manager, key)
    assert doc is not None
    assert not doc.get("owner")
    assert not doc.get("holders")
    assert doc["ended"].count(owner) == 1
    manager.acquire(key, blocking=False).release()


def test_giving_up_on_keys_without_a_document_keeps_to_the_indexes(
    mongolock_url: str, manager: LockManager
) -> None:
    """The documents a give-up makes are as an acquire makes them: the unique index on
    ``key`` (``migrate_mongolock``) takes any number of them."""
    with LockManager(
        mongolock_url, database=manager.database, collection="abandon_indexed"
    ) as indexed:
        try:
            indexed.ensure_indexes()
            owners = {key: indexed.new_owner() for key in ("gone-a", "gone-b", "gone-c")}
            for key, owner in owners.items():
                indexed.store.abandon(key, owner)
            for key, owner in owners.items():
                late = indexed.store.acquire(key, owner, 30.0, queue=True)
                assert late.owner != owner
                indexed.acquire(key, blocking=False).release()
        finally:
            indexed.client[indexed.database].drop_collection("abandon_indexed")


@pytest.mark.parametrize("waiter", ["thread", "coroutine"])
@pytest.mark.parametrize("shared", [False, True], ids=["writer", "reader"])
@pytest.mark.parametrize("state", ["missing", "free"])
def test_a_stopped_acquire_whose_attempt_arrives_late_leaves_the_key_free(
    manager: LockManager,
    other: LockManager,
    monkeypatch: pytest.MonkeyPatch,
    waiter: str,
    state: str,
    shared: bool,
) -> None:
    """Ctrl-C (or a cancellation) while the attempt's bytes are still on their way: the
    acquire gives up at once, and the attempt reaches the server after that. The key is
    not taken by nobody until the lease would end."""
    key = f"stopped-late-{waiter}-{state}-{shared}"
    if state == "free":
        manager.acquire(key, ttl=30).release()
    acquire = LockStore.acquire
    gate = threading.Event()
    answers: list[LockInfo] = []
    arrivals: list[threading.Thread] = []

    def send_late(arguments: dict[str, Any]) -> None:
        def arrive() -> None:
            assert gate.wait(BOUND)
            answers.append(acquire(other.store, **arguments))

        arrivals.append(threading.Thread(target=arrive))
        arrivals[-1].start()

    def on_its_way(self: LockStore, **arguments: Any) -> LockInfo:
        if self is not other.store:
            return acquire(self, **arguments)
        send_late(arguments)
        raise _Interrupted

    async def aon_its_way(self: AsyncLockStore, **arguments: Any) -> LockInfo:
        send_late(arguments)
        raise asyncio.CancelledError

    async def cancelled() -> None:
        with pytest.raises(asyncio.CancelledError):
            await other.aacquire(key, ttl=30, shared=shared, timeout=BOUND)
        deadline = time.monotonic() + BOUND
        while cleanups:  # the give-up runs as a task of its own
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)

    monkeypatch.setattr(LockStore, "acquire", on_its_way)
    monkeypatch.setattr(AsyncLockStore, "acquire", aon_its_way)
    try:
        if waiter == "thread":
            with pytest.raises(_Interrupted):
                other.acquire(key, ttl=30, shared=shared, timeout=BOUND)
        else:
            asyncio.run(cancelled())
    finally:
        gate.set()
        for late in arrivals:
            late.join(BOUND)
    monkeypatch.undo()
    [late] = arrivals
    assert not late.is_alive()
    [answer] = answers
    assert not (answer.live_holders if shared else answer.live)
    doc = _document(manager, key)
    assert doc is not None
    assert not doc.get("owner")
    assert not doc.get("holders")
    assert all(place["until"] is None for place in doc["waiters"])  # no live place
    manager.acquire(key, blocking=False).release()


# -- callbacks are checked when given ----------------------------------------------------------


def test_callbacks_that_cannot_be_called_are_refused_before_any_io() -> None:
    # Nothing listens on port 9: any I/O would end in ServerUnavailable, not TypeError.
    with LockManager("mongodb://127.0.0.1:9/", server_selection_timeout=0.2) as offline:
        with pytest.raises(TypeError, match=r"on_lost .*'not a callable'"):
            offline.acquire("k", on_lost="not a callable")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"on_lost .*42"):
            offline.lock("k", on_lost=42)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"on_lost .*'x'"):
            offline.alock("k", on_lost="x")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"on_lost .*'x'"):
            offline.semaphore("k", 2).acquire(on_lost="x")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"on_elected .*'not a callable'"):
            offline.elect("k", on_elected="not a callable")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"on_demoted .*\[\]"):
            offline.elect("k", on_demoted=[])  # type: ignore[arg-type]

        async def main() -> None:
            with pytest.raises(TypeError, match=r"on_lost .*b'x'"):
                await offline.aacquire("k", on_lost=b"x")  # type: ignore[arg-type]

        asyncio.run(main())
        assert offline._connection._astores == {}  # no async client was even built


def test_a_refused_election_campaigns_for_nothing(manager: LockManager) -> None:
    with pytest.raises(TypeError, match="on_elected"):
        manager.elect("nothing", on_elected="x")  # type: ignore[arg-type]
    time.sleep(0.3)
    assert manager.status("nothing") is None


# -- a failing lock_acquired receiver leaves no orphan -----------------------------------------


class _ReceiverFailed(Exception):
    pass


@pytest.fixture
def receivers() -> Iterator[Callable[[Callable[..., Any]], None]]:
    """Connect receivers to lock_acquired for this test only."""
    connected: list[Callable[..., Any]] = []

    def connect(receiver: Callable[..., Any]) -> None:
        lock_acquired.connect(receiver, weak=False)
        connected.append(receiver)

    yield connect
    for receiver in connected:
        lock_acquired.disconnect(receiver)


def _failing(exc: BaseException) -> Callable[..., None]:
    def receiver(sender: Any, lock: Lock, **kwargs: Any) -> None:
        raise exc

    return receiver


def _free(manager: LockManager, key: str) -> bool:
    status = manager.status(key)
    return status is None or not status.live


def test_a_raising_receiver_gives_the_lock_back_and_raises(
    manager: LockManager,
    other: LockManager,
    receivers: Callable[[Callable[..., Any]], None],
    lock_events: list[tuple[str, Any]],
) -> None:
    failing = _failing(_ReceiverFailed("no"))
    receivers(failing)
    with pytest.raises(_ReceiverFailed, match="no"):
        manager.acquire("orphan", ttl=30)
    # The key is free at once, not after a lease that nobody can release.
    assert _free(manager, "orphan")
    # Every receiver heard of the acquisition, and then of its release.
    assert [(name, lock.key) for name, lock in lock_events] == [
        ("acquired", "orphan"),
        ("released", "orphan"),
    ]
    lock_acquired.disconnect(failing)
    newcomer = other.acquire("orphan", blocking=False)
    assert newcomer.release()


def test_a_raising_receiver_does_not_keep_the_others_from_hearing(
    manager: LockManager, receivers: Callable[[Callable[..., Any]], None]
) -> None:
    heard: list[tuple[str, bool]] = []
    receivers(_failing(_ReceiverFailed("first")))
    receivers(lambda sender, lock, **kwargs: heard.append((lock.key, lock.valid)))
    with pytest.raises(_ReceiverFailed):
        manager.acquire("robust", ttl=30, timeout=5)
    assert heard == [("robust", True)]
    assert _free(manager, "robust")


def test_a_receiver_calling_sys_exit_frees_the_key(
    manager: LockManager, receivers: Callable[[Callable[..., Any]], None]
) -> None:
    receivers(_failing(SystemExit(3)))
    with pytest.raises(SystemExit):
        manager.acquire("exit", ttl=30)
    assert _free(manager, "exit")


def test_a_raising_receiver_frees_an_async_acquisition(
    manager: LockManager, receivers: Callable[[Callable[..., Any]], None]
) -> None:
    receivers(_failing(_ReceiverFailed("async")))

    async def main() -> None:
        with pytest.raises(_ReceiverFailed):
            await manager.aacquire("async-orphan", ttl=30)
        assert _free(manager, "async-orphan")
        with pytest.raises(_ReceiverFailed):
            async with manager.alock("async-orphan", ttl=30, timeout=5):
                pytest.fail("the block must not run")

    asyncio.run(main())
    assert _free(manager, "async-orphan")


class _NoThread(RuntimeError):
    pass


@pytest.mark.parametrize("waiter", ["thread", "coroutine"])
@pytest.mark.parametrize(
    ("shared", "handed"),
    [(False, False), (False, True), (True, False)],
    ids=["taken", "handed-over", "shared"],
)
def test_a_lease_whose_handle_cannot_be_made_is_given_back(
    manager: LockManager,
    other: LockManager,
    monkeypatch: pytest.MonkeyPatch,
    waiter: str,
    shared: bool,
    handed: bool,
) -> None:
    """The server gave the caller the lock (taken itself, or handed over by a release
    while it waited), but the handle cannot be made: the refresher's lane took it, then
    its thread could not start. The caller gets the error, the key is free at once, not
    taken by nobody until the lease ends, and the handle it never got is neither kept
    nor announced lost when its lease would have ended."""
    key = f"no-handle-{waiter}-{shared}-{handed}"
    ttl = 1.0
    holder = manager.acquire(key, ttl=30) if handed else None
    lost: list[Lock] = []

    def start(self: Lane) -> None:
        raise _NoThread("can't start new thread")

    monkeypatch.setattr(Lane, "_start", start)

    def take() -> Lock:
        if waiter == "thread":
            return other.acquire(key, ttl=ttl, shared=shared, timeout=BOUND, on_lost=lost.append)
        return asyncio.run(
            other.aacquire(key, ttl=ttl, shared=shared, timeout=BOUND, on_lost=lost.append)
        )

    with ThreadPoolExecutor(1) as pool:
        taking = pool.submit(take)
        if holder is not None:
            _until_in_line(manager, key)
            assert holder.release()
        with pytest.raises(_NoThread):
            taking.result(timeout=BOUND)
    assert _free(manager, key)
    assert key not in {lock.key for lock in get_refresher().held()}
    time.sleep(ttl + 0.5)  # past the lease's end by this process's clock
    assert lost == []
    monkeypatch.undo()
    manager.acquire(key, blocking=False).release()
