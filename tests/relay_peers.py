"""Peers of the relay made by hand: a follower's side of the handshake, and a process of
the same user that holds the relay's name and says what it likes (``FakeLeader``)."""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

import bson

from django_mongolock import clock, relay
from tests.waiting import until


def hello(nonce: bytes, prefix: str = "x:") -> bytes:
    """A follower's hello."""
    return bson.encode({"t": "hello", "prefix": prefix, "nonce": nonce})


def receive(sock: socket.socket, size: int) -> bytes:
    """Exactly ``size`` bytes from ``sock`` (its timeout bounds each read)."""
    data = b""
    while len(data) < size:
        more = sock.recv(size - len(data))
        assert more, f"closed after {len(data)} of {size} bytes"
        data += more
    return data


def frame_of(sock: socket.socket, sealed: bool = False) -> bytes:
    """One frame from ``sock``, with its HMAC if ``sealed``."""
    head = receive(sock, 4)
    size = int.from_bytes(head, "little")
    return head + receive(sock, size - 4 + (relay.MAC_BYTES if sealed else 0))


def join(address: bytes, secret: bytes, prefix: str = "x:") -> tuple[socket.socket, bytes]:
    """Follow the leader at ``address`` by hand: the connected socket and the key of the
    HMACs of its frames, once the leader's first sealed frame came and was checked."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(address)
    ours = os.urandom(relay.NONCE_BYTES)
    sock.sendall(hello(ours, prefix))
    answer = bson.decode(frame_of(sock))
    assert answer["t"] == "a"
    connection = (address, ours, answer["nonce"], prefix)
    assert answer["proof"] == relay.proof("leader", secret, *connection)
    said = relay.proof("follower", secret, *connection)
    sock.sendall(bson.encode({"t": "proof", "proof": said}))
    key = relay.session_key(secret, *connection)
    first = frame_of(sock, sealed=True)
    assert first == relay.seal(key, 0, first[: -relay.MAC_BYTES])
    assert bson.decode(first[: -relay.MAC_BYTES])["t"] == "h"
    return sock, key


class FakeLeader:
    """A process of the same user that holds the relay's name: it answers each hello as a
    leader whose secret is ``secret`` (its proof made for ``address``, the follower's
    nonce and its prefix, unless told others), then beats and sends what it is told to.
    Its heartbeats say they were sent ``lag`` seconds before they were."""

    def __init__(
        self,
        where: relay.Place,
        secret: bytes,
        *,
        address: bytes | None = None,
        nonce: bytes | None = None,
        prefix: str | None = None,
    ) -> None:
        listener = relay.bind(where)
        assert listener is not None, "the relay's name is taken"
        self._listener = listener
        self._address = where.address if address is None else address
        self._nonce = nonce
        self._prefix = prefix
        self._secret = secret
        self._conn: socket.socket | None = None
        self._key = b""
        self._sent = 0
        self.lag = 0.0
        # Every sealed frame it sent, on every connection: (its key, its number, it).
        self.sealed: list[tuple[bytes, int, bytes]] = []
        self.hellos = 0
        self.hung_up = 0
        self._stop = threading.Event()
        self._sending = threading.Lock()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self._listener.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                self._beat()
                continue
            self._greet(conn)

    def _greet(self, conn: socket.socket) -> None:
        conn.settimeout(5)
        hello = bson.decode(frame_of(conn))
        theirs, prefix = hello["nonce"], hello["prefix"]
        self.hellos += 1
        ours = os.urandom(relay.NONCE_BYTES)
        proved = self._nonce or theirs
        said = relay.proof(
            "leader", self._secret, self._address, proved, ours, self._prefix or prefix
        )
        conn.sendall(bson.encode({"t": "a", "nonce": ours, "proof": said}))
        # The follower's proof, or its hang-up when the answer did not prove anything.
        if not conn.recv(4096):
            self.hung_up += 1
            conn.close()
            return
        with self._sending:
            if self._conn is not None:
                self._conn.close()
            self._conn = conn
            self._key = relay.session_key(self._secret, self._address, theirs, ours, prefix)
            self._sent = 0
        self._beat()

    def _beat(self) -> None:
        self._send({"t": "h", "ok": True, "at": clock.now() - self.lag})

    def _send(self, message: dict[str, Any]) -> None:
        with self._sending:
            if self._conn is None:
                return
            try:
                sealed = relay.seal(self._key, self._sent, bson.encode(message))
                self.sealed.append((self._key, self._sent, sealed))
                self._conn.sendall(sealed)
                self._sent += 1
            except OSError:  # the follower hung up
                self.hung_up += 1
                self._conn.close()
                self._conn = None

    def send(self, change: dict[str, Any]) -> None:
        """Relay ``change`` to the follower, sealed as a leader's frame."""
        until(lambda: self._conn is not None, 30, "a follower")
        self._send({"t": "e", "c": change})
        assert self._conn is not None, "the follower hung up"

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        if self._conn is not None:
            self._conn.close()
        self._listener.close()


def drained(sock: socket.socket, timeout: float) -> int:
    """Read ``sock`` until its peer closes it (bounded); how many bytes it had."""
    total = 0
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"the connection did not end within {timeout:g} s"
        sock.settimeout(left)
        try:
            data = sock.recv(65536)
        except TimeoutError:
            continue  # the assertion above says so
        if not data:
            return total
        total += len(data)
