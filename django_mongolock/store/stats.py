"""The contention statistics next to the lock collection (``<collection>.stats``).

A store of its own over the lock store's collection, so the lock store's queries stay
as they are: one bulk write per flush, and the admin's reads of the last hour.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import pymongo
from pymongo import ASCENDING
from pymongo.collection import Collection
from pymongo.errors import OperationFailure

from django_mongolock.info import IndexAction
from django_mongolock.queries import stats as queries
from django_mongolock.queries.indexes import TTLIndex
from django_mongolock.store.base import StoreBase

__all__ = ["INDEX_RETRY", "INDEX_TIME", "StatsStore"]

logger = logging.getLogger("django_mongolock.stats")

# Seconds before a failed creation of the indexes is tried again.
INDEX_RETRY = 60.0
# The limit of one creation of the indexes: an index build on a replica set waits for
# every voting member, and an interrupted one is aborted by the server.
INDEX_TIME = 60.0
# The server's code for a hint that names no index (among other bad values).
BAD_VALUE = 2


class StatsStore(StoreBase):
    """Per key and minute counts of acquisitions, waits, losses and handoffs."""

    def __init__(self, collection: Collection[Any]) -> None:
        super().__init__(collection)
        self._indexed = False
        self._indexing: threading.Thread | None = None
        self._index_retry = 0.0  # when a failed index creation may be tried again
        self._mutex = threading.Lock()

    @property
    def stats(self) -> Collection[Any]:
        return self._side("stats")

    @property
    def index(self) -> TTLIndex:
        return TTLIndex(queries.STATS_TTL_INDEX, "at", queries.STATS_RETENTION, "statistics")

    def check_index(self) -> IndexAction:
        """Whether the TTL index that bounds the collection is in place."""
        return self.index.plan(self._index_information(self.stats).get(self.index.name))

    def ensure_index(self) -> IndexAction:
        """Create the TTL index (or bring its expiry in line) and the index of a key's
        minutes; idempotent."""
        item = self.check_index()
        index = self.index
        with self._translate:
            self.stats.create_index(
                [("key", ASCENDING), ("at", ASCENDING)], name=queries.STATS_KEY_INDEX
            )
            self.stats.create_index(
                [(name, ASCENDING) for name in queries.BUSY_FIELDS], name=queries.STATS_BUSY_INDEX
            )
            if item.action == "missing":
                self.stats.create_index(
                    index.field, expireAfterSeconds=index.seconds, name=index.name
                )
                item = IndexAction(item.name, item.description, "created")
            elif item.action == "differs":
                self._set_ttl(self.stats, index.name, index.seconds)
                item = IndexAction(item.name, item.description, "updated", item.detail)
        self._indexed = True
        return item

    def add(self, buckets: Mapping[tuple[str, datetime], queries.Bucket]) -> None:
        """Add one process's counts: one unordered bulk write. The first also starts the
        creation of the indexes, on a thread of its own, which it does not wait for."""
        writes = queries.flush(buckets)
        if not writes:
            return
        self._index_soon()
        with self._translate:
            self.stats.bulk_write(writes, ordered=False)

    def _index_soon(self) -> None:
        """Create the indexes once, with a limit of their own (``INDEX_TIME``), off the
        flush's thread: within a flush's limit (a quarter of the refresher's interval,
        on its thread) a build that waits for a slow member was cut off, and so aborted,
        every time. A failed creation is tried again a minute later; none is started at
        interpreter exit (no thread can start then), where the counts go all the same."""
        with self._mutex:
            if self._indexed or self._indexing or time.monotonic() < self._index_retry:
                return
            # In a fresh context: not under the flush's own operation limit.
            building = threading.Thread(
                target=contextvars.Context().run,
                args=(self._build_indexes,),
                name="mongolock-stats-indexes",
                daemon=True,
            )
            try:
                building.start()
            except RuntimeError:  # interpreter shutdown: a later process builds them
                return
            self._indexing = building

    def _build_indexes(self) -> None:
        try:
            with pymongo.timeout(INDEX_TIME):
                self.ensure_index()
        except Exception as exc:  # a thread of its own: logged, and tried again
            logger.warning("could not create the statistics indexes (again in a minute): %s", exc)
            with self._mutex:
                self._index_retry = time.monotonic() + INDEX_RETRY
        finally:
            with self._mutex:
                self._indexing = None

    def wait_indexed(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a creation of the indexes under way; whether
        they are in place (for tests and tools)."""
        with self._mutex:
            building = self._indexing
        if building is not None:
            building.join(timeout)
        return self._indexed

    def busiest(self, since: datetime, limit: int) -> list[dict[str, Any]]:
        """The busiest keys since ``since``, through their index; without it while it is not
        built yet (the first flush of the processes that count starts building it)."""
        pipeline = queries.busiest(since, limit)
        with self._translate:
            try:
                return list(self.stats.aggregate(pipeline, hint=queries.STATS_BUSY_INDEX))
            except OperationFailure as exc:
                if exc.code != BAD_VALUE or "hint" not in str(exc):
                    raise
            self._index_soon()
            return list(self.stats.aggregate(pipeline))

    def totals(self, since: datetime) -> list[dict[str, Any]]:
        with self._translate:
            return list(self.stats.aggregate(queries.totals(since)))

    def key_minutes(self, keys: Sequence[str], since: datetime) -> list[dict[str, Any]]:
        if not keys:
            return []
        with self._translate:
            return list(self.stats.aggregate(queries.key_minutes(keys, since)))

    def waiting_now(self, limit: int) -> list[tuple[str, int]]:
        """The keys with the longest lines of waiters now, from the lock documents."""
        with self._translate:
            rows = self.collection.aggregate(queries.waiting_now(limit))
            return [(str(row["_id"]), int(row["waiting"])) for row in rows]

    def line(self, key: str) -> tuple[datetime | None, list[dict[str, Any]]]:
        """The server's time and the live waiters of ``key``, first in line first."""
        with self._translate:
            doc = self.collection.find_one(*queries.line(key))
        if doc is None:
            return None, []
        return doc.get("now"), list(doc.get("waiters") or ())
