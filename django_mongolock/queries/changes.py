"""The change stream filter that tells the watcher a key was freed."""

from __future__ import annotations

from typing import Any, Final

__all__ = ["FREED_EVENTS"]

# A key is freed by a delete (release of old, force release, the TTL monitor), or by a
# release that keeps the document for its waiters (it sets ``released_at``).
FREED_EVENTS: Final[list[dict[str, Any]]] = [
    {
        "$match": {
            "$or": [
                {"operationType": "delete"},
                {
                    "operationType": "update",
                    "updateDescription.updatedFields.released_at": {"$exists": True},
                },
            ]
        }
    }
]
