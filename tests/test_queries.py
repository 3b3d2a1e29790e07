"""The pure layer on its own: queries, reply reading and error text, with no server."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any, Final

import bson
import pytest

from django_mongolock import mongo, queries
from django_mongolock.exceptions import LimitConflict, LineFull, LockNotAcquired
from django_mongolock.info import LockInfo

NOW = datetime(2030, 1, 1, tzinfo=UTC)


def _info(**fields: object) -> LockInfo:
    doc = {"_id": "k", "owner": "", "token": 7, "expires_at": NOW, "now": NOW, **fields}
    return LockInfo.from_document(doc)


def test_a_listing_takes_prefix_and_owner_as_text() -> None:
    query = queries.listing("live", "a.b*", owner="h:1")
    assert query["$and"][0]["_id"] == {"$regex": "^a\\.b\\*"}
    assert query["$and"][1]["$or"][0] == {"owner": {"$regex": "h:1"}}
    assert query["$expr"] == queries.LIVE
    assert queries.listing("expired", None)["$expr"] == {"$not": [queries.LIVE]}
    assert "$expr" not in queries.listing("all", None)
    with pytest.raises(ValueError, match="state must be"):
        queries.listing("soon", None)  # type: ignore[arg-type]


def test_a_force_release_names_the_token_only_when_given() -> None:
    assert "token" not in queries.force_release("k", None)
    assert queries.force_release("k", 3)["token"] == 3
    assert queries.force_release("k", 3)["_id"] == "k"


def test_index_plans_say_what_is_missing_or_differs() -> None:
    actions = [a.action for a in queries.plan_locks(600, {})]
    assert actions == ["missing", "missing"]
    existing = {queries.KEY_INDEX: {}, queries.TTL_INDEX: {"expireAfterSeconds": 60}}
    key, ttl = queries.plan_locks(600, existing)
    assert (key.action, ttl.action, ttl.detail) == ("unchanged", "differs", "was 60")
    index = queries.TTLIndex(queries.AUDIT_TTL_INDEX, "at", 30, "audit trail")
    assert index.plan(None).action == "missing"
    assert index.plan({"expireAfterSeconds": 30}).action == "unchanged"
    assert queries.plan_keyed({queries.AUDIT_KEY_INDEX: {}}).action == "unchanged"


def test_a_refusal_for_good_is_told_from_a_busy_key() -> None:
    busy = _info(owner="other", expires_at=NOW + timedelta(seconds=5))
    assert queries.refused(busy, "me", queue=False, shared=False, limit=None) is busy
    ended = _info(owner="me", expires_at=NOW - timedelta(seconds=1))
    with pytest.raises(LockNotAcquired, match="ended"):
        queries.refused(ended, "me", queue=False, shared=False, limit=None)
    holder = {"owner": "x", "token": 1, "expires_at": NOW + timedelta(seconds=5), "ttl": 5.0}
    shared = _info(mode="shared", limit=2, holders=[holder])
    with pytest.raises(LimitConflict):
        queries.refused(shared, "me", queue=False, shared=True, limit=3)
    full = _info(owner="other", expires_at=NOW + timedelta(seconds=5), waiting=1000)
    with pytest.raises(LineFull):
        queries.refused(full, "me", queue=True, shared=False, limit=None)
    with pytest.raises(ValueError, match="limit must be at most"):
        queries.check_limit(True, queries.MAX_HOLDERS + 1)


def test_replies_of_releases_and_shared_refreshes_are_read() -> None:
    assert queries.released_live(None) is False
    assert queries.released_live({"live": False}) is False
    assert queries.released_live({}) is True  # a retried release: the filter matched the holder
    later = NOW + timedelta(seconds=1)
    docs = [
        {"now": NOW, "holders": [{"owner": "a", "expires_at": later}]},
        {"now": NOW, "holders": [{"owner": "b", "expires_at": NOW}, {"owner": "c"}]},
    ]
    assert queries.live_shared_owners(docs, {"a", "b"}) == {"a"}


def test_heartbeats_and_liveness_are_read_by_server_time() -> None:
    writes = queries.heartbeats(["p", "p", "q"], 2.0)
    assert len(writes) == 2
    assert queries.liveness([{"_id": "p", "alive": True, "silent": 1500}]) == {"p": (True, 1.5)}
    assert queries.liveness([{"_id": "q", "silent": -3}]) == {"q": (False, 0.0)}


def test_messages_never_carry_credentials() -> None:
    text = "cannot reach mongodb://user:secret@db:27017/?x=1, Timeout: 5s, Topology: ..."
    assert (
        mongo.redact(text) == "cannot reach mongodb://***@db:27017/?x=1, Timeout: 5s, Topology: ..."
    )
    assert mongo.brief(text) == "cannot reach mongodb://***@db:27017/?x=1"
    assert "secret" not in mongo.redact("mongodb+srv://u:secret@cluster/")


# What names a whole line inside a query: the stored line (also through ``$$ROOT`` or
# ``$$CURRENT``); ``_walk`` adds every variable bound to a list drawn from it.
_STORED_LINE: Final = ("$waiters", "$$ROOT.waiters", "$$CURRENT.waiters")
# The operators whose value is a list drawn from their list arguments.
_LIST_OPERATORS: Final = frozenset(
    {"$filter", "$map", "$slice", "$concatArrays", "$reverseArray", "$sortArray", "$setUnion"}
)
# Per-element bodies: ``$map``'s ``in``, ``$filter``'s ``cond``, ``$reduce``'s ``in``.
_BODIES: Final = {"$map": "in", "$filter": "cond", "$reduce": "in"}


def _names_line(node: object, lines: frozenset[str]) -> bool:
    """Whether ``node`` mentions a line (or a path through one) anywhere in it."""
    if isinstance(node, str):
        return any(node == line or node.startswith(f"{line}.") for line in lines)
    if isinstance(node, dict):
        return any(_names_line(value, lines) for value in node.values())
    if isinstance(node, list):
        return any(_names_line(item, lines) for item in node)
    return False


def _is_line(node: object, lines: frozenset[str]) -> bool:
    """Whether ``node`` evaluates to a list drawn from a line (as far as its shape tells)."""
    if isinstance(node, str):
        return _names_line(node, lines)
    if not isinstance(node, dict) or len(node) != 1:
        return False
    [(op, args)] = node.items()
    if op in _LIST_OPERATORS:
        return _names_line(args, lines)
    if op == "$ifNull":
        return any(_is_line(arg, lines) for arg in args)
    if op == "$cond":
        branches = args[1:] if isinstance(args, list) else [args["then"], args["else"]]
        return any(_is_line(branch, lines) for branch in branches)
    if op == "$let":
        return _is_line(args["in"], _bound(args["vars"], lines))
    return False


def _bound(variables: dict[str, Any], lines: frozenset[str]) -> frozenset[str]:
    return lines | {f"$${name}" for name, value in variables.items() if _is_line(value, lines)}


def _walk(node: object, lines: frozenset[str]) -> Iterator[tuple[object, frozenset[str]]]:
    """Every per-element body over a line in ``node``, with the names of the lines in
    scope there (evaluated once per place)."""
    if isinstance(node, list):
        for item in node:
            yield from _walk(item, lines)
        return
    if not isinstance(node, dict):
        return
    if isinstance(node.get("$let"), dict):
        spec = node["$let"]
        yield from _walk(spec["vars"], lines)
        yield from _walk(spec["in"], _bound(spec["vars"], lines))
        return
    for op, body in _BODIES.items():
        spec = node.get(op)
        if isinstance(spec, dict) and _names_line(spec.get("input"), lines):
            yield spec[body], lines
    for value in node.values():
        yield from _walk(value, lines)


def _every_write_on_a_line() -> Iterator[tuple[str, dict[str, Any]]]:
    for queue, shared, limit, tags in itertools.product(
        (False, True), (False, True), (None, 3), ({}, {"kind": "x"})
    ):
        if limit is not None and not shared:
            continue
        op = queries.acquire("me", 5.0, queue=queue, shared=shared, limit=limit, tags=tags)
        yield f"acquire {queue=} {shared=} {limit=} {tags=}", op.command("locks", "k")
    for contended in (False, True):
        for n, release in enumerate(queries.release_writes(contended=contended)):
            yield f"release {contended=} #{n}", release("k", "me", 7).command("locks")
    yield "leave", queries.leave("k", "me").command("locks")
    for shared in (False, True):
        yield f"give up {shared=}", queries.give_up("k", "me", shared=shared).command("locks")
    query, pipeline = queries.release_many([("k", "me", 7)])
    yield "release many", {"q": query, "u": pipeline}
    yield "release shared", {"u": queries.release_shared("k", "me", 7).pipeline}
    query, pipeline = queries.release_shared_many([("k", "me", 7)])
    yield "release shared many", {"q": query, "u": pipeline}


@pytest.mark.parametrize(("name", "command"), list(_every_write_on_a_line()))
def test_no_write_works_per_place_over_the_whole_line(name: str, command: dict[str, Any]) -> None:
    """What a write evaluates for each place of a line names that place and single
    values only: naming the line again there (``$$q.owner``, say) makes the server build
    the whole line's list once per place. A handoff did so, and over a line of 900
    places took about 63 ms of server work, against about 2.5 ms since (the scale
    benchmark's line-cost table)."""
    plain = bson.decode(bson.encode(command))  # the encoded parts as plain documents
    bodies = list(_walk(plain, frozenset(_STORED_LINE)))
    assert bodies  # every one of them reads the line
    for body, lines in bodies:
        assert not _names_line(body, lines), f"{name}: a per-place expression names a line"


def test_the_walk_follows_lists_drawn_from_the_line_into_variables() -> None:
    """The rule above sees through ``$let``: a variable bound to a slice of the line is
    a line too, and a variable bound to one place of it is not."""
    place = {"$eq": ["$$w.owner", "x"]}
    line = {"$slice": [{"$ifNull": ["$waiters", []]}, 2]}
    named = {
        "$let": {
            "vars": {"a": line, "first": {"$arrayElemAt": ["$waiters", 0]}},
            "in": {
                "$map": {
                    "input": "$$a",
                    "as": "w",
                    "in": {"$and": [place, {"$gt": ["$$w.at", "$$first.at"]}]},
                }
            },
        }
    }
    [(body, lines)] = _walk(named, frozenset(_STORED_LINE))
    assert not _names_line(body, lines)
    again = {
        "$let": {"vars": {"a": line}, "in": {"$map": {"input": "$$a", "as": "w", "in": "$$a"}}}
    }
    [(body, lines)] = _walk(again, frozenset(_STORED_LINE))
    assert _names_line(body, lines)
    reduced = {
        "$reduce": {"input": "$$ROOT.waiters", "initialValue": 0, "in": {"$size": "$waiters"}}
    }
    [(body, lines)] = _walk(reduced, frozenset(_STORED_LINE))
    assert _names_line(body, lines)
