"""The contention statistics next to the lock collection (``<collection>.stats``).

A store of its own over the lock store's collection, so the lock store's queries stay
as they are: one bulk write per flush, and the admin's reads of the last hour.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from pymongo import ASCENDING
from pymongo.collection import Collection

from django_mongolock.info import IndexAction
from django_mongolock.queries import stats as queries
from django_mongolock.queries.indexes import TTLIndex
from django_mongolock.store.base import StoreBase

__all__ = ["INDEX_RETRY", "StatsStore"]

# Seconds before a failed creation of the indexes is tried again.
INDEX_RETRY = 60.0


class StatsStore(StoreBase):
    """Per key and minute counts of acquisitions, waits, losses and handoffs."""

    def __init__(self, collection: Collection[Any]) -> None:
        super().__init__(collection)
        self._indexed = False
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
        """Add one process's counts: one unordered bulk write (the indexes once first; a
        failed creation is tried again a minute later, not on every flush)."""
        writes = queries.flush(buckets)
        if not writes:
            return
        with self._mutex:
            due = not self._indexed and time.monotonic() >= self._index_retry
            if due:
                self._index_retry = time.monotonic() + INDEX_RETRY
        if due:
            self.ensure_index()
        with self._translate:
            self.stats.bulk_write(writes, ordered=False)

    def busiest(self, since: datetime, limit: int) -> list[dict[str, Any]]:
        with self._translate:
            return list(
                self.stats.aggregate(queries.busiest(since, limit), hint=queries.STATS_BUSY_INDEX)
            )

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
