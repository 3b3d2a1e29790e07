"""Watches the lease end of every held lock, independently of any I/O.

The refresher extends leases over the network, and the network can hang. This thread
never touches it: it sleeps until the earliest local deadline (``clock.now()`` at the
moment the acquire or last successful refresh was sent, plus the lease, minus the drift
margin) and then calls ``lapse()`` on each lease past its deadline, which marks it lost,
and then ``announce_lapse()`` on each, which posts its notices. So a holder learns of its
loss by its own bound of the lease end, whatever the server or the network does, before
another process can take the key.

One heap entry per watched lease: a refresh moves the lease's deadline, and its entry,
when it comes up, is pushed back to the new deadline (about one heap operation per lease
and lease period). Released leases are dropped lazily, and the heap is rebuilt when they
make up most of it. The same thread supervises the notice workers (``notices.py``).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import os
import threading
import weakref
from typing import Protocol

from django_mongolock import clock
from django_mongolock.notices import get_notices

__all__ = ["Deadlines", "Lease", "get_deadlines"]

logger = logging.getLogger("django_mongolock.deadlines")

# The longest the watch sleeps while it watches anything (see _due).
_MAX_SLEEP = 0.25
# Rebuild the heap when released entries outnumber live ones and there are at least this many.
_COMPACT_AT = 1024


class Lease(Protocol):
    """What the watch needs of a held lock."""

    @property
    def deadline(self) -> float:
        """The lease end on ``clock.now()``'s scale, margin included."""
        ...

    @property
    def over(self) -> bool:
        """Released or lost: nothing more to watch."""
        ...

    def lapse(self, now: float) -> bool:
        """Mark the lease lost if ``now`` is past its deadline (under its own mutex);
        True when this call marked it."""
        ...

    def announce_lapse(self) -> None:
        """Post the notices of the lapse ``lapse()`` marked."""
        ...


_Entry = tuple[float, int, "weakref.ref[Lease]"]


class Deadlines:
    """The heap of lease deadlines and the thread that acts on them."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._heap: list[_Entry] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._wake = math.inf
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._ended = 0  # entries of leases that ended since the last rebuild
        self.lapsed = 0

    def __len__(self) -> int:
        with self._cond:
            return len(self._heap)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def watch(self, lease: Lease) -> None:
        """Act on ``lease`` at its deadline (and at each later one a refresh sets)."""
        deadline = lease.deadline
        with self._cond:
            if self._stopping:
                return
            heapq.heappush(self._heap, (deadline, next(self._seq), weakref.ref(lease)))
            if self._thread is None or not self._thread.is_alive():
                self._start()
            elif deadline < self._wake:
                self._cond.notify()

    def ended(self) -> None:
        """A watched lease was released: its entry may go at the next rebuild."""
        with self._cond:
            self._ended += 1
            if self._ended > len(self._heap) // 2 and len(self._heap) >= _COMPACT_AT:
                self._heap = [e for e in self._heap if (lease := e[2]()) and not lease.over]
                heapq.heapify(self._heap)
                self._ended = 0

    def kick(self) -> None:
        """Look at the notice workers now (a notice was posted)."""
        with self._cond:
            if self._thread is None or not self._thread.is_alive():
                self._start()
            else:
                self._wake = clock.now()
                self._cond.notify()

    def stop(self, timeout: float = 2.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="mongolock-deadlines", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                due = self._due()
                if due is None:
                    return
                # Every lease due is marked first, then the notices go out: a mass loss
                # marks its last lease as soon as its first.
                marked: list[Lease] = []
                for lease in due:
                    try:
                        if lease.lapse(clock.now()):
                            marked.append(lease)
                    except Exception:
                        logger.exception("could not mark a lease lost")
                for lease in marked:
                    try:
                        lease.announce_lapse()
                    except Exception:
                        logger.exception("could not announce a lost lease")
                self.lapsed += len(due)
        except BaseException:
            logger.exception("the deadline watch failed")
        finally:
            with self._cond:
                if not self._stopping and self._thread is threading.current_thread():
                    # Only an error in this module ends the loop: never leave leases unwatched.
                    logger.error("the deadline watch ended unexpectedly; restarting it")
                    self._start()

    def _due(self) -> list[Lease] | None:
        """Sleep until a deadline passes; the leases past theirs (None: stop)."""
        notices = get_notices()
        with self._cond:
            while not self._stopping:
                now = clock.now()
                due: list[Lease] = []
                heap = self._heap
                while heap and heap[0][0] <= now:
                    _, seq, ref = heapq.heappop(heap)
                    lease = ref()
                    if lease is None or lease.over:
                        self._ended = max(0, self._ended - 1)
                        continue
                    if lease.deadline > now:  # refreshed meanwhile: watch its new deadline
                        heapq.heappush(heap, (lease.deadline, seq, ref))
                        continue
                    due.append(lease)
                if due:
                    return due
                check = notices.supervise(now)
                self._wake = min(heap[0][0] if heap else math.inf, check)
                if self._wake == math.inf and not heap:
                    # Nothing to watch: sleep until a lease or a notice arrives.
                    self._cond.wait()
                else:
                    # Timed waits run on CLOCK_MONOTONIC, which stops while the machine
                    # sleeps: wake at least every _MAX_SLEEP to catch up after a resume.
                    self._cond.wait(max(0.0, min(self._wake - now, _MAX_SLEEP)))
            return None


_deadlines: Deadlines | None = None
_mutex = threading.Lock()


def get_deadlines() -> Deadlines:
    """This process's deadline watch (a forked child gets its own, watching nothing)."""
    global _deadlines
    deadlines = _deadlines
    if deadlines is not None and deadlines.pid == os.getpid():
        return deadlines
    with _mutex:
        if _deadlines is None or _deadlines.pid != os.getpid():
            _deadlines = Deadlines()
        return _deadlines


def _forget_in_child() -> None:
    global _deadlines, _mutex
    _deadlines = None
    _mutex = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)
