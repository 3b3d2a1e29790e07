"""``on_busy="coalesce"``: a busy call leaves a request; a holder runs once more for it.

Requests are kept in MongoDB, next to the locks, so that they outlive the process that
made them and the one that holds the lock: the collection ``<locks collection>.requests``,
one document per key. ``requested`` counts the requests made; ``served`` is the highest
count a finished run has covered. A run covers the requests counted when it started (under
the lock), so a request made while it runs stays pending, and a holder that dies mid-run
serves nothing: its pending requests are served by the next run of the key.

The order that makes this safe: a busy call records its request, then tries the lock once
more; a holder, after its run and its release, looks for pending requests and, if there
are any, tries the lock again. Whoever holds the lock after a request was recorded either
started after it (and covers it) or finds it when done.
"""

from __future__ import annotations

import logging
import threading
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from pymongo.collection import Collection
from pymongo.errors import OperationFailure

from django_mongolock import mongo
from django_mongolock.manager import LockManager

__all__ = ["IDLE_EXPIRY", "REQUESTS_SUFFIX", "TTL_INDEX", "Requests"]

logger = logging.getLogger("django_mongolock.decorators")

REQUESTS_SUFFIX: Final = ".requests"
TTL_INDEX: Final = "expires_at_ttl"
_UNAUTHORIZED: Final = 13
# A key's document is dropped by a TTL index once nobody has asked for a run for this long:
# a request that no holder served in a week is stale (and the next run serves it anyway).
IDLE_EXPIRY: Final = timedelta(days=7)

_indexed: set[tuple[int, str, str]] = set()
_indexed_mutex = threading.Lock()


class Requests:
    """The run requests of one manager's keys (majority writes and reads)."""

    __slots__ = ("_collection", "_translate")

    def __init__(self, manager: LockManager) -> None:
        store = manager.store  # connects, as the acquire before or after does anyway
        name = manager.collection + REQUESTS_SUFFIX
        self._collection: Collection[Any] = mongo.majority(manager.client[manager.database][name])
        self._translate = mongo.Translate(store)
        self._ensure_index(manager)

    def _ensure_index(self, manager: LockManager) -> None:
        """The TTL index, created once per client and collection (idempotent anyway).

        A user that may not create indexes still gets its requests kept and served; only
        the clean-up of idle keys' documents is missing, which is logged once.
        """
        marker = (id(manager.client), manager.database, self._collection.name)
        with _indexed_mutex:
            if marker in _indexed:
                return
        with self._translate:
            try:
                self._collection.create_index("expires_at", expireAfterSeconds=0, name=TTL_INDEX)
            except OperationFailure as exc:
                if exc.code != _UNAUTHORIZED:
                    raise
                logger.warning(
                    "cannot create the TTL index %r of %s.%s (not authorized): run requests "
                    "of idle keys are not cleaned up",
                    TTL_INDEX,
                    manager.database,
                    self._collection.name,
                )
        with _indexed_mutex:
            _indexed.add(marker)

    def add(self, key: str) -> None:
        """Record one request for a run of ``key`` (durable once this returns)."""
        expires = datetime.now(UTC) + IDLE_EXPIRY
        with self._translate:
            self._collection.update_one(
                {"_id": key},
                {"$inc": {"requested": 1}, "$set": {"expires_at": expires}},
                upsert=True,
            )

    def count(self, key: str) -> int:
        """How many requests a run starting now covers; read while holding the lock."""
        with self._translate:
            found = self._collection.find_one({"_id": key}, {"requested": 1})
        return int(found.get("requested", 0)) if found else 0

    def serve(self, key: str, covered: int) -> None:
        """A run that started at ``count() == covered`` has finished."""
        if covered <= 0:
            return
        with self._translate:
            self._collection.update_one({"_id": key}, {"$max": {"served": covered}})

    def pending(self, key: str) -> bool:
        """Whether a request came in that no finished run has covered."""
        query = {"_id": key, "$expr": {"$gt": ["$requested", {"$ifNull": ["$served", 0]}]}}
        with self._translate:
            return self._collection.find_one(query, {"_id": 1}) is not None
