"""The expressions every lock query shares: liveness, the projection, fencing tokens.

One document per key. An exclusive holder lives in the top-level fields (``owner``,
``token``, ``expires_at``...). Shared holders (shared locks and semaphores) live in
``holders``, with ``owner`` null and the top-level ``expires_at`` set to the latest of
their leases, so that "is this key free for an exclusive holder?" stays one comparison
with ``$$NOW``, and the TTL index and listings treat both kinds alike. Every decision
about time is made by the server inside the update.
"""

from __future__ import annotations

from typing import Any, Final

# Fencing token from the cluster time: seconds * 2**31 + increment. The server keeps the
# increment below 2**31, so tokens stay ordered like cluster times and fit in an int64
# until the year 2106. The cluster time only moves forward, also across elections.
CLUSTER_TOKEN: Final = {
    "$add": [
        {"$multiply": [{"$toLong": {"$tsSecond": "$$CLUSTER_TIME"}}, 2**31]},
        {"$toLong": {"$tsIncrement": "$$CLUSTER_TIME"}},
    ]
}
LIVE: Final = {"$gt": ["$expires_at", "$$NOW"]}


def place_live(place: str = "$$w") -> dict[str, Any]:
    """True when the place in ``place`` has not lapsed."""
    return {"$gt": [f"{place}.until", "$$NOW"]}


def live_places(places: Any) -> dict[str, Any]:
    """The places of ``places`` (a line) that have not lapsed, in line order."""
    return {"$filter": {"input": places, "as": "w", "cond": place_live()}}


# Every place in line as stored, live or lapsed.
PLACES: Final = {"$ifNull": ["$waiters", []]}
# Waiters in line whose place has not lapsed.
LIVE_WAITERS: Final = live_places(PLACES)
# A place its waiter left the line from by taking the key (or by leaving): marked lapsed
# where it stands instead of taken out, so that the places behind it keep their index
# and the write changes one entry of the line, not every entry behind it (a removal
# from the front of a 200-place line makes a 9 KB oplog entry, which every change
# stream on the collection reads). ``kept`` takes lapsed places out in bulk. A null
# ``until`` sorts below every date: the mark holds whatever the server's clock does.
LAPSED_PLACE: Final = {"until": None}
# Lapsed places stay in line until there are at least this many, and at least as many
# as live places: taking them out then rewrites the line at most once per that many
# writes, and the stored line stays below twice ``MAX_WAITERS`` places.
COMPACT_AT: Final = 16
LIVE_HOLDERS: Final = {
    "$filter": {
        "input": {"$ifNull": ["$holders", []]},
        "as": "h",
        "cond": {"$gt": ["$$h.expires_at", "$$NOW"]},
    }
}
FIELDS: Final = (
    "owner",
    "token",
    "acquired_at",
    "refreshed_at",
    "expires_at",
    "ttl",
    "mode",
    "limit",
    "group",
    "kind",
    "holders",
)
PROJECTION: Final = {
    **dict.fromkeys(FIELDS, 1),
    "now": "$$NOW",
    "waiting": {"$size": LIVE_WAITERS},
}
# A document is a lock while it has an exclusive owner or shared holders; a released
# document kept for its waiters' line has neither.
HELD: Final = {"$or": [{"owner": {"$nin": [None, ""]}}, {"holders.0": {"$exists": True}}]}
# How long after the lease end it waits for a waiter keeps its place in line (ms); a place
# also lasts at least this long after any attempt of its waiter.
PLACE_GRACE_MS: Final = 2000
# At most how long a place behind the head of the line lasts past a handoff, beyond the
# grace period, unless renewed (ms). Those waiters hear of no handoff: they look again at
# least this often while others are ahead of them, and an exclusive one's place lasts
# this and the grace period from each of its attempts while the key is held. A run of
# dead waiters in line lapses within this and the grace period of the handoff that
# found them.
LINE_CHECK_MS: Final = 5000
# The first lease of a lock handed to a waiter by a release is at most this long (ms): a
# waiter that died in line then holds the key back no longer than a lapsed place would.
# A live one is woken by the release and its refresher extends the lease to its ttl.
HANDOFF_LEASE_MS: Final = PLACE_GRACE_MS
# The lists inside one document are capped far below MongoDB's 16 MB document limit (an
# entry takes about 100 bytes): a blocking acquirer facing a full line, or a shared one
# facing a full list of holders, is refused with ``LineFull`` instead of growing them.
MAX_WAITERS: Final = 1000
MAX_HOLDERS: Final = 1000
# Owner ids of the latest acquisitions of a key that ended (released, or given back): a
# late duplicate of one of those acquire requests changes nothing instead of taking the
# key again for a holder that has moved on.
ENDED_KEEP: Final = 16
ENDED: Final = {"$ifNull": ["$ended", []]}
NEW_TOKEN: Final = {"$max": [{"$add": [{"$ifNull": ["$token", 0]}, 1]}, CLUSTER_TOKEN]}


def kept(places: Any) -> dict[str, Any]:
    """``places`` (the stored line after this write's changes), with its lapsed places
    taken out once they are ``COMPACT_AT`` or more, and as many as the live ones, or
    when no live place is left (an empty line is written as ``[]``)."""
    live = live_places("$$all_places")
    lapsed = {"$subtract": [{"$size": "$$all_places"}, {"$size": "$$live_places"}]}
    due = {
        "$or": [
            {"$eq": [{"$size": "$$live_places"}, 0]},
            {"$gte": [lapsed, {"$max": [COMPACT_AT, {"$size": "$$live_places"}]}]},
        ]
    }
    return {
        "$let": {
            "vars": {"all_places": places},
            "in": {
                "$let": {
                    "vars": {"live_places": live},
                    "in": {"$cond": [due, "$$live_places", "$$all_places"]},
                }
            },
        }
    }


def without(owner: Any) -> dict[str, Any]:
    """The line with the live place of ``owner`` marked lapsed (see ``LAPSED_PLACE``)."""
    gone = {"$and": [place_live(), {"$eq": ["$$w.owner", owner]}]}
    return kept(
        {"$map": {"input": PLACES, "as": "w", "in": {"$cond": [gone, LAPSED_PLACE, "$$w"]}}}
    )


def lease_end(ttl: float) -> dict[str, Any]:
    return {"$add": ["$$NOW", round(ttl * 1000)]}


def mine(me: Any) -> dict[str, Any]:
    """This owner's entry in ``holders`` (missing when it has none)."""
    return {
        "$arrayElemAt": [
            {
                "$filter": {
                    "input": {"$ifNull": ["$holders", []]},
                    "as": "h",
                    "cond": {"$eq": ["$$h.owner", me]},
                }
            },
            0,
        ]
    }


def holder_is(owner: str, *, live: bool) -> dict[str, Any]:
    """True when ``owner`` has an entry in ``holders`` (and, with ``live``, a live one)."""
    test: Any = {"$eq": ["$$h.owner", {"$literal": owner}]}
    if live:
        test = {"$and": [test, {"$gt": ["$$h.expires_at", "$$NOW"]}]}
    return {
        "$anyElementTrue": [
            {"$map": {"input": {"$ifNull": ["$holders", []]}, "as": "h", "in": test}}
        ]
    }
