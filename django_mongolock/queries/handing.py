"""What a release writes: the document freed, or handed to the first waiter in line.

Shared by the holder's release (and its bulk form at exit), the undoing of an
acquisition whose outcome is unknown, and a waiter leaving the line, which gives back a
lock handed to it meanwhile (``leases``).
"""

from __future__ import annotations

from typing import Any, Final

from django_mongolock.queries.common import (
    ENDED,
    ENDED_KEEP,
    HANDOFF_LEASE_MS,
    LAPSED_PLACE,
    LINE_CHECK_MS,
    LIVE,
    LIVE_WAITERS,
    NEW_TOKEN,
    PLACE_GRACE_MS,
    PLACES,
    kept,
    place_live,
)

__all__ = [
    "FREED",
    "HEAD_MARK",
    "RELEASED_AT",
    "ended_once",
    "ended_with",
    "ended_with_each",
    "free_stage",
    "head_owner",
    "release_stage",
    "shortened",
]


# A release that frees the key marks the document freed (every watcher wakes its waiters
# of the key on it) and shortens every place in line to the grace period from now: live
# waiters, woken by the release, renew theirs at their next attempt; a dead waiter's place
# then lapses within the grace period instead of at the lease end it was waiting for. A
# release that hands the key on wakes only its new holder and head (``_handed_line``).
def shortened(places: Any, grace_ms: int = PLACE_GRACE_MS) -> dict[str, Any]:
    return {"$map": {"input": places, "as": "w", "in": _cut("$$w", grace_ms)}}


def _cut(place: Any, ms: int) -> dict[str, Any]:
    """``place`` lasting at most ``ms`` from now."""
    return {
        "$mergeObjects": [place, {"until": {"$min": [f"{place}.until", {"$add": ["$$NOW", ms]}]}}]
    }


def _cut_if_longer(place: Any, ms: int) -> dict[str, Any]:
    """``_cut``, with ``place`` (a live one) rebuilt only when it lasts longer than ``ms``
    from now. For the places behind a handoff's new head, most of which end sooner in a
    running line: rebuilding every one of them was about half of a handoff's work over
    a line of 900. Elsewhere the plain cut, a smaller request, does as well."""
    cutoff = {"$add": ["$$NOW", ms]}
    return {
        "$cond": [
            {"$gt": [f"{place}.until", cutoff]},
            {"$mergeObjects": [place, {"until": cutoff}]},
            place,
        ]
    }


def _handed_line() -> dict[str, Any]:
    """The line after a handoff to the first live place ``$$n`` (its head now the owner
    of the second, ``$$head``): the new holder's place marked lapsed where it stands
    (``LAPSED_PLACE``), the new head's place cut to the grace period (the handoff wakes
    it, and it renews it), every live place behind to ``LINE_CHECK_MS`` beyond that
    (their waiters look again at least that often). The cut changes only the places
    that last past it (renewed since the previous handoff while a lease longer than the
    line check was held); no place moves, so what the write logs does not grow with the
    line.
    Each place is compared with the two owners bound once: naming the head by an
    expression over the line inside the ``$map`` would rebuild the line's owners for
    every place, a handoff's work growing with the square of the line.
    """
    place = {
        "$switch": {
            "branches": [
                {"case": {"$not": [place_live()]}, "then": "$$w"},
                {"case": {"$eq": ["$$w.owner", "$$n.owner"]}, "then": LAPSED_PLACE},
                {"case": {"$eq": ["$$w.owner", "$$head"]}, "then": _cut("$$w", PLACE_GRACE_MS)},
            ],
            "default": _cut_if_longer("$$w", LINE_CHECK_MS + PLACE_GRACE_MS),
        }
    }
    return kept({"$map": {"input": PLACES, "as": "w", "in": place}})


# The owner of the second live place (``$$q``), the head after a handoff; missing when
# there is none. Picked by index, not from ``$$q.owner``, which builds every owner's list.
_SECOND_OWNER: Final = {
    "$let": {"vars": {"second": {"$arrayElemAt": ["$$q", 1]}}, "in": "$$second.owner"}
}


# What ``head`` holds between the owner of the place first in line after a handoff and
# that handoff's token: no two handoffs of a key write the same ``head``, so the change
# stream reports it on every one (``queries.wakeups`` matches how it starts), also when
# the same waiter is named again (its place lapsed, and it joined again behind the waiter
# the handoff goes to): the server leaves a field written with its old value out of the
# event.
HEAD_MARK: Final = "@"


def head_owner(head: object) -> str | None:
    """The owner of the place a handoff named first in line, from its ``head`` (None when
    it named none)."""
    if not isinstance(head, str):
        return None
    owner, mark, token = head.rpartition(HEAD_MARK)
    return owner if mark and token.isdigit() else head


# ``released_at`` always changes (even two releases in one millisecond), so that the
# change stream reports it and the watcher wakes the key's waiters on every release.
RELEASED_AT: Final = {"$max": ["$$NOW", {"$add": [{"$ifNull": ["$released_at", "$$NOW"]}, 1]}]}
FREED: Final = {"released_at": RELEASED_AT, "waiters": shortened(LIVE_WAITERS)}


def ended_with(owner: Any) -> dict[str, Any]:
    """The ``ended`` list with ``owner`` in front, the latest ``ENDED_KEEP`` kept."""
    return ended_with_each([owner])


def ended_once(owner: Any) -> dict[str, Any]:
    """``ended_with(owner)`` where ``owner`` may be in the list already (a give-up sent
    again): in front once, so that repeats take no other owner's entry."""
    others = {"$filter": {"input": ENDED, "as": "e", "cond": {"$ne": ["$$e", owner]}}}
    return {"$slice": [{"$concatArrays": [[owner], others]}, ENDED_KEEP]}


def ended_with_each(owners: Any) -> dict[str, Any]:
    """The ``ended`` list with the array ``owners`` in front, the latest ``ENDED_KEEP``
    kept: what as many releases, one after the other, would leave."""
    return {"$slice": [{"$concatArrays": [owners, ENDED]}, ENDED_KEEP]}


def _freed(places: Any) -> dict[str, Any]:
    return {
        "$mergeObjects": [
            "$$ROOT",
            {
                "owner": None,
                "head": None,  # nobody is named first in line while the key is free
                "released_at": RELEASED_AT,
                "waiters": shortened(places),
                "expires_at": "$$NOW",
                "ended": ended_with("$owner"),
            },
        ]
    }


def free_stage() -> dict[str, Any]:
    """The release stage of a lock whose filter found nobody to hand it to: a live
    lease is freed, an ended one left as it is."""
    return {"$replaceWith": {"$cond": [LIVE, _freed(LIVE_WAITERS), "$$ROOT"]}}


def release_stage(owner_matches: Any) -> dict[str, Any]:
    """The release stage: free the document, or hand it to the first waiter in line.

    Only a live lease is released (``owner_matches`` says whether it is the caller's).
    When the first live place in line is a plain exclusive waiter's (it carries
    ``hand``), the same write makes that waiter the holder: a new token, its lease
    (``HANDOFF_LEASE_MS`` at most, until its refresher extends it to its ttl), its place
    marked lapsed, and the owner of the place now first in line as ``head`` (followed by
    ``HEAD_MARK`` and the new token).
    Only the processes of those two learn of it from their change streams
    (``queries.wakeups``): the new holder takes the lock without a write of its own, the
    new head looks again, so that it takes the key soon after that first lease if the
    new holder died in line. The head's place is cut to the grace period and every place
    further back to ``LINE_CHECK_MS`` beyond it: their waiters, who hear of no handoff,
    look again at least that often, and a run of dead waiters lapses together instead of
    each holding the key back in turn. Otherwise (nobody in line, or a shared reader
    first) the key is freed, every place is cut to the grace period, and every process
    with waiters is woken to try again.
    """
    freed = _freed("$$q")
    handed = {
        "$mergeObjects": [
            "$$ROOT",
            {
                "owner": "$$n.owner",
                "token": "$$token",
                "acquired_at": "$$NOW",
                "refreshed_at": "$$NOW",
                "expires_at": {"$add": ["$$NOW", {"$min": ["$$n.ttl_ms", HANDOFF_LEASE_MS]}]},
                "ttl": "$$n.ttl",
                "released_at": RELEASED_AT,
                "waiters": _handed_line(),
                "head": {"$concat": ["$$head", HEAD_MARK, {"$toString": "$$token"}]},
                "ended": ended_with("$owner"),
                "group": None,
                "kind": None,
            },
        ]
    }
    handing = {"$eq": ["$$n.hand", True]}
    decide = {
        "$let": {
            "vars": {"q": LIVE_WAITERS},
            "in": {
                "$let": {
                    "vars": {
                        "n": {"$arrayElemAt": ["$$q", 0]},
                        "head": _SECOND_OWNER,
                        "token": NEW_TOKEN,
                    },
                    "in": {"$cond": [handing, handed, freed]},
                }
            },
        }
    }
    return {"$replaceWith": {"$cond": [{"$and": [LIVE, owner_matches]}, decide, "$$ROOT"]}}
