"""The server's work per write by the length of a key's line.

A release that hands the key on, a waiter renewing its place, and a waiter joining the
line each rewrite the line inside the key's document. Here each of those writes, as the
library builds it, is applied by one ``update_many`` to documents that each carry a line
of ``N`` live places, beside a plain write of the same documents (one field set, the
line untouched): the time per document, less the plain write's, is the work the line
costs one such write. The places last as long as those of waiters that looked again
within the line check, so that a handoff cuts only the new head's place; the handoff is
measured a second time over places that last a minute (a line that joined behind a long
lease), which its cut shortens every one of. The documents are written afresh before
every turn, timed by the server's clock (and again, should writing them leave the places
too little time), and checked after the write for what it was to do. One command per
turn, so the wait for the majority write concern is shared by the documents and does
not hide their work; the shorter the line, the more documents (at least
``places_in_all`` places, and ``documents`` documents), so that no line's figure rests
on less work than that.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from pymongo import MongoClient
from pymongo.collection import Collection
from pymongo.write_concern import WriteConcern

from benchmarks.contenders import DATABASE
from django_mongolock import queries

__all__ = ["LINES", "WRITES", "render", "run"]

# A full line (``MAX_WAITERS`` places) takes no join: the longest stays below it.
LINES: Final = (4, 16, 64, 200, 900)
DOCUMENTS: Final = 50
PLACES: Final = 20_000
TURNS: Final = 7
# The writes measured, in the table's order.
WRITES: Final = ("handoff", "handoff, every place cut", "renewal", "join")
_HOLDER: Final = "holder"
_TOKEN: Final = 5
# Far enough that no lease ends during a run.
_FAR: Final = datetime(2100, 1, 1, tzinfo=UTC)
# How long the places last from their write: as a waiter's that looked again within the
# line check, which a handoff's cut of the places behind its new head leaves as they are.
PLACES_LAST_MS: Final = queries.LINE_CHECK_MS
PLACES_LAST: Final = timedelta(milliseconds=PLACES_LAST_MS)
# Places of waiters that joined behind a long lease: a handoff cuts every one.
LONG_PLACES_LAST: Final = timedelta(minutes=1)
# A turn's write is sent only while its places have at least this long left, for the
# time until the server applies it; otherwise the documents are written again, up to
# ``TURN_TRIES`` times in all.
LIVE_MARGIN: Final = timedelta(seconds=1)
TURN_TRIES: Final = 3


@dataclass(frozen=True)
class Write:
    """One write over every document, the places it meets, and what it must have done."""

    pipeline: list[Any]
    let: Mapping[str, Any] | None
    done: Mapping[str, Any]  # a filter every document matches after the write
    last: timedelta = PLACES_LAST
    # How long the places must still last when the write is applied, for it to do what
    # it is named (beyond ``LIVE_MARGIN``): a handoff cuts only the places that last
    # past the line check and the grace period.
    needs: timedelta = timedelta(0)


def _document(number: int, places: int, at: datetime, last: timedelta) -> dict[str, Any]:
    until = at + last
    line = [
        {"owner": f"waiter-{n}", "until": until, "at": at, "hand": True, "ttl": 60.0}
        | {"ttl_ms": 60_000}
        for n in range(places)
    ]
    return {
        "_id": f"line-{number}",
        "owner": _HOLDER,
        "token": _TOKEN,
        "acquired_at": _FAR,
        "refreshed_at": _FAR,
        "expires_at": _FAR,
        "ttl": 60.0,
        "waiters": line,
        "ended": [],
    }


def _last_until(until: Any) -> dict[str, Any]:
    """A filter: the line's last place (``$$last`` in ``until``) ends at ``until``."""
    last = {"$arrayElemAt": ["$waiters", -1]}
    return {"$expr": {"$let": {"vars": {"last": last}, "in": {"$eq": ["$$last.until", until]}}}}


# A filter: the line's last place (the one the write renewed or added, at ``$$NOW``) was
# written while its first place was live, so the write met a live line.
_MET_LIVE: Final = {
    "$expr": {
        "$lt": [{"$arrayElemAt": ["$waiters.at", -1]}, {"$arrayElemAt": ["$waiters.until", 0]}]
    }
}


def _writes(places: int) -> dict[str, Write]:
    """Each write, and the plain one, over every document of the collection."""
    handing = list(queries.release_writes(contended=True)[0]("-", _HOLDER, _TOKEN).pipeline)
    renewing = queries.acquire(f"waiter-{places - 1}", 60.0, queue=True)
    joining = queries.acquire("newcomer", 60.0, queue=True)
    # The head written is the second waiter's id followed by the handoff's token.
    head = {"$regex": f"^waiter-1{queries.HEAD_MARK}[0-9]+$"} if places > 1 else None
    handed: dict[str, Any] = {"owner": "waiter-0", "head": head}
    left, cut = handed, handed
    line_check = queries.LINE_CHECK_MS + queries.PLACE_GRACE_MS
    if places > 2:  # the last place is behind the new head: cut, or left as it was
        left = handed | _last_until({"$add": ["$$last.at", PLACES_LAST_MS]})
        cut = handed | _last_until({"$add": ["$acquired_at", line_check]})
    cut_all = timedelta(milliseconds=line_check)
    # Renewed where it stands (a lapsed place would have made it join at the end).
    renewed = {
        f"waiters.{places}": {"$exists": False},
        f"waiters.{places - 1}.owner": f"waiter-{places - 1}",
    }
    return {
        "handoff": Write(handing, None, left),
        "handoff, every place cut": Write(handing, None, cut, LONG_PLACES_LAST, cut_all),
        "renewal": Write(list(renewing.pipeline), renewing.let, renewed | _MET_LIVE),
        "join": Write(
            list(joining.pipeline),
            joining.let,
            {f"waiters.{places}.owner": "newcomer"} | _MET_LIVE,
        ),
        "plain": Write([{"$set": {"refreshed_at": "$$NOW"}}], None, {"owner": _HOLDER}),
    }


def _server_time(collection: Collection[dict[str, Any]]) -> datetime:
    local: datetime = collection.database.client.admin.command("hello")["localTime"]
    return local.replace(tzinfo=UTC)


def _turn(
    collection: Collection[dict[str, Any]], documents: int, places: int, write: Write
) -> float:
    """The write's time per document, over ``documents`` lines of ``places`` places.

    The places last ``write.last`` from the server time read before the documents are
    written: on a loaded machine, writing thousands of them can take that long, and a
    write over lapsed places does other work (a renewal joins the end, a release frees
    the key). So the write is sent only while they have ``write.needs`` and
    ``LIVE_MARGIN`` left, the documents written again otherwise.
    """
    for _ in range(TURN_TRIES):
        collection.delete_many({})
        at = _server_time(collection)
        collection.insert_many([_document(n, places, at, write.last) for n in range(documents)])
        if _server_time(collection) < at + write.last - write.needs - LIVE_MARGIN:
            break
    else:
        raise RuntimeError(
            f"writing {documents} documents left their places less than "
            f"{(write.needs + LIVE_MARGIN).total_seconds():g} s of their "
            f"{write.last.total_seconds():g} s, {TURN_TRIES} times: the server is too slow "
            "for this probe now"
        )
    started = time.perf_counter()
    result = collection.update_many(
        {"owner": _HOLDER, "token": _TOKEN}, write.pipeline, let=write.let
    )
    spent = time.perf_counter() - started
    done = collection.count_documents(write.done)
    if result.modified_count != documents or done != documents:
        raise RuntimeError(
            f"a write changed {result.modified_count} of {documents} documents, "
            f"and {done} are as it should leave them"
        )
    return spent / documents


def run(
    url: str,
    lines: Sequence[int] = LINES,
    documents: int = DOCUMENTS,
    places_in_all: int = PLACES,
    turns: int = TURNS,
    name: str = "line_cost",
) -> dict[str, Any]:
    """Median time per document of each write (and the plain one) by line length, in the
    collection ``name`` (dropped after)."""
    client: MongoClient[dict[str, Any]] = MongoClient(url)
    collection = client[DATABASE].get_collection(name, write_concern=WriteConcern("majority"))
    points: dict[str, dict[str, float]] = {}
    try:
        for places in lines:
            writes = _writes(places)
            count = max(documents, -(-places_in_all // places))
            spent: dict[str, list[float]] = {write: [] for write in writes}
            for turn in range(turns + 1):  # the first turn warms up and is not kept
                # A new order every turn (the same in every run), so that no write
                # always meets the server right after the same one.
                names = list(writes)
                random.Random(turn).shuffle(names)
                for write in names:
                    taken = _turn(collection, count, places, writes[write])
                    if turn:
                        spent[write].append(taken)
            points[str(places)] = {
                **{write: statistics.median(times) for write, times in spent.items()},
                "documents": count,
            }
    finally:
        collection.drop()
        client.close()
    return {"turns": turns, "points": points}


def render(data: Mapping[str, Any]) -> list[str]:
    """The table: each write's server work per document, less the plain write's."""
    points = sorted(data["points"].items(), key=lambda item: int(item[0]))
    lines = [
        "### Server work per write by line length",
        "",
        "Each write as the library sends it, applied by one `update_many` to the *documents*, "
        "each carrying a line of that many live places, against a plain write of the same "
        "documents (one field set, the line untouched); the median of "
        f"{data['turns']} turns, per document, less the plain write's. *Handoff*: a release "
        "that hands the key to the first place, over places that last the line check (its "
        "cut shortens the new head's place only); *every place cut*: the same over places "
        "that last a minute, as in a line that joined behind a long lease; *renewal*: the "
        "last waiter renewing its place; *join*: a newcomer joining at the end. *Per added "
        "place*: a handoff's work beyond the first row's, divided by the places beyond it: "
        "flat if the work grows in proportion to the line.",
        "",
        "| places | documents | handoff | every place cut | renewal | join | plain write "
        "| per added place: handoff | every place cut |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    handoffs = WRITES[:2]
    first: tuple[int, dict[str, float]] | None = None
    for places, point in points:
        extra = {name: point[name] - point["plain"] for name in WRITES}
        figures = [f"{extra[name] * 1e6:,.0f} µs" for name in WRITES]
        if first is None:
            first = (int(places), extra)
            per_place = ["n/a"] * len(handoffs)
        else:
            beyond = int(places) - first[0]
            per_place = [
                f"{(extra[name] - first[1][name]) / beyond * 1e6:.2f} µs" for name in handoffs
            ]
        lines.append(
            f"| {int(places):,} | {point['documents']:,} | "
            + " | ".join([*figures, f"{point['plain'] * 1e6:,.0f} µs", *per_place])
            + " |"
        )
    return [*lines, ""]
