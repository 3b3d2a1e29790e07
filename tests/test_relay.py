"""One change stream per host: processes that lead, follow, and fall back (``relay``)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from django_mongolock import LockManager, queries
from django_mongolock.owners import host_prefix
from tests.waiting import lead_and_follow, streaming_as, until


def _wait(manager: LockManager, key: str, out: list[Any]) -> threading.Thread:
    def run() -> None:
        lock = manager.acquire(key, timeout=30)
        out.append((lock, time.monotonic()))
        lock.release()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_second_manager_follows_the_first_and_is_woken_through_it(
    shared: Callable[[], LockManager], manager: LockManager
) -> None:
    _, following = lead_and_follow(shared)
    assert following.watcher.opened == 0  # no stream of its own
    holder = manager.acquire("relayed", ttl=30)
    out: list[Any] = []
    thread = _wait(following, "relayed", out)
    until(lambda: len(following.waiters) == 1, 30, "the waiter in line")
    time.sleep(0.5)
    assert holder.release()
    thread.join(20)
    assert out, "the follower's waiter was not woken"
    assert out[0][0].token > holder.token
    assert following.watcher.events >= 1


def _events(stream: Any, until_key: str) -> list[tuple[Any, ...]]:
    """The events of ``stream`` up to the delete of ``until_key`` (bounded)."""
    seen: list[tuple[Any, ...]] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        change = stream.try_next()
        if change is None:
            continue
        seen.append((change["clusterTime"], change["documentKey"]["_id"], change))
        if change["operationType"] == "delete" and change["documentKey"]["_id"] == until_key:
            return seen
    raise AssertionError("the closing event did not come")


def test_the_leaders_routing_agrees_with_the_servers_filter(manager: LockManager) -> None:
    """What a leader passes on to a follower (``reaches``) is exactly what the follower's
    own filtered stream would have had: nothing missed, nothing more."""
    store, collection = manager.store, manager.store.collection
    with (
        collection.watch(queries.wakeups("h:"), max_await_time_ms=200) as wide,
        collection.watch(queries.wakeups("h:1:"), max_await_time_ms=200) as narrow,
    ):
        # Freed with nobody in line: every process hears of it.
        mine = store.acquire("free", "h:1:a", 30)
        assert store.release("free", "h:1:a", mine.token)
        # Handed to one of ours, then from it to another process's waiter.
        held = store.acquire("handed", "h:2:a", 30)
        store.acquire("handed", "h:1:b", 30, queue=True)
        store.acquire("handed", "h:2:c", 30, queue=True)
        assert store.release("handed", "h:2:a", held.token, contended=True)
        ours = store.find("handed")
        assert ours is not None
        assert ours.owner == "h:1:b"
        assert store.release("handed", "h:1:b", ours.token, contended=True)
        # Handed between two other processes, with one of ours next in line.
        held = store.acquire("next", "h:2:x", 30)
        store.acquire("next", "h:2:y", 30, queue=True)
        store.acquire("next", "h:1:z", 30, queue=True)
        assert store.release("next", "h:2:x", held.token, contended=True)
        # Handed between two other processes, nobody of ours in line.
        held = store.acquire("theirs", "h:2:p", 30)
        store.acquire("theirs", "h:2:q", 30, queue=True)
        assert store.release("theirs", "h:2:p", held.token, contended=True)
        # A shared lease ended: the owner field is not in the update.
        reader = store.acquire("read", "h:2:s", 30, shared=True)
        store.acquire("read", "h:2:t", 30, shared=True)
        assert store.release("read", "h:2:s", reader.token, shared=True)
        closing = store.acquire("closing", "h:3:a", 30)
        assert store.release("closing", "h:3:a", closing.token)
        collection.delete_one({"_id": "closing"})
        wide_events, narrow_events = _events(wide, "closing"), _events(narrow, "closing")
    routed = [event[:2] for event in wide_events if queries.reaches(event[2], "h:1:")]
    assert routed == [event[:2] for event in narrow_events]
    # The premises: the wide stream had events the narrow one must not get, and the
    # narrow one got a handoff through its next-in-line field alone.
    assert len(wide_events) > len(narrow_events)
    assert any(key == "theirs" for _, key, _ in wide_events)
    assert not any(key == "theirs" for _, key, _ in narrow_events)
    assert any(key == "next" for _, key, _ in narrow_events)


def test_the_setting_makes_the_default_manager_share_its_stream(
    mongolock_settings: dict[str, Any],
) -> None:
    from django.test import override_settings

    from django_mongolock import conf

    assert conf.get_manager().shared_stream is False
    assert conf.get_manager()._connection._relay() is None
    with override_settings(MONGOLOCK={**mongolock_settings, "SHARED_STREAM": True}):
        manager = conf.get_manager()
        assert manager.shared_stream is True
        where = manager._connection._relay()
        assert where is not None
        assert f"/{os.geteuid()}/".encode() in where.address
        assert where.prefix == host_prefix(None)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_a_shared_stream_that_is_not_a_bool_is_refused(mongolock_url: str, value: Any) -> None:
    with pytest.raises(TypeError, match="shared_stream must be True or False"):
        LockManager(mongolock_url, shared_stream=value)


def test_a_manager_given_a_client_keeps_a_stream_of_its_own(manager: LockManager) -> None:
    """A relay is named after the URL: a given client's could be anything."""
    given = LockManager(client=manager.client, database=manager.database, shared_stream=True)
    try:
        assert given._connection._relay() is None
        given.watcher.ensure_running()
        until(streaming_as(given.watcher, "own"), 30, "the role")
    finally:
        given.close()


def test_a_waiter_with_ids_of_its_own_leaves_the_relay(
    shared: Callable[[], LockManager], manager: LockManager
) -> None:
    """Its handoffs could reach no relay (the leader's stream carries the host's ids only):
    its process streams every handoff on its own."""
    leading, following = shared(), shared()
    leading.watcher.ensure_running()
    until(streaming_as(leading.watcher, "leader"), 30, "the role")
    following.new_owner = lambda: f"custom-{time.monotonic_ns()}"  # type: ignore[method-assign]
    holder = manager.acquire("own-ids", ttl=30)
    out: list[Any] = []
    thread = _wait(following, "own-ids", out)
    until(streaming_as(following.watcher, "own"), 30, "the role")
    until(lambda: len(following.waiters) == 1, 30, "the waiter in line")
    assert holder.release()
    thread.join(20)
    assert out, "the waiter with ids of its own was not woken"
    assert out[0][0].owner.startswith("custom-")
