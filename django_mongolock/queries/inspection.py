"""The operator's queries: find a lock, list and count them, remove one by force.

Reads count only documents that are locks (``HELD``: an owner or shared holders); a
released document kept for its waiters' line is no lock. Live or expired is decided
by the server's clock.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

from pymongo import ASCENDING, DESCENDING

from django_mongolock.info import Order, State
from django_mongolock.queries.common import HELD, LIVE

__all__ = [
    "COUNTED",
    "SORTS",
    "at_tokens",
    "counts",
    "find",
    "find_many",
    "force_release",
    "listing",
]

SORTS: Final[Mapping[Order, list[tuple[str, int]]]] = {
    "key": [("_id", ASCENDING)],
    "-key": [("_id", DESCENDING)],
    "expires": [("expires_at", ASCENDING), ("_id", ASCENDING)],
    "-expires": [("expires_at", DESCENDING), ("_id", ASCENDING)],
    "acquired": [("acquired_at", ASCENDING), ("_id", ASCENDING)],
    "-acquired": [("acquired_at", DESCENDING), ("_id", ASCENDING)],
}
# The fields of the ``counts`` pipeline's one row.
COUNTED: Final = ("live", "expired", "expiring")


def find(key: str) -> dict[str, Any]:
    """The lock document of ``key``, live or expired."""
    return {"_id": key, **HELD}


def force_release(key: str, token: int | None) -> dict[str, Any]:
    """The lock of ``key`` whoever holds it; only at ``token`` when one is given."""
    query = find(key)
    if token is not None:
        query["token"] = token
    return query


def find_many(keys: Sequence[str]) -> dict[str, Any]:
    """The locks of ``keys``, whoever holds them (a force release checks their tokens)."""
    return {"_id": {"$in": list(keys)}, **HELD}


def at_tokens(locks: Sequence[tuple[str, int]]) -> dict[str, Any]:
    """The documents of ``locks``, each only while its token is the one given."""
    return {
        "_id": {"$in": [key for key, _ in locks]},
        "$or": [{"_id": key, "token": token} for key, token in locks],
    }


def listing(state: State, prefix: str | None, owner: str | None = None) -> dict[str, Any]:
    """The locks in ``state`` whose key starts with ``prefix`` and whose holder has ``owner``
    in its id (both taken as text, never as patterns)."""
    query: dict[str, Any] = dict(HELD)
    if prefix:
        query["_id"] = {"$regex": "^" + re.escape(prefix)}
    if owner:
        pattern = {"$regex": re.escape(owner)}
        query = {"$and": [query, {"$or": [{"owner": pattern}, {"holders.owner": pattern}]}]}
    if state == "live":
        query["$expr"] = LIVE
    elif state == "expired":
        query["$expr"] = {"$not": [LIVE]}
    elif state != "all":
        raise ValueError(f"state must be 'live', 'expired' or 'all', not {state!r}")
    return query


def counts(soon: float) -> list[dict[str, Any]]:
    """An aggregation counting live, expired and expiring-within-``soon``-seconds locks in
    one pass on the server: one row with the ``COUNTED`` fields, none without locks."""
    soon_ms = round(soon * 1000)
    expiring = {"$and": [LIVE, {"$lte": ["$expires_at", {"$add": ["$$NOW", soon_ms]}]}]}
    return [
        {"$match": HELD},
        {
            "$group": {
                "_id": None,
                "live": {"$sum": {"$cond": [LIVE, 1, 0]}},
                "expired": {"$sum": {"$cond": [LIVE, 0, 1]}},
                "expiring": {"$sum": {"$cond": [expiring, 1, 0]}},
            }
        },
    ]
