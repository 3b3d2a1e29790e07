"""The change stream filter that tells a process's watcher a key was freed or handed to it."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

__all__ = ["FREED_EVENTS", "reaches", "wakeups"]

_UPDATED: Final = "updateDescription.updatedFields"
# A replace event of a release: its owner (if any) was made the holder in the release.
_RELEASE_LOGGED_WHOLE: Final = {
    "$expr": {"$gte": ["$fullDocument.released_at", "$fullDocument.acquired_at"]}
}
# The line and the shared holders are no part of a wake-up or a handoff: a replace event
# of a long line would carry hundreds of kilobytes to the watching process, and an update
# event names every place a release changed apart (``waiters.17.until``...: a release that
# frees the key cuts every place, kilobytes for a long line), which the watcher would
# read, and a relay pass on, for nothing. So are the later entries of ``ended``, which a
# release shifts too (the server names them apart, or reports the list whole): only its
# first, the owner the release ended, tells whose release it was.
_KEPT_FIELD: Final = r"^(?!(waiters|holders)(\.|$)|ended\.[1-9])"


def _first_only(ended: str) -> dict[str, Any]:
    """``ended`` (an expression) cut to its first entry, in a list as before; left as it
    is if it is no list (a stage that raised would fail every resume of the stream)."""
    return {"$cond": [{"$isArray": ended}, {"$slice": [ended, 1]}, ended]}


# ``ended`` reported whole in an update event: its first entry alone.
_FIRST_ENDED: Final = {
    "$cond": [{"$eq": ["$$f.k", "ended"]}, {"k": "ended", "v": _first_only("$$f.v")}, "$$f"]
}
# The same in the document of a replace event.
_REPLACED: Final = {
    "$cond": [
        {"$eq": ["$operationType", "replace"]},
        {"$mergeObjects": ["$fullDocument", {"ended": _first_only("$fullDocument.ended")}]},
        "$fullDocument",
    ]
}
_WITHOUT_LISTS: Final = (
    {"$project": {"fullDocument.waiters": 0, "fullDocument.holders": 0}},
    {
        "$set": {
            "fullDocument": _REPLACED,
            "updateDescription": {
                "$cond": [
                    {"$eq": ["$operationType", "update"]},
                    {
                        "$mergeObjects": [
                            "$updateDescription",
                            {
                                "updatedFields": {
                                    "$arrayToObject": {
                                        "$map": {
                                            "input": {
                                                "$filter": {
                                                    "input": {"$objectToArray": f"${_UPDATED}"},
                                                    "as": "f",
                                                    "cond": {
                                                        "$regexMatch": {
                                                            "input": "$$f.k",
                                                            "regex": _KEPT_FIELD,
                                                        }
                                                    },
                                                }
                                            },
                                            "as": "f",
                                            "in": _FIRST_ENDED,
                                        }
                                    }
                                }
                            },
                        ]
                    },
                    "$$REMOVE",
                ]
            },
        }
    },
)


def wakeups(prefix: str | None) -> list[dict[str, Any]]:
    """The pipeline of the change stream of a process whose holder ids start with ``prefix``.

    A key is freed by a delete (release of old, force release, the TTL monitor), or by a
    release that keeps the document for its waiters (it sets ``released_at`` and clears
    ``owner``): every process with waiters hears of those. A release that hands the key
    to the first waiter in line (it makes a new ``owner``, and names the next place in
    line ``head``, its holder id followed by the handoff's token) matters to those two
    waiters only: with ``prefix``, only the processes they belong to hear of it, so that
    one handoff costs the server one event to deliver, however many processes wait for
    the key. ``None`` lets every handoff through.

    The server logs an update whose changes are about as large as the document as a
    whole new document: the stream reports it as a ``replace`` (a release that hands a
    small document to a waiter often is one), matched the same way.
    """
    if prefix is None:
        updated: dict[str, Any] = {}
        replaced: dict[str, Any] = {}
    else:
        ours = {"$regex": f"^{re.escape(prefix)}"}
        updated = {
            "$or": [
                {f"{_UPDATED}.owner": None},  # freed (null), or a shared lease (unchanged)
                {f"{_UPDATED}.owner": ours},
                {f"{_UPDATED}.head": ours},
            ]
        }
        replaced = {"$or": [{"fullDocument.owner": ours}, {"fullDocument.head": ours}]}
    return [
        {
            "$match": {
                "$or": [
                    {"operationType": "delete"},
                    {
                        "operationType": "update",
                        f"{_UPDATED}.released_at": {"$exists": True},
                        **updated,
                    },
                    {"operationType": "replace", "fullDocument.owner": None},
                    {"operationType": "replace", **_RELEASE_LOGGED_WHOLE, **replaced},
                ]
            }
        },
        *_WITHOUT_LISTS,
    ]


# Every freed key and every handoff, whoever it goes to.
FREED_EVENTS: Final[list[dict[str, Any]]] = wakeups(None)


def reaches(change: Mapping[str, Any], prefix: str) -> bool:
    """Whether ``wakeups(prefix)`` lets through ``change``, an event that a stream with a
    shorter prefix (every holder id of the host: see ``relay``) let through.

    Such an event frees its key (a delete, or no owner: every waiter hears of it) or
    names an owner, or the next in line, with the shorter prefix: then it concerns the
    process whose ids start with ``prefix`` only if one of the two does.
    """
    if change.get("operationType") == "delete":
        return True
    if change.get("operationType") == "replace":
        fields = change.get("fullDocument") or {}
    else:
        fields = (change.get("updateDescription") or {}).get("updatedFields") or {}
    owner = fields.get("owner")
    if owner is None:
        return True
    head = fields.get("head")
    return (isinstance(owner, str) and owner.startswith(prefix)) or (
        isinstance(head, str) and head.startswith(prefix)
    )
