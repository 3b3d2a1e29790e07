"""The contention statistics' queries: per key and minute counts in ``<collection>.stats``.

Each process counts what its acquirers and holders saw (acquisitions, waits, refusals,
losses, handoffs) and adds them, once per refresher tick, to one document per key and
minute: ``$inc`` merges the counts of every process. A TTL index on the minute (``at``)
purges a document ``STATS_RETENTION`` seconds after it, and each manager writes at most
``MAX_KEYS`` keys a minute (the rest are added up under ``OTHER_KEYS``), so the collection stays
small whatever the number of keys. Minutes are the recording process's clock: unlike
lease ends, nothing here decides who holds a lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from pymongo import UpdateOne

from django_mongolock.queries.common import LIVE_WAITERS

__all__ = [
    "BUCKET_SECONDS",
    "BUSY_FIELDS",
    "COUNTERS",
    "EVENTS_KEEP",
    "MAX_KEYS",
    "OTHER_KEYS",
    "STATS_BUSY_INDEX",
    "STATS_KEY_INDEX",
    "STATS_RETENTION",
    "STATS_TTL_INDEX",
    "Bucket",
    "bucket_of",
    "busiest",
    "events_of",
    "flush",
    "key_minutes",
    "line",
    "minutes_of",
    "since",
    "totals",
    "waiting_now",
]

# One document per key and minute.
BUCKET_SECONDS: Final = 60
# Seconds a minute's document is kept after that minute (the admin shows the last hour).
STATS_RETENTION: Final = 7200
STATS_TTL_INDEX: Final = "stats_ttl"
# A key's minutes, for its page and the busiest keys' sparklines.
STATS_KEY_INDEX: Final = "stats_key_at"
# What the busiest keys are chosen by, so that the choice reads the index alone.
STATS_BUSY_INDEX: Final = "stats_busy"
BUSY_FIELDS: Final = ("at", "key", "score", "acquired")
# At most this many keys per manager and minute, across its flushes; the others are summed
# up under OTHER_KEYS (an empty key, which no lock can have).
MAX_KEYS: Final = 100
OTHER_KEYS: Final = ""
# The notable events (losses, handoffs, timeouts) kept per key and minute, newest last.
EVENTS_KEEP: Final = 20
# The counters of a bucket, in the order the pages show them.
COUNTERS: Final = (
    "acquired",  # acquisitions
    "waited",  # of which had to wait
    "wait_ms",  # total wait of those that waited
    "busy",  # refused at once (not blocking)
    "timeouts",  # gave up waiting
    "errors",  # failed (server trouble)
    "released",
    "hold_ms",  # total hold time of the released ones
    "lost",
    "handoffs",
)


def bucket_of(moment: float) -> datetime:
    """The start of the minute (UTC) that the Unix time ``moment`` falls in."""
    start = int(moment // BUCKET_SECONDS) * BUCKET_SECONDS
    return datetime.fromtimestamp(start, UTC)


@dataclass(slots=True)
class Bucket:
    """What one process counted for one key in one minute, until its next flush."""

    counts: dict[str, int] = field(default_factory=dict)
    wait_max_ms: int = 0
    lost_by: dict[str, int] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def score(self) -> int:
        """How much contention it shows: waits, refusals, timeouts, and losses ten times."""
        c = self.counts
        return c.get("waited", 0) + c.get("busy", 0) + c.get("timeouts", 0) + 10 * c.get("lost", 0)

    @property
    def weight(self) -> int:
        """What a busiest-first cut keeps: the score, then the acquisitions."""
        return self.score * 1000 + self.counts.get("acquired", 0)

    def merge(self, other: Bucket) -> None:
        for name, value in other.counts.items():
            self.counts[name] = self.counts.get(name, 0) + value
        self.wait_max_ms = max(self.wait_max_ms, other.wait_max_ms)
        for reason, value in other.lost_by.items():
            self.lost_by[reason] = self.lost_by.get(reason, 0) + value
        self.events = (self.events + other.events)[-EVENTS_KEEP:]


def flush(buckets: Mapping[tuple[str, datetime], Bucket]) -> list[UpdateOne]:
    """The bulk write that adds ``buckets`` ({(key, minute): counts}) to the collection,
    and their sum per minute to that minute's total (``key`` None), which the charts of
    every key read instead of adding up the keys' documents on each page."""
    totals: dict[datetime, Bucket] = {}
    for (_, minute), bucket in buckets.items():
        total = totals.setdefault(minute, Bucket())
        total.merge(Bucket(bucket.counts, bucket.wait_max_ms, bucket.lost_by))
    writes = [
        UpdateOne(
            {"_id": {"t": minute}},
            {
                "$setOnInsert": {"key": None, "at": minute},
                "$max": {"wait_max_ms": total.wait_max_ms},
                "$inc": {name: value for name, value in total.counts.items() if value}
                or {"acquired": 0},
            },
            upsert=True,
        )
        for minute, total in sorted(totals.items())
    ]
    for (key, minute), bucket in sorted(buckets.items(), key=lambda item: item[0]):
        inc: dict[str, int] = {name: value for name, value in bucket.counts.items() if value}
        inc.update({f"lost_by.{reason}": n for reason, n in bucket.lost_by.items() if n})
        inc["score"] = bucket.score
        update: dict[str, Any] = {
            "$setOnInsert": {"key": key, "at": minute},
            "$max": {"wait_max_ms": bucket.wait_max_ms},
        }
        if inc:
            update["$inc"] = inc
        if bucket.events:
            update["$push"] = {"events": {"$each": bucket.events, "$slice": -EVENTS_KEEP}}
        # The key and minute as the _id: concurrent upserts of one bucket by two
        # processes cannot make two documents (the server retries the loser as an update).
        writes.append(UpdateOne({"_id": {"k": key, "t": minute}}, update, upsert=True))
    return writes


def _sums() -> dict[str, Any]:
    sums: dict[str, Any] = {name: {"$sum": f"${name}"} for name in COUNTERS}
    sums["wait_max_ms"] = {"$max": "$wait_max_ms"}
    return sums


def busiest(since: datetime, limit: int) -> list[dict[str, Any]]:
    """The ``limit`` keys with the most contention since ``since`` (``score``: waits,
    refusals, timeouts and ten times the losses), then the most acquisitions.

    Only the key, minute, score and acquisitions are read, all from ``STATS_BUSY_INDEX``
    (a covered scan: no document is fetched); the summed-up ``OTHER_KEYS`` and the
    minutes' totals are left out.
    """
    return [
        {"$match": {"at": {"$gte": since}, "key": {"$gt": OTHER_KEYS}}},
        {"$group": {"_id": "$key", "score": {"$sum": "$score"}, "acquired": {"$sum": "$acquired"}}},
        {"$sort": {"score": -1, "acquired": -1, "_id": 1}},
        {"$limit": limit},
    ]


def totals(since: datetime) -> list[dict[str, Any]]:
    """Every key's counts added up per minute since ``since`` (from the minutes' totals)."""
    return [
        {"$match": {"at": {"$gte": since}, "key": None}},
        {"$group": {"_id": "$at", **_sums()}},
        {"$sort": {"_id": 1}},
    ]


def key_minutes(keys: Sequence[str], since: datetime) -> list[dict[str, Any]]:
    """The counts of each of ``keys`` per minute since ``since`` (its events included)."""
    sums = _sums()
    sums["events"] = {"$push": "$events"}
    return [
        {"$match": {"at": {"$gte": since}, "key": {"$in": list(keys)}}},
        {"$group": {"_id": {"key": "$key", "at": "$at"}, **sums}},
        {"$sort": {"_id.at": 1}},
    ]


def waiting_now(limit: int) -> list[dict[str, Any]]:
    """The lock documents with the longest lines of live waiters now, longest first."""
    return [
        {"$match": {"waiters.0": {"$exists": True}}},
        {"$project": {"waiting": {"$size": LIVE_WAITERS}}},
        {"$match": {"waiting": {"$gt": 0}}},
        {"$sort": {"waiting": -1, "_id": 1}},
        {"$limit": limit},
    ]


def line(key: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``find_one`` arguments for the live waiters of ``key`` in line order, at server time."""
    return {"_id": key}, {"now": "$$NOW", "waiters": LIVE_WAITERS}


def since(now: datetime, minutes: int) -> datetime:
    """The first minute of a window of ``minutes`` minutes that ends with ``now``'s."""
    return bucket_of(now.timestamp()) - timedelta(minutes=minutes - 1)


def minutes_of(start: datetime, count: int) -> list[datetime]:
    return [start + timedelta(minutes=i) for i in range(count)]


def events_of(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The events of grouped rows (lists of lists), flattened, newest first."""
    found = [event for row in rows for group in row.get("events") or () for event in group or ()]
    return sorted(
        found, key=lambda event: event.get("at") or datetime.min.replace(tzinfo=UTC), reverse=True
    )
