"""Leader election: an exclusive lock the refresher keeps campaigning for, then keeps alive.

The only thread it adds is an election's callback worker: it runs that election's
callbacks one after another, in the order of the events, outside the refresher's tick,
and exits when it has nothing left to run.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
from collections.abc import Callable
from types import TracebackType

from django_mongolock import acquiring
from django_mongolock.exceptions import LockNotAcquired, MongoLockError
from django_mongolock.lock import Lock
from django_mongolock.recipes.source import LockSource, tagged_request
from django_mongolock.refresher import get_refresher
from django_mongolock.validation import check_callback, validate_key, validate_ttl

__all__ = ["Election"]

logger = logging.getLogger("django_mongolock.primitives")


class Election:
    """Campaigns for the exclusive lock ``key`` until stopped; the holder is the leader.

    The process's refresher thread tries to take the lock about three times per lease
    while this process is not the leader, and keeps the lease alive while it is. When
    the lease is lost (another process force-released it, or it could not be refreshed
    in time) the election notices within one refresh tick, calls ``on_demoted`` and
    campaigns again.

    Callbacks run in the order of the events (an ``on_demoted`` never before the
    ``on_elected`` of its term) in a worker thread of this election, never in the
    refresher's. A callback that raises or calls ``sys.exit()`` is logged and the next
    one runs; a callback that blocks delays only this election's later callbacks.
    """

    def __init__(
        self,
        manager: LockSource,
        key: str,
        *,
        on_elected: Callable[[Election], object] | None = None,
        on_demoted: Callable[[Election], object] | None = None,
        ttl: float | None = None,
    ) -> None:
        self.key = validate_key(key)
        self.ttl = manager.ttl if ttl is None else validate_ttl(ttl)
        check_callback("on_elected", on_elected)
        check_callback("on_demoted", on_demoted)
        self.on_elected = on_elected
        self.on_demoted = on_demoted
        self._manager = manager
        self._lock: Lock | None = None
        self._mutex = threading.Lock()
        # Held while a campaign attempt runs: stop() waits for it, so that an attempt that
        # wins after stop() gives its lock back while the manager is still open. Reentrant:
        # a lock_released receiver of that give-back may itself call stop().
        self._attempt = threading.RLock()
        self._active = threading.Event()
        self.changed = threading.Event()
        self.terms = 0
        # The callbacks still to run, in the order of their events, and the worker
        # thread running them (None while idle).
        self._calls: collections.deque[Callable[[Election], object]] = collections.deque()
        self._calls_mutex = threading.Lock()
        self._worker: threading.Thread | None = None

    def __repr__(self) -> str:
        role = "leader" if self.is_leader else "follower"
        return f"<Election {self.key!r} {role}>"

    @property
    def is_leader(self) -> bool:
        lock = self._lock
        return lock is not None and lock.valid

    @property
    def token(self) -> int | None:
        """The fencing token of this process's current term, or None when not leading."""
        lock = self._lock
        return lock.token if lock is not None and lock.valid else None

    @property
    def running(self) -> bool:
        return self._active.is_set()

    @property
    def backend(self) -> LockSource:
        """The source this election campaigns through (its refresher lane's)."""
        return self._manager

    def leader(self) -> str | None:
        """The current leader's owner id (any process), or None."""
        return self._manager.leader(self.key)

    def start(self) -> None:
        with self._mutex:
            if self._active.is_set():
                return
            # Campaign through the manager the settings describe now, when given the lazy
            # default one: its refresher lane, its signals, its locks.
            self._manager = self._manager._resolved()
            self._active.set()
        get_refresher().add_election(self)

    def stop(self) -> None:
        """Stop campaigning; a leader steps down (releases) and ``on_demoted`` runs.

        Waits for a campaign attempt under way (bounded by the operation limit),
        so that no lock taken after ``stop()`` is left to the end of its lease.
        """
        self._active.clear()
        with self._attempt:  # an attempt under way sees the election stopped, and ends
            pass
        with self._mutex:
            lock, self._lock = self._lock, None
            if lock is not None:
                lock.on_lost = None  # this step-down is the term's one demotion
        get_refresher().remove_election(self)
        if lock is not None:
            # A term that ended by itself meanwhile (its lease lapsed) is not held any
            # more: release() then does nothing, and the demotion is still announced.
            try:
                lock.release()
            finally:
                self._callback(self.on_demoted)

    def campaign(self) -> None:
        """One attempt to become leader (called from the refresher's tick)."""
        with self._attempt:
            self._campaign()

    def _campaign(self) -> None:
        if not self._active.is_set() or self.is_leader:
            return
        request = tagged_request(self._manager, self.key, self.ttl, "kind", "election")
        try:
            # No lock_acquired here: receivers are user code, and this runs on the
            # refresher's thread. The election's worker sends it, then calls on_elected.
            lock = acquiring.acquire(
                self._manager, request, 0.0, True, self._demoted, announcing=False
            )
        except LockNotAcquired:
            return
        except MongoLockError as exc:
            logger.warning("campaign for %r failed: %s", self.key, exc)
            return
        with self._mutex:
            # Stopped while this attempt ran, or the process is exiting: the exit's
            # releases may have run already, and no lane would keep this lease.
            stopped = not self._active.is_set() or get_refresher().stopping
            if not stopped:
                self._lock = lock
                self.terms += 1
                # Queued under the mutex: a demotion of this term queues after it.
                self._callback(functools.partial(Election._begin_term, lock=lock))
        if stopped:
            lock.on_lost = None
            lock.release()  # outside the mutex: lock_released receivers may call stop()
            return
        logger.info("elected leader of %r (token %s)", self.key, lock.token)
        if lock.lost.is_set():
            # Lost before it was this election's term: its on_lost found nothing to demote.
            self._demoted(lock)

    def _begin_term(self, lock: Lock) -> None:
        """On the election's worker: send ``lock_acquired``, then call ``on_elected``.

        A receiver that fails gives the lock back (see ``acquiring.announce``): that
        term ends unannounced, with neither callback, and the election campaigns again.
        """
        try:
            acquiring.announce(lock)
        except BaseException:
            with self._mutex:
                if self._lock is lock:
                    self._lock = None
            logger.exception("a lock_acquired receiver failed; %r campaigns again", self.key)
            return
        if self.on_elected is not None:
            self.on_elected(self)

    def _demoted(self, lock: Lock) -> None:
        with self._mutex:
            if self._lock is not lock:
                return
            self._lock = None
            self._callback(self.on_demoted)
        logger.warning("demoted: lost the leadership of %r (token %s)", self.key, lock.token)

    def _callback(self, callback: Callable[[Election], object] | None) -> None:
        """Queue ``callback`` behind this election's earlier ones (see the class docstring)."""
        self.changed.set()
        if callback is None:
            return
        with self._calls_mutex:
            self._calls.append(callback)
            worker = self._worker
            if worker is None or not worker.is_alive():  # idle, or gone with a fork
                self._worker = threading.Thread(
                    target=self._run_callbacks, name="mongolock-election-callbacks", daemon=True
                )
                self._worker.start()

    def _run_callbacks(self) -> None:
        """The worker: run queued callbacks in order until none is left, then exit."""
        while True:
            with self._calls_mutex:
                if not self._calls:
                    self._worker = None
                    return
                callback = self._calls.popleft()
            try:
                callback(self)
            except BaseException:  # sys.exit() too: it would end this thread, and the queue
                logger.exception("election callback for %r failed", self.key)

    def __enter__(self) -> Election:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
