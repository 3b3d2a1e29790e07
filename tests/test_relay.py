"""One change stream per host: processes that lead, follow, and fall back (``relay``)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import bson
import pytest

from django_mongolock import LockManager, clock, queries, relay
from django_mongolock import watcher as watching
from django_mongolock.exceptions import MongoLockError
from django_mongolock.owners import host_prefix
from tests.relay_peers import FakeLeader, drained, frame_of, hello, join
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
    fake = FakeLeader(where, os.urandom(32))
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
    fake = FakeLeader(where, manager.store.relay_secret())
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
    # It asked once without the line and joined it with a second request (the key was
    # not lately busy for this manager), then learnt of the handoff from its leader.
    assert len(attempts) == 2
    assert lock.release()


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
    assert alone.watcher._trouble == "secret"


@pytest.mark.parametrize("made_for", ["another address", "another nonce", "another prefix"])
def test_a_leaders_proof_counts_only_for_this_name_and_this_hello(
    manager: LockManager, made_for: str
) -> None:
    """The right secret is not enough: a proof made for another relay's name, for another
    hello (a replay), or for another prefix than the follower's is refused."""
    where = relay.place("mongodb://proof", manager.database, manager.collection, "x:")
    secret = manager.store.relay_secret()
    if made_for == "another address":
        fake = FakeLeader(where, secret, address=where.address + b"-other")
    elif made_for == "another nonce":
        fake = FakeLeader(where, secret, nonce=os.urandom(relay.NONCE_BYTES))
    else:  # a process in between changed the hello's prefix (which handoffs it gets)
        fake = FakeLeader(where, secret, prefix="y:")
    codec = manager.store.collection.codec_options
    try:
        with pytest.raises(relay.Unproven):
            relay.Follower.join(where, "x:", codec, secret)
        until(lambda: fake.hung_up == 1, 10, "the follower hanging up")
    finally:
        fake.close()
    # The same fake, with its proof made for this name and hello, is followed.
    fake = FakeLeader(where, secret)
    try:
        joined = relay.Follower.join(where, "x:", codec, secret)
        assert joined is not None
        assert joined.healthy
        joined.close()
    finally:
        fake.close()


def _a_leader(
    shared: Callable[[], LockManager],
) -> tuple[LockManager, relay.Leader, relay.Place]:
    """A manager that leads (bounded), its side of the relay, and where that is."""
    leading = shared()
    leading.watcher.ensure_running()
    until(streaming_as(leading.watcher, "leader"), 30, "leading")
    leader = leading.watcher.leader
    assert leader is not None
    where = leading._connection._relay()
    assert where is not None
    return leading, leader, where


def _connected(where: relay.Place) -> socket.socket:
    """A connection to the relay at ``where``, made by hand."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(where.address)
    return sock


def test_a_leader_turns_away_a_follower_that_does_not_know_the_secret(
    shared: Callable[[], LockManager],
) -> None:
    leading, leader, where = _a_leader(shared)
    with _connected(where) as guessing:
        nonce = os.urandom(relay.NONCE_BYTES)
        guessing.sendall(hello(nonce))
        answer = bson.decode(frame_of(guessing))
        connection = (where.address, nonce, answer["nonce"], "x:")
        said = relay.proof("follower", os.urandom(32), *connection)
        guessing.sendall(bson.encode({"t": "proof", "proof": said}))
        # Closed, with nothing sent after the answer: no event, no word of health.
        assert guessing.recv(4096) == b""
    assert len(leader) == 0
    # One that knows it is taken in.
    sock, _ = join(where.address, leading.store.relay_secret())
    with sock:
        until(lambda: len(leader) == 1, 10, "the follower counted")


def _lost(follower: relay.Follower, timeout: float = 10.0) -> relay.RelayLost:
    """Read ``follower`` until it finds its leader lost (bounded); why."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            follower.read(0.2)
        except relay.RelayLost as exc:
            return exc
    raise AssertionError(f"the follower read on for {timeout:g} s")


def test_a_follower_leaves_a_connection_at_a_frame_its_leader_did_not_seal(
    manager: LockManager,
) -> None:
    """Frames carry an HMAC under the connection's key, and their number: a frame that is
    forged, or sent again, or one missing, ends the connection."""
    where = relay.place("mongodb://sealed", manager.database, manager.collection, "x:")
    secret = manager.store.relay_secret()
    codec = manager.store.collection.codec_options
    frame = bson.encode({"t": "h", "ok": True, "at": clock.now()})
    wrongs: dict[str, Callable[[bytes, int], bytes]] = {
        "forged": lambda key, next_: relay.seal(os.urandom(32), next_, frame),
        "sent again": lambda key, next_: relay.seal(key, next_ - 1, frame),
        "one missing": lambda key, next_: relay.seal(key, next_ + 1, frame),
    }
    for name, wrong in wrongs.items():
        fake = FakeLeader(where, secret)
        try:
            joined = relay.Follower.join(where, "x:", codec, secret)
            assert joined is not None, name
            with fake._sending:  # between two of the fake's heartbeats
                assert fake._conn is not None
                fake._conn.sendall(wrong(fake._key, fake._sent))
            assert "is not the leader's" in str(_lost(joined)), name
            joined.close()
        finally:
            fake.close()


def test_a_process_that_passes_a_true_leaders_handshake_on_cannot_forge_a_handoff(
    shared: Callable[[], LockManager],
    manager: LockManager,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A same-user process without the secret holds the relay's name when a follower
    joins, then lets a true leader take the name and passes the follower's hello to it,
    and its answers back: the follower follows, through it. It sends a handoff it forged
    to the follower's waiter: the follower leaves at that frame, its waiter holds nothing,
    and it is handed the lock by the true release later."""
    monkeypatch.setattr(relay, "HELLO_TIMEOUT", 20.0)  # time to pass the handshake on
    monkeypatch.setattr(relay, "SILENCE", 60.0)  # it passes on no heartbeat after the first
    caplog.set_level(logging.INFO, logger="django_mongolock.watcher")
    following = shared()
    where = following._connection._relay()
    assert where is not None
    squatter = relay.bind(where)
    assert squatter is not None
    squatter.setblocking(True)
    squatter.settimeout(30)
    following.watcher.ensure_running()
    victim, _ = squatter.accept()
    victim.settimeout(10)
    squatter.close()  # the name is free for a true leader
    leading = shared()
    leading.watcher.ensure_running()
    until(streaming_as(leading.watcher, "leader"), 30, "a true leader")
    with victim, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as passing:
        passing.settimeout(10)
        passing.connect(where.address)
        passing.sendall(frame_of(victim))  # the follower's hello
        victim.sendall(frame_of(passing))  # the leader's answer
        passing.sendall(frame_of(victim))  # the follower's proof
        victim.sendall(frame_of(passing, sealed=True))  # the leader's first sealed word
        until(streaming_as(following.watcher, "follower"), 30, "following through it")

        holder = manager.acquire("passed-on", ttl=30)
        out: list[Any] = []
        thread = _wait(following, "passed-on", out)
        in_line(manager, "passed-on", 1)
        doc = manager.store.collection.find_one({"_id": "passed-on"})
        assert doc is not None
        first = doc["waiters"][0]["owner"]
        token = holder.token + 10**12  # a token from minutes ahead
        forged = bson.encode({"t": "e", "c": _handoff("passed-on", first, token)})
        victim.sendall(relay.seal(os.urandom(32), 1, forged))
        # It leaves the connection at that frame, and holds nothing.
        drained(victim, 10)  # the follower hung up
        assert any("frame 1 is not the leader's" in r.getMessage() for r in caplog.records)
        assert not out
        found = manager.store.find("passed-on")
        assert found is not None
        assert found.owner == holder.owner
    # Handed the lock by the true release, with the server's token.
    assert holder.release()
    thread.join(30)
    assert out, "the waiter was not handed the lock"
    assert holder.token < out[0][0].token < token


def test_a_leader_whose_secret_was_made_anew_leads_again_with_the_new_one(
    shared: Callable[[], LockManager], manager: LockManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(watching, "RELAY_RETRY", 1.0)
    leading, following = lead_and_follow(shared)
    old = manager.store.relay_secret()
    manager.store.relay.delete_many({})
    new = manager.store.relay_secret()
    assert new != old
    # A process that read only the new secret follows, or leads: no stream of its own.
    joining = shared()
    joining.watcher.ensure_running()

    def on_the_new_secret() -> bool:
        """One leads with the new secret, and the others follow it (they proved it)."""
        managers = (leading, following, joining)
        leaders = [m.watcher.leader for m in managers if m.watcher.role == "leader"]
        roles = sorted(str(m.watcher.role) for m in managers)
        return (
            roles == ["follower", "follower", "leader"]
            and all(m.watcher.healthy for m in managers)
            and leaders[0] is not None
            and leaders[0].secret == new
        )

    until(on_the_new_secret, 30, "one leading with the new secret, two following it")
    assert joining.watcher.opened <= 1


def test_a_follower_leaves_a_leader_whose_heartbeats_come_late(manager: LockManager) -> None:
    """Bytes that keep coming are not enough: a heartbeat sent ``SILENCE`` seconds ago or
    more ends the connection, however recently it came (a process in between that holds
    the leader's frames back gains nothing by passing them on slowly)."""
    where = relay.place("mongodb://late", manager.database, manager.collection, "x:")
    secret = manager.store.relay_secret()
    fake = FakeLeader(where, secret)
    try:
        joined = relay.Follower.join(where, "x:", manager.store.collection.codec_options, secret)
        assert joined is not None
        fake.lag = relay.SILENCE + 1  # from now on, every 0.2 s
        started = time.monotonic()
        assert "no heartbeat sent in the last" in str(_lost(joined))
        # Counted from the last heartbeat on time (its frames kept coming all along).
        assert time.monotonic() - started < relay.SILENCE + 2
        joined.close()
    finally:
        fake.close()


def test_a_leaders_followers_hear_its_heartbeats_each_at_a_phase_of_its_own(
    shared: Callable[[], LockManager],
) -> None:
    """Each of 20 followers hears a heartbeat every ``HEARTBEAT``, but not all at once:
    in no tenth of a second do more than half of them (all at once, a leader would wake
    every waiting process of its host together each second)."""
    leading, leader, where = _a_leader(shared)
    secret = leading.store.relay_secret()
    count = 20
    with ThreadPoolExecutor(count) as pool:
        socks = [sock for sock, _ in pool.map(lambda _: join(where.address, secret), range(count))]
    heard: dict[int, list[float]] = {n: [] for n in range(count)}
    try:
        until(lambda: len(leader) == count, 10, "every follower counted")
        with selectors.DefaultSelector() as selector:
            for n, sock in enumerate(socks):
                selector.register(sock, selectors.EVENT_READ, n)
            end = time.monotonic() + 4 * relay.HEARTBEAT
            while (left := end - time.monotonic()) > 0:
                for ready, _ in selector.select(left):
                    frame = frame_of(cast(socket.socket, ready.fileobj), sealed=True)
                    if bson.decode(frame[: -relay.MAC_BYTES])["t"] == "h":
                        heard[ready.data].append(time.monotonic())
    finally:
        for sock in socks:
            sock.close()
    for times in heard.values():
        # Every beat, late by a pass of the leader's loop at most (``LEAD_AWAIT``).
        assert len(times) >= 3, heard
        gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
        assert max(gaps) < relay.HEARTBEAT + 0.5, gaps
    beats = sorted((t, n) for n, times in heard.items() for t in times)
    crowded = max(
        len({n for t, n in beats if start <= t < start + 0.1 * relay.HEARTBEAT})
        for start, _ in beats
    )
    assert crowded <= count // 2, beats


def test_a_leaders_proof_is_not_a_followers_and_a_sessions_frames_fit_no_other(
    shared: Callable[[], LockManager], manager: LockManager, caplog: pytest.LogCaptureFixture
) -> None:
    """The leader's proof sent back as the follower's is refused; a frame sealed for one
    connection is refused on another, at the same number; a proof made for one prefix
    does not count for another."""
    caplog.set_level(logging.INFO, logger="django_mongolock.relay")
    _, leader, where = _a_leader(shared)
    secret = manager.store.relay_secret()
    with _connected(where) as reflecting:
        nonce = os.urandom(relay.NONCE_BYTES)
        reflecting.sendall(hello(nonce, "y:"))
        answer = bson.decode(frame_of(reflecting))
        # The proof is bound to the prefix of the hello it answers.
        assert answer["proof"] == relay.proof(
            "leader", secret, where.address, nonce, answer["nonce"], "y:"
        )
        assert answer["proof"] != relay.proof(
            "leader", secret, where.address, nonce, answer["nonce"], "x:"
        )
        reflecting.sendall(bson.encode({"t": "proof", "proof": answer["proof"]}))
        drained(reflecting, 10)  # the leader hung up
    assert len(leader) == 0
    assert any("does not know the relay secret" in r.getMessage() for r in caplog.records)

    spliced = relay.place("mongodb://spliced", manager.database, manager.collection, "x:")
    fake = FakeLeader(spliced, secret)
    try:
        codec = manager.store.collection.codec_options
        first = relay.Follower.join(spliced, "x:", codec, secret)
        assert first is not None
        first.close()
        second = relay.Follower.join(spliced, "x:", codec, secret)
        assert second is not None
        old_key = fake.sealed[0][0]
        assert old_key != fake._key
        with fake._sending:  # no heartbeat of the fake's meanwhile
            assert fake._conn is not None
            due = fake._sent  # the number the follower reads next
            fake._conn.sendall(relay.seal(old_key, due, bson.encode({"t": "h", "ok": True})))
            assert f"frame {due} is not the leader's" in str(_lost(second))
        second.close()
    finally:
        fake.close()


@pytest.mark.parametrize("lag", [relay.FIRST_WORD_AGE + 1, -1.0], ids=["behind", "ahead"])
def test_a_leader_on_another_clock_is_not_followed(manager: LockManager, lag: float) -> None:
    """Heartbeats from a clock behind (another time namespace) would soon look silent,
    and from one ahead could never: such a leader is refused at the handshake, and one
    whose clock jumps ahead later is left."""
    where = relay.place("mongodb://clock", manager.database, manager.collection, "x:")
    secret = manager.store.relay_secret()
    codec = manager.store.collection.codec_options
    fake = FakeLeader(where, secret)
    try:
        fake.lag = lag
        with pytest.raises(relay.Skewed):
            relay.Follower.join(where, "x:", codec, secret)
        fake.lag = 0.0
        joined = relay.Follower.join(where, "x:", codec, secret)
        assert joined is not None
        fake.lag = -5.0
        assert "ahead" in str(_lost(joined))
        joined.close()
    finally:
        fake.close()
