"""``on_busy="coalesce"``: a busy call leaves a request; a holder runs once more for it.

Requests are kept in MongoDB, next to the locks, so that they outlive the process that
made them and the one that holds the lock: the collection ``<locks collection>.requests``,
one document per key (``LockStore.add_request`` and friends). ``requested`` counts the
requests made; ``served`` is the highest count a finished run has covered. A run covers
the requests counted when it started (under the lock), so a request made while it runs
stays pending, and a holder that dies mid-run serves nothing: its pending requests are
served by the next run of the key.

The order that makes this safe: a busy call records its request, then tries the lock once
more; a holder, after its run and its release, looks for pending requests and, if there
are any, tries the lock again. Whoever holds the lock after a request was recorded either
started after it (and covers it) or finds it when done.

At most one extra run: any acquire that is not a call's own first run (a busy call's second
try, a holder's next round) reads the counts once it holds the lock and runs only if its
reason still stands: the busy call's request is not served yet, or (for a holder) some
request is pending. Otherwise it releases, and looks for pending requests once more, since
a request made while it held the lock found the key busy.

A run's start (under the lock) also keeps the key's document from the TTL monitor, and a
run serves its count only on a document that has counted that many, so that a document
dropped and made anew mid-run does not have its new requests marked served.

``migrate_mongolock`` creates the collection's TTL index (idle keys' documents go after
``IDLE_EXPIRY``); it is also created on first use, once per process, where the user may.
"""

from __future__ import annotations

import logging
import threading

from django_mongolock.manager import LockManager
from django_mongolock.queries.requests import IDLE_EXPIRY, REQUESTS_TTL_INDEX, RequestCount
from django_mongolock.store import LockStore

__all__ = ["IDLE_EXPIRY", "RequestCount", "Requests"]

logger = logging.getLogger("django_mongolock.decorators")

_indexed: set[tuple[int, str, str]] = set()
_indexed_mutex = threading.Lock()


class Requests:
    """The run requests of one manager's keys (majority writes and reads)."""

    __slots__ = ("_store",)

    def __init__(self, manager: LockManager) -> None:
        self._store: LockStore = manager.store  # connects, as the acquire does anyway
        self._ensure_index(manager)

    def _ensure_index(self, manager: LockManager) -> None:
        """The TTL index, created once per client and collection (idempotent anyway).

        A user that may not create indexes still gets its requests kept and served; only
        the clean-up of idle keys' documents is missing, which is logged once.
        """
        requests = self._store.requests
        marker = (id(manager.client), manager.database, requests.name)
        with _indexed_mutex:
            if marker in _indexed:
                return
        if not self._store.ensure_requests_index():
            logger.warning(
                "cannot create the TTL index %r of %s.%s (not authorized): run requests "
                "of idle keys are not cleaned up",
                REQUESTS_TTL_INDEX,
                manager.database,
                requests.name,
            )
        with _indexed_mutex:
            _indexed.add(marker)

    def add(self, key: str) -> int:
        """Record one request for a run of ``key`` (durable once this returns); its number:
        a run covered it once ``served`` reaches it."""
        return self._store.add_request(key)

    def count(self, key: str) -> RequestCount:
        """The counts a run starting now sees (it covers ``requested``); read while holding
        the lock. Keeps the key's document from the TTL monitor while the run goes on."""
        return self._store.requested(key)

    def serve(self, key: str, covered: int) -> None:
        """A run that started at ``count().requested == covered`` has finished."""
        self._store.serve_requests(key, covered)

    def pending(self, key: str) -> bool:
        """Whether a request came in that no finished run has covered."""
        return self._store.request_pending(key)
