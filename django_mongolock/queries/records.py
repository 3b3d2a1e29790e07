"""The side collections' queries: process heartbeats (is a holder alive?) and the audit
trail of force releases. Both sit next to the lock collection (``locks.processes``,
``locks.audit``); every time in them is the server's."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

from bson import ObjectId
from pymongo import DESCENDING, UpdateOne

from django_mongolock.info import LockInfo

__all__ = [
    "HEARTBEAT_SLACK",
    "HISTORY_SORT",
    "LIVENESS",
    "audit_record",
    "heartbeats",
    "liveness",
]

# A process counts as alive while its last heartbeat is newer than two of its tick
# intervals plus this many seconds (a slow tick, a retried write).
HEARTBEAT_SLACK: Final = 5.0
# Whether a process is alive, and for how long (ms) it has been silent, by server time.
LIVENESS: Final = {
    "alive": {"$gt": ["$alive_until", "$$NOW"]},
    "silent": {"$subtract": ["$$NOW", "$seen_at"]},
}
# The force releases of a key, newest first.
HISTORY_SORT: Final = [("at", DESCENDING), ("_id", DESCENDING)]


def heartbeats(process_ids: Iterable[str], interval: float) -> list[UpdateOne]:
    """The bulk write that records these processes alive, ticking every ``interval``.

    The document counts as alive until two intervals plus ``HEARTBEAT_SLACK`` after the
    write (``alive_until``, also the TTL index's field).
    """
    bound_ms = round((2 * interval + HEARTBEAT_SLACK) * 1000)
    stamp = [
        {
            "$set": {
                "seen_at": "$$NOW",
                # Another lane of the process may tick less often: keep its bound.
                "alive_until": {"$max": ["$alive_until", {"$add": ["$$NOW", bound_ms]}]},
                "interval": float(interval),
            }
        }
    ]
    return [UpdateOne({"_id": pid}, stamp, upsert=True) for pid in sorted(set(process_ids))]


def liveness(docs: Iterable[dict[str, Any]]) -> dict[str, tuple[bool, float]]:
    """``{process id: (alive, seconds silent)}`` from the documents read with ``LIVENESS``."""
    return {
        str(doc["_id"]): (
            bool(doc.get("alive")),
            max(0.0, float(doc.get("silent") or 0) / 1000),
        )
        for doc in docs
    }


def audit_record(key: str, info: LockInfo, *, by: str, reason: str) -> tuple[Any, list[Any]]:
    """``update_one(filter, pipeline, upsert=True)`` arguments that record a force release
    of the lock ``info`` at the server's time."""
    owner = info.owner or ", ".join(h.owner for h in info.live_holders)
    # $literal: a key, owner, name or reason that starts with "$" is text, not a field
    # path or variable of the update pipeline.
    record = {
        "key": {"$literal": key},
        "owner": {"$literal": owner},
        "token": info.token,
        "by": {"$literal": by},
        "reason": {"$literal": reason},
        "expired": not info.live,
        "at": "$$NOW",
    }
    return {"_id": ObjectId()}, [{"$set": record}]
