"""The fault injector itself: each mode of :class:`TcpProxy` does to a real client what it says.

The network fault tests pass only if their faults happen; these checks make sure they do.
"""

from __future__ import annotations

import contextlib
import gc
import socket
import time
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
from pymongo import MongoClient
from pymongo.errors import PyMongoError

from django_mongolock.testing import MongoReplicaSet
from tests.reliability.conftest import SLACK
from tests.reliability.proxy import TcpProxy, command_of

TIMEOUT = 1.5


@pytest.fixture
def through(proxy: TcpProxy) -> Iterator[MongoClient[dict[str, Any]]]:
    """A client through the proxy, every call bounded by ``TIMEOUT``; the proxy passes after."""
    ms = round(TIMEOUT * 1000)
    client: MongoClient[dict[str, Any]] = MongoClient(
        proxy.direct_url, serverSelectionTimeoutMS=ms, connectTimeoutMS=ms, timeoutMS=ms
    )
    try:
        client.admin.command("ping")
        yield client
    finally:
        proxy.set_mode("pass")
        proxy.disarm()
        client.close()


def timed_failure(client: MongoClient[dict[str, Any]], **doc: Any) -> float:
    """Seconds until an insert through ``client`` fails (it must fail)."""
    sent = time.monotonic()
    with pytest.raises(PyMongoError):
        client.proxytest.docs.insert_one(doc)
    return time.monotonic() - sent


def recovers(client: MongoClient[dict[str, Any]], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.admin.command("ping")
            return
        except PyMongoError:
            assert time.monotonic() < deadline, "no answer through the proxy after it healed"
            time.sleep(0.1)


def test_drop_makes_calls_wait_for_their_timeout_and_pass_heals(
    proxy: TcpProxy, through: MongoClient[dict[str, Any]]
) -> None:
    proxy.set_mode("drop")
    took = timed_failure(through, _id=uuid.uuid4().hex)
    assert TIMEOUT - 0.1 <= took <= TIMEOUT + SLACK
    proxy.set_mode("pass")
    recovers(through)


def test_reset_fails_calls_at_once(proxy: TcpProxy, through: MongoClient[dict[str, Any]]) -> None:
    proxy.set_mode("reset")
    assert timed_failure(through, _id=uuid.uuid4().hex) <= TIMEOUT + SLACK
    assert proxy.connections >= 2  # the reset one, and at least one new attempt refused
    proxy.set_mode("pass")
    recovers(through)


def test_half_open_applies_requests_whose_replies_never_come(
    proxy: TcpProxy, through: MongoClient[dict[str, Any]], lone: MongoReplicaSet
) -> None:
    marker = uuid.uuid4().hex
    proxy.set_mode("half-open")
    timed_failure(through, _id=marker)
    proxy.set_mode("pass")
    direct: MongoClient[dict[str, Any]]
    with MongoClient(lone.url, serverSelectionTimeoutMS=10000) as direct:
        assert direct.proxytest.docs.find_one({"_id": marker}) == {"_id": marker}


def test_delay_holds_every_chunk_back(
    proxy: TcpProxy, through: MongoClient[dict[str, Any]]
) -> None:
    proxy.set_mode("delay", 0.4)
    sent = time.monotonic()
    through.admin.command("ping")
    assert time.monotonic() - sent >= 0.8  # there and back
    proxy.set_mode("delay", 1.0)
    timed_failure(through, _id=uuid.uuid4().hex)  # 2 s there and back: past the timeout


def test_hold_next_applies_a_request_after_its_client_gave_up_on_it(
    proxy: TcpProxy, through: MongoClient[dict[str, Any]], lone: MongoReplicaSet
) -> None:
    """The held request reaches the server only when let go, after the client's call
    timed out and closed its connection, and the server applies it then."""
    marker = uuid.uuid4().hex
    proxy.hold_next(marker.encode())
    timed_failure(through, _id=marker)  # the client closes the connection
    assert proxy.held.is_set()
    direct: MongoClient[dict[str, Any]]
    with MongoClient(lone.url, serverSelectionTimeoutMS=10000) as direct:
        assert direct.proxytest.docs.find_one({"_id": marker}) is None
        through.admin.command("ping")  # other requests pass meanwhile
        proxy.let_go()
        assert proxy.answered.wait(10)
        assert command_of(proxy.request)["insert"] == "docs"
        assert command_of(bytes(proxy.reply))["n"] == 1
        assert direct.proxytest.docs.find_one({"_id": marker}) == {"_id": marker}


def test_isolate_black_holes_one_origin_only(lone: MongoReplicaSet) -> None:
    node = lone.nodes[0]
    with TcpProxy((node.host, node.port), classify=lambda port, own: "me") as proxy:
        ms = round(TIMEOUT * 1000)
        client: MongoClient[dict[str, Any]]
        with MongoClient(
            proxy.direct_url, serverSelectionTimeoutMS=ms, connectTimeoutMS=ms, timeoutMS=ms
        ) as client:
            client.admin.command("ping")
            proxy.isolate({"someone else"})
            client.admin.command("ping")
            proxy.isolate({"me"})
            timed_failure(client, _id=uuid.uuid4().hex)
            proxy.isolate(())
            recovers(client)


def test_stopping_resets_a_connection_still_connecting_to_the_target() -> None:
    """A client connected while the proxy's own connection to the target is still being
    made (here a target whose backlog is full, so the connect hangs) is reset when the
    proxy stops: the stop is not held up, and no transport is left for the garbage
    collector to find open."""
    with contextlib.ExitStack() as stack:
        full = stack.enter_context(socket.socket())
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        # Connections nobody accepts fill the backlog: the next SYN goes unanswered.
        for _ in range(3):
            filler = stack.enter_context(socket.socket())
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(full.getsockname())
        time.sleep(0.2)
        proxy = TcpProxy(full.getsockname(), name="stuck").start()
        stack.callback(proxy.stop)  # a second stop does nothing
        client = stack.enter_context(socket.create_connection(("127.0.0.1", proxy.port)))
        client.settimeout(10)
        deadline = time.monotonic() + 10
        while not proxy.pending:  # accepted, its connection to the target pending
            assert time.monotonic() < deadline, "the proxy never accepted the client"
            time.sleep(0.01)
        time.sleep(0.2)
        assert proxy.pending, "the connection to the target did not hang"
        gc.collect()  # what earlier tests left is not this test's to judge
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            proxy.stop()
            gc.collect()
        assert proxy.connections == 1
        assert proxy.forwarded == 0
        with contextlib.suppress(ConnectionResetError):
            assert client.recv(1) == b""
        left = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
        assert not left, left
