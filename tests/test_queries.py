"""The pure layer on its own: queries, reply reading and error text, with no server."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

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


# What names a whole line inside a query: the stored line, and the variables the
# queries bind to one (``$$q``: the live places; ``kept``'s two).
_LINE = re.compile(r"^\$(waiters|\$q|\$all_places|\$live_places)(\.|$)")


def _per_place_bodies(node: object) -> Iterator[object]:
    """The bodies of every ``$map`` and ``$filter`` over a line in ``node``: evaluated
    once per place."""
    if isinstance(node, list):
        for item in node:
            yield from _per_place_bodies(item)
    elif isinstance(node, dict):
        for op, body_key in (("$map", "in"), ("$filter", "cond")):
            spec = node.get(op)
            if isinstance(spec, dict) and _mentions_line(spec.get("input")):
                yield spec[body_key]
        for value in node.values():
            yield from _per_place_bodies(value)


def _mentions_line(node: object) -> bool:
    if isinstance(node, str):
        return bool(_LINE.match(node))
    if isinstance(node, dict):
        return any(_mentions_line(value) for value in node.values())
    if isinstance(node, list):
        return any(_mentions_line(item) for item in node)
    return False


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


@pytest.mark.parametrize(("name", "command"), list(_every_write_on_a_line()))
def test_no_write_works_per_place_over_the_whole_line(name: str, command: dict[str, Any]) -> None:
    """What a write evaluates for each place of a line names that place and single
    values only: naming the line again there (``$$q.owner``, say) makes the server build
    the whole line's list once per place, so a handoff over a line of 1,000 places took
    about 68 ms of server time, against about 4 ms with the line's values bound once."""
    plain = bson.decode(bson.encode(command))  # the encoded parts as plain documents
    bodies = list(_per_place_bodies(plain))
    assert bodies  # every one of them reads the line
    for body in bodies:
        assert not _mentions_line(body), f"{name}: a per-place expression names the line"
