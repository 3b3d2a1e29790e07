"""Runs loss notices (signal receivers, ``on_lost``) off the engine's threads.

Receivers and callbacks are user code: they may raise, call ``sys.exit()`` or block.
None of that may stop the thread that keeps leases alive or watches their deadlines, nor
hold back the notices of other locks. So the engine only *posts* a notice here, and
worker threads run them:

- a notice that raises anything (``SystemExit`` included) is logged, and the worker goes on;
- urgent notices (a lock's ``on_lost``, which demotes an election) run before the others;
- a posted notice that finds no idle worker gets a new one at once (up to ``EAGER``
  workers), so a receiver that blocks holds back nothing posted after it;
- workers all busy with one notice for longer than ``STUCK`` seconds while others wait
  get helpers: the deadline watch calls ``supervise()``, which starts one per waiting
  notice (at most ``BATCH`` at a time). Threads grow with notices that block, never with
  the number of locks;
- workers end after ``IDLE`` seconds without work, and a forked child starts afresh.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence

from django_mongolock import clock

__all__ = ["IDLE", "STUCK", "Notices", "get_notices"]

logger = logging.getLogger("django_mongolock.notices")

STUCK = 0.03
"""A notice running longer than this, while others wait, gets them other workers."""

EAGER = 32
"""Up to this many workers are started at once, without waiting for one to be stuck."""

BATCH = 16
"""Workers ``supervise()`` starts at most at once for notices waiting behind stuck ones."""

IDLE = 10.0
"""A worker with nothing to do for this long ends."""


class Notices:
    """A queue of notices and the threads that run them."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._queue: deque[Callable[[], object]] = deque()
        self._urgent: deque[Callable[[], object]] = deque()
        self._cond = threading.Condition()
        # Each worker's start of its current notice (infinity while it waits for one).
        self._busy: dict[threading.Thread, float] = {}
        self.started = 0

    def post(self, notice: Callable[[], object]) -> None:
        """Run ``notice`` soon on a worker thread; never blocks on other notices."""
        self.post_all([notice])

    def post_all(
        self,
        notices: Sequence[Callable[[], object]],
        urgent: Sequence[Callable[[], object]] = (),
    ) -> None:
        """Run ``urgent``, then ``notices``, soon: on idle workers, or on new ones."""
        with self._cond:
            self._urgent.extend(urgent)
            self._queue.extend(notices)
            idle = sum(1 for since in self._busy.values() if since == math.inf)
            waiting = len(self._urgent) + len(self._queue)
            for _ in range(min(waiting - idle, EAGER - len(self._busy))):
                self._start()
            if not self._busy:
                self._start()
            self._cond.notify(len(notices) + len(urgent))

    def supervise(self, now: float) -> float:
        """Start a worker if every one is stuck while notices wait; when to look again."""
        with self._cond:
            waiting = len(self._urgent) + len(self._queue)
            if not waiting:
                return math.inf
            if any(since == math.inf for since in self._busy.values()):
                return now + STUCK
            newest = max(self._busy.values(), default=-math.inf)
            if now - newest >= STUCK:
                extra = min(waiting, BATCH)
                logger.warning(
                    "lock notices have run for %.2f s or more; %d more worker(s) for %d waiting",
                    now - newest,
                    extra,
                    waiting,
                )
                for _ in range(extra):
                    self._start()
            return now + STUCK

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._urgent) + len(self._queue)

    def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until every posted notice ran (for tests, exit)."""
        deadline = clock.now() + timeout
        with self._cond:
            while self._urgent or self._queue or any(s != math.inf for s in self._busy.values()):
                left = deadline - clock.now()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
        return True

    def _start(self) -> None:
        thread = threading.Thread(target=self._work, name="mongolock-notices", daemon=True)
        self._busy[thread] = math.inf
        self.started += 1
        thread.start()

    def _work(self) -> None:
        me = threading.current_thread()
        try:
            while True:
                with self._cond:
                    self._busy[me] = math.inf
                    self._cond.notify_all()  # drain() waits for idle workers
                    idle_until = clock.now() + IDLE
                    while not (self._urgent or self._queue):
                        # Woken for a notice another worker took: wait on, up to IDLE.
                        left = idle_until - clock.now()
                        if left <= 0:
                            return
                        self._cond.wait(left)
                    notice = (self._urgent or self._queue).popleft()
                    self._busy[me] = clock.now()
                try:
                    notice()
                except BaseException:  # user code: SystemExit and all; the worker goes on
                    logger.exception("a lock notice failed")
        finally:
            with self._cond:
                self._busy.pop(me, None)
                # A worker ending with work queued (it should not) leaves a successor.
                waiting = self._urgent or self._queue
                if waiting and not any(s == math.inf for s in self._busy.values()):
                    self._start()
                self._cond.notify_all()


_notices: Notices | None = None
_mutex = threading.Lock()


def get_notices() -> Notices:
    """This process's notice runner (a forked child gets its own)."""
    global _notices
    notices = _notices
    if notices is not None and notices.pid == os.getpid():
        return notices
    with _mutex:
        if _notices is None or _notices.pid != os.getpid():
            _notices = Notices()
        return _notices


def _forget_in_child() -> None:
    global _notices, _mutex
    _notices = None
    _mutex = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)
