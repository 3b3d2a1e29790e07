"""Run requests of ``on_busy="coalesce"``: one document per key in ``<collection>.requests``.

``requested`` counts the requests made; ``served`` is the highest count a finished run
covered. A request is pending while ``requested > served``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Final

__all__ = [
    "IDLE_EXPIRY",
    "REQUESTS_TTL_INDEX",
    "add_request",
    "pending_request",
    "served",
]

REQUESTS_TTL_INDEX: Final = "requests_expires_at_ttl"
# A key's document is dropped by the TTL index once nobody has asked for a run for this long:
# a request that no holder served in a week is stale (and the next run serves it anyway).
IDLE_EXPIRY: Final = timedelta(days=7)


def add_request() -> list[dict[str, Any]]:
    """The update that counts one more request and keeps the document for ``IDLE_EXPIRY``
    (by the server's clock, as every time of the package)."""
    idle_ms = int(IDLE_EXPIRY / timedelta(milliseconds=1))
    return [
        {
            "$set": {
                "requested": {"$add": [{"$ifNull": ["$requested", 0]}, 1]},
                "expires_at": {"$add": ["$$NOW", idle_ms]},
            }
        }
    ]


def served(covered: int) -> dict[str, Any]:
    """The update recording that a run covering ``covered`` requests has finished."""
    return {"$max": {"served": covered}}


def pending_request(key: str) -> dict[str, Any]:
    """The filter matching ``key``'s document while a request is not served."""
    return {"_id": key, "$expr": {"$gt": ["$requested", {"$ifNull": ["$served", 0]}]}}
