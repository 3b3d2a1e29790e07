"""The sync and the async acquire: attempts, waiting on the wake event, and the handle.

Both loops follow one ``WaitPlan`` (``acquirer.py``); they differ only in how an attempt
is sent and how a waiter sleeps. A wait that is interrupted leaves the line (and gives
back a lease an interrupted attempt may have taken), so that the next waiter is not
held up by a place nobody keeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Protocol, TypeVar

from django_mongolock import clock, events
from django_mongolock.acquirer import Request, WaitPlan, busy, first_lease, must_extend
from django_mongolock.astore import AsyncLockStore
from django_mongolock.exceptions import LockNotAcquired, MongoLockError
from django_mongolock.info import LockInfo
from django_mongolock.lock import Lock, LockBackend
from django_mongolock.refresher import get_refresher
from django_mongolock.signals import lock_acquired
from django_mongolock.store import LockStore
from django_mongolock.waiters import AsyncWake, Waiters, Wake
from django_mongolock.watcher import Watcher

__all__ = ["ABANDONED", "Source", "aacquire", "acquire", "announce"]

logger = logging.getLogger("django_mongolock.manager")

_T = TypeVar("_T")


class Source(LockBackend, Protocol):
    """What acquiring needs of a manager: its stores, its waiters and its change stream."""

    @property
    def waiters(self) -> Waiters: ...

    @property
    def watcher(self) -> Watcher: ...

    def new_owner(self) -> str: ...

    def _resolved(self) -> Source:
        """The manager that does the work: the lazy default manager names the one its
        settings describe now, so that a lock is tied to it and not to the proxy."""
        ...


@events.observed
def acquire(
    source: Source,
    request: Request,
    wait: float | None,
    keep: bool,
    on_lost: Callable[[Lock], object] | None,
    *,
    announcing: bool = True,
) -> Lock:
    """Take the lock (waiting up to ``wait``); ``announcing=False`` leaves ``lock_acquired``
    to the caller (an election sends it from its own worker, not the refresher's)."""
    source = source._resolved()
    store = source.store
    plan: WaitPlan | None = None
    try:
        if wait == 0:
            sent_at = clock.now()
            info = store.acquire(**request.arguments(queue=False))
            mine = request.taken(info)
            if mine is None:
                raise busy(info)
        else:
            # Subscribe before the first attempt: a release right after it must wake us.
            with source.waiters.subscribe(request.key, request.owner) as wake:
                started, sent_at, info = _first_attempt(source.waiters, store, request)
                mine = request.taken(info)
                if mine is None:
                    plan = WaitPlan(request, wait, sent_at, info, started)
                    try:
                        sent_at, mine = _wait(source, store, plan, wake, keep)
                    finally:
                        source.waiters.found_busy(request.key)  # busy until now
                    request = plan.request
        if plan is None:
            first = first_lease(mine, request)
            handoff = _handoff(mine, first)
            if (ready := _ready(store, request, sent_at, first, keep)) is None:
                raise busy(first)
            sent_at, mine = ready
        else:
            # A wait returns its lease ready: a stall since is any holder's stall.
            handoff = plan.handoff
    except BaseException as exc:
        # A refusal or a timeout left the line already; a server error leaves the place
        # to lapse. Anything else (KeyboardInterrupt, ...) must not keep it, nor a lease.
        if not isinstance(exc, MongoLockError):
            _abandon(store, request if plan is None else plan.request)
        raise
    try:
        lock = _handle(source, mine, sent_at, keep, on_lost, _full(mine, request))
    except BaseException:
        # No handle for the caller (a refresher thread that could not start, an
        # interrupt): nobody could release the lease, which would block others to its end.
        _abandon(store, request)
        raise
    if announcing:
        announce(lock)
    _told(source, handoff, lock)
    return lock


def _first_attempt(
    waiters: Waiters, store: LockStore, request: Request
) -> tuple[float, float, LockInfo]:
    """A blocking acquire's first attempt: when its first request was sent, when the
    one that answered was, and the answer.

    A key this manager has not lately found busy is asked for without a place in line:
    the server parses that request faster (the line's expressions are most of a
    queueing request's bytes), and it is all that an uncontended acquire sends. Only a
    key found busy costs a second request, which joins the line. A key lately busy
    joins the line with the first request, as a waiter's every later attempt does.
    """
    started = clock.now()
    if not waiters.lately_busy(request.key):
        info = store.acquire(**request.arguments(queue=False))
        if _noted(waiters, request, info):
            return started, started, info
    sent_at = clock.now()
    info = store.acquire(**request.arguments(queue=True))
    _noted(waiters, request, info)
    return started, sent_at, info


async def _afirst_attempt(
    waiters: Waiters, store: AsyncLockStore, request: Request
) -> tuple[float, float, LockInfo]:
    """``_first_attempt`` for coroutines."""
    started = clock.now()
    if not waiters.lately_busy(request.key):
        info = await _shielded(store, request, queue=False)
        if _noted(waiters, request, info):
            return started, started, info
    sent_at = clock.now()
    info = await _shielded(store, request, queue=True)
    _noted(waiters, request, info)
    return started, sent_at, info


def _noted(waiters: Waiters, request: Request, info: LockInfo) -> bool:
    """Whether the attempt that answered ``info`` took the key; a key it found busy, or
    took with others waiting (a shared request may enter past shared waiters), is noted
    as lately busy: it likely is at this manager's next acquire too."""
    taken = request.taken(info) is not None
    if not taken or info.waiting:
        waiters.found_busy(request.key)
    return taken


@events.waited
def _wait(
    source: Source, store: LockStore, plan: WaitPlan, wake: Wake, keep: bool
) -> tuple[float, LockInfo]:
    """Retry until the key is ours: woken by a release, the holder's lease end, a failure
    of the change stream, or back-off."""
    watcher = source.watcher
    watcher.ensure_running(plan.request.owner)
    while True:
        since = watcher.healthy_since()
        wake_at = plan.wake_at(since, clock.now())
        if wake_at is None:
            with contextlib.suppress(MongoLockError):  # the place lapses by itself soon
                # A release may hand us the lock right now: leaving gives it back.
                store.leave(plan.request.key, plan.request.owner)
            raise plan.busy(clock.now())
        while (left := wake_at - clock.now()) > 0 and wake.wait(left):
            # Cleared before it is looked at: a wake-up that comes meanwhile is kept.
            wake.clear()
            if _stirred(plan, wake, watcher, since):
                break
            wake_at = plan.behind(wake_at, clock.now())
        handed = plan.handed(wake.handed)
        if handed is not None:
            if (kept := _kept(store, plan, plan.sent_at, handed, keep)) is not None:
                return kept
            _renamed(source, plan, wake)
        wake.clear()
        wake.handed = None  # a handoff from here on comes after this attempt
        watcher.ensure_running(plan.request.owner)
        seen, sent_at = wake.count, clock.now()
        try:
            info = store.acquire(**plan.request.arguments(queue=True))
        except LockNotAcquired as exc:
            if type(exc) is not LockNotAcquired:
                raise
            _renamed(source, plan, wake)
            seen, sent_at = wake.count, clock.now()
            info = store.acquire(**plan.request.arguments(queue=True))
        mine = plan.answered(sent_at, info, seen, wake.handed)
        if mine is not None:
            if (kept := _kept(store, plan, sent_at, mine, keep)) is not None:
                return kept
            _renamed(source, plan, wake)


def _stirred(plan: WaitPlan, wake: Wake | AsyncWake, watcher: Watcher, since: float | None) -> bool:
    """Whether a waiter woken before its time tries now: its turn may have come, a
    release handed it the lock, or its stream failed or reopened since it planned its
    sleep (``since``). Then releases may have gone unheard, and a timer set for a stream
    no longer holds: a waiter behind others would sleep on while MongoDB is gone.
    """
    return plan.woken(wake.count) or wake.handed is not None or watcher.healthy_since() != since


def _kept(
    store: LockStore, plan: WaitPlan, sent_at: float, lease: LockInfo, keep: bool
) -> tuple[float, LockInfo] | None:
    """``lease``, got while waiting, as the wait's answer (``_ready``); None when it is
    found over, and the wait goes on as a new acquisition."""
    return _ready(store, plan.request, sent_at, first_lease(lease, plan.request), keep)


async def _akept(
    store: AsyncLockStore, plan: WaitPlan, sent_at: float, lease: LockInfo, keep: bool
) -> tuple[float, LockInfo] | None:
    """``_kept`` for coroutines."""
    return await _aready(store, plan.request, sent_at, first_lease(lease, plan.request), keep)


def _ready(
    store: LockStore, request: Request, sent_at: float, first: LockInfo, keep: bool
) -> tuple[float, LockInfo] | None:
    """A lease just got (its ``first_lease``), with when its request was sent, ready to
    return: extended to the ttl asked for first when it ``must_extend``; None when that
    finds it over."""
    if not must_extend(sent_at, first, request, clock.now(), keep=keep):
        return sent_at, first
    sent_at = clock.now()
    extended = store.refresh(
        request.key, request.owner, first.token, request.ttl, shared=request.shared
    )
    return None if extended is None else (sent_at, extended)


async def _aready(
    store: AsyncLockStore, request: Request, sent_at: float, first: LockInfo, keep: bool
) -> tuple[float, LockInfo] | None:
    """``_ready`` for coroutines."""
    if not must_extend(sent_at, first, request, clock.now(), keep=keep):
        return sent_at, first
    sent_at = clock.now()
    extended = await store.refresh(
        request.key, request.owner, first.token, request.ttl, shared=request.shared
    )
    return None if extended is None else (sent_at, extended)


@events.aobserved
async def aacquire(
    source: Source,
    request: Request,
    wait: float | None,
    keep: bool,
    on_lost: Callable[[Lock], object] | None,
) -> Lock:
    """``acquire`` for coroutines: the same plan, sleeping on an asyncio event."""
    source = source._resolved()
    store = await source.astore()
    plan: WaitPlan | None = None
    try:
        if wait == 0:
            sent_at = clock.now()
            info = await _shielded(store, request, queue=False)
            mine = request.taken(info)
            if mine is None:
                raise busy(info)
        else:
            with source.waiters.subscribe_async(request.key, request.owner) as wake:
                started, sent_at, info = await _afirst_attempt(source.waiters, store, request)
                mine = request.taken(info)
                if mine is None:
                    plan = WaitPlan(request, wait, sent_at, info, started)
                    try:
                        sent_at, mine = await _await(source, store, plan, wake, keep)
                    finally:
                        source.waiters.found_busy(request.key)  # busy until now
                    request = plan.request
        if plan is None:
            first = first_lease(mine, request)
            handoff = _handoff(mine, first)
            if (ready := await _aready(store, request, sent_at, first, keep)) is None:
                raise busy(first)
            sent_at, mine = ready
        else:
            handoff = plan.handoff
    except BaseException as exc:
        # Cancelled (a task cancelled, a request aborted): leave the line as a timeout
        # does, or the next holder would wait for our place, and give back a lease the
        # cancelled write may have taken or extended. (A coroutine closed by its garbage
        # collection may not await any more.)
        if not isinstance(exc, MongoLockError | GeneratorExit):
            await _leave_line(store, request if plan is None else plan.request, stopped=True)
        raise
    try:
        lock = _handle(source, mine, sent_at, keep, on_lost, _full(mine, request))
    except BaseException:
        await _leave_line(store, request, stopped=True)  # as ``acquire`` does
        raise
    lock = await aannounce(lock)
    _told(source, handoff, lock)
    return lock


@events.awaited
async def _await(
    source: Source, store: AsyncLockStore, plan: WaitPlan, wake: AsyncWake, keep: bool
) -> tuple[float, LockInfo]:
    """``_wait`` for coroutines."""
    watcher = source.watcher
    watcher.ensure_running(plan.request.owner)
    while True:
        since = watcher.healthy_since()
        wake_at = plan.wake_at(since, clock.now())
        if wake_at is None:
            await _leave_line(store, plan.request)
            raise plan.busy(clock.now())
        while (left := wake_at - clock.now()) > 0:
            try:
                # Not wait_for: on Python 3.11 it loses a cancellation that comes with
                # the wake-up, and the task would wait in line for good.
                async with asyncio.timeout(left):
                    await wake.wait()
            except TimeoutError:
                break
            wake.clear()  # see _wait
            if _stirred(plan, wake, watcher, since):
                break
            wake_at = plan.behind(wake_at, clock.now())
        handed = plan.handed(wake.handed)
        if handed is not None:
            if (kept := await _akept(store, plan, plan.sent_at, handed, keep)) is not None:
                return kept
            _renamed(source, plan, wake)
        wake.clear()
        wake.handed = None  # see _wait
        watcher.ensure_running(plan.request.owner)
        seen, sent_at = wake.count, clock.now()
        try:
            info = await _shielded(store, plan.request, queue=True)
        except LockNotAcquired as exc:
            if type(exc) is not LockNotAcquired:
                raise
            _renamed(source, plan, wake)
            seen, sent_at = wake.count, clock.now()
            info = await _shielded(store, plan.request, queue=True)
        mine = plan.answered(sent_at, info, seen, wake.handed)
        if mine is not None:
            if (kept := await _akept(store, plan, sent_at, mine, keep)) is not None:
                return kept
            _renamed(source, plan, wake)


def _handoff(mine: LockInfo, first: LockInfo) -> str | None:
    """ "" if the first attempt's ``mine`` was handed over, else None.

    Without a wait, the first attempt took the key: handed over only if a release
    handed it to the place that attempt had taken in line when its reply was lost,
    before the same attempt was sent again. ``first`` is ``first_lease(mine, ...)``,
    computed once by the caller: a shorter first lease is what tells (``handed_over``).
    """
    return "" if first.ttl < mine.ttl else None


def _told(source: Source, handoff: str | None, lock: Lock) -> None:
    """Tell observers that ``lock`` came straight from the release of its last holder,
    once it is surely the caller's: after the refresh that makes a lease ready (which,
    finding it over, renames a wait and clears its handoff), and after the
    ``lock_acquired`` receivers, which may give it back."""
    if handoff is not None:
        events.handoff(source, lock.key, handoff, lock.owner, lock.token)


def _renamed(source: Source, plan: WaitPlan, wake: Wake | AsyncWake) -> None:
    """Go on waiting as a new acquisition after this one's lease was found over.

    While waiting, a lease ends before the waiter can take it when it was learnt too
    late, or held up before the refresh that makes it ready (``_kept``): handed over by
    a release (the store then refuses the next attempt, as for any request whose lease
    ended before it took it), or found by an attempt whose answer came after its end.
    The caller's wait is not over: it tries again at once under a new owner id, and
    that lapsed lease stays over for good.
    """
    plan.rename(source.new_owner())
    wake.owner = plan.request.owner
    wake.handed = None


def _full(mine: LockInfo, request: Request) -> float | None:
    """The ttl a handed lock's refresher extends it to (None: its lease has it)."""
    return request.ttl if mine.ttl < request.ttl else None


def _handle(
    source: Source,
    mine: LockInfo,
    sent_at: float,
    keep: bool,
    on_lost: Callable[[Lock], object] | None,
    ttl: float | None = None,
) -> Lock:
    lock = Lock(source, mine, sent_at, on_lost=on_lost, refresh=keep)
    refresher = get_refresher() if keep else None
    try:
        if refresher is not None:
            # The refresher's first tick comes within a third of the lease it registers:
            # registered with a handed lock's short first lease, then told the full one.
            refresher.register(lock)
        if ttl is not None:
            lock.lengthen(ttl)
    except BaseException:
        # A lane may hold it already (its thread then failed to start): the caller never
        # gets it, so it is neither kept nor lost; the caller gives its lease back.
        lock.take_release()
        if refresher is not None:
            refresher.unregister(lock)
        raise
    return lock


def _abandon(store: LockStore, request: Request) -> None:
    """Leave the line of a wait that was interrupted, and give back what it took.

    The interruption may have cut an attempt or the refresh that makes a lease ready
    short after the server applied it, or before it did (the attempt's bytes still on
    their way), or a release may have handed the lock over: a lease of this request's
    is released rather than left to lapse, and an attempt applied later is refused
    (``LockStore.abandon``). Best effort: the place lapses by itself soon, the lease at
    its end.
    """
    with contextlib.suppress(MongoLockError):
        store.abandon(request.key, request.owner, shared=request.shared)


def announce(lock: Lock) -> Lock:
    """Send ``lock_acquired``; if a receiver fails, release the lock and raise its error.

    Every receiver runs (``send_robust``), so each one that is told of the
    acquisition is told of the release too. The caller never gets a handle, so
    the key must not stay taken by nobody's handle until its lease ends.
    """
    try:
        failed = _failure(lock_acquired.send_robust(sender=lock.backend, lock=lock))
    except BaseException:  # sys.exit() or KeyboardInterrupt in a receiver
        _give_back_quietly(lock)
        raise
    if failed is not None:
        _give_back_quietly(lock)
        raise failed
    return lock


async def aannounce(lock: Lock) -> Lock:
    """``announce`` for coroutines: the release goes through the async client."""
    try:
        failed = _failure(lock_acquired.send_robust(sender=lock.backend, lock=lock))
    except BaseException:
        await _agive_back_quietly(lock)
        raise
    if failed is not None:
        await _agive_back_quietly(lock)
        raise failed
    return lock


def _failure(responses: list[tuple[Any, Any]]) -> BaseException | None:
    """The first error of ``send_robust`` responses (Django logs each of them)."""
    return next((r for _, r in responses if isinstance(r, BaseException)), None)


def _give_back_quietly(lock: Lock) -> None:
    """Release a lock its caller will never get; if that fails, its lease lapses."""
    try:
        lock.release()
    except MongoLockError as exc:
        logger.warning("could not release %r after a failed receiver: %s", lock.key, exc)


async def _agive_back_quietly(lock: Lock) -> None:
    try:
        await lock.arelease()
    except MongoLockError as exc:
        logger.warning("could not release %r after a failed receiver: %s", lock.key, exc)


async def _shielded(store: AsyncLockStore, request: Request, *, queue: bool) -> LockInfo:
    """One attempt that a cancellation cannot cut in half.

    If the caller is cancelled while the attempt is in flight, the attempt still
    completes, and a lock it took is released at once instead of being left to lapse.
    The cancellation waits for the attempt (unless cancelled again), so that leaving
    the line afterwards comes after the attempt that took the place.
    """
    attempt = asyncio.ensure_future(store.acquire(**request.arguments(queue=queue)))
    try:
        return await asyncio.shield(attempt)
    except asyncio.CancelledError:
        attempt.add_done_callback(functools.partial(_give_back, store, request))
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait([attempt])
        raise


def _give_back(store: AsyncLockStore, request: Request, attempt: asyncio.Future[LockInfo]) -> None:
    if attempt.cancelled() or attempt.exception() is not None:
        return
    mine = request.taken(attempt.result())
    if mine is None:
        return
    _in_background(store.release(mine.key, mine.owner, mine.token, shared=request.shared))


async def _leave_line(store: AsyncLockStore, request: Request, *, stopped: bool = False) -> None:
    """Give up a waiter's place in line (and a lock a release handed over meanwhile),
    even if the caller is cancelled meanwhile; ``stopped``, for a caller stopped before
    its acquire could end: as ``_abandon`` (``AsyncLockStore.abandon``).

    The write runs as a task of its own: a cancellation stops the wait for it, not it.
    """
    key, owner = request.key, request.owner
    work = store.abandon(key, owner, shared=request.shared) if stopped else store.leave(key, owner)
    leave = _in_background(work)
    with contextlib.suppress(MongoLockError):  # the place lapses by itself soon
        await asyncio.shield(leave)


def _in_background(work: Coroutine[Any, Any, _T]) -> asyncio.Future[_T]:
    """Run ``work`` as a task that nobody may be left to await: kept referenced until
    done, its error (the lease or the place lapses by itself) not reported twice.
    """
    task = asyncio.ensure_future(work)
    ABANDONED.add(task)
    task.add_done_callback(_forget)
    return task


def _forget(task: asyncio.Future[Any]) -> None:
    ABANDONED.discard(task)
    if not task.cancelled():
        task.exception()  # retrieved: no "exception was never retrieved" at exit


# Clean-up writes of cancelled acquisitions, kept referenced until they finish.
ABANDONED: set[asyncio.Future[Any]] = set()
