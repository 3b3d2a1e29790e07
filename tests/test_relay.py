"""One change stream per host: processes that lead, follow, and fall back (``relay``)."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import bson
import pytest

from django_mongolock import LockManager, queries, relay
from django_mongolock import watcher as watching
from django_mongolock.owners import host_prefix
from tests.waiting import count_attempts, in_line, lead_and_follow, streaming_as, until


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
    assert following.watcher.opened == 1  # it followed first, then opened its own


class _FakeLeader:
    """A process of the same user that holds the relay's name and says what it likes."""

    def __init__(self, where: relay.Place) -> None:
        listener = relay.bind(where)
        assert listener is not None, "the relay's name is taken"
        self._listener = listener
        self._conn: socket.socket | None = None
        self._stop = threading.Event()
        self._sending = threading.Lock()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self._listener.setblocking(True)
        self._listener.settimeout(30)
        conn, _ = self._listener.accept()
        conn.settimeout(5)
        hello = conn.recv(4096)
        assert bson.decode(hello)["t"] == "hello"
        self._conn = conn
        while not self._stop.is_set():
            with self._sending:
                conn.sendall(bson.encode({"t": "h", "ok": True}))
            self._stop.wait(0.5)

    def send(self, change: dict[str, Any]) -> None:
        until(lambda: self._conn is not None, 30, "the follower's hello")
        assert self._conn is not None
        with self._sending:
            self._conn.sendall(bson.encode({"t": "e", "c": change}))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        if self._conn is not None:
            self._conn.close()
        self._listener.close()


def _handoff(key: str, owner: str, token: int) -> dict[str, Any]:
    now = datetime.now(UTC)
    fields = {
        "owner": owner,
        "token": token,
        "acquired_at": now,
        "expires_at": now + timedelta(seconds=30),
        "released_at": now,
    }
    return {
        "operationType": "update",
        "documentKey": {"_id": key},
        "updateDescription": {"updatedFields": fields},
    }


def test_a_forged_handoff_gives_no_lock_and_a_true_one_is_confirmed(
    shared: Callable[[], LockManager], manager: LockManager
) -> None:
    """A same-user process that holds the relay's name cannot make a waiter believe it
    holds a lock: a relayed handoff counts only once the lock's document says so."""
    following = shared()
    where = following._connection._relay()
    assert where is not None
    fake = _FakeLeader(where)
    try:
        following.watcher.ensure_running()
        until(streaming_as(following.watcher, "follower"), 30, "following the fake leader")
        holder = manager.acquire("forged", ttl=30)
        out: list[Any] = []
        thread = _wait(following, "forged", out)
        in_line(manager, "forged", 1)
        doc = manager.store.collection.find_one({"_id": "forged"})
        assert doc is not None
        first = doc["waiters"][0]["owner"]

        attempts = count_attempts(following)
        fake.send(_handoff("forged", first, holder.token + 10**9))

        # The document names another holder: the waiter takes the event for a wake-up,
        # tries (the key is busy), and holds nothing.
        until(lambda: attempts, 30, "an attempt after the forged handoff")
        assert not out
        found = manager.store.find("forged")
        assert found is not None
        assert found.owner == holder.owner

        # A true handoff, relayed: the document confirms it and the waiter holds the lock
        # without an attempt of its own.
        assert holder.release()
        handed = manager.store.find("forged")
        assert handed is not None
        assert handed.owner == first
        tried = len(attempts)
        fake.send(_handoff("forged", handed.owner, handed.token))
        thread.join(20)
        assert out, "the waiter did not take the lock handed to it"
        lock = out[0][0]
        assert lock.token == handed.token
        assert len(attempts) == tried
    finally:
        fake.close()


def test_a_process_that_joins_a_leader_late_looks_again_rather_than_trust_the_gap(
    shared: Callable[[], LockManager], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its own stream stopped before the leader took it in: what came in between reached
    neither, so its waiters look again and its stream counts from the leader's hello."""
    monkeypatch.setattr(watching, "RELAY_RETRY", 1.0)
    leading = shared()
    leading.watcher.ensure_running()
    until(streaming_as(leading.watcher, "leader"), 30, "leading")
    real = relay.Follower.join
    answering = threading.Event()

    def late(*args: Any) -> relay.Follower | None:
        return real(*args) if answering.is_set() else None

    monkeypatch.setattr(relay.Follower, "join", late)
    joining = shared()
    joining.watcher.ensure_running()
    until(streaming_as(joining.watcher, "own"), 30, "a stream of its own first")
    own_since = joining.watcher.healthy_since()
    assert own_since is not None
    woken: list[int] = []
    joining.waiters.notify_all = lambda: woken.append(1)  # type: ignore[method-assign]
    answering.set()
    until(streaming_as(joining.watcher, "follower"), 30, "following the leader")
    since = joining.watcher.healthy_since()
    assert since is not None
    assert since > own_since
    assert woken


def test_a_coroutine_takes_a_relayed_handoff_once_the_document_confirms_it(
    shared: Callable[[], LockManager], manager: LockManager
) -> None:
    _, following = lead_and_follow(shared)
    holder = manager.acquire("async-relayed", ttl=30)
    confirmed: list[Any] = []

    async def wait() -> Any:
        store = await following.astore()
        real = store.find

        async def find(key: str) -> Any:
            found = await real(key)
            confirmed.append(found)
            return found

        store.find = find  # type: ignore[method-assign]
        return await following.aacquire("async-relayed", timeout=30)

    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(asyncio.run(wait())))
    thread.start()
    in_line(manager, "async-relayed", 1)
    assert holder.release()
    thread.join(30)
    assert out, "the coroutine did not take the lock"
    lock = out[0]
    assert lock.token > holder.token
    # It learnt of the handoff from its leader, and read the document to be sure.
    assert [found.token for found in confirmed] == [lock.token]
    assert lock.release()
