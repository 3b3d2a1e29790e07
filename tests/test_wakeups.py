"""Who hears of a release: a handoff reaches the new holder's and the new head's processes only.

Each manager here has an owner name of its own, so its holder ids start with a prefix of
their own, as another process's would: its change stream is filtered as that process's
would be. Raw streams with each manager's filter record exactly what every "process"
was sent; a sentinel document deleted at the end marks where each stream's story ends.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import bson
import pytest
from pymongo import MongoClient

from django_mongolock import Lock, LockManager, events
from django_mongolock.owners import owner_prefix
from django_mongolock.queries import (
    ENDED_KEEP,
    FREED_EVENTS,
    HEAD_MARK,
    LINE_CHECK_MS,
    PLACE_GRACE_MS,
    head_owner,
    wakeups,
)
from django_mongolock.watcher import handoff_of

BOUND = 60.0
# "web.1" as a regex would also match "webX1": the filter must take the name literally.
NAMES = ("web.1", "webX1", "worker-c")
SENTINEL = "wakeups-sentinel"


@pytest.fixture
def named(mongolock_url: str, manager: LockManager) -> Iterator[list[LockManager]]:
    """Three managers on the test collection, each with an owner name of its own."""
    managers = [
        LockManager(
            mongolock_url, database=manager.database, collection=manager.collection, owner=name
        )
        for name in NAMES
    ]
    yield managers
    for each in managers:
        each.close()


def _until(condition: Any) -> None:
    deadline = time.monotonic() + BOUND
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def _line(locks: Any, key: str) -> list[dict[str, Any]]:
    return list((locks.find_one({"_id": key}) or {}).get("waiters") or ())


def _stored(doc: dict[str, Any]) -> list[tuple[Any, Any]]:
    """The stored line, lapsed places too: (owner, until) of each, None for a marker."""
    return [(place.get("owner"), place["until"]) for place in doc["waiters"]]


def _owner(locks: Any, key: str) -> Any:
    return (locks.find_one({"_id": key}) or {}).get("owner", "")


def _story(stream: Any) -> list[tuple[str, Any, Any]]:
    """What a stream was sent up to the sentinel's delete: (kind, new owner, the owner of
    the new head)."""
    story: list[tuple[str, Any, Any]] = []
    deadline = time.monotonic() + BOUND
    while time.monotonic() < deadline:
        change = stream.try_next()
        if change is None:
            continue
        kind = change["operationType"]
        if change["documentKey"]["_id"] == SENTINEL:
            assert kind == "delete"
            return story
        fields = change.get("fullDocument") or (change.get("updateDescription") or {}).get(
            "updatedFields", {}
        )
        if kind == "delete":
            story.append(("delete", None, None))
        elif fields.get("owner"):
            story.append(("handoff", fields["owner"], head_owner(fields.get("head"))))
        else:
            story.append(("freed", None, None))
    raise AssertionError(f"the sentinel never came; so far {story}")


def test_a_handoff_names_the_new_head_and_cuts_the_places_behind_it(
    manager: LockManager,
) -> None:
    """Three places in line, taken by attempts nobody follows up (no waiter can renew a
    place meanwhile). The handing release makes the first the holder and marks its
    place lapsed where it stands, names the second ``head`` and cuts its place to the
    grace period (the handoff wakes it), and cuts the third to the line check beyond
    that (its waiter looks again that often). A release that frees the key names no
    head."""
    key = "wakeups-places"
    store = manager.store
    holder = manager.acquire(key, ttl=30)
    places = [f"{name}:1:{n:012x}" for n, name in enumerate(NAMES)]
    for owner in places:
        assert store.acquire(key, owner, 30.0, queue=True).owner == holder.owner
    doc = store.collection.find_one({"_id": key})
    assert doc is not None
    lease_end = doc["expires_at"]
    assert [place["until"] for place in doc["waiters"]] == [
        lease_end + timedelta(milliseconds=PLACE_GRACE_MS)
    ] * 3

    assert holder.release()
    doc = store.collection.find_one({"_id": key})
    assert doc is not None
    handed_at = doc["acquired_at"]
    assert (doc["owner"], head_owner(doc["head"])) == (places[0], places[1])
    assert _stored(doc) == [
        (None, None),  # the new holder's place, marked lapsed where it stands
        (places[1], handed_at + timedelta(milliseconds=PLACE_GRACE_MS)),
        (places[2], handed_at + timedelta(milliseconds=LINE_CHECK_MS + PLACE_GRACE_MS)),
    ]

    # The second and third leave; the first's release then frees the key: no head.
    for owner in places[1:]:
        store.leave(key, owner)
    assert store.release(key, places[0], doc["token"])
    doc = store.collection.find_one({"_id": key})
    assert doc is not None
    assert (doc["owner"], doc["head"], doc["waiters"]) == (None, None, [])


def test_a_handoff_reaches_its_new_head_when_the_last_one_named_it_too(
    mongolock_url: str, manager: LockManager
) -> None:
    """The same waiter can be first in line after two handoffs in a row: its place was
    cut to the grace period by the first and lapsed (here: it left), and it joined again
    behind the waiter the second hands the key to. The second handoff must still reach
    its process, or it sleeps until its line check while its new place, cut again,
    lapses: ``head`` carries each handoff's token, so the server never leaves it out of
    the event as unchanged."""
    key = "wakeups-same-head"
    store = manager.store
    client: MongoClient[dict[str, Any]] = MongoClient(mongolock_url, tz_aware=True)
    locks = client[manager.database][manager.collection]
    first, head, later = (f"{owner_prefix(name)}{n:012x}" for n, name in enumerate(NAMES))
    stream = locks.watch(wakeups(owner_prefix(NAMES[1])), max_await_time_ms=100)
    try:
        holder = manager.acquire(key, ttl=30)
        for owner in (first, head):
            assert store.acquire(key, owner, 30.0, queue=True).owner == holder.owner
        assert holder.release()
        handed = locks.find_one({"_id": key})
        assert handed is not None
        assert (handed["owner"], head_owner(handed["head"])) == (first, head)
        # The handed first lease lasts 2 s: made long enough for the rest of the test.
        assert store.refresh(key, first, handed["token"], 30.0) is not None
        # The head gives up its place and joins again, behind a newcomer.
        store.leave(key, head)
        for owner in (later, head):
            assert store.acquire(key, owner, 30.0, queue=True).owner == first
        assert [place["owner"] for place in _line(locks, key) if place.get("owner")] == [
            later,
            head,
        ]
        assert store.release(key, first, handed["token"], contended=True)
        again = locks.find_one({"_id": key})
        assert again is not None
        assert (again["owner"], head_owner(again["head"])) == (later, head)
        assert again["head"] != handed["head"]
        locks.insert_one({"_id": SENTINEL})
        locks.delete_one({"_id": SENTINEL})
        assert _story(stream) == [("handoff", first, head), ("handoff", later, head)]
    finally:
        stream.close()
        client.close()


def test_places_behind_the_head_last_the_line_check_while_the_key_is_held(
    manager: LockManager,
) -> None:
    """Behind a lease shorter than the line check, the head's place lasts the grace
    period past the lease end (it wakes then), also when it renews it, and every place
    behind it lasts the line check and the grace period from its own attempt (those
    waiters look again every line check, not at each lease end). A handoff cuts no place
    behind the new head to less. Once the lease has ended, a place behind others lasts
    the grace period only (its waiter looks again within it)."""
    key = "wakeups-short-lease"
    store = manager.store
    holder = manager.acquire(key, ttl=3, refresh=False)
    places = [f"{name}:1:{n:012x}" for n, name in enumerate(NAMES)]
    for owner in places:
        assert store.acquire(key, owner, 30.0, queue=True).owner == holder.owner
    assert store.acquire(key, places[0], 30.0, queue=True).position == 0  # the head renews
    doc = store.collection.find_one({"_id": key})
    assert doc is not None
    lease_end, line = doc["expires_at"], doc["waiters"]
    grace, check = (timedelta(milliseconds=ms) for ms in (PLACE_GRACE_MS, LINE_CHECK_MS))
    assert lease_end - line[0]["at"] < check  # the premise: a lease shorter than that
    assert [place["until"] for place in line] == [
        lease_end + grace,
        line[1]["at"] + check + grace,
        line[2]["at"] + check + grace,
    ]

    assert holder.release()
    doc = store.collection.find_one({"_id": key})
    assert doc is not None
    handed_at, handed_end = doc["acquired_at"], doc["expires_at"]
    assert doc["owner"] == places[0]
    assert _stored(doc) == [
        (None, None),
        (places[1], handed_at + grace),
        (places[2], line[2]["at"] + check + grace),
    ]

    # The new head renews its place; then the handed first lease ends (as if its holder
    # died): the key is free, with the head still ahead of the third, whose place now
    # lasts the grace period only.
    assert store.acquire(key, places[1], 30.0, queue=True).position == 0
    store.collection.update_one({"_id": key}, [{"$set": {"expires_at": "$$NOW"}}])
    answer = store.acquire(key, places[2], 30.0, queue=True)
    assert (answer.owner, answer.live, answer.position) == (places[0], False, 1)
    doc = store.collection.find_one({"_id": key})
    assert doc is not None
    assert doc["expires_at"] < handed_end
    assert _stored(doc) == [
        (None, None),
        (places[1], handed_end + grace),
        (places[2], doc["waiters"][2]["at"] + grace),
    ]


def test_shared_places_behind_others_last_the_grace_period_past_the_lease_end(
    manager: LockManager,
) -> None:
    """Shared waiters look again at the lease end (readers behind a lease that runs out
    enter together): their places, behind others too, last the grace period past it."""
    key = "wakeups-shared-places"
    store = manager.store
    holder = manager.acquire(key, ttl=3, refresh=False)
    for owner in (f"{name}:1:{n:012x}" for n, name in enumerate(NAMES)):
        assert store.acquire(key, owner, 30.0, queue=True, shared=True).owner == holder.owner
    doc = store.collection.find_one({"_id": key})
    assert doc is not None
    grace = timedelta(milliseconds=PLACE_GRACE_MS)
    assert [place["until"] for place in doc["waiters"]] == [doc["expires_at"] + grace] * 3
    assert holder.release()


def test_a_handoff_reaches_only_the_new_holder_and_the_new_head(
    mongolock_url: str, manager: LockManager, named: list[LockManager]
) -> None:
    """Three waiters of three "processes" in line: each release hands the key to the head
    of the line. Its event goes to the process of the new holder (which takes the lock
    from it) and to that of the new head (which looks again, in case the new holder died
    in line), never to the others; a release that frees the key goes to all. The places
    behind the head keep their time: no release they do not hear of cuts it."""
    key = "wakeups-line"
    client: MongoClient[dict[str, Any]] = MongoClient(mongolock_url, tz_aware=True)
    locks = client[manager.database][manager.collection]
    prefixes = [owner_prefix(name) for name in NAMES]
    streams = [locks.watch(wakeups(prefix), max_await_time_ms=100) for prefix in prefixes]
    everything = locks.watch(FREED_EVENTS, max_await_time_ms=100)
    got: dict[int, Lock] = {}
    releases = {n: threading.Event() for n in range(len(named))}
    told: list[events.Handoff] = []
    stop = events.subscribe(
        lambda e: told.append(e) if isinstance(e, events.Handoff) and e.key == key else None
    )

    def wait_hold_release(n: int) -> None:
        got[n] = named[n].acquire(key, ttl=30, timeout=BOUND)
        releases[n].wait(BOUND)
        got[n].release()

    try:
        holder = manager.acquire(key, ttl=30)
        threads = []
        for n in range(len(named)):
            named[n].watcher.ensure_running()
            _until(lambda n=n: named[n].watcher.healthy)
            thread = threading.Thread(target=wait_hold_release, args=(n,))
            thread.start()
            threads.append(thread)
            _until(lambda n=n: len(_line(locks, key)) == n + 1)
        owners = [place["owner"] for place in _line(locks, key)]
        for owner, prefix in zip(owners, prefixes, strict=True):
            assert owner.startswith(prefix)
        seen_before = [each.watcher.events for each in named]

        assert holder.release()
        for n in range(len(named)):
            _until(lambda n=n: n in got)
            releases[n].set()
            if n + 1 < len(named):
                _until(lambda n=n: _owner(locks, key) == owners[n + 1])
        for thread in threads:
            thread.join(BOUND)
        tokens = [holder.token] + [got[n].token for n in range(len(named))]
        assert tokens == sorted(set(tokens))
        # Each waiter took the lock from its handoff event, which names the releasing
        # holder (an attempt of its own that found the lock its own could not).
        assert [(e.from_owner, e.to_owner, e.token) for e in told] == [
            (before, after, token)
            for before, after, token in zip(
                [holder.owner, *owners[:-1]], owners, tokens[1:], strict=True
            )
        ]
        _until(lambda: _owner(locks, key) is None)
        locks.insert_one({"_id": SENTINEL})
        locks.delete_one({"_id": SENTINEL})

        h1 = ("handoff", owners[0], owners[1])
        h2 = ("handoff", owners[1], owners[2])
        h3 = ("handoff", owners[2], None)
        freed = ("freed", None, None)
        assert _story(everything) == [h1, h2, h3, freed]
        assert [_story(stream) for stream in streams] == [
            [h1, freed],
            [h1, h2, freed],
            [h2, h3, freed],
        ]
        # The managers' own watchers were sent the same: those events and the sentinel.
        expected = [3, 4, 4]
        _until(
            lambda: all(
                each.watcher.events - before >= count
                for each, before, count in zip(named, seen_before, expected, strict=True)
            )
        )
        assert [
            each.watcher.events - before for each, before in zip(named, seen_before, strict=True)
        ] == expected
    finally:
        stop()
        for stream in [*streams, everything]:
            stream.close()
        client.close()


class OwnIds(LockManager):
    """A manager whose holder ids do not start with its process's prefix."""

    def new_owner(self) -> str:
        return f"own-{uuid.uuid4().hex}"


def test_a_waiter_with_holder_ids_of_its_own_still_hears_of_its_handoff(
    mongolock_url: str, manager: LockManager
) -> None:
    """The watcher streams only the handoffs to ids with its process's prefix, until a
    waiter with another kind of id comes: from then on it streams every handoff (from
    where it stopped), and that waiter takes the lock from the event, not at the end of
    the holder's 30 s lease."""
    key = "wakeups-own-ids"
    own = OwnIds(mongolock_url, database=manager.database, collection=manager.collection)
    told: list[events.Handoff] = []
    stop = events.subscribe(
        lambda e: told.append(e) if isinstance(e, events.Handoff) and e.key == key else None
    )
    box: list[Lock] = []
    try:
        own.watcher.ensure_running()
        _until(lambda: own.watcher.healthy)
        holder = manager.acquire(key, ttl=30)
        thread = threading.Thread(target=lambda: box.append(own.acquire(key, timeout=20)))
        thread.start()
        locks = manager.store.collection
        _until(lambda: len(_line(locks, key)) == 1)
        # The stream was opened again with every handoff let through.
        _until(lambda: own.watcher.opened == 2)
        streamed = own.watcher.events
        assert holder.release()
        thread.join(BOUND)
        [lock] = box
        assert lock.owner.startswith("own-")
        # The reopened stream lets the handoff through (the only change it lets through
        # here). The waiter may still find the lock handed to it by an attempt of its own
        # before the event comes, on a loaded machine: then it cannot name the releaser.
        _until(lambda: own.watcher.events > streamed)
        [(from_owner, to_owner)] = [(e.from_owner, e.to_owner) for e in told]
        assert from_owner in (holder.owner, "")
        assert to_owner == lock.owner
        assert lock.token > holder.token
        assert lock.release()
    finally:
        stop()
        own.close()


@pytest.mark.parametrize("handed", [True, False], ids=["handoff", "freed"])
def test_a_release_event_leaves_the_line_out(manager: LockManager, handed: bool) -> None:
    """A release may change every place in line (a handoff cuts the places behind the
    new head to the line check; a release that frees the key cuts each to the grace
    period), and the server names each changed place in its update event
    (``waiters.17.until``...):
    the stream leaves them out, so that what reaches a watcher, and what a relay passes
    on, does not grow with the line. What the watcher reads of the release is all there."""
    locks = manager.store.collection
    key = f"long-line-{uuid.uuid4().hex[:8]}"
    holder = manager.acquire(key, ttl=30, refresh=False)
    # 150 places in line, as blocked acquirers of another process leave them; without
    # ``hand`` (a recipe's waiters) the release frees the key instead of handing it on.
    place: dict[str, Any] = {"until": {"$add": ["$$NOW", 60_000]}, "at": "$$NOW"}
    if handed:
        place.update(hand=True, ttl=30.0, ttl_ms=30_000)
    line = [{"owner": f"other:7:{n:012x}", **place} for n in range(150)]
    # The latest acquisitions that ended, as a busy key keeps them: a release shifts them.
    ended = [f"gone:7:{n:012x}" for n in range(ENDED_KEEP)]
    locks.update_one({"_id": key}, [{"$set": {"waiters": line, "ended": ended}}])
    with locks.watch(wakeups("other:"), max_await_time_ms=100) as stream:
        assert holder.release()
        deadline = time.monotonic() + BOUND
        while (change := stream.try_next()) is None:
            assert time.monotonic() < deadline
    # An update, not a replace: the server logs changes smaller than the document as
    # such (the places' fields are most of the document, but not all of it).
    assert change["operationType"] == "update"
    fields = change["updateDescription"]["updatedFields"]
    assert [name for name in fields if name.startswith(("waiters", "holders"))] == []
    # Of ``ended``, only the owner the release put in front.
    assert {name: value for name, value in fields.items() if name.startswith("ended")} in (
        {"ended": [holder.owner]},
        {"ended.0": holder.owner},
    )
    assert len(bson.encode(change)) < 1024  # 5 to 14 KB with the places' fields
    if handed:
        handoff = handoff_of(change)
        assert handoff is not None
        assert (handoff.owner, handoff.previous) == ("other:7:000000000000", holder.owner)
        assert handoff.token > holder.token
        assert head_owner(fields["head"]) == "other:7:000000000001"
        assert fields["head"] == f"other:7:000000000001{HEAD_MARK}{handoff.token}"
    else:
        assert "owner" in fields
        assert fields["owner"] is None
        assert handoff_of(change) is None
    # The document itself keeps its line; a handoff marks the new holder's place lapsed
    # where it stands.
    stored = _line(locks, key)
    assert len(stored) == 150
    assert [place.get("owner") for place in stored[:2]] == [
        None if handed else "other:7:000000000000",
        "other:7:000000000001",
    ]


def _through_the_stream(manager: LockManager, events: list[dict[str, Any]]) -> list[Any]:
    """``events``, as the server writes them, out of the stream's own stages, in order."""
    stored = manager.store.collection.database["synthetic_events"]
    stored.insert_many([{"n": n, **event} for n, event in enumerate(events)])
    out = stored.aggregate([*wakeups(None), {"$sort": {"n": 1}}])
    return [{k: v for k, v in event.items() if k not in ("_id", "n")} for event in out]


_LATEST = ["old-holder", *(f"gone:{n}" for n in range(1, ENDED_KEEP))]


@pytest.mark.parametrize(
    ("form", "ended", "kept"),
    [
        pytest.param(
            "by-position",
            {f"ended.{n}": owner for n, owner in enumerate(_LATEST)},
            {"ended.0": "old-holder"},
            id="by-position",
        ),
        pytest.param("whole", {"ended": _LATEST}, {"ended": ["old-holder"]}, id="whole"),
        pytest.param("replace", {"ended": _LATEST}, {"ended": ["old-holder"]}, id="replace"),
        pytest.param(
            "not-a-list", {"ended": "old-holder"}, {"ended": "old-holder"}, id="not-a-list"
        ),
    ],
)
def test_a_handoff_event_keeps_only_the_first_ended_owner(
    manager: LockManager, form: str, ended: dict[str, Any], kept: dict[str, Any]
) -> None:
    """The server reports a changed ``ended`` whole or by its positions, or the whole
    document (a replace event); each way the stream keeps only its first entry (the owner
    the release ended) and every field the watcher reads, and drops the places of the
    lists. An ``ended`` that is no list passes as it is: the stream must not fail on it."""
    released_at = datetime.now(UTC).replace(microsecond=0)  # as BSON keeps it
    fields = {
        "owner": "next:7:1",
        "token": 12,
        "acquired_at": released_at,
        "expires_at": released_at + timedelta(seconds=30),
        "released_at": released_at,
        "head": "next:7:2",
    }
    if form == "replace":
        lists = {"waiters": [{"owner": "next:7:5", "until": released_at}], "holders": []}
        whole = {"_id": "k", **fields, **ended, **lists}
        (trimmed,) = _through_the_stream(
            manager, [{"operationType": "replace", "fullDocument": whole}]
        )
        assert trimmed["fullDocument"] == {"_id": "k", **fields, **kept}
    else:
        places = {"waiters.3.owner": "next:7:5", "waiters.3.until": released_at, "holders": []}
        changed = {"updatedFields": {**fields, **ended, **places}}
        (trimmed,) = _through_the_stream(
            manager, [{"operationType": "update", "updateDescription": changed}]
        )
        assert trimmed == {
            "operationType": "update",
            "updateDescription": {"updatedFields": {**fields, **kept}},
        }  # and no fullDocument added
    handoff = handoff_of(trimmed)
    assert handoff is not None
    previous = "" if form == "not-a-list" else "old-holder"
    assert (handoff.owner, handoff.token, handoff.previous) == ("next:7:1", 12, previous)


def test_the_trim_adds_nothing_to_events_that_lack_what_it_cuts(manager: LockManager) -> None:
    """A delete, an update without ``ended`` and a replace without it, or with one that
    is no list, come out of the stream's stages as they went in (the lists aside)."""
    now = datetime.now(UTC).replace(microsecond=0)
    freed = {"owner": None, "released_at": now, "head": None}
    given: list[dict[str, Any]] = [
        {"operationType": "delete", "documentKey": {"_id": "k"}},
        {"operationType": "update", "updateDescription": {"updatedFields": freed}},
        {"operationType": "replace", "fullDocument": {"_id": "k", **freed, "acquired_at": now}},
        {
            "operationType": "replace",
            "fullDocument": {"_id": "k", **freed, "acquired_at": now, "ended": "x"},
        },
    ]
    assert _through_the_stream(manager, given) == given
