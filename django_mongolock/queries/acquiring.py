"""The acquire: one atomic upsert that decides, by the server's clock, who gets the key.

Built as plain data (a ``findAndModify`` command) so that the sync and async stores send
the same bytes, and read back here too: ``refused`` tells a busy key (wait) from one that
refused the caller for good (raise).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

import bson
from bson.raw_bson import RawBSONDocument

from django_mongolock.exceptions import LimitConflict, LineFull, LockNotAcquired
from django_mongolock.info import LockInfo
from django_mongolock.queries.common import (
    ENDED,
    LINE_CHECK_MS,
    LIVE_HOLDERS,
    LIVE_WAITERS,
    MAX_HOLDERS,
    MAX_WAITERS,
    NEW_TOKEN,
    PLACE_GRACE_MS,
    PLACES,
    PROJECTION,
    kept,
    mine,
    place_live,
    without,
)

__all__ = ["Acquire", "acquire", "check_limit", "refused"]


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


# The acquire command's variables: the owner, the lease in seconds and in milliseconds,
# the shared limit, the live waiters (q, but for an exclusive request that does not
# queue) and live shared holders (h) before the update.
_ME: Final = "$$me"
_LEASE_END: Final = {"$add": ["$$NOW", "$$ttl_ms"]}


def _queue_busy(shared: bool, handoff: bool) -> dict[str, Any]:
    """The document with the caller in its line of waiters (added, or its place renewed).

    A place lasts until the grace period after the lease end its waiter was told to
    wait for (the head, and a shared waiter, wake at that lease end at the latest), or
    after now if the key is free. An exclusive waiter behind others while the key is
    held hears of no handoff but to the waiter just ahead, and looks again every
    ``LINE_CHECK_MS`` whatever the lease (``acquirer.next_delay``): its place lasts that
    and the grace period from now, if that is later. A line that turns over within the
    line check then costs no renewals at all. Shared waiters look again at the lease
    end, so that readers behind a lease that runs out enter together. A full line
    (``MAX_WAITERS`` live places) takes nobody new: the document is left as it is.
    ``at`` is the server time of this attempt; with ``handoff`` the place also carries
    the lease asked for, so that a release may hand the lock over to it
    (``queries.release``). The line is written as stored, lapsed places too
    (``queries.common.kept``).
    """
    after_lease = {"$add": [{"$max": ["$expires_at", "$$NOW"]}, PLACE_GRACE_MS]}
    until: Any = after_lease
    if not shared:
        behind_while_held = {
            "$and": [
                {"$gt": ["$expires_at", "$$NOW"]},
                {"$gt": [{"$size": "$$q"}, 0]},
                {"$ne": [{"$arrayElemAt": ["$$q.owner", 0]}, _ME]},
            ]
        }
        checked = {"$add": ["$$NOW", LINE_CHECK_MS + PLACE_GRACE_MS]}
        until = {"$cond": [behind_while_held, {"$max": [after_lease, checked]}, after_lease]}
    place: dict[str, Any] = {"owner": _ME, "until": until, "at": "$$NOW"}
    if shared:
        place["shared"] = True  # readers in line enter together (see _shared_turn)
    elif handoff:
        place.update(hand=True, ttl="$$ttl", ttl_ms="$$ttl_ms")
    renewed = {"$and": [place_live(), {"$eq": ["$$w.owner", _ME]}]}
    # The new place is bound once, outside the ``$map`` that renews it: its ``until``
    # looks at the line (``$$q``), which no expression evaluated per place may name (it
    # was only ever evaluated for the caller's own place, at the same cost as here).
    return {"$let": {"vars": {"place": place}, "in": _join_or_renew(renewed)}}


def _join_or_renew(renewed: Any) -> dict[str, Any]:
    """The line with ``$$place`` in it: the caller's live place replaced by it, or it
    added at the end (unless the line is full)."""
    return {
        "$cond": [
            {"$in": [_ME, "$$q.owner"]},
            {
                "$mergeObjects": [
                    "$$ROOT",
                    {
                        "waiters": kept(
                            {
                                "$map": {
                                    "input": PLACES,
                                    "as": "w",
                                    "in": {"$cond": [renewed, "$$place", "$$w"]},
                                }
                            }
                        )
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
                            {"waiters": kept({"$concatArrays": [PLACES, ["$$place"]]})},
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
    # Only a request that may join the line, or a shared one (a reader may enter past
    # the shared waiters ahead of it), binds the line to ``$$q`` and writes it back
    # rewritten. An exclusive request that does not queue takes the key only when no
    # live place is in line, whoever its owner is (even the head's: it asks for its
    # turn queueing), and then leaves the line empty, as ``kept`` would have it:
    # without the variable or the rewritten line, which would be most of the request.
    lined = queue or shared
    variables: dict[str, Any] = {"q": LIVE_WAITERS} if lined else {}
    waiters: Any = without(_ME) if lined else []
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
                "vars": {"t": NEW_TOKEN},
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
        projection = {**PROJECTION, "mine": mine(_ME)}
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
        if queue:
            my_turn = {
                "$or": [
                    {"$eq": [{"$size": "$$q"}, 0]},
                    {"$eq": [{"$arrayElemAt": ["$$q.owner", 0]}, _ME]},
                ]
            }
        else:
            # Looked at once, and only when the key is free: no variable needed.
            my_turn = {"$eq": [{"$size": LIVE_WAITERS}, 0]}
        taken = {
            "_id": "$_id",
            "key": "$_id",
            "owner": _ME,
            "token": NEW_TOKEN,
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
    # Only a plain exclusive waiter is handed the lock: the tags of a recipe's lock are
    # written by its own acquire.
    busy = _queue_busy(shared, handoff=not tag_names) if queue else "$$ROOT"
    decide = {
        "$switch": {
            "branches": [
                {"case": held_already, "then": "$$ROOT"},
                {"case": {"$in": [_ME, ENDED]}, "then": "$$ROOT"},
                *({"case": case, "then": "$$ROOT"} for case in refused),
                {"case": {"$and": [free, my_turn]}, "then": taken},
            ],
            "default": busy,
        }
    }
    stage = {"$replaceWith": {"$let": {"vars": variables, "in": decide}} if variables else decide}
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
    from those who waited; without ``queue``, only when nobody is in line. Shared: free
    when no exclusive lease is live and only shared waiters are ahead in line (the
    readers in line enter together; none passes a writer), within ``limit`` counting
    the live holders and those ahead. With ``queue`` (a blocking acquirer), a caller
    that does not get the key joins the line, unless it is full. Changes nothing for a
    request whose acquisition has ended (a late duplicate), nor, shared, for a limit
    other than the live holders' or a full list of holders.
    """
    tags = tags or {}
    pipeline, projection = _acquire_command(queue, shared, limit is not None, tuple(tags))
    let: dict[str, Any] = {"me": {"$literal": owner}, "ttl": ttl, "ttl_ms": round(ttl * 1000)}
    if limit is not None:
        let["limit"] = limit
    for n, value in enumerate(tags.values()):
        let[f"tag{n}"] = {"$literal": value}
    return Acquire(list(pipeline), projection, let)


# -- what the reply means ----------------------------------------------------------------


def check_limit(shared: bool, limit: int | None) -> None:
    """A semaphore cannot have more slots than a document takes holders (before any I/O)."""
    if shared and limit is not None and limit > MAX_HOLDERS:
        raise ValueError(
            f"limit must be at most {MAX_HOLDERS} (the shared holders one key takes), got {limit}"
        )


def refused(
    info: LockInfo, owner: str, *, queue: bool, shared: bool, limit: int | None
) -> LockInfo:
    """``info``, unless the acquire was refused for a reason waiting cannot cure.

    A limit other than the live holders' (LimitConflict), a full list of shared holders
    or a full line of waiters (LineFull): the acquire changed nothing, and a blocking
    caller must not wait for a place it will never get. A request that found the lease
    it took already ended (its reply was lost, and the retry came after the lease end)
    gets LockNotAcquired: that acquisition is over, and is not taken twice.
    """
    if shared:
        if info.as_holder(owner) is not None:
            return info
        for holder in info.holders:
            if holder.owner == owner:
                raise _ended(info.key, owner, holder.expires_at)
        live = info.live_holders
        if live and info.limit != limit:
            raise LimitConflict(info.key, info.limit, limit)
        if len(live) >= MAX_HOLDERS:
            raise LineFull(info.key, MAX_HOLDERS, "shared holders")
    elif info.owner == owner:
        if info.live:
            return info
        raise _ended(info.key, owner, info.expires_at)
    if queue and info.position < 0 and info.waiting >= MAX_WAITERS:
        raise LineFull(info.key, MAX_WAITERS, "waiters")
    return info


def _ended(key: str, owner: str, expires_at: datetime) -> LockNotAcquired:
    """The acquisition ``owner`` took a lease whose end passed before its reply arrived."""
    return LockNotAcquired(
        key,
        detail=f"lock {key!r}: the lease acquisition {owner} took ended at "
        f"{expires_at.isoformat()} (server time) before its reply came back; acquire again",
    )
