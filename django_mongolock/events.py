"""What the locks of this process do, as typed events for in-process observers.

The core calls the functions below at each state change (an acquisition finished, a
release, a loss, a refresher tick, a handoff); observers given to ``subscribe`` receive
one frozen event each, in the thread (or task) where the change happened, so an
observer sees the caller's context (its current span, its request). Metrics, traces
and the admin's statistics are observers (``contrib/``); the core knows none of them.

While nobody listens, each call returns at its first test: no event is built and no
clock is read. The few log lines users care about (a loss, a refresher behind its
schedule, an acquisition that had to wait) are written here whether or not anybody
listens, with their fields as ``extra`` so that JSON log formatters pick them up; an
uncontended acquisition writes none.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import weakref
from collections.abc import Awaitable, Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Final, Literal, ParamSpec, Protocol, TypeVar

from django_mongolock import clock
from django_mongolock.exceptions import LockNotAcquired
from django_mongolock.notices import get_notices
from django_mongolock.reasons import (
    CLOSED,
    LAPSED,
    answered,
    lease_refused,
    refused,
    unanswered,
)

__all__ = [
    "AcquireFinished",
    "Event",
    "Handoff",
    "Held",
    "Lost",
    "Observer",
    "RefresherTick",
    "Released",
    "held_count",
    "subscribe",
    "waiting_count",
]

Outcome = Literal["acquired", "busy", "timeout", "error", "cancelled"]
Reason = Literal["expired", "force-released", "server-unreachable", "refresh-failed"]

OUTCOMES: Final = ("acquired", "busy", "timeout", "error", "cancelled")
REASONS: Final = ("expired", "force-released", "server-unreachable", "refresh-failed")


logger = logging.getLogger("django_mongolock.events")
loss_logger = logging.getLogger("django_mongolock.lock")
wait_logger = logging.getLogger("django_mongolock.manager")
tick_logger = logging.getLogger("django_mongolock.refresher")


class Held(Protocol):
    """A held lock as the events show it (a ``Lock``)."""

    @property
    def key(self) -> str: ...
    @property
    def owner(self) -> str: ...
    @property
    def token(self) -> int: ...
    @property
    def shared(self) -> bool: ...
    @property
    def over(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class AcquireFinished:
    """One call to acquire ended: ``waited`` seconds after it began (round trips included).

    ``lock`` is the handle when ``outcome`` is "acquired" (``token`` is its token), else None.
    ``contended``: its first attempt found the key taken and it waited for it (a slow
    round trip on a loaded machine is not a wait; a timeout always is).
    """

    source: object
    key: str
    owner: str
    shared: bool
    outcome: Outcome
    waited: float
    token: int | None
    lock: Held | None
    error: BaseException | None = None
    contended: bool = False


@dataclass(frozen=True, slots=True)
class Released:
    """Its holder released a lock; ``held_for`` is None if it was taken before anybody
    listened; ``held`` is False if the lease had already ended, on the server or by this
    process's clock (a ``Lost`` comes too, before or after)."""

    source: object
    lock: Held
    held: bool
    held_for: float | None


@dataclass(frozen=True, slots=True)
class Lost:
    """The holder learnt it lost its lock: ``reason`` is one of ``REASONS``, ``detail``
    the sentence the holder's ``LockLost`` carries."""

    source: object
    lock: Held
    reason: Reason
    detail: str
    held_for: float | None


@dataclass(frozen=True, slots=True)
class RefresherTick:
    """One tick of a manager's refresher lane, on the lane's thread, after its writes.

    ``lag`` is how late it started after its due time; ``interval`` the lane's period;
    ``ok`` False when the refresh failed: the server was unreachable, or it answered
    with an error (for some of the leases, or all).
    """

    source: object
    duration: float
    lag: float
    leases: int
    interval: float
    ok: bool


@dataclass(frozen=True, slots=True)
class Handoff:
    """A lock passed from its holder straight to the next waiter in line."""

    source: object
    key: str
    from_owner: str
    to_owner: str
    token: int


Event = AcquireFinished | Released | Lost | RefresherTick | Handoff
Observer = Callable[[Event], object]

_observers: tuple[Observer, ...] = ()
_mutex = threading.Lock()
# When each handle seen acquired was taken (clock.now()), while somebody listens.
_since: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()
_waiting = 0


def subscribe(observer: Observer) -> Callable[[], None]:
    """Call ``observer(event)`` for every event from now on; returns the unsubscribe call.

    An observer should be quick: acquisitions and releases are told in the thread of the
    change (the holder's); losses and refresher ticks on a notice worker, so that an
    observer that blocks never holds up a refresh or another lock's loss. One that raises
    is logged and skipped; the lock goes on.
    """
    global _observers
    if not callable(observer):
        raise TypeError(f"observer must be callable, not {type(observer).__name__}")
    with _mutex:
        _observers = (*_observers, observer)

    def unsubscribe() -> None:
        global _observers
        with _mutex:
            _observers = tuple(o for o in _observers if o is not observer)
            if not _observers:
                _since.clear()

    return unsubscribe


def listening() -> bool:
    """Whether any observer is subscribed (the core builds events only then)."""
    return bool(_observers)


def observers() -> tuple[Observer, ...]:
    """The observers subscribed now, in the order they subscribed."""
    return _observers


@contextlib.contextmanager
def swapped(chosen: tuple[Observer, ...]) -> Iterator[None]:
    """Inside, ``chosen`` alone receive the events, the subscribed ones after (benchmarks
    and tests: one plain assignment each way, cheap enough to swap every cycle). Not for
    a process whose other threads subscribe meanwhile: the exit puts the old set back."""
    global _observers
    subscribed = _observers
    _observers = chosen
    try:
        yield
    finally:
        _observers = subscribed


def held_count() -> int:
    """Locks this process took while somebody listened and still holds."""
    with _mutex:
        return len(_since)


def waiting_count() -> int:
    """Acquisitions under way in this process (waiting or in flight), while somebody listens."""
    return _waiting


def _emit_aside(event: Event) -> None:
    """Tell the observers on a notice worker: the engine's own threads (the deadline watch,
    the refresher) emit losses and ticks, and no observer may hold them up."""
    get_notices().post(functools.partial(_emit, event))


def _emit(event: Event) -> None:
    for observer in _observers:
        try:
            observer(event)
        except Exception:
            logger.exception("lock event observer %r failed", observer)


# -- acquisitions -------------------------------------------------------------------------------

_P = ParamSpec("_P")
_H = TypeVar("_H", bound=Held)

# Set by the wait loops, read when the acquisition around them ends (same thread or task):
# whether it found the key taken. Its elapsed time cannot tell on a loaded machine.
_contended: ContextVar[bool] = ContextVar("django_mongolock_contended", default=False)


def observed(acquire: Callable[_P, _H]) -> Callable[_P, _H]:
    """Wrap the sync acquire ``(source, request, wait, ...)``: one ``AcquireFinished``."""

    @functools.wraps(acquire)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _H:
        if not _observers:
            return acquire(*args, **kwargs)
        started, outer = _began(), _uncontended()
        try:
            lock = acquire(*args, **kwargs)
        except BaseException as exc:
            _failed(args, started, exc)
            raise
        else:
            _acquired(args, started, lock)
        finally:
            _contended.set(outer)
        return lock

    return wrapper


def aobserved(acquire: Callable[_P, Awaitable[_H]]) -> Callable[_P, Awaitable[_H]]:
    """``observed`` for the async acquire."""

    @functools.wraps(acquire)
    async def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _H:
        if not _observers:
            return await acquire(*args, **kwargs)
        started, outer = _began(), _uncontended()
        try:
            lock = await acquire(*args, **kwargs)
        except BaseException as exc:
            _failed(args, started, exc)
            raise
        else:
            _acquired(args, started, lock)
        finally:
            _contended.set(outer)
        return lock

    return wrapper


def _uncontended() -> bool:
    """Clear the flag for an acquisition starting; the value to put back when it ends,
    by ``set``, not ``reset``: a coroutine closed by its garbage collection ends in
    whatever context is current then."""
    outer = _contended.get()
    _contended.set(False)
    return outer


def _began() -> float:
    global _waiting
    with _mutex:
        _waiting += 1
    return clock.now()


def _ended() -> float:
    global _waiting
    with _mutex:
        _waiting -= 1
    return clock.now()


def _acquired(args: tuple[Any, ...], started: float, lock: Held) -> None:
    global _waiting
    now = clock.now()
    with _mutex:  # one lock for both: this runs on every acquisition while observed
        _waiting -= 1
        # Lost or released before this (a ``lock_acquired`` receiver ran meanwhile):
        # that end found nothing to pop, and nothing may stay counted as held. Its flag
        # is set before it pops, under this mutex, so one of the two sees the other.
        if not lock.over:
            _since[lock] = now
    source, waited = args[0], now - started
    _emit(
        AcquireFinished(
            source,
            lock.key,
            lock.owner,
            lock.shared,
            "acquired",
            waited,
            lock.token,
            lock,
            contended=_contended.get(),
        )
    )


def _failed(args: tuple[Any, ...], started: float, exc: BaseException) -> None:
    """Any ``Exception`` that is not a refusal is an error (the server's, or a failing
    ``lock_acquired`` receiver's: the lock was given back); the rest is a cancellation."""
    waited, (source, request) = _ended() - started, args[:2]
    outcome: Outcome = "error" if isinstance(exc, Exception) else "cancelled"
    key, owner, shared = request.key, request.owner, request.shared
    # A refusal of another key is a ``lock_acquired`` receiver's own, raised after this
    # acquisition took its key: that receiver's error.
    if isinstance(exc, LockNotAcquired) and exc.key == key:
        outcome = "busy" if exc.waited is None else "timeout"
    contended = _contended.get()
    _emit(AcquireFinished(source, key, owner, shared, outcome, waited, None, None, exc, contended))


def waited(wait: Callable[_P, tuple[float, Any]]) -> Callable[_P, tuple[float, Any]]:
    """Wrap the sync wait loop ``(source, store, plan, wake)``: log an acquisition that
    had to wait (only contended acquisitions get here)."""

    @functools.wraps(wait)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> tuple[float, Any]:
        if _observers:
            _contended.set(True)
        started = clock.now()
        result = wait(*args, **kwargs)
        _log_wait(args[2], result[1], started)
        return result

    return wrapper


def awaited(
    wait: Callable[_P, Awaitable[tuple[float, Any]]],
) -> Callable[_P, Awaitable[tuple[float, Any]]]:
    """``waited`` for the async wait loop."""

    @functools.wraps(wait)
    async def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> tuple[float, Any]:
        if _observers:
            _contended.set(True)
        started = clock.now()
        result = await wait(*args, **kwargs)
        _log_wait(args[2], result[1], started)
        return result

    return wrapper


def _log_wait(plan: Any, info: Any, started: float) -> None:
    """One INFO line for an acquisition that waited (its first attempt found the key taken)."""
    if not wait_logger.isEnabledFor(logging.INFO):
        return
    seconds = clock.now() - started
    wait_logger.info(
        "lock %r acquired after waiting %.3fs (token %s)",
        info.key,
        seconds,
        info.token,
        extra={
            "key": info.key,
            "owner": plan.request.owner,
            "token": info.token,
            "shared": plan.request.shared,
            "waited_seconds": round(seconds, 6),
        },
    )


# -- releases and losses ------------------------------------------------------------------------


def released(source: object, lock: Held, held: bool) -> None:
    """The holder's own release went through (``held``: its lease was still running)."""
    if not _observers:
        return
    _emit(Released(source, lock, held, _held_for(lock)))


def lost(source: object, lock: Held, detail: str, deadline: float) -> None:
    """The holder learnt its lock is lost (once per lock): log it, then tell the observers."""
    reason = _reason(source, lock, detail, deadline)
    held_for = _held_for(lock) if _observers else None
    loss_logger.warning(
        "lock %r (token %s) lost: %s",
        lock.key,
        lock.token,
        detail,
        extra={
            "key": lock.key,
            "owner": lock.owner,
            "token": lock.token,
            "shared": lock.shared,
            "reason": reason,
            "held_seconds": None if held_for is None else round(held_for, 6),
        },
    )
    if _observers:
        _emit_aside(Lost(source, lock, reason, detail, held_for))


def _reason(source: object, lock: object, detail: str, deadline: float) -> Reason:
    """Sort a loss: the local deadline comes before the server's lease end, so a refusal
    before it means somebody else removed the lock. A lease that ended while the server
    answered its refresh with an error, or whose manager was closed, ended as its refresh
    failed; one that ended while the server could not be reached, or while a refresh of
    it sent before its end had no answer yet, for want of a server; otherwise nobody
    refreshed it in time (``expired``)."""
    if detail == CLOSED:
        return "refresh-failed"
    if detail == LAPSED or clock.now() >= deadline:
        if lease_refused(lock) or (refused(source) and getattr(lock, "refreshable", False)):
            return "refresh-failed"
        return "server-unreachable" if unanswered(source, lock, deadline) else "expired"
    return "force-released"


def _held_for(lock: Held) -> float | None:
    with _mutex:
        since = _since.pop(lock, None)
    return None if since is None else clock.now() - since


# -- the refresher and handoffs -----------------------------------------------------------------


def tick(
    source: object,
    started: float,
    lag: float,
    leases: int,
    every: float,
    ok: bool,
    *,
    refusal: bool = False,
    partial: bool = False,
) -> None:
    """A lane's tick ended: log one that started more than half an interval late (its
    leases last three intervals: half of one late is the first sign of a stalled lane).
    ``refusal``: the server answered the refresh write with an error; ``partial``: it
    refused some of the leases' writes only (the tick is not ``ok`` for observers)."""
    answered(source, ok, refused=refusal)
    if lag > every / 2:
        tick_logger.warning(
            "the lock refresher is %.3fs behind its schedule (%d lease(s), every %.3fs)",
            lag,
            leases,
            every,
            extra={"lag_seconds": round(lag, 6), "leases": leases, "interval_seconds": every},
        )
    if _observers:
        took, late = clock.now() - started, max(0.0, lag)
        _emit_aside(RefresherTick(source, took, late, leases, every, ok and not partial))


def handoff(source: object, key: str, from_owner: str, to_owner: str, token: int) -> None:
    """A holder handed its lock to the next waiter in line."""
    if _observers:
        _emit(Handoff(source, key, from_owner, to_owner, token))
