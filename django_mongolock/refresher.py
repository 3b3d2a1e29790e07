"""Background refresh that keeps held leases alive: one lane per server connection.

Each ``LockManager`` (one client, one server or replica set) gets a *lane*: a thread
that extends all leases held through that manager with one write per tick, at about a
third of the shortest lease, and campaigns for its elections. A slow or unreachable
server therefore delays only its own lane: the leases of other managers keep being
extended on time. Each write is bounded by the time left until the last of its leases
ends (a later answer could not save any of them).

A lane never decides that a lease is over by the clock: the deadline watch
(``deadlines.py``) does that for every held lock, independently of any I/O. The lane
marks lost only the leases the server refused to extend. Lanes start with the first held
lock, end when their manager holds nothing, survive any exception (and a thread that
dies anyway is replaced, with a log line), and are not inherited by forked children. At
normal interpreter exit they stop and the locks still held are released.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import threading
from collections import defaultdict

import pymongo

from django_mongolock import clock
from django_mongolock.exceptions import MongoLockError
from django_mongolock.lanes import Campaign, Lane, Lease, StoreSource
from django_mongolock.store import LockStore

__all__ = ["Refresher", "get_refresher", "install", "shutdown"]

logger = logging.getLogger("django_mongolock.refresher")

# How long interpreter exit may spend stopping the threads and releasing held locks.
EXIT_TIMEOUT = 2.0
# A release at exit still gets this long when the writes before it used up the rest.
LAST_WRITE_TIME = 0.2


class Refresher:
    """This process's lanes, one per LockManager, created and ended on demand.

    Holds weak references to the locks: a handle dropped without being released stops
    being refreshed and lapses at the end of its lease, like a crashed holder's.
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._lanes: dict[StoreSource, Lane] = {}
        self._mutex = threading.Lock()
        self._stopping = False
        self.restarts = 0

    def __len__(self) -> int:
        return sum(len(lane) for lane in self._lanes_now())

    @property
    def running(self) -> bool:
        return any(lane.running for lane in self._lanes_now())

    @property
    def stopping(self) -> bool:
        """Stopped for good (interpreter exit): a lock won from now on is not kept."""
        return self._stopping

    @property
    def ticks(self) -> int:
        """Ticks of all lanes so far (ended lanes included)."""
        return self._ended_ticks + sum(lane.ticks for lane in self._lanes_now())

    _ended_ticks = 0

    @property
    def due(self) -> float:
        """When the next tick of any lane is due (infinity while nothing is kept)."""
        return min((lane.due for lane in self._lanes_now()), default=math.inf)

    def lane_of(self, manager: StoreSource) -> Lane | None:
        with self._mutex:
            return self._lanes.get(manager)

    def register(self, lock: Lease) -> None:
        """Keep ``lock`` alive from now on; starts its manager's lane on first need."""
        # A lane that retired between the lookup and the add refuses: take the new one.
        while (lane := self._lane(lock.backend)) is not None and not lane.add(lock):
            pass

    def unregister(self, lock: Lease) -> None:
        lane = self.lane_of(lock.backend)
        if lane is not None:
            lane.discard(lock)

    def add_election(self, election: Campaign) -> None:
        """Campaign for ``election`` on every tick of its manager's lane (the first at once)."""
        manager = election.backend
        while (lane := self._lane(manager)) is not None and not lane.add_election(election):
            pass

    def remove_election(self, election: Campaign) -> None:
        lane = self.lane_of(election.backend)
        if lane is not None:
            lane.remove_election(election)

    def held(self) -> list[Lease]:
        return [lk for lane in self._lanes_now() for lk in lane.held()]

    def stop(self, timeout: float = EXIT_TIMEOUT) -> None:
        """Stop every lane (bounded wait); locks are no longer refreshed."""
        with self._mutex:
            self._stopping = True
            lanes = list(self._lanes.values())
        for lane in lanes:
            lane.stop()
        self.join(timeout)

    def join(self, timeout: float) -> None:
        """Wait (bounded) for the lanes' threads to end, once ``stop`` told them to (a
        running lane's thread waits out the whole ``timeout``)."""
        deadline = clock.now() + timeout
        for lane in self._lanes_now():
            lane.join(max(0.0, deadline - clock.now()))

    def tick(self) -> None:
        """Run one tick of every lane in the calling thread (benchmarks, tests)."""
        for lane in self._lanes_now():
            lane.tick()

    def release_all(self, timeout: float = EXIT_TIMEOUT) -> int:
        """Release every lock still held within ``timeout``: per collection, one write
        for the exclusive locks and one for the shared leases. Returns how many lock
        documents those writes changed (all the permits a process held of one semaphore
        count once)."""
        groups: dict[LockStore, list[Lease]] = defaultdict(list)
        for lock in self.held():
            try:
                store = lock.store
            except MongoLockError:
                continue  # its manager was closed: the lease lapses by itself
            if lock.take_release():
                groups[store].append(lock)
        released = 0
        deadline = clock.now() + timeout
        for store, group in groups.items():
            # Each kind in its own write and try: one that fails leaves the other to go.
            for shared, release in ((False, store.release_many), (True, store.release_shared_many)):
                held = [(lk.key, lk.owner, lk.token) for lk in group if lk.shared is shared]
                if not held:
                    continue
                try:
                    with pymongo.timeout(max(LAST_WRITE_TIME, deadline - clock.now())):
                        released += release(held)
                except (MongoLockError, pymongo.errors.PyMongoError) as exc:
                    kind = "shared lease(s)" if shared else "lock(s)"
                    logger.warning("could not release %d %s at exit: %s", len(held), kind, exc)
        return released

    # -- lanes -------------------------------------------------------------------------------

    def _lane(self, manager: StoreSource) -> Lane | None:
        with self._mutex:
            if self._stopping:
                return None
            lane = self._lanes.get(manager)
            if lane is None:
                lane = self._lanes[manager] = Lane(self, manager)
            return lane

    def _lanes_now(self) -> list[Lane]:
        with self._mutex:
            return list(self._lanes.values())

    def forget(self, lane: Lane) -> None:
        """Drop ``lane``, which keeps nothing any more (called holding the lane's condition)."""
        with self._mutex:
            if self._lanes.get(lane.manager) is lane:
                del self._lanes[lane.manager]
                self._ended_ticks += lane.ticks

    def restarted(self) -> None:
        """Count a lane thread that died and was replaced."""
        self.restarts += 1


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
    """Stop the lanes and release this process's locks (runs at interpreter exit)."""
    refresher = _refresher
    if refresher is None or refresher.pid != os.getpid():
        return
    # One budget for both steps. A lane stuck on a slow server's refresh gets half of
    # it, no more: the releases, which free the locks for others at once, the rest.
    deadline = clock.now() + EXIT_TIMEOUT
    refresher.stop(EXIT_TIMEOUT / 2)
    refresher.release_all(max(LAST_WRITE_TIME, deadline - clock.now()))
    # A lane still in its tick gets what is left, so that what it gives back comes
    # before the process ends, and its daemon threads with it: the key of an election's
    # campaign that wins meanwhile (``Election._campaign``), and a lease that ran out
    # here while its refresh was held (the releases skip it) but that the server then
    # extended.
    refresher.join(max(0.0, deadline - clock.now()))


def install() -> None:
    """Register the exit and fork hooks once per interpreter; starts no thread."""
    global _installed
    if _installed:
        return
    _installed = True
    atexit.register(shutdown)
    os.register_at_fork(after_in_child=_forget_in_child)
