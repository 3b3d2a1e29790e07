"""One change stream per host: processes that lead, follow, and fall back (``relay``)."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

import bson
import pytest

from django_mongolock import LockManager, queries, relay
from django_mongolock import watcher as watching
from django_mongolock.exceptions import MongoLockError
from django_mongolock.owners import host_prefix
from tests.waiting import Wait, count_attempts, in_line, lead_and_follow, streaming_as, until


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
    Wait(manager, following, "relayed").woken_by_release("follower")
    assert following.watcher.opened == 0


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
    leading, following = lead_and_follow(shared)
    following.new_owner = lambda: f"custom-{time.monotonic_ns()}"  # type: ignore[method-assign]
    wait = Wait(manager, following, "own-ids")
    until(streaming_as(following.watcher, "own"), 30, "the role")
    lock = wait.woken_by_release("own")
    assert lock.owner.startswith("custom-")
    assert following.watcher.opened == 1  # it followed first, then opened its own
    assert leading.watcher.role == "leader"


class _FakeLeader:
    """A process of the same user that holds the relay's name: it answers each hello
    with a proof made with ``secret``, beats, and sends what it is told to."""

    def __init__(self, where: relay.Place, secret: bytes) -> None:
        listener = relay.bind(where)
        assert listener is not None, "the relay's name is taken"
        self._listener = listener
        self._where = where
        self._secret = secret
        self._conn: socket.socket | None = None
        self.hellos = 0
        self.hung_up = 0
        self._stop = threading.Event()
        self._sending = threading.Lock()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self._listener.setblocking(True)
        self._listener.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                self._send({"t": "h", "ok": True})  # a heartbeat
                continue
            conn.settimeout(5)
            hello = bson.decode(conn.recv(4096))
            proof = relay.proof(self._secret, self._where.address, hello["nonce"])
            conn.sendall(bson.encode({"t": "h", "ok": True, "proof": proof}))
            self.hellos += 1
            # A follower says nothing after its hello: what comes now is its hang-up.
            conn.settimeout(0.5)
            try:
                hung_up = conn.recv(1) == b""
            except TimeoutError:
                hung_up = False
            if hung_up:
                self.hung_up += 1
                conn.close()
                continue
            with self._sending:
                if self._conn is not None:
                    self._conn.close()
                self._conn = conn

    def _send(self, message: dict[str, Any]) -> None:
        with self._sending:
            if self._conn is None:
                return
            try:
                self._conn.sendall(bson.encode(message))
            except OSError:  # the follower hung up
                self.hung_up += 1
                self._conn.close()
                self._conn = None

    def send(self, change: dict[str, Any]) -> None:
        until(lambda: self._conn is not None, 30, "a follower")
        self._send({"t": "e", "c": change})
        assert self._conn is not None, "the follower hung up"

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


def test_a_leader_that_does_not_know_the_relay_secret_is_not_followed(
    shared: Callable[[], LockManager],
    manager: LockManager,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A same-user process that holds the relay's name but cannot read the lock database
    cannot prove it leads: nobody follows it, so it can hand nobody a lock."""
    monkeypatch.setattr(watching, "RELAY_RETRY", 60.0)  # no second round in the test
    following = shared()
    where = following._connection._relay()
    assert where is not None
    fake = _FakeLeader(where, os.urandom(32))
    try:
        wait = Wait(manager, following, "unproven")
        until(streaming_as(following.watcher, "own"), 30, "a stream of its own")
        # Each of its tries to follow ended at the answer, before a word was relayed.
        until(lambda: fake.hung_up == watching.JOIN_TRIES, 10, "the follower hanging up")
        assert fake.hellos == watching.JOIN_TRIES
        assert following.watcher.leader is None
        assert following.watcher._alone is False  # it tries again later
        assert any("did not prove" in r.getMessage() for r in caplog.records)
        wait.woken_by_release("own")
        assert fake.hellos == fake.hung_up == watching.JOIN_TRIES
    finally:
        fake.close()


def test_a_leader_that_proves_it_knows_the_secret_is_believed(
    shared: Callable[[], LockManager], manager: LockManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The proof is what a follower trusts: a handoff its leader relays is the lock, taken
    without an attempt or a read of its own (as from its own stream)."""
    monkeypatch.setattr(relay, "SILENCE", 30.0)
    following = shared()
    where = following._connection._relay()
    assert where is not None
    fake = _FakeLeader(where, manager.store.relay_secret())
    try:
        following.watcher.ensure_running()
        until(streaming_as(following.watcher, "follower"), 30, "following")
        holder = manager.acquire("proven", ttl=30)
        out: list[Any] = []
        thread = _wait(following, "proven", out)
        in_line(manager, "proven", 1)
        attempts = count_attempts(following)
        assert holder.release()
        handed = manager.store.find("proven")
        assert handed is not None
        fake.send(_handoff("proven", handed.owner, handed.token))
        thread.join(20)
        assert out, "the waiter did not take the lock handed to it"
        assert out[0][0].token == handed.token
        assert out[0][0].owner == handed.owner
        assert attempts == []
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


def test_a_coroutine_is_handed_a_lock_through_the_relay_without_an_attempt(
    shared: Callable[[], LockManager], manager: LockManager
) -> None:
    _, following = lead_and_follow(shared)
    holder = manager.acquire("async-relayed", ttl=30)
    attempts: list[float] = []

    async def wait() -> Any:
        store = await following.astore()
        real = store.acquire

        async def acquire(*args: Any, **kwargs: Any) -> Any:
            attempts.append(time.monotonic())
            return await real(*args, **kwargs)

        store.acquire = acquire  # type: ignore[method-assign]
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
    # It joined the line with one attempt, and learnt of the handoff from its leader.
    assert len(attempts) == 1
    assert lock.release()


def test_a_follower_whose_secret_was_made_anew_reads_it_again_and_follows(
    shared: Callable[[], LockManager], manager: LockManager
) -> None:
    """Its secret was read before the relay's document was deleted and made anew: the
    leader's proof fails with it, so it reads the secret again, and follows."""
    leading = shared()
    leading.watcher.ensure_running()
    until(streaming_as(leading.watcher, "leader"), 30, "leading")
    joining = shared()
    joining.watcher._secret = os.urandom(32)  # the one of before
    joining.watcher.ensure_running()
    until(streaming_as(joining.watcher, "follower"), 30, "following")
    assert joining.watcher._secret == manager.store.relay_secret()
    assert joining.watcher.opened == 0


def test_every_process_reads_the_one_relay_secret(manager: LockManager) -> None:
    """Made by whoever comes first, the same for all who race to make it."""
    with ThreadPoolExecutor(8) as pool:
        found = set(pool.map(lambda _: manager.store.relay_secret(), range(32)))
    assert len(found) == 1
    (secret,) = found
    assert len(secret) == 32
    assert manager.store.relay.count_documents({}) == 1


def test_a_relay_secret_that_is_not_one_is_refused_and_the_process_streams_alone(
    shared: Callable[[], LockManager], manager: LockManager
) -> None:
    manager.store.relay.insert_one({"_id": "secret", "secret": "guessable"})
    with pytest.raises(MongoLockError, match="delete its document"):
        manager.store.relay_secret()
    alone = shared()
    wait = Wait(manager, alone, "no-secret")
    until(streaming_as(alone.watcher, "own"), 30, "a stream of its own")
    wait.woken_by_release("own")
    assert alone.watcher.leader is None
    assert alone.watcher._secret is None
