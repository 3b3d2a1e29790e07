"""A lane: the thread that keeps the leases of one lock source alive and runs its elections.

See ``refresher.py`` for the whole: one lane per source (a ``LockManager``), so a slow
or unreachable server delays only its own lane. A lane knows the leases it keeps through
the ``Lease`` protocol only (a ``Lock`` is one), and its elections through ``Campaign``.
A tick with exclusive and shared leases sends the shared ones' write from a thread that
lasts for that write (``_Aside``), beside the exclusive one.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
import logging
import math
import threading
import weakref
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import pymongo
from pymongo.errors import WriteError

from django_mongolock import clock, events, reasons
from django_mongolock.exceptions import MongoLockError, ServerUnavailable
from django_mongolock.info import processes_of
from django_mongolock.mongo import DOCUMENT_REFUSED
from django_mongolock.store import Kept, LockStore

__all__ = ["Campaign", "Lane", "Lease", "Registry", "StoreSource", "interval"]

logger = logging.getLogger("django_mongolock.refresher")

# Never tick more often than this, whatever the shortest lease (a 1 ms lease cannot be kept).
MIN_INTERVAL = 0.05
# After a failed tick, try again this soon (or at the usual interval, if shorter).
RETRY_INTERVAL = 1.0
# A lane that keeps nothing for this long ends its thread.
IDLE_END = 5.0
# The shortest time a refresh write is given, even when its leases are about to end.
MIN_WRITE_TIME = 0.05
# How long past its budget a tick waits for the shared leases' write from its own
# thread (``_Aside``, named after the lane's with this suffix); that write's timeout
# ends it before.
ASIDE_SLACK = 1.0
ASIDE_SUFFIX = "-shared"
# A tick starts no campaign once this share of its interval has passed since it began:
# the elections left go first on the next tick, and the next refresh is not late.
CAMPAIGN_SHARE = 0.5


class StoreSource(Protocol):
    """Whose leases share a lane (a ``LockManager``): the store of this process, which
    raises MongoLockError once the source is closed."""

    @property
    def store(self) -> LockStore: ...


class Lease(Protocol):
    """What a lane needs of a held lock (a ``Lock``): who holds what, until when, and the
    few transitions the refresher makes (renewed, lost, released at exit)."""

    @property
    def backend(self) -> StoreSource: ...
    @property
    def store(self) -> LockStore: ...
    @property
    def key(self) -> str: ...
    @property
    def owner(self) -> str: ...
    @property
    def token(self) -> int: ...
    @property
    def ttl(self) -> float: ...
    @property
    def shared(self) -> bool: ...
    @property
    def refreshable(self) -> bool: ...
    @property
    def deadline(self) -> float: ...
    @property
    def over(self) -> bool: ...
    @property
    def released(self) -> bool: ...

    def renewed(self, sent_at: float, ends: dict[float, float] | None = None) -> bool: ...

    def mark_lost(self, reason: str, *, inline: bool = True) -> bool: ...

    def take_release(self) -> bool: ...


class Campaign(Protocol):
    """What a lane needs of an election: its source, its lease and one attempt to lead."""

    @property
    def backend(self) -> StoreSource: ...
    @property
    def key(self) -> str: ...
    @property
    def ttl(self) -> float: ...

    def campaign(self) -> None: ...


class Registry(Protocol):
    """The refresher, as its lanes see it: where an idle lane leaves, and who counts restarts."""

    def forget(self, lane: Lane) -> None: ...

    def restarted(self) -> None: ...


class Lane:
    """The thread that refreshes the leases of one manager and runs its elections."""

    def __init__(self, refresher: Registry, manager: StoreSource) -> None:
        self.refresher = refresher
        self.manager = manager
        self._locks: weakref.WeakSet[Lease] = weakref.WeakSet()
        # Elections campaign until stopped, so they are held strongly, like a thread. In
        # the order they campaign in: a tick takes each from the left and puts it back on
        # the right, and a new one joins on the left.
        self._elections: collections.deque[Campaign] = collections.deque()
        self._cond = threading.Condition()
        self._due = math.inf
        self._stopping = False
        self._retired = False
        self._thread: threading.Thread | None = None
        self._failing = False  # the last refresh failed: the server was unreachable, or refused it
        self._refused = False  # the server answered the last refresh with an error
        self._partly = False  # ... or refused the writes of some of its leases only
        self._silent = False  # the last heartbeat failed (logged once)
        self.ticks = 0
        self._late = 0.0  # how late the current tick started after its due time
        # When the next tick of every lease is due: one due before is an early tick, for
        # leases handed over with a short first lease, and refreshes only the leases
        # that could not wait for it.
        self._full_due = 0.0
        # Moves on whenever a lease joins or leaves ``_locks`` through this lane. One
        # whose handle is garbage collected leaves by itself, and only ever leaves: at
        # the same version, as many leases are the same leases, and a tick reuses the
        # last one's ``_Batch`` while neither has changed.
        self._version = 0
        self._batch: _Batch | None = None

    def __len__(self) -> int:
        with self._cond:
            return len(self._locks)

    @property
    def due(self) -> float:
        return self._due

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def batch(self) -> _Batch | None:
        """What the last tick sent for the leases, kept while none came or went: for
        inspection (read-only)."""
        return self._batch

    @property
    def current(self) -> bool:
        """Whether the kept ``batch`` lists the lane's leases of now."""
        batch = self._batch
        return batch is not None and batch.version == self._version

    def add(self, lock: Lease) -> bool:
        """Keep ``lock``; False if this lane has retired (the refresher has a new one)."""
        with self._cond:
            if self._retired:
                return False
            self._locks.add(lock)
            self._version += 1
            now = clock.now()
            every = interval(lock.ttl)
            left = lock.deadline - now
            # A lock handed over by a release may come with under two intervals of its
            # short first lease left: its first tick then comes at a third of what is left.
            self._schedule(now + (every if left >= 2 * every else max(MIN_INTERVAL, left / 3)))
            return True

    def discard(self, lock: Lease) -> None:
        with self._cond:
            self._locks.discard(lock)
            self._version += 1

    def add_election(self, election: Campaign) -> bool:
        with self._cond:
            if self._retired:
                return False
            if election not in self._elections:
                self._elections.appendleft(election)
            self._schedule(clock.now())
            return True

    def remove_election(self, election: Campaign) -> None:
        with self._cond, contextlib.suppress(ValueError):
            self._elections.remove(election)

    def held(self) -> list[Lease]:
        with self._cond:
            return [lk for lk in self._locks if not lk.over]

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def join(self, timeout: float) -> None:
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _retire(self) -> bool:
        """Leave the refresher if this lane keeps nothing (its thread then ends); False if
        it must go on. The lane's condition first, then the refresher's mutex, as in
        ``_schedule``."""
        with self._cond:
            if self._locks or self._elections:
                return False
            self.refresher.forget(self)
            self._retired = True
            return True

    def _schedule(self, due: float) -> None:
        """Tick no later than ``due``; (re)start the thread when needed (holding ``_cond``).

        Only a due date earlier than the sleeping thread's wakes it: acquiring and
        releasing in a loop costs no thread switch per lock; the next tick simply
        refreshes whatever is held by then.
        """
        if self._thread is None or not self._thread.is_alive():
            self._due = due
            self._start()
        elif due < self._due:
            self._due = due
            self._cond.notify()

    @property
    def name(self) -> str:
        """Its thread's name."""
        return f"mongolock-refresher-{id(self.manager):x}"

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException:
            logger.exception("a refresher thread failed")
        finally:
            with self._cond:
                if (
                    not self._stopping
                    and not self._retired
                    and self._thread is threading.current_thread()
                    and (self._locks or self._elections)
                ):
                    logger.error("a refresher thread ended unexpectedly; restarting it")
                    self.refresher.restarted()
                    self._start()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping:
                    if not (self._locks or self._elections):
                        self._due = math.inf
                    left = self._due - clock.now()
                    if left <= 0:
                        break
                    if left == math.inf:
                        # Nothing kept for a while: end the thread; a new lock restarts it.
                        self._cond.wait(IDLE_END)
                        if self._due == math.inf and not (self._locks or self._elections):
                            break
                        continue
                    self._cond.wait(left)
                if self._stopping:
                    return
                # A lock registered while the tick runs may ask for an earlier tick.
                due, self._due = self._due, math.inf
                self._late = clock.now() - due
            if due == math.inf:
                if self._retire():
                    return
                continue
            try:
                self.tick(forced=False)
            except BaseException:  # user code runs in campaigns: the lane outlives it all
                logger.exception("refresh tick failed")
                with self._cond:
                    self._due = min(self._due, clock.now() + RETRY_INTERVAL)

    def tick(self, *, forced: bool = True) -> None:
        """Extend every held lease of this manager now (one write), then campaign.

        The per-lock work is kept to attribute reads and one float store under the
        lock's own mutex: at 10,000 held locks it is a share of the tick that the write
        itself does not dwarf.

        The lane's own ticks (not ``forced``, as one by hand is) are early while the next
        tick of every lease is more than a quarter interval away: they come for leases
        handed over with a short first lease (``add``), and extend only the leases that
        would reach that tick with less left than a tick leaves them (``_kept_until``),
        a lease handed over or shorter than the others. Extending every lease
        then made a stream of handoffs refresh all of a lane's leases every few tenths
        of a second, a write as large as the lane that the other writes queued behind.
        """
        started, lag, self._late = clock.now(), self._late, 0.0
        locks: list[Lease] = []
        over: list[Lease] = []
        with self._cond:
            for lk in self._locks:  # one pass: at 10,000 leases each pass counts
                if lk.over:
                    over.append(lk)  # lost by its deadline: nothing left to keep
                elif lk.refreshable:
                    locks.append(lk)
            for lock in over:
                self._locks.discard(lock)
            if over:
                self._version += 1
            version = self._version
            elections = len(self._elections)
            election_ttl = min((election.ttl for election in self._elections), default=math.inf)
        if not locks:
            self._batch = None  # nothing to keep listed while elections alone tick
            if not elections:
                return
        shortest = min(
            min({lk.ttl for lk in locks}, default=math.inf),
            election_ttl,
        )
        now = clock.now()
        next_due = now + interval(shortest)
        full_due = self._full_due
        # A tick never runs before it is due: one more than a quarter interval before the
        # full tick is early (due for a lease handed over); nearer, it is the full tick.
        early = not forced and now < full_due - interval(shortest) / 4
        if early:
            # A lease is left to the full tick only if it will have there what a tick
            # leaves (every lease the last one extended); that tick must not be put off.
            locks = [lk for lk in locks if lk.deadline < _kept_until(lk, full_due)]
            next_due = min(next_due, full_due)
            if not locks and not elections:
                with self._cond:
                    self._due = min(self._due, next_due)
                return  # nothing written: no tick to tell of
        if locks:
            batch = self._batch
            if early:
                batch = _Batch.of(locks, -1)  # the lane's own batch stays kept
            elif batch is None or batch.version != version or batch.size != len(locks):
                batch = self._batch = _Batch.of(locks, version)
            next_due = min(next_due, self._refresh(locks, batch, shortest))
            self._heartbeat(batch.processes, interval(shortest))
        with self._cond:
            self._due = min(self._due, next_due)
            if not early:
                self._full_due = next_due
        self.ticks += 1
        refreshed = bool(locks)  # an election's tick alone says nothing of the refresh
        events.tick(
            self.manager,
            started,
            lag,
            len(locks),
            interval(shortest),
            not (refreshed and self._failing),
            refusal=refreshed and self._refused,
            partial=refreshed and self._partly,
        )
        if elections:
            self._campaign(started + interval(shortest) * CAMPAIGN_SHARE)

    def _campaign(self, until: float) -> None:
        """One campaign for each of the lane's elections that does not lead, starting none
        after ``until`` (but the first): the rest go first on the next tick, and one added
        meanwhile before them. Each such campaign is an acquire, a write: a thousand of
        them at 2 ms each made the next refresh two seconds late, past the end of a 3 s
        lease. None once the lane stops, not even the first: at exit, a lease won after
        the releases would stay held, unrefreshed, until its ttl ran out."""
        done: set[Campaign] = set()
        while True:
            if self._stopping or (done and clock.now() >= until):
                return
            with self._cond:
                # Each one campaigned goes to the back: one found in front again means
                # all have had their turn, however many came or went meanwhile.
                if not self._elections or self._elections[0] in done:
                    return
                election = self._elections[0]
                self._elections.rotate(-1)
            done.add(election)
            try:
                election.campaign()
            except Exception:  # one election must not stop the others, nor the thread
                logger.exception("campaign for %r failed", election.key)

    def _refresh(self, locks: list[Lease], batch: _Batch, shortest: float) -> float:
        """Extend ``locks`` (a write for the exclusive leases and one for the shared;
        lease by lease for a kind whose write the server refused, see ``_write``); mark
        the ones found released by others lost; when to tick again."""
        try:
            store = self.manager.store
        except MongoLockError:
            for lock in locks:
                lock.mark_lost(reasons.CLOSED, inline=False)
            with self._cond:
                for lock in locks:
                    self._locks.discard(lock)
                self._version += 1
            return math.inf
        sent_at = clock.now()
        # Long enough for the earliest lease (at least one tick's interval), never past
        # the last one: a hung write must not keep the lane from trying again.
        deadlines = [lk.deadline for lk in locks]
        budget = max(
            MIN_WRITE_TIME,
            min(max(deadlines) - sent_at, max(min(deadlines) - sent_at, interval(shortest))),
        )
        reasons.sent(self.manager, sent_at, locks)
        answered = False
        self._refused = self._partly = False
        refused: list[Lease] = []
        try:
            with pymongo.timeout(budget):
                gone, refused = _write(store, locks, batch, budget, self.name + ASIDE_SUFFIX)
            answered = True
            self._partly = bool(refused)
            reasons.accepted(locks, refused)
            if refused:
                reasons.refused_leases(refused)
                logger.warning(
                    "the server refused to refresh %d of %d lock(s) (%s): they will lapse",
                    len(refused),
                    len(locks),
                    ", ".join(repr(lk.key) for lk in refused[:5]),
                )
        except (MongoLockError, pymongo.errors.PyMongoError) as exc:
            if not self._failing:
                logger.warning("cannot refresh %d lock(s): %s", len(locks), exc)
            self._failing = True
            # The server answered with an error (a store error but for an unreachable
            # server): the losses that follow are refresh failures, not a partition's.
            self._refused = isinstance(exc, MongoLockError) and not isinstance(
                exc, ServerUnavailable
            )
            # The deadline watch announces the losses on time; try again soon.
            return clock.now() + min(RETRY_INTERVAL, interval(shortest))
        finally:
            reasons.answered(self.manager, answered, refused=self._refused)
        if self._failing:
            logger.warning("refreshing locks again")
            self._failing = False
        lost: list[Lease] = []
        lapsed: list[Lease] = []
        left = set(map(id, refused)) if refused else None
        ends: dict[float, float] = {}  # each lease length's new deadline
        for lock in locks:
            if left is not None and id(lock) in left:
                continue  # not extended: its deadline comes, as a refresh failure
            if gone and lock.owner in gone:
                if not lock.released:  # released while this tick ran: not lost
                    lost.append(lock)
            # Extended by its ttl at a server time after sent_at.
            elif not lock.renewed(sent_at, ends) and not lock.released:
                lapsed.append(lock)
        if lost or lapsed:
            with self._cond:
                for lock in lost + lapsed:
                    self._locks.discard(lock)
                self._version += 1
        for lock in lost:
            lock.mark_lost(_NOT_EXTENDED, inline=False)
        if lapsed:
            self._give_back(store, lapsed)
        return math.inf

    def _heartbeat(self, processes: frozenset[str], interval: float) -> None:
        """Tell the server the holders' process is alive: one write, never in the way.

        Bounded by the tick interval, skipped while the server is unreachable, and a
        failure is logged once until a heartbeat gets through again.
        """
        if self._failing:
            return
        try:
            store = self.manager.store
            # Half an interval at most: the next tick's refresh must not wait on it.
            with pymongo.timeout(max(MIN_WRITE_TIME, interval / 2)):
                store.heartbeat(processes, interval)
        except (MongoLockError, pymongo.errors.PyMongoError) as exc:
            if not self._silent:
                logger.warning("cannot record this process's heartbeat: %s", exc)
            self._silent = True
            return
        self._silent = False

    def _give_back(self, store: LockStore, lapsed: Sequence[Lease]) -> None:
        """Release leases the server extended after their holders were told they lost them."""
        try:
            with pymongo.timeout(max(MIN_WRITE_TIME, min(lk.ttl for lk in lapsed))):
                store.release_many([(lk.key, lk.owner, lk.token) for lk in lapsed if not lk.shared])
                store.release_shared_many(
                    [(lk.key, lk.owner, lk.token) for lk in lapsed if lk.shared]
                )
        except (MongoLockError, pymongo.errors.PyMongoError) as exc:
            logger.warning("could not give back %d lapsed lease(s): %s", len(lapsed), exc)


_NOT_EXTENDED = "its lease could not be extended (released by somebody else, or already over)"


def interval(ttl: float) -> float:
    return max(MIN_INTERVAL, ttl / 3)


def _kept_until(lock: Lease, full_due: float) -> float:
    """The deadline a tick before ``full_due`` leaves ``lock`` to that tick from: one
    that a tick when ``full_due`` was set gave it, whose lease then ends two intervals
    after ``full_due`` (less the margin), as a lease at the regular pace does."""
    ttl = lock.ttl
    return full_due + ttl - interval(ttl) - clock.margin(ttl)


# A lease as a refresh write names it: key, owner, token.
Held = tuple[str, str, int]


class _Batch(NamedTuple):
    """What a tick sends for a lane's leases: their (key, owner, token), exclusive and
    shared apart, and the processes whose heartbeat it records.

    Built again only when the leases changed (``version``, ``size``): a lease's key,
    owner, token and kind never change, and at 10,000 leases listing them and parsing
    their processes every tick was a quarter to a third of the tick's own work. The
    store keeps the writes' encoded arguments in ``kept`` (``LockStore.refresh_many``),
    which goes with the batch.
    """

    version: int
    exclusive: tuple[tuple[str, str, int], ...]
    shared: tuple[tuple[str, str, int], ...]
    processes: frozenset[str]
    kept: Kept  # mutable: a batch is told apart by identity, never hashed

    @property
    def size(self) -> int:
        return len(self.exclusive) + len(self.shared)

    @classmethod
    def of(cls, locks: Sequence[Lease], version: int) -> _Batch:
        return cls(
            version,
            tuple([(lk.key, lk.owner, lk.token) for lk in locks if not lk.shared]),
            tuple([(lk.key, lk.owner, lk.token) for lk in locks if lk.shared]),
            frozenset(processes_of(lk.owner for lk in locks)),
            {},
        )


def _write(
    store: LockStore, locks: Sequence[Lease], batch: _Batch, budget: float, aside_name: str
) -> tuple[set[str], list[Lease]]:
    """Refresh ``locks`` (listed in ``batch``) within ``budget`` seconds: the owners whose
    lease could not be extended, and the leases whose write the server refused.

    One ``update_many`` for the exclusive leases and one for the shared ones
    (``_kind``). With both kinds held, the shared leases' write goes from a thread of
    its own (``aside_name``) while the lane's thread sends the exclusive one, so that
    the tick takes about as long as the longer write instead of both. That thread
    lives for that write; when it cannot start, the writes go one after the other.
    Raises when every lease was refused, and for any other error (a permission
    revoked, an unreachable server) once the other write is over or its wait ran out:
    writing again would not help. A write that went through beside a failed one counts
    for nothing, as when it came before the failed one: its leases end by this
    process's clock, before the server's extended lease, unless a later tick extends
    them again in time.
    """
    exclusive, shared = batch.exclusive, batch.shared
    aside = _Aside.started(store, shared, batch.kept, aside_name) if exclusive and shared else None
    outcomes: list[_Outcome] = []
    failed: BaseException | None = None
    try:
        if exclusive:
            outcomes.append(_kind(store, exclusive, False, batch.kept))
        if shared and aside is None:
            outcomes.append(_kind(store, shared, True, batch.kept))
    except Exception as exc:  # raised once the other write, in flight, is over
        failed = exc
    if aside is not None:
        outcome = aside.outcome(budget + ASIDE_SLACK)
        if isinstance(outcome, BaseException):
            if failed is not None:
                logger.debug("the shared leases' refresh failed too: %s", outcome)
            failed = failed or outcome
        else:
            outcomes.append(outcome)
    if failed is not None:
        raise failed
    gone: set[str] = set()
    refused: set[str] = set()
    first: MongoLockError | None = None
    for lost, not_taken, refusal in outcomes:
        gone |= lost
        refused |= not_taken
        first = first or refusal
    if first is not None and len(refused) >= len(locks):
        raise first
    return gone, ([lk for lk in locks if lk.owner in refused] if refused else [])


# One kind's write: the owners whose lease could not be extended, those whose document
# the server refused, and the refusal (None when the write went through).
_Outcome = tuple[set[str], set[str], MongoLockError | None]


def _kind(store: LockStore, held: Sequence[Held], is_shared: bool, kept: Kept) -> _Outcome:
    """Extend the leases of one kind in one write.

    When the server refuses to update a document (a validator that rejects it: a write
    error, not a failure of the whole command), that update stops there, with the
    documents before it extended and the rest not; the leases are then written again
    one by one, in a single unordered bulk write, so that the refused document costs its
    own lease, not all of the manager's (the other kind's write stands).
    """
    refresh = store.refresh_shared_many if is_shared else store.refresh_many
    try:
        return refresh(held, kept=kept), set(), None
    except MongoLockError as exc:
        if not _refusal(exc):
            raise
        refusal = exc
    if len(held) == 1:  # its only document is the one refused: no need to ask again
        return set(), {held[0][1]}, refusal
    lost, not_taken = store.refresh_each(held, shared=is_shared)
    return lost, not_taken, refusal


class _Aside:
    """The shared leases' ``_kind`` write, from a thread of its own during a tick, in
    the lane's context (so within its ``pymongo.timeout``).

    It holds its thread rather than being one: ``threading.Thread`` keeps attributes of
    its own (from Python 3.14, the context it runs in), which a subclass must not shadow.
    """

    def __init__(self, store: LockStore, held: Sequence[Held], kept: Kept, name: str) -> None:
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._lane_context = contextvars.copy_context()
        self._write = functools.partial(_kind, store, held, True, kept)
        self._outcome: _Outcome | BaseException | None = None

    @classmethod
    def started(
        cls, store: LockStore, held: Sequence[Held], kept: Kept, name: str
    ) -> _Aside | None:
        aside = cls(store, held, kept, name)
        try:
            aside.start()
        except RuntimeError:  # no thread to be had: the lane's thread writes both
            return None
        return aside

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        try:
            self._outcome = self._lane_context.run(self._write)
        except BaseException as exc:  # handed to the lane's thread, which raises it
            self._outcome = exc

    def outcome(self, timeout: float) -> _Outcome | BaseException:
        """The write's outcome or error, waited for at most ``timeout`` seconds (its
        timeout ends it before that)."""
        self.thread.join(timeout)
        if self.thread.is_alive():
            return pymongo.errors.NetworkTimeout(
                f"the refresh of shared leases did not end within {timeout:g}s"
            )
        if self._outcome is None:  # cannot happen: _run() records either
            return RuntimeError("the refresh of shared leases ended without an outcome")
        return self._outcome


def _refusal(exc: MongoLockError) -> bool:
    """Whether the server refused to update a document (a validator rejected it), as
    opposed to failing the whole write."""
    cause = exc.__cause__
    return (
        not isinstance(exc, ServerUnavailable)
        and isinstance(cause, WriteError)
        and cause.code == DOCUMENT_REFUSED
    )
