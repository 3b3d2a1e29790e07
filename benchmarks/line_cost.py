"""The server's work per write by the length of a key's line.

A release that hands the key on, a waiter renewing its place, and a waiter joining the
line each rewrite the line inside the key's document. Here each of those writes, as the
library builds it, is applied by one ``update_many`` to documents that each
carry a line of ``N`` live places (lasting as long as a waiter's that looked again
within the line check), beside a plain write of the same documents (one field
set, the line untouched): the time per document, less the plain write's, is the work the
line costs one such write. The documents are written afresh before every turn, so each
turn applies the write to the same line. One command per turn, so the wait for the
majority write concern is shared by the documents and does not hide their work; the
shorter the line, the more documents (``places`` places in all, ``documents`` documents
at least), so that every line's figure rests on as much work.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
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
WRITES: Final = ("handoff", "renewal", "join")
_HOLDER: Final = "holder"
_TOKEN: Final = 5
# Far enough that no lease ends during a run.
_FAR: Final = datetime(2100, 1, 1, tzinfo=UTC)
# How long the places last from their write: as a waiter's that looked again within the
# line check, so that a handoff cuts none but the new head's (it changes what changed
# hands, as it would in a running line, not every place).
PLACES_LAST: Final = timedelta(milliseconds=queries.LINE_CHECK_MS)


def _document(number: int, places: int, at: datetime) -> dict[str, Any]:
    until = at + PLACES_LAST
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


def _writes(places: int) -> dict[str, tuple[dict[str, Any], list[Any], Mapping[str, Any] | None]]:
    """(filter, pipeline, let) of each write, over every document of the collection."""
    handing = queries.release_writes(contended=True)[0]("-", _HOLDER, _TOKEN)
    renewing = queries.acquire(f"waiter-{places - 1}", 60.0, queue=True)
    joining = queries.acquire("newcomer", 60.0, queue=True)
    every = {"owner": _HOLDER, "token": _TOKEN}
    return {
        "handoff": (every, list(handing.pipeline), None),
        "renewal": (every, list(renewing.pipeline), renewing.let),
        "join": (every, list(joining.pipeline), joining.let),
        "plain": (every, [{"$set": {"refreshed_at": "$$NOW"}}], None),
    }


def _turn(
    collection: Collection[dict[str, Any]],
    documents: int,
    places: int,
    write: tuple[dict[str, Any], list[Any], Mapping[str, Any] | None],
) -> float:
    collection.delete_many({})
    at = datetime.now(UTC)
    collection.insert_many([_document(n, places, at) for n in range(documents)])
    query, pipeline, let = write
    started = time.perf_counter()
    result = collection.update_many(query, pipeline, let=let)
    spent = time.perf_counter() - started
    if result.modified_count != documents:
        raise RuntimeError(f"a write changed {result.modified_count} of {documents} documents")
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
            count = max(documents, places_in_all // places)
            spent: dict[str, list[float]] = {write: [] for write in writes}
            for turn in range(turns + 1):  # the first turn warms up and is not kept
                # Each write goes first in turn, so none always follows the same one.
                names = list(writes)
                shift = turn % len(names)
                for write in names[shift:] + names[:shift]:
                    taken = _turn(collection, count, places, writes[write])
                    if turn:
                        spent[write].append(taken)
            points[str(places)] = {
                **{write: statistics.median(times) for write, times in spent.items()},
                "documents": count,
            }
        collection.drop()
    finally:
        client.close()
    return {"turns": turns, "points": points}


def render(data: Mapping[str, Any]) -> list[str]:
    """The table: each write's server work per document, less the plain write's."""
    points = sorted(data["points"].items(), key=lambda item: int(item[0]))
    lines = [
        "### Server work per write by line length",
        "",
        "Each write as the library sends it, applied by one `update_many` to the *documents*, "
        "each carrying a line of that many live places, against a plain write "
        "of the same documents (one field set, the line untouched); the median of "
        f"{data['turns']} turns, per document, less the plain write's. *Handoff*: a release "
        "that hands the key to the first place; *renewal*: the last waiter renewing its "
        "place; *join*: a newcomer joining at the end. *Per added place*: the handoff's "
        "work beyond the shortest line's, divided by the places beyond it: flat while the "
        "work grows in proportion to the line.",
        "",
        "| places | documents | handoff | renewal | join | plain write | handoff per added place |",
        "|---|---|---|---|---|---|---|",
    ]
    first: tuple[int, float] | None = None
    for places, point in points:
        extra = {name: max(point[name] - point["plain"], 0.0) for name in WRITES}
        figures = [f"{extra[name] * 1e6:,.0f} µs" for name in WRITES]
        if first is None:
            first = (int(places), extra["handoff"])
            per_place = "n/a"
        else:
            added = (extra["handoff"] - first[1]) / (int(places) - first[0])
            per_place = f"{added * 1e6:.2f} µs"
        lines.append(
            f"| {int(places):,} | {point['documents']:,} | "
            + " | ".join(figures)
            + f" | {point['plain'] * 1e6:,.0f} µs | {per_place} |"
        )
    return [*lines, ""]
