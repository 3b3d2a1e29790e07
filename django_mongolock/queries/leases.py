"""The holder's other queries: keep a lease (refresh), give it up (release), leave a line.

Every filter names the holder's owner and token, so that nobody else's lease is ever
touched; every time is the server's (``$$NOW``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any, Final

import bson
from bson.raw_bson import RawBSONDocument

from django_mongolock.queries.common import (
    ENDED,
    LIVE,
    PROJECTION,
    holder_is,
    lease_end,
    mine,
    without,
)
from django_mongolock.queries.handing import (
    FREED,
    ended_once,
    ended_with,
    ended_with_each,
    free_stage,
    release_stage,
)

__all__ = [
    "REFRESHED_LIVE",
    "RELEASE_PIPELINE",
    "SHARED_LEASES",
    "Release",
    "Update",
    "give_up",
    "handing_release",
    "leave",
    "live_shared_owners",
    "refresh",
    "refresh_many",
    "refresh_shared",
    "refresh_shared_many",
    "release",
    "release_many",
    "release_shared",
    "release_shared_many",
    "release_writes",
    "released_live",
    "still_freed",
]


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
    upsert: bool = False

    def command(self, collection: str) -> dict[str, Any]:
        """The ``update`` command document, with majority write concern.

        Sent as a plain command (see ``Acquire.command``); after a lost reply the store
        sends it again and, if that changes nothing, looks whether the first one freed
        the document.
        """
        update: dict[str, Any] = {"q": self.filter, "u": self.pipeline}
        if self.upsert:
            update["upsert"] = True
        return {"update": collection, "updates": [update], "writeConcern": {"w": "majority"}}


def refresh(key: str, owner: str, token: int, ttl: float) -> Update:
    """Extend a live exclusive lease of ``owner``/``token``."""
    return Update(
        {"_id": key, "owner": owner, "token": token, "$expr": LIVE},
        [{"$set": {"expires_at": lease_end(ttl), "refreshed_at": "$$NOW", "ttl": ttl}}],
        PROJECTION,
    )


def refresh_shared(key: str, owner: str, token: int, ttl: float) -> Update:
    """Extend a live shared lease of ``owner``/``token``."""
    me = {"$literal": owner}
    return Update(
        {
            "_id": key,
            "holders": {"$elemMatch": {"owner": owner, "token": token}},
            "$expr": holder_is(owner, live=True),
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
                                            {"expires_at": lease_end(ttl), "ttl": ttl},
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
        {**PROJECTION, "mine": mine(me)},
    )


def refresh_shared_many(
    held: Sequence[tuple[str, str, int]],
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``update_many`` arguments that extend every live shared lease in ``held``.

    The filter names the keys, so the documents are found through the ``_id`` index
    whatever the size of the collection (send it with that hint). A document is
    modified only when one of the listed leases in it was live and is extended
    (``refreshed_at``, and the document's ``expires_at``, move only then), so that with
    one lease per key the modified count tells whether every lease was extended.

    The filter already found one of the listed owners among a document's holders (the
    query's ``$in``, matched against a sorted set): a lone holder is that one, and the
    pipeline tests the owner of only the holders of a document with several. Its ``$in``
    over the listed owners is a scan of the whole list for each holder, which made a
    tick over a thousand shared leases on their own keys about a third slower.
    """
    listed = {"$literal": sorted({owner for _, owner, _ in held})}
    alone = {"$eq": [{"$size": "$holders"}, 1]}
    ours_live = {
        "$and": [
            {"$or": [alone, {"$in": ["$$h.owner", listed]}]},
            {"$gt": ["$$h.expires_at", "$$NOW"]},
        ]
    }
    return (
        shared_leases_filter(held),
        [
            {
                "$set": {
                    "holders": {
                        "$map": {
                            "input": "$holders",
                            "as": "h",
                            "in": {
                                "$cond": [
                                    ours_live,
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
                    "refreshed_at": {
                        "$cond": [
                            {
                                "$anyElementTrue": [
                                    {"$map": {"input": "$holders", "as": "h", "in": ours_live}}
                                ]
                            },
                            "$$NOW",
                            "$refreshed_at",
                        ]
                    },
                }
            },
            # Only where a lease was extended (refreshed_at is now): elsewhere the
            # document is left as it was.
            {
                "$set": {
                    "expires_at": {
                        "$cond": [
                            {"$eq": ["$refreshed_at", "$$NOW"]},
                            {"$max": "$holders.expires_at"},
                            "$expires_at",
                        ]
                    }
                }
            },
        ],
    )


def shared_leases_filter(held: Sequence[tuple[str, str, int]]) -> dict[str, Any]:
    """The documents of the shared leases in ``held``, by key (the ``_id`` index)."""
    owners = sorted({owner for _, owner, _ in held})
    return {"_id": {"$in": sorted({key for key, _, _ in held})}, "holders.owner": {"$in": owners}}


# What a bulk shared refresh reads back: the holders, and the server's time to judge them.
SHARED_LEASES: Final = {"holders": 1, "now": "$$NOW"}


def live_shared_owners(docs: Iterable[Mapping[str, Any]], owners: Set[str]) -> set[str]:
    """Which of ``owners`` hold a live shared lease in ``docs`` (read with ``SHARED_LEASES``)."""
    return {
        entry["owner"]
        for doc in docs
        for entry in doc.get("holders") or ()
        if entry.get("owner") in owners and entry["expires_at"] > doc["now"]
    }


def release(key: str, owner: str, token: int) -> Release:
    """Give up an exclusive lock nobody waits for: free its document in place.

    The filter adds "no waiter the lock could be handed to" to the holder's owner and
    token, so this write stays as small as the lock's only write on the uncontended path.
    When it changes nothing (somebody waits, or the lease is over), ``handing_release``
    decides in a second write. The document stays (without an owner it is no lock, and
    the TTL index purges it ``RETENTION`` seconds later), so the line of waiters
    survives the release, the next acquisition of the key is an update rather than an
    insert, and the stored token keeps counting. The filter on owner and token means a
    release can never touch somebody else's lock. A lease that has already ended is left
    as it is: it is free already, and the unmodified document tells the caller that it
    was no longer held.
    """
    return Release(
        {"_id": key, "owner": owner, "token": token, "waiters.hand": {"$ne": True}},
        list(FREE_PIPELINE),
    )


def handing_release(key: str, owner: str, token: int) -> Release:
    """Give up an exclusive lock: hand it to the first waiter in line (see
    ``handing.release_stage``), or free it when nobody in line can take it so."""
    return Release({"_id": key, "owner": owner, "token": token}, list(RELEASE_PIPELINE))


def release_writes(*, contended: bool) -> tuple[Callable[[str, str, int], Release], ...]:
    """The release writes to send in turn, until one changes the document.

    The small one first, unless the lock was taken with others in line: they likely
    still wait, and the handing write alone then does it in one round trip.
    """
    if contended:
        return (handing_release,)
    return (release, handing_release)


def give_up(key: str, owner: str, *, shared: bool) -> Release:
    """``update_one`` arguments that undo an acquisition whose outcome is unknown.

    For an acquire that failed after the server may have applied it (its write concern
    failed): whatever lease ``owner`` got is given back, so it does not block the key
    until it ends. Matches nothing when the acquisition did not happen.
    """
    if shared:
        op = release_shared(key, owner, 0, again=True)
        return Release({"_id": key, "holders.owner": owner}, list(op.pipeline))
    return Release({"_id": key, "owner": owner}, list(RELEASE_PIPELINE))


# The release pipeline of every exclusive lock (also applied in bulk at exit): the
# filter names the holder, so the owner needs no second test.
RELEASE_PIPELINE: Final = (RawBSONDocument(bson.encode(release_stage(True))),)
# The release of a lock no waiter can be handed: its filter says so, and it only frees.
FREE_PIPELINE: Final = (RawBSONDocument(bson.encode(free_stage())),)


def leave(key: str, owner: str, *, final: bool = False) -> Release:
    """Stop waiting: leave the line, and give back the lock if a release handed it over.

    One write, so that a release handing the key to ``owner`` cannot come between
    looking and leaving (a timeout or a cancellation at that moment must not leave the
    key held by nobody): a live lease of ``owner`` is released (and handed on) as its
    holder would; otherwise its place in line is marked lapsed (``without``).

    ``final``, for a caller stopped while an attempt of its may still be on its way to
    the server: ``owner`` goes into ``ended`` whatever it holds, and a missing document
    is made (free, ended now, so purged as a released one), so that an attempt applied
    after this write changes nothing, as a late duplicate does, instead of taking the
    key for a caller that is gone.
    """
    me = {"$literal": owner}
    mine = {"$eq": ["$owner", me]}
    stage = release_stage(mine)
    changes: dict[str, Any] = {
        "waiters": without(me),
        # A handed lease that lapsed is over for good: a late duplicate of one of this
        # waiter's attempts must not take the key again.
        "ended": ended_once(me) if final else {"$cond": [mine, ended_with(me), ENDED]},
    }
    if final:
        # A document made here is as the acquire makes one: the unique index on ``key``
        # takes one document without it at most.
        changes["key"] = "$_id"
        changes["expires_at"] = {"$ifNull": ["$expires_at", "$$NOW"]}
    out = {"$mergeObjects": ["$$ROOT", changes]}
    return Release(
        {"_id": key},
        [{"$replaceWith": {"$cond": [{"$and": [mine, LIVE]}, stage["$replaceWith"], out]}}],
        upsert=final,
    )


# After a shared release: the document ends with its last holder left, or now if none is.
HOLDERS_END: Final = {
    "$set": {"expires_at": {"$ifNull": [{"$max": "$holders.expires_at"}, "$$NOW"]}}
}


def release_shared(key: str, owner: str, token: int, *, again: bool = False) -> Update:
    """Give up a shared lease: drop this holder's entry (the document stays until purged).

    ``again``: ``owner`` may be in ``ended`` already (a give-up after ``leave``).
    """
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
                    **FREED,
                    "ended": ended_once(me) if again else ended_with(me),
                }
            },
            HOLDERS_END,
        ],
        {"_id": 0, "live": holder_is(owner, live=True)},
        return_after=False,
    )


def refresh_many(held: Sequence[tuple[str, str, int]]) -> tuple[dict[str, Any], list[Any]]:
    """``update_many`` arguments that extend every live exclusive lease in ``held``.

    Each document keeps its own lease length (its ``ttl`` field). An owner id is unique
    per acquisition and its document holds one token for it, so key and owner name the
    lease: the tokens need not travel (a third less to send and match). The filter finds
    the holders' documents by key and owner alone; whether a lease is still live is
    decided in the pipeline, which leaves an ended one as it is, so the modified count
    tells how many were extended. That keeps the filter a plain index lookup: an
    ``$expr`` on ``expires_at`` in the filter made the same write a fifth to a half
    slower over 10,000 leases. Send it with a hint on ``_id``; ``REFRESHED_LIVE`` finds,
    afterwards, the leases that are still live.
    """
    keys = [key for key, _, _ in held]
    owners = [owner for _, owner, _ in held]
    return {"_id": {"$in": keys}, "owner": {"$in": owners}}, list(REFRESH_MANY_PIPELINE)


# Extends a live exclusive lease by its own ttl; leaves an ended one unchanged.
REFRESH_MANY_PIPELINE: Final = (
    {
        "$set": {
            "expires_at": {
                "$cond": [LIVE, {"$add": ["$$NOW", {"$multiply": ["$ttl", 1000]}]}, "$expires_at"]
            },
            "refreshed_at": {"$cond": [LIVE, "$$NOW", "$refreshed_at"]},
        }
    },
)
# Added to ``refresh_many``'s filter: the leases among them that are live.
REFRESHED_LIVE: Final = {"$expr": LIVE}


def release_many(held: Sequence[tuple[str, str, int]]) -> tuple[dict[str, Any], list[Any]]:
    """``update_many`` arguments that free the holders' exclusive locks (at exit)."""
    query = {
        "_id": {"$in": [key for key, _, _ in held]},
        "owner": {"$in": [owner for _, owner, _ in held]},
        "token": {"$in": [token for _, _, token in held]},
    }
    return query, list(RELEASE_PIPELINE)


def release_shared_many(
    held: Sequence[tuple[str, str, int]],
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``update_many`` arguments that drop the holders' shared leases (at exit): what
    ``release_shared`` does for each, in one write.

    The filter is the bulk refresh's (``shared_leases_filter``: send it with the hint on
    ``_id``), so a document's lone holder is one of the listed owners, and only a
    document with several (permits of one semaphore, readers of one key) tests its
    holders against the list. An owner id is unique per acquisition, so owners name
    the leases. The owners it drops go to the front of ``ended`` (the latest
    ``ENDED_KEEP`` kept), as one release after another would leave them: a late
    duplicate of one of their acquisitions must not take the key again.
    """
    listed = {"$literal": sorted({owner for _, owner, _ in held})}
    alone = {"$eq": [{"$size": "$holders"}, 1]}
    ours = {"$cond": [alone, "$holders.owner", {"$setIntersection": ["$holders.owner", listed]}]}
    others = {
        "$filter": {
            "input": "$holders",
            "as": "h",
            "cond": {"$not": [{"$in": ["$$h.owner", listed]}]},
        }
    }
    return (
        shared_leases_filter(held),
        [
            {
                "$set": {
                    "holders": {"$cond": [alone, [], others]},
                    **FREED,
                    "ended": ended_with_each(ours),
                }
            },
            HOLDERS_END,
        ],
    )


def still_freed(key: str, owner: str) -> dict[str, Any]:
    """The document of ``key`` if a release by ``owner`` was applied.

    A release sent twice whose second send changed nothing freed the document with its
    first if this matches: a release records its owner in ``ended``, which the next
    holders keep (a release that handed the key on, or a later acquisition, changes
    ``owner`` and ``token``, not that).
    """
    return {"_id": key, "ended": owner}


def released_live(doc: Mapping[str, Any] | None) -> bool:
    """Whether a release freed a live lease, from the document it matched.

    A retried release is answered without the computed ``live`` field; the document
    matched the holder's owner and token, so it is counted as held.
    """
    return doc is not None and bool(doc.get("live", True))
