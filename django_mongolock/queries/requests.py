"""Run requests of ``on_busy="coalesce"``: one document per key in ``<collection>.requests``.

``requested`` counts the requests made; ``served`` is the highest count a finished run
covered. A request is pending while ``requested > served``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Final, NamedTuple

__all__ = [
    "IDLE_EXPIRY",
    "REQUESTS_TTL_INDEX",
    "RequestCount",
    "add_request",
    "pending_request",
    "served",
    "start_run",
]

REQUESTS_TTL_INDEX: Final = "requests_expires_at_ttl"
# A key's document is dropped by the TTL index once nobody has asked for a run for this long:
# a request that no holder served in a week is stale (and the next run serves it anyway).
IDLE_EXPIRY: Final = timedelta(days=7)


class RequestCount(NamedTuple):
    """A key's counts as a run starting now sees them."""

    requested: int
    served: int

    @property
    def pending(self) -> bool:
        return self.requested > self.served


def _kept() -> dict[str, Any]:
    """``expires_at`` ``IDLE_EXPIRY`` from now, by the server's clock (as every time of the
    package): a document in use is never the TTL monitor's to drop."""
    idle_ms = int(IDLE_EXPIRY / timedelta(milliseconds=1))
    return {"$add": ["$$NOW", idle_ms]}


def add_request() -> list[dict[str, Any]]:
    """The update that counts one more request and keeps the document for ``IDLE_EXPIRY``."""
    return [
        {
            "$set": {
                "requested": {"$add": [{"$ifNull": ["$requested", 0]}, 1]},
                "expires_at": _kept(),
            }
        }
    ]


def start_run() -> list[dict[str, Any]]:
    """The update (an upsert) a run makes when it starts: it counts nothing, but keeps the
    document for ``IDLE_EXPIRY`` so that the TTL monitor cannot drop it (and with it the
    count the run will serve) while the run goes on."""
    return [
        {
            "$set": {
                "requested": {"$ifNull": ["$requested", 0]},
                "served": {"$ifNull": ["$served", 0]},
                "expires_at": _kept(),
            }
        }
    ]


def served(key: str, covered: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The filter and update recording that a run covering ``covered`` requests has
    finished. A document whose count is below ``covered`` is not the one the run counted
    (it was dropped and made anew): its requests came after the run started, so it is
    left pending."""
    return {"_id": key, "requested": {"$gte": covered}}, {"$max": {"served": covered}}


def pending_request(key: str) -> dict[str, Any]:
    """The filter matching ``key``'s document while a request is not served."""
    return {"_id": key, "$expr": {"$gt": ["$requested", {"$ifNull": ["$served", 0]}]}}
