"""Wakes local waiters when their key is freed, through one change stream.

A key becomes free when its document is deleted (release, force release, the TTL
monitor), or when a release frees it but keeps it for the waiters in line. The watcher
thread tails those events on the lock collection and sets the wake-up events of that
key's waiters only; they re-check by trying to acquire. While the stream is healthy
waiters need not poll; when change streams are unavailable or the stream breaks,
waiters fall back to their jittered back-off and the watcher resumes the stream (from
its resume token when it can). A release that handed the key to a waiter in line
(``queries.release``) names it in the event: that waiter takes the lock from the event,
without a request of its own. Such an event reaches only the process of that waiter and
of the next one in line (``queries.wakeups``), so the cost of a handoff does not grow
with the number of processes waiting for the key. The thread starts with the first
waiter and ends after a minute without any.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from pymongo.errors import OperationFailure, PyMongoError

from django_mongolock import clock, mongo, queries
from django_mongolock.exceptions import MongoLockError
from django_mongolock.store import LockStore
from django_mongolock.waiters import Handoff, Waiters

__all__ = ["Watcher", "handoff_of"]

logger = logging.getLogger("django_mongolock.watcher")

# How long the server holds an empty getMore: bounds how fast the thread notices stop.
MAX_AWAIT = 0.5
# The thread ends after this long with nobody waiting; the next waiter starts it again.
IDLE_EXIT = 60.0


def handoff_of(change: Mapping[str, Any]) -> Handoff | None:
    """The handoff a release event reports, if the release made a waiter the holder.

    Such a release changes ``owner`` (an id unique per acquisition), ``token`` (it
    grows) and ``acquired_at``; an update event without all three is only a wake-up. A
    ``replace`` event (the server logged the release as a whole document) carries the
    document itself: a handoff when it has an owner acquired in the release itself.
    """
    if change.get("operationType") == "replace":
        doc = change.get("fullDocument") or {}
        released_at, acquired_at = doc.get("released_at"), doc.get("acquired_at")
        if not isinstance(released_at, datetime) or not isinstance(acquired_at, datetime):
            return None
        if released_at < acquired_at:
            return None  # an acquisition logged whole, not a release
        fields: Mapping[str, Any] = doc
    else:
        fields = (change.get("updateDescription") or {}).get("updatedFields") or {}
    owner, token, acquired_at = fields.get("owner"), fields.get("token"), fields.get("acquired_at")
    if not isinstance(owner, str) or not owner or not isinstance(token, int):
        return None
    if not isinstance(acquired_at, datetime):
        return None
    expires_at = fields.get("expires_at")
    return Handoff(
        owner,
        token,
        acquired_at,
        expires_at if isinstance(expires_at, datetime) else None,
        _released_by(fields),
    )


def _released_by(fields: Mapping[str, Any]) -> str:
    """The owner a release put in front of ``ended``: the server reports the list whole
    or by its changed positions (every owner id is new, so position 0 always changes)."""
    ended = fields.get("ended")
    first = ended[0] if isinstance(ended, list) and ended else fields.get("ended.0")
    return first if isinstance(first, str) else ""


class Watcher:
    """One change stream on one lock collection, shared by all waiting threads of a process."""

    def __init__(
        self,
        store_of: Callable[[], LockStore],
        waiters: Waiters,
        prefix_of: Callable[[], str | None] = lambda: None,
    ) -> None:
        self._store_of = store_of
        self.waiters = waiters
        # What this process's holder ids start with: only handoffs to them are streamed,
        # until a waiter with another kind of id comes (``ensure_running``).
        self._prefix_of = prefix_of
        self._unfiltered = False
        self._reopen = threading.Event()
        self.pid = os.getpid()
        self._mutex = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._healthy_since: float | None = None
        self.events = 0
        self.opened = 0

    @property
    def healthy(self) -> bool:
        """True while a stream is open: a delete after ``healthy_since`` will be seen."""
        return self._healthy_since is not None

    def healthy_since(self) -> float | None:
        """Monotonic time from which every delete event is delivered (None: not healthy)."""
        return self._healthy_since

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def ensure_running(self, owner: str = "") -> None:
        """Start the thread if it is not running (cheap when it is).

        ``owner`` is the holder id of the waiter that needs the stream: one that does
        not start with this process's prefix (a manager whose ``new_owner()`` makes ids
        of its own) would never hear of a handoff to it, so the stream lets every
        handoff through from then on.
        """
        if owner and not self._unfiltered:
            prefix = self._prefix_of()
            if prefix is not None and not owner.startswith(prefix):
                self._unfiltered = True
                self._reopen.set()
                logger.info("waiter %r has a holder id of its own: streaming every handoff", owner)
        if self.running or self.pid != os.getpid():
            return
        with self._mutex:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="mongolock-watcher", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        resume_token: Any = None
        failures = 0
        idle_since = clock.now()
        while not self._stop.is_set():
            # Set when the stream is closed only to be opened again with another filter,
            # from where it stopped: its waiters miss nothing meanwhile.
            reopened = False
            try:
                store = self._store_of()
                self._reopen.clear()
                with store.collection.watch(
                    queries.wakeups(None if self._unfiltered else self._prefix_of()),
                    max_await_time_ms=round(MAX_AWAIT * 1000),
                    resume_after=resume_token,
                ) as stream:
                    if self._healthy_since is None:
                        self._healthy_since = clock.now()
                    self.opened += 1
                    if failures:
                        logger.info("change stream resumed; waiters are woken by releases again")
                    failures = 0
                    while not self._stop.is_set() and stream.alive:
                        if self._reopen.is_set() and resume_token is not None:
                            reopened = True
                            break
                        change = stream.try_next()
                        resume_token = stream.resume_token
                        if change is not None:
                            self.events += 1
                            key = change["documentKey"]["_id"]
                            if self.waiters.notify(key, handoff_of(change)):
                                # Let the woken waiter take the interpreter lock now,
                                # before this thread goes on to ask for the next event.
                                time.sleep(0)
                            continue
                        if len(self.waiters):
                            idle_since = clock.now()
                        elif clock.now() - idle_since > IDLE_EXIT:
                            return
            except (PyMongoError, MongoLockError) as exc:
                if isinstance(exc, OperationFailure) and exc.code in mongo.HISTORY_LOST:
                    resume_token = None  # the resume point is gone: start afresh
                failures += 1
                if failures == 1:
                    logger.warning("change stream unavailable, waiters poll instead: %s", exc)
            except Exception:
                failures += 1
                logger.exception("change stream failed")
            finally:
                if not reopened:
                    self._healthy_since = None
                    # Waiters sleeping on the stream must switch to their back-off now.
                    self.waiters.notify_all()
            if reopened:
                continue
            if not self._stop.is_set():
                self._stop.wait(min(30.0, 0.5 * 2 ** min(failures, 6)) * random.uniform(0.5, 1.0))
        with self._mutex:
            self._healthy_since = None
