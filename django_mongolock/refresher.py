"""ONE background thread per process that keeps every held lease alive.

Each tick extends all leases this process holds with one write per collection, at
about a third of the shortest lease held, and marks lost every lock whose lease could
not be extended. While MongoDB cannot be reached, a lock is marked lost as soon as its
lease has certainly ended by this process's monotonic clock. The thread starts with the
first held lock, never dies from an exception, and is not inherited by forked children.
At normal interpreter exit it stops and releases the locks still held.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import threading
import time
import weakref
from collections import defaultdict
from typing import TYPE_CHECKING

import pymongo

from django_mongolock.exceptions import MongoLockError

if TYPE_CHECKING:
    from django_mongolock.lock import Lock
    from django_mongolock.manager import LockManager
    from django_mongolock.primitives import Election
    from django_mongolock.store import LockStore

__all__ = ["Refresher", "get_refresher", "install", "shutdown"]

logger = logging.getLogger("django_mongolock.refresher")

# Never tick more often than this, whatever the shortest lease (a 1 ms lease cannot be kept).
MIN_INTERVAL = 0.05
# After a failed tick, try again this soon (or at the usual interval, if shorter).
RETRY_INTERVAL = 1.0
# How long interpreter exit may spend stopping the thread and releasing held locks.
EXIT_TIMEOUT = 2.0


class Refresher:
    """Holds weak references to the locks of this process and extends their leases.

    A lock whose handle is dropped without being released stops being refreshed and
    lapses at the end of its lease, like a crashed holder's.
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._locks: weakref.WeakSet[Lock] = weakref.WeakSet()
        # Elections campaign until stopped, so they are held strongly, like a thread.
        self._elections: set[Election] = set()
        self._cond = threading.Condition()
        self._due = 0.0
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._unreachable = False
        self.ticks = 0

    def __len__(self) -> int:
        with self._cond:
            return len(self._locks)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def register(self, lock: Lock) -> None:
        """Keep ``lock`` alive from now on; starts the thread on first need."""
        with self._cond:
            if self._stopping:
                return
            self._locks.add(lock)
            self._schedule(time.monotonic() + _interval(lock.ttl))

    def add_election(self, election: Election) -> None:
        """Campaign for ``election`` on every tick from now on (the first one at once)."""
        with self._cond:
            if self._stopping:
                return
            self._elections.add(election)
            self._schedule(time.monotonic())

    def remove_election(self, election: Election) -> None:
        with self._cond:
            self._elections.discard(election)

    def _schedule(self, due: float) -> None:
        """Tick no later than ``due``; start the thread on first need (holding ``_cond``).

        ``_due`` is when the thread wakes next (infinity while it has nothing to keep).
        Only a due date earlier than that wakes the sleeping thread: acquiring and
        releasing in a loop costs no thread switch per lock; the next tick simply
        refreshes whatever is held by then.
        """
        if self._thread is None or not self._thread.is_alive():
            self._due = due
            self._thread = threading.Thread(
                target=self._run, name="mongolock-refresher", daemon=True
            )
            self._thread.start()
        elif due < self._due:
            self._due = due
            self._cond.notify()

    def unregister(self, lock: Lock) -> None:
        with self._cond:
            self._locks.discard(lock)

    def held(self) -> list[Lock]:
        with self._cond:
            return [lk for lk in self._locks if not lk.released and not lk._lost]

    def stop(self, timeout: float = EXIT_TIMEOUT) -> None:
        """Stop the thread (bounded wait); locks are no longer refreshed."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    # -- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping:
                    if not (self._locks or self._elections):
                        self._due = math.inf
                    left = self._due - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(None if left == math.inf else left)
                if self._stopping:
                    return
                # A lock registered while the tick runs may ask for an earlier tick.
                self._due = math.inf
            try:
                self.tick()
            except Exception:  # the thread must outlive any single failure
                logger.exception("refresh tick failed")
                with self._cond:
                    self._due = min(self._due, time.monotonic() + RETRY_INTERVAL)

    def tick(self) -> None:
        """Extend every held lease now: one write per collection, then mark the lost ones.

        Then campaign for the elections this process is not leading. The per-lock work
        is kept to attribute reads and one float store: at 10,000 held locks it is a
        share of the tick that the write itself does not dwarf.
        """
        with self._cond:
            locks = [
                lk for lk in self._locks if lk.refreshable and not lk._released and not lk._lost
            ]
            elections = list(self._elections)
        if not locks and not elections:
            return
        shortest = min(
            min((lk.ttl for lk in locks), default=math.inf),
            min((election.ttl for election in elections), default=math.inf),
        )
        next_due = time.monotonic() + _interval(shortest)
        by_manager: dict[LockManager, list[Lock]] = defaultdict(list)
        for lock in locks:
            by_manager[lock._manager].append(lock)
        lost: list[tuple[Lock, str]] = []
        for manager, group in by_manager.items():
            try:
                store = manager.store
            except MongoLockError:
                lost.extend((lock, "its LockManager was closed") for lock in group)
                continue
            sent_at = time.monotonic()
            try:
                gone = store.refresh_many(
                    [(lk.key, lk.owner, lk.token) for lk in group if not lk.shared]
                ) | store.refresh_shared_many(
                    [(lk.key, lk.owner, lk.token) for lk in group if lk.shared]
                )
            except MongoLockError as exc:
                if not self._unreachable:
                    logger.warning("cannot refresh %d lock(s): %s", len(group), exc)
                self._unreachable = True
                next_due = min(
                    next_due, time.monotonic() + min(RETRY_INTERVAL, _interval(shortest))
                )
                now = time.monotonic()
                lost.extend(
                    (lk, "its lease ended while MongoDB could not be reached")
                    for lk in group
                    if now >= lk._deadline
                )
                continue
            if self._unreachable:
                logger.warning("refreshing locks again")
                self._unreachable = False
            for lock in group:
                if gone and lock.owner in gone:
                    if not lock._released:  # released while this tick ran: not lost
                        lost.append((lock, _NOT_EXTENDED))
                else:
                    # Extended by its ttl at a server time after sent_at.
                    lock._deadline = sent_at + lock.ttl
        with self._cond:
            self._due = min(self._due, next_due)
            for lock, _ in lost:
                self._locks.discard(lock)
        self.ticks += 1
        for lock, reason in lost:
            lock._mark_lost(reason)
        for election in elections:
            try:
                election.campaign()
            except Exception:  # one election must not stop the others, nor the thread
                logger.exception("campaign for %r failed", election.key)

    def release_all(self, timeout: float = EXIT_TIMEOUT) -> int:
        """Release every lock still held, one write per collection, within ``timeout``."""
        groups: dict[LockStore, list[Lock]] = defaultdict(list)
        for lock in self.held():
            try:
                store = lock.store
            except MongoLockError:
                continue  # its manager was closed: the lease lapses by itself
            if lock._take_release():
                groups[store].append(lock)
        released = 0
        for store, group in groups.items():
            try:
                with pymongo.timeout(timeout):
                    released += store.release_many(
                        [(lk.key, lk.owner, lk.token) for lk in group if not lk.shared]
                    )
                    for lk in group:
                        if lk.shared:
                            released += store.release(lk.key, lk.owner, lk.token, shared=True)
            except (MongoLockError, pymongo.errors.PyMongoError) as exc:
                logger.warning("could not release %d lock(s) at exit: %s", len(group), exc)
        return released


_NOT_EXTENDED = "its lease could not be extended (released by somebody else, or already over)"


def _interval(ttl: float) -> float:
    return max(MIN_INTERVAL, ttl / 3)


_refresher: Refresher | None = None
_mutex = threading.Lock()
_installed = False


def get_refresher() -> Refresher:
    """This process's refresher (a forked child gets a fresh one, with no locks)."""
    global _refresher
    refresher = _refresher
    if refresher is not None and refresher.pid == os.getpid():
        return refresher
    with _mutex:
        if _refresher is None or _refresher.pid != os.getpid():
            _refresher = Refresher()
        install()
        return _refresher


def _forget_in_child() -> None:
    global _refresher, _mutex
    _refresher = None
    _mutex = threading.Lock()


def shutdown() -> None:
    """Stop the thread and release this process's locks (runs at interpreter exit)."""
    refresher = _refresher
    if refresher is None or refresher.pid != os.getpid():
        return
    refresher.stop()
    refresher.release_all()


def install() -> None:
    """Register the exit and fork hooks once per interpreter; starts no thread."""
    global _installed
    if _installed:
        return
    _installed = True
    atexit.register(shutdown)
    os.register_at_fork(after_in_child=_forget_in_child)
