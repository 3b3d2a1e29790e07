"""Work an observer takes off the caller's thread: queued in a few hundred nanoseconds,
done in batches by one thread of its own.

Spans are built by the tracing SDK, which checks every attribute and asks the sampler:
tens of microseconds a span, paid by the thread that holds the lock if done there. A
span's times are given explicitly, so building it a moment later changes nothing in the
trace. Metrics are updated by ``prometheus_client``, which takes a lock for each update.
A waiting thread's time is better spent on the round trip it is waiting for.

The thread sleeps while there is no work (no wake-ups when idle); the first job posted
wakes it, and it runs the jobs that gathered ``delay`` seconds later, so a busy process
pays one wake-up per batch, not one per lock. The queue is bounded: past ``limit`` jobs
waiting, a new one is dropped and counted (``dropped``), as the SDK's own batch
processor does with spans, or, with ``overflow="run"``, run at once in the posting
thread (a count must not be lost).

A job may hold a lock of its library (``prometheus_client`` takes one per update) that a
child forked at that moment would inherit held, by a thread it does not have: the child's
next update of that metric would never return. So each job runs under the backlog's job
lock, and a fork takes every backlog's job lock first (waiting ``FORK_WAIT`` at most, for
all of them together): no job is half done in the child. It gets it between two jobs: a
batch offers the interpreter every ``YIELD_AFTER`` between two jobs, without the lock.
A forked child starts with an empty queue, and its first post starts its own thread.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Final, Literal

__all__ = ["Backlog"]

logger = logging.getLogger("django_mongolock.contrib")

DELAY: Final = 0.2
"""How long the thread lets jobs gather between two batches while they keep coming."""

LIMIT: Final = 8192
"""Jobs waiting at most; more are dropped, or run by their poster (``overflow``)."""

YIELD_AFTER: Final = 0.0001
"""A batch offers other threads the interpreter after this many seconds of work, so that
a caller whose answer came usually waits about this much of a batch, not the
interpreter's switch interval (5 ms). A span takes tens of microseconds to build, so a
batch offers it every few jobs; each offer is one system call."""

FORK_WAIT: Final = 1.0
"""How long a fork waits, for all backlogs together, for the jobs under way to end."""


class Backlog:
    """A bounded queue of jobs and the daemon thread that runs them."""

    def __init__(
        self,
        name: str,
        *,
        delay: float = DELAY,
        limit: int = LIMIT,
        overflow: Literal["drop", "run"] = "drop",
    ) -> None:
        if overflow not in ("drop", "run"):
            raise ValueError(f"overflow must be 'drop' or 'run', not {overflow!r}")
        self.name = name
        self.delay = delay
        self.limit = limit
        self.overflow = overflow
        self.dropped = 0
        self._jobs: deque[Callable[[], object]] = deque()
        self._cond = threading.Condition()
        # Serialises batches: the thread's and a caller's flush() never run jobs at once
        # (a job run by its poster past the limit runs beside them: prometheus_client's
        # updates take their own locks).
        self._running = threading.Lock()
        # Held around each job: a fork takes it between two jobs (re-entrant: a job that
        # forks, or a forking thread that runs a job, takes it again).
        self._job = threading.RLock()
        self._asleep = False
        self._closed = False
        self._thread: threading.Thread | None = None
        with _registry:
            _backlogs.add(self)
        atexit.register(self.flush)

    def post(self, job: Callable[[], object]) -> None:
        """Run ``job`` soon on the backlog's thread (past ``limit`` jobs waiting: dropped,
        or run now in this thread with ``overflow="run"``)."""
        if self._closed:
            return
        if len(self._jobs) >= self.limit:
            if self.overflow == "run":
                self._run_one(job)
                return
            with self._cond:
                self.dropped += 1
                first = self.dropped == 1
            if first:
                logger.warning("%s: more than %d jobs waiting; dropping", self.name, self.limit)
            return
        self._jobs.append(job)
        if self.closed:  # closed meanwhile: its last drain may be over, run it here
            self._drain(None)
            return
        # Read after the append: a thread that has just found the queue empty said it
        # sleeps before it looked, so this job is either seen by it or followed by a
        # wake-up (the interpreter's lock orders the two threads' steps).
        if self._asleep or self._thread is None:
            with self._cond:
                if self._thread is None and not self._closed:
                    self._start()
                self._cond.notify()

    @property
    def job(self) -> threading.RLock:
        """The lock each job runs under, which a fork waits for: hold it to do outside the
        queue what a job does (a read of the state the jobs write under their library's
        locks)."""
        return self._job

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called: posts are dropped from then on."""
        return self._closed

    def flush(self) -> None:
        """Run, now and in this thread, the jobs queued before the call (not those posted
        while it runs: a caller under load would never return)."""
        self._drain(len(self._jobs))

    def close(self) -> None:
        """Run what is queued, then take no more jobs and let the thread end."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._drain(None)
        atexit.unregister(self.flush)

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def _after_fork(self) -> None:
        """In a forked child: the parent's jobs and thread are not ours."""
        self._jobs.clear()
        self._cond = threading.Condition()
        self._running = threading.Lock()
        self._job = threading.RLock()
        self._asleep = False
        self._thread = None

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    if not self._jobs:
                        self._asleep = True
                        while not self._jobs and not self._closed:
                            self._cond.wait()
                        self._asleep = False
                    if self._closed:
                        break
                    # Let a batch gather: posts do not wake a thread that is not asleep.
                    self._cond.wait(self.delay)
                while self._jobs:  # in bounded runs: a flush() waits for one at most
                    self._drain(len(self._jobs))
        finally:
            with self._cond:
                if self._thread is threading.current_thread():
                    self._thread = None  # a later post starts another
                self._asleep = False
            self._drain(None)  # posted while it closed: run, not lost

    def _drain(self, most: int | None) -> None:
        """Run the queued jobs (at most ``most`` of them; all, and those posted meanwhile,
        for None)."""
        with self._running:
            since = time.monotonic()
            while self._jobs and (most is None or most > 0):
                job = self._jobs.popleft()
                if most is not None:
                    most -= 1
                self._run_one(job)
                if time.monotonic() - since > YIELD_AFTER:
                    # Give the interpreter up now and then (best effort: it cannot be
                    # handed over), so that a caller whose answer came is not kept waiting
                    # for the interpreter's whole switch interval.
                    time.sleep(0)
                    since = time.monotonic()

    def _run_one(self, job: Callable[[], object]) -> None:
        with self._job:
            try:
                job()
            except Exception:
                logger.exception("%s: a job failed", self.name)


_backlogs: weakref.WeakSet[Backlog] = weakref.WeakSet()
# Guards the set's changes and the snapshots a fork takes of it (re-entrant: a signal
# handler that forks may run while its thread holds it).
_registry = threading.RLock()
# Per forking thread, a stack: the job locks each fork under way holds (a fork made by
# another library's fork hook runs inside this one's).
_holding = threading.local()


def _before_fork() -> None:
    """Take every backlog's job lock (``FORK_WAIT`` at most for all): no job is half
    done, holding a lock of its library, when the process forks."""
    taken: list[threading.RLock] = []
    stack: list[list[threading.RLock]] | None = getattr(_holding, "stack", None)
    if stack is None:
        stack = _holding.stack = []
    stack.append(taken)
    with _registry:
        # In one order: two forks at once would otherwise wait for each other's locks.
        backlogs = sorted(_backlogs, key=id)
    deadline = time.monotonic() + FORK_WAIT
    for backlog in backlogs:
        lock = backlog._job
        if lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            taken.append(lock)


def _after_fork_in_parent() -> None:
    stack: list[list[threading.RLock]] | None = getattr(_holding, "stack", None)
    for lock in stack.pop() if stack else ():
        lock.release()


def _forget_in_child() -> None:
    global _registry
    _registry = threading.RLock()
    _holding.stack = None
    for backlog in list(_backlogs):
        backlog._after_fork()


os.register_at_fork(
    before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_forget_in_child
)
