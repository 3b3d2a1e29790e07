"""The change stream filter that tells the watcher a key was freed."""

from __future__ import annotations

from typing import Any, Final

__all__ = ["FREED_EVENTS"]

# A key is freed by a delete (release of old, force release, the TTL monitor), or by a
# release that keeps the document for its waiters (it sets ``released_at``). The server
# logs an update whose changes are about as large as the document as a whole new
# document: the stream reports it as a ``replace`` (a release that hands a small
# document to a waiter often is one), matched when it leaves the key without an owner,
# or made its owner in the release itself (``released_at`` not before ``acquired_at``).
FREED_EVENTS: Final[list[dict[str, Any]]] = [
    {
        "$match": {
            "$or": [
                {"operationType": "delete"},
                {
                    "operationType": "update",
                    "updateDescription.updatedFields.released_at": {"$exists": True},
                },
                {"operationType": "replace", "fullDocument.owner": None},
                {
                    "operationType": "replace",
                    "$expr": {"$gte": ["$fullDocument.released_at", "$fullDocument.acquired_at"]},
                },
            ]
        }
    },
    # The line and the shared holders are no part of a wake-up or a handoff: a replace
    # event of a long line would carry hundreds of kilobytes to every watching process.
    {"$project": {"fullDocument.waiters": 0, "fullDocument.holders": 0}},
]
