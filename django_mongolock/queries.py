"""The holder's queries, built as plain data so the sync and async stores run the same ones.

One document per key. An exclusive holder lives in the top-level fields (``owner``,
``token``, ``expires_at``...). Shared holders (shared locks and semaphores) live in
``holders``, with ``owner`` null and the top-level ``expires_at`` set to the latest of
their leases, so that "is this key free for an exclusive holder?" stays one comparison
with ``$$NOW``, and the TTL index and listings treat both kinds alike. Every decision
about time is made by the server inside the update.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import bson
from bson.raw_bson import RawBSONDocument

__all__ = [
    "CLUSTER_TOKEN",
    "ENDED_KEEP",
    "HELD",
    "LIVE",
    "MAX_HOLDERS",
    "MAX_WAITERS",
    "PROJECTION",
    "RELEASE_PIPELINE",
    "Acquire",
    "Release",
    "Update",
    "acquire",
    "give_up",
    "leave_queue",
    "refresh",
    "refresh_shared",
    "release",
    "release_shared",
]

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
# Waiters in line whose place has not lapsed.
LIVE_WAITERS: Final = {
    "$filter": {
        "input": {"$ifNull": ["$waiters", []]},
        "as": "w",
        "cond": {"$gt": ["$$w.until", "$$NOW"]},
    }
}
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
# How long after the lease end it waits for a waiter keeps its place in line (ms).
PLACE_GRACE_MS: Final = 2000
# The lists inside one document are capped far below MongoDB's 16 MB document limit (an
# entry takes about 100 bytes): a blocking acquirer facing a full line, or a shared one
# facing a full list of holders, is refused with ``LineFull`` instead of growing them.
MAX_WAITERS: Final = 1000
MAX_HOLDERS: Final = 1000
# Owner ids of the latest acquisitions of a key that ended (released, or given back): a
# late duplicate of one of those acquire requests changes nothing instead of taking the
# key again for a holder that has moved on.
ENDED_KEEP: Final = 16
_ENDED: Final = {"$ifNull": ["$ended", []]}
_NEW_TOKEN: Final = {"$max": [{"$add": [{"$ifNull": ["$token", 0]}, 1]}, CLUSTER_TOKEN]}


@dataclass(frozen=True, slots=True)
class Acquire:
    """One upsert: ``find_one_and_update({"_id": key}, pipeline, projection, upsert, let)``.

    The pipeline and projection depend only on the kind of request and are encoded once;
    the owner, the lease and the tags travel as the command's ``let`` variables.
    """

    pipeline: list[Mapping[str, Any]]  # the driver takes a list, never a tuple
    projection: Mapping[str, Any]
    let: dict[str, Any]

    def command(self, collection: str, key: str) -> dict[str, Any]:
        """The ``findAndModify`` command document, with majority write concern.

        It is sent as a plain command, not as a retryable write: the server then keeps
        no copy of the document for a retry (a second write per acquisition). The
        caller may send it again after a lost reply instead: for the same owner the
        update is idempotent (see ``acquire``).
        """
        return {
            "findAndModify": collection,
            "query": {"_id": key},
            "update": self.pipeline,
            "fields": self.projection,
            "upsert": True,
            "new": True,
            "let": self.let,
            "writeConcern": {"w": "majority"},
        }


@dataclass(frozen=True, slots=True)
class Update:
    """One ``find_one_and_update(filter, pipeline, projection)``."""

    filter: dict[str, Any]
    pipeline: list[dict[str, Any]]
    projection: dict[str, Any]
    return_after: bool = True


@dataclass(frozen=True, slots=True)
class Release:
    """One update by ``pipeline`` that changes the document only if the lease was live.

    An update, not a ``findAndModify``: the server keeps no pre-image for a retry, and
    the modified count still tells a live lease (1) from an ended one (0).
    """

    filter: dict[str, Any]
    pipeline: list[Mapping[str, Any]]

    def command(self, collection: str) -> dict[str, Any]:
        """The ``update`` command document, with majority write concern.

        Sent as a plain command (see ``Acquire.command``); after a lost reply the store
        sends it again and, if that changes nothing, looks whether the first one freed
        the document.
        """
        return {
            "update": collection,
            "updates": [{"q": self.filter, "u": self.pipeline}],
            "writeConcern": {"w": "majority"},
        }


def _lease_end(ttl: float) -> dict[str, Any]:
    return {"$add": ["$$NOW", round(ttl * 1000)]}


def _mine(me: Any) -> dict[str, Any]:
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


# The acquire command's variables: the owner, the lease in seconds and in milliseconds,
# the shared limit, the live waiters (q) and live shared holders (h) before the update.
_ME: Final = "$$me"
_LEASE_END: Final = {"$add": ["$$NOW", "$$ttl_ms"]}


def _queue_busy(shared: bool) -> dict[str, Any]:
    """The document with the caller in its line of waiters (added, or its place renewed).

    A waiter's place lapses unless it tries again by shortly after the lease end it was
    told to wait for (it wakes at that lease end at the latest). A full line
    (``MAX_WAITERS`` live places) takes nobody new: the document is left as it is.
    """
    until = {"$add": [{"$max": ["$expires_at", "$$NOW"]}, PLACE_GRACE_MS]}
    place: dict[str, Any] = {"owner": _ME, "until": until}
    if shared:
        place["shared"] = True  # readers in line enter together (see _shared_turn)
    return {
        "$cond": [
            {"$in": [_ME, "$$q.owner"]},
            {
                "$mergeObjects": [
                    "$$ROOT",
                    {
                        "waiters": {
                            "$map": {
                                "input": "$$q",
                                "as": "w",
                                "in": {"$cond": [{"$eq": ["$$w.owner", _ME]}, place, "$$w"]},
                            }
                        }
                    },
                ]
            },
            {
                "$cond": [
                    {"$gte": [{"$size": "$$q"}, MAX_WAITERS]},
                    "$$ROOT",
                    {
                        "$mergeObjects": [
                            "$$ROOT",
                            {"waiters": {"$concatArrays": ["$$q", [place]]}},
                        ]
                    },
                ]
            },
        ]
    }


def _shared_turn(limited: bool) -> dict[str, Any]:
    """Whether a shared request may enter past the line: every live waiter ahead of it is
    shared too (so the readers in line enter together, and none passes a writer), and,
    with a limit, those ahead and the live holders leave it a slot."""
    ahead = {
        "$let": {
            "vars": {"i": {"$indexOfArray": ["$$q.owner", _ME]}},
            "in": {
                "$cond": [
                    {"$lt": ["$$i", 0]},
                    "$$q",
                    {"$slice": ["$$q", {"$max": ["$$i", 0]}]},
                ]
            },
        }
    }
    all_shared = {
        "$allElementsTrue": [
            {"$map": {"input": "$$a", "as": "w", "in": {"$eq": ["$$w.shared", True]}}}
        ]
    }
    test: Any = all_shared
    if limited:
        slots = {"$lt": [{"$add": [{"$size": "$$h"}, {"$size": "$$a"}]}, "$$limit"]}
        test = {"$and": [all_shared, slots]}
    return {"$let": {"vars": {"a": ahead}, "in": test}}


@functools.cache
def _acquire_command(
    queue: bool, shared: bool, limited: bool, tag_names: tuple[str, ...]
) -> tuple[tuple[RawBSONDocument, ...], RawBSONDocument]:
    """The pipeline and projection of one kind of acquire, BSON-encoded once."""
    extra = {name: f"$$tag{n}" for n, name in enumerate(tag_names)}
    waiters = {"$filter": {"input": "$$q", "as": "w", "cond": {"$ne": ["$$w.owner", _ME]}}}
    variables: dict[str, Any] = {"q": LIVE_WAITERS}
    if shared:
        variables["h"] = LIVE_HOLDERS
        entry = {
            "owner": _ME,
            "token": "$$t",
            "acquired_at": "$$NOW",
            "expires_at": _LEASE_END,
            "ttl": "$$ttl",
            **extra,
        }
        fields = {
            "key": "$_id",
            "mode": "shared",
            "limit": "$$limit" if limited else None,
            "owner": None,
            "token": "$$t",
            "acquired_at": "$$NOW",
            "refreshed_at": "$$NOW",
            "expires_at": {"$max": [_LEASE_END, {"$max": "$$h.expires_at"}]},
            "ttl": "$$ttl",
            "holders": {"$concatArrays": ["$$h", [entry]]},
            "waiters": waiters,
            "group": None,
            "kind": None,
        }
        # The token is used twice: computed once, and only when the key is taken.
        taken: Any = {
            "$let": {
                "vars": {"t": _NEW_TOKEN},
                "in": {"$mergeObjects": ["$$ROOT", fields]},
            }
        }
        no_writer = {
            "$or": [
                {"$in": [{"$ifNull": ["$owner", None]}, [None, ""]]},
                {"$lte": ["$expires_at", "$$NOW"]},
            ]
        }
        free: Any = no_writer
        my_turn: Any = _shared_turn(limited)
        projection = {**PROJECTION, "mine": _mine(_ME)}
        # The limit belongs to the key while it has live holders: a caller asking for
        # another one (or none) is refused and joins no line, so the limit the holders
        # rely on is never exceeded. A full list of holders (a semaphore's limit is at
        # most the cap) takes nobody new either.
        refused: list[Any] = [
            {
                "$and": [
                    {"$gt": [{"$size": "$$h"}, 0]},
                    {"$ne": [{"$ifNull": ["$limit", None]}, "$$limit" if limited else None]},
                ]
            },
            {"$gte": [{"$size": "$$h"}, MAX_HOLDERS]},
        ]
    else:
        taken = {
            "_id": "$_id",
            "key": "$_id",
            "owner": _ME,
            "token": _NEW_TOKEN,
            "acquired_at": "$$NOW",
            "refreshed_at": "$$NOW",
            "expires_at": _LEASE_END,
            "ttl": "$$ttl",
            "waiters": waiters,
            "ended": "$ended",
            **extra,
        }
        # A missing expires_at sorts below every date, so a fresh upsert takes the lock;
        # shared leases keep the top-level expires_at at the latest of them.
        free = {"$lte": ["$expires_at", "$$NOW"]}
        my_turn = {
            "$or": [
                {"$eq": [{"$size": "$$q"}, 0]},
                {"$eq": [{"$arrayElemAt": ["$$q.owner", 0]}, _ME]},
            ]
        }
        projection = dict(PROJECTION)
        refused = []
    if queue:
        # The caller's place in line, so that it sleeps through the releases that are
        # for the waiters ahead of it.
        place = {"$map": {"input": LIVE_WAITERS, "as": "w", "in": "$$w.owner"}}
        projection["position"] = {"$indexOfArray": [place, _ME]}
    # One stage: a busy key without a queue comes back unchanged, which the server
    # does not write at all. The same request sent again (after a lost reply) finds its
    # own lease and changes nothing: live, the caller reads the lock it already took;
    # ended (lapsed, or released and recorded in ``ended``), it is not taken again, so
    # one acquisition never gets two leases, nor the key after its release.
    if shared:
        held_already: Any = {"$in": [_ME, {"$ifNull": ["$holders.owner", []]}]}
    else:
        held_already = {"$eq": ["$owner", _ME]}
    busy = _queue_busy(shared) if queue else "$$ROOT"
    decide = {
        "$switch": {
            "branches": [
                {"case": held_already, "then": "$$ROOT"},
                {"case": {"$in": [_ME, _ENDED]}, "then": "$$ROOT"},
                *({"case": case, "then": "$$ROOT"} for case in refused),
                {"case": {"$and": [free, my_turn]}, "then": taken},
            ],
            "default": busy,
        }
    }
    stage = {"$replaceWith": {"$let": {"vars": variables, "in": decide}}}
    return (RawBSONDocument(bson.encode(stage)),), RawBSONDocument(bson.encode(projection))


def acquire(
    owner: str,
    ttl: float,
    *,
    queue: bool = False,
    shared: bool = False,
    limit: int | None = None,
    tags: Mapping[str, str] | None = None,
) -> Acquire:
    """Take the key for ``owner`` if it is free for it, in one atomic upsert.

    Exclusive: free when no lease (exclusive or shared) is live, and the caller is first
    in line (or the line is empty), so a releaser cannot grab its lock straight back
    from those who waited. Shared: free when no exclusive lease is live and only shared
    waiters are ahead in line (the readers in line enter together; none passes a writer),
    within ``limit`` counting the live holders and those ahead. With ``queue`` (a
    blocking acquirer), a caller that does not get the key joins the line, unless it is
    full. Changes nothing for a request whose acquisition has ended (a late duplicate),
    nor, shared, for a limit other than the live holders' or a full list of holders.
    """
    tags = tags or {}
    pipeline, projection = _acquire_command(queue, shared, limit is not None, tuple(tags))
    let: dict[str, Any] = {"me": {"$literal": owner}, "ttl": ttl, "ttl_ms": round(ttl * 1000)}
    if limit is not None:
        let["limit"] = limit
    for n, value in enumerate(tags.values()):
        let[f"tag{n}"] = {"$literal": value}
    return Acquire(list(pipeline), projection, let)


def leave_queue(key: str, owner: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``update_one`` arguments that give up a waiter's place in line."""
    return {"_id": key}, {"$pull": {"waiters": {"owner": owner}}}


def refresh(key: str, owner: str, token: int, ttl: float) -> Update:
    """Extend a live exclusive lease of ``owner``/``token``."""
    return Update(
        {"_id": key, "owner": owner, "token": token, "$expr": LIVE},
        [{"$set": {"expires_at": _lease_end(ttl), "refreshed_at": "$$NOW", "ttl": ttl}}],
        PROJECTION,
    )


def _holder_is(owner: str, *, live: bool) -> dict[str, Any]:
    """True when ``owner`` has an entry in ``holders`` (and, with ``live``, a live one)."""
    test: Any = {"$eq": ["$$h.owner", {"$literal": owner}]}
    if live:
        test = {"$and": [test, {"$gt": ["$$h.expires_at", "$$NOW"]}]}
    return {
        "$anyElementTrue": [
            {"$map": {"input": {"$ifNull": ["$holders", []]}, "as": "h", "in": test}}
        ]
    }


def refresh_shared(key: str, owner: str, token: int, ttl: float) -> Update:
    """Extend a live shared lease of ``owner``/``token``."""
    me = {"$literal": owner}
    return Update(
        {
            "_id": key,
            "holders": {"$elemMatch": {"owner": owner, "token": token}},
            "$expr": _holder_is(owner, live=True),
        },
        [
            {
                "$set": {
                    "holders": {
                        "$map": {
                            "input": "$holders",
                            "as": "h",
                            "in": {
                                "$cond": [
                                    {"$eq": ["$$h.owner", me]},
                                    {
                                        "$mergeObjects": [
                                            "$$h",
                                            {"expires_at": _lease_end(ttl), "ttl": ttl},
                                        ]
                                    },
                                    "$$h",
                                ]
                            },
                        }
                    },
                    "refreshed_at": "$$NOW",
                }
            },
            {"$set": {"expires_at": {"$max": "$holders.expires_at"}}},
        ],
        {**PROJECTION, "mine": _mine(me)},
    )


def refresh_shared_many(
    held: Sequence[tuple[str, str, int]],
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``update_many`` arguments that extend every live shared lease in ``held``.

    The filter names the keys, so the documents are found through the ``_id`` index
    whatever the size of the collection (send it with that hint).
    """
    owners = sorted({owner for _, owner, _ in held})
    listed = {"$literal": owners}
    return (
        {"_id": {"$in": sorted({key for key, _, _ in held})}, "holders.owner": {"$in": owners}},
        [
            {
                "$set": {
                    "holders": {
                        "$map": {
                            "input": "$holders",
                            "as": "h",
                            "in": {
                                "$cond": [
                                    {
                                        "$and": [
                                            {"$in": ["$$h.owner", listed]},
                                            {"$gt": ["$$h.expires_at", "$$NOW"]},
                                        ]
                                    },
                                    {
                                        "$mergeObjects": [
                                            "$$h",
                                            {
                                                "expires_at": {
                                                    "$add": [
                                                        "$$NOW",
                                                        {"$multiply": ["$$h.ttl", 1000]},
                                                    ]
                                                }
                                            },
                                        ]
                                    },
                                    "$$h",
                                ]
                            },
                        }
                    },
                    "refreshed_at": "$$NOW",
                }
            },
            {"$set": {"expires_at": {"$max": "$holders.expires_at"}}},
        ],
    )


# A release marks the document freed (the watcher wakes waiters on it) and shortens every
# place in line to the grace period from now: live waiters, woken by the release, renew
# theirs at their next attempt; a dead waiter's place then lapses within the grace
# period instead of at the lease end it was waiting for.
_FREED: Final = {
    "released_at": "$$NOW",
    "waiters": {
        "$map": {
            "input": LIVE_WAITERS,
            "as": "w",
            "in": {
                "$mergeObjects": [
                    "$$w",
                    {"until": {"$min": ["$$w.until", {"$add": ["$$NOW", PLACE_GRACE_MS]}]}},
                ]
            },
        }
    },
}


def _ended_with(owner: Any) -> dict[str, Any]:
    """The ``ended`` list with ``owner`` in front, the latest ``ENDED_KEEP`` kept."""
    return {"$slice": [{"$concatArrays": [[owner], _ENDED]}, ENDED_KEEP]}


def release(key: str, owner: str, token: int) -> Release:
    """Give up an exclusive lock: free its document in place, in one round trip.

    The document stays (without an owner it is no lock, and the TTL index purges it
    ``RETENTION`` seconds later), so the line of waiters survives the release, the next
    acquisition of the key is an update rather than an insert, and the stored token
    keeps counting. The filter on owner and token means a release can never touch
    somebody else's lock. A lease that has already ended is left as it is: it is free
    already, and the unmodified document tells the caller that it was no longer held.
    """
    return Release({"_id": key, "owner": owner, "token": token}, list(RELEASE_PIPELINE))


def give_up(key: str, owner: str, *, shared: bool) -> Release:
    """``update_one`` arguments that undo an acquisition whose outcome is unknown.

    For an acquire that failed after the server may have applied it (its write concern
    failed): whatever lease ``owner`` got is given back, so it does not block the key
    until it ends. Matches nothing when the acquisition did not happen.
    """
    if shared:
        op = release_shared(key, owner, 0)
        return Release({"_id": key, "holders.owner": owner}, list(op.pipeline))
    return Release({"_id": key, "owner": owner}, list(RELEASE_PIPELINE))


# The one release pipeline of every exclusive lock (also applied in bulk at exit).
RELEASE_PIPELINE: Final = (
    RawBSONDocument(
        bson.encode(
            {
                "$replaceWith": {
                    "$cond": [
                        LIVE,
                        {
                            "$mergeObjects": [
                                "$$ROOT",
                                {
                                    "owner": None,
                                    **_FREED,
                                    "expires_at": "$$NOW",
                                    "ended": _ended_with("$owner"),
                                },
                            ]
                        },
                        "$$ROOT",
                    ]
                }
            }
        )
    ),
)


def release_shared(key: str, owner: str, token: int) -> Update:
    """Give up a shared lease: drop this holder's entry (the document stays until purged)."""
    me = {"$literal": owner}
    return Update(
        {"_id": key, "holders": {"$elemMatch": {"owner": owner, "token": token}}},
        [
            {
                "$set": {
                    "holders": {
                        "$filter": {
                            "input": "$holders",
                            "as": "h",
                            "cond": {"$ne": ["$$h.owner", me]},
                        }
                    },
                    **_FREED,
                    "ended": _ended_with(me),
                }
            },
            {"$set": {"expires_at": {"$ifNull": [{"$max": "$holders.expires_at"}, "$$NOW"]}}},
        ],
        {"_id": 0, "live": _holder_is(owner, live=True)},
        return_after=False,
    )
