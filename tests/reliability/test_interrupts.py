"""A process stopped with Ctrl-C while its acquire's attempt is still on its way.

The attempt is held on its way to the server (``TcpProxy.hold_next``) while the process
is interrupted, gives up and ends; then the server gets it, on a connection that is
still open, as a request already past a middlebox with connections of its own to the
server (``mongos`` forwarding to a shard) does. It must change nothing: not take the
key for a process that no longer exists, nor a place in line that a release would hand
the key to, nor touch another holder's lease.

(mongod itself ends a command whose client has gone when the command next checks for
an interrupt. A fail point that holds the command on the server is such a check, so it
does not show the race; a command past its last check still writes.)
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from typing import Any, Literal

import bson
import pytest

from django_mongolock import LockManager, queries
from django_mongolock.testing import MongoReplicaSet
from tests.reliability.conftest import Spawn, agent_config
from tests.reliability.proxy import TcpProxy, command_of

BOUND = 30.0


@pytest.fixture
def database_set(lone: MongoReplicaSet) -> MongoReplicaSet:
    return lone


@pytest.fixture
def holding(proxy: TcpProxy) -> Iterator[TcpProxy]:
    """The module's proxy, holding nothing once the test is over."""
    try:
        yield proxy
    finally:
        proxy.disarm()


def _pipeline(queue: bool) -> list[Any]:
    """The update pipeline of an exclusive acquire, as the server decodes it."""
    op = queries.acquire("anyone", 30.0, queue=queue)
    return list(bson.decode(bson.encode({"u": op.pipeline}))["u"])


@pytest.mark.parametrize("api", ["acquire", "aacquire"])
@pytest.mark.parametrize("taken", [False, True], ids=["free-key", "key-held-by-another"])
def test_a_process_interrupted_mid_attempt_leaves_the_key_as_it_found_it(
    lone: MongoReplicaSet,
    holding: TcpProxy,
    database: str,
    spawn: Spawn,
    taken: bool,
    api: Literal["acquire", "aacquire"],
) -> None:
    """A free key is free for others as soon as the process ended, and stays so; a key
    another process holds stays its own, and its release does not hand the key to the
    process that is gone.

    With a key held by another, the agent first learns that the key is busy, so that
    its held attempt is one that asks for a place in line. ``aacquire`` runs in
    ``asyncio.run``, whose task Ctrl-C cancels: the cancelled acquire waits for its
    attempt until that times out, then gives up.
    """
    key = f"stopped-{'taken' if taken else 'free'}"
    observer = LockManager(lone.url, database=database)
    try:
        documents = observer.store.collection
        holder = observer.acquire(key, ttl=60, refresh=False) if taken else None
        config = {**agent_config(lone, database), "url": holding.direct_url}
        agent = spawn("rpc", config, name="stopped")
        agent.event("ready", BOUND)
        if taken:
            busy = agent.call("acquire", name="probe", key=key, timeout=0.3)
            assert busy["error"] == "LockNotAcquired", busy
        before = documents.find_one({"_id": key}) or {}

        holding.hold_next(b"findAndModify", key.encode())
        agent.send(api, name="job", key=key, timeout=60)
        assert holding.held.wait(BOUND), "the attempt never reached the proxy"
        attempt = command_of(holding.request)
        assert attempt["findAndModify"] == "locks", attempt
        assert attempt["update"] == _pipeline(queue=taken)  # a key found busy: in line
        agent.kill(signal.SIGINT)
        try:
            code = agent.process.wait(BOUND)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the agent did not end:\n{agent.stderr()}") from None

        # The process ended on the interrupt, having given up: its owner is named ended.
        assert agent.event("crash", BOUND)["error"] == "KeyboardInterrupt"
        assert code == -signal.SIGINT, (code, agent.stderr())
        given_up = documents.find_one({"_id": key})
        assert given_up is not None
        stopped = [owner for owner in given_up["ended"] if owner not in before.get("ended", [])]
        assert stopped == [attempt["let"]["me"]["$literal"]], given_up
        assert given_up.get("waiters", []) == before.get("waiters", []), given_up
        if holder is None:  # free at once for others
            status = observer.status(key)
            assert status is None or not status.live, status

        # The server gets the attempt now, and runs it: it changes nothing.
        holding.let_go()
        assert holding.answered.wait(BOUND), "the server never answered the held attempt"
        reply = command_of(bytes(holding.reply))
        assert reply["ok"] == 1, reply
        assert reply["lastErrorObject"]["updatedExisting"] is True, reply
        assert documents.find_one({"_id": key}) == given_up

        if holder is not None:
            assert (given_up["owner"], given_up["token"]) == (holder.owner, holder.token)
            assert given_up["expires_at"] == before["expires_at"]
            assert holder.release()  # the key is not handed to the process that is gone
        after = observer.acquire(key, ttl=30, blocking=False)
        assert after.token > (holder.token if holder is not None else 0)
        assert after.release()
    finally:
        observer.close()
