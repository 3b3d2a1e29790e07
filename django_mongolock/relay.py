"""One change stream per host: a lock collection's wake-ups passed on over a local socket.

Every waiting process opens a change stream, and the server evaluates every lock
write once per open stream: with hundreds of processes waiting on a host, that cost
dominates a release. With ``SHARED_STREAM`` the first process of a user on a host to
need the stream binds an abstract Unix socket named after the user and the lock
collection, and leads: its watcher opens the one stream, filtered by the host's holder
ids, and passes each event on to the processes connected to it that it concerns (a
freed key to all, a handoff to the processes of the new holder and of the next waiter
in line). The others follow: they connect, and read.

Trust: the name carries the effective uid, and each side checks the other's uid
(``SO_PEERCRED``): only a process of the same user may lead or follow. A name held by
another user is not joined: that process keeps a stream of its own. A process of the
same user is not yet a peer to trust: a follower takes handoffs from its leader as it
would from the server (it holds the lock, with the token it was told). So both sides
read a random secret kept next to the lock collection (``<collection>.relay``, made on
first use), and each proves it knows it: the follower's hello carries a fresh nonce and
the prefix of its holder ids, the leader answers with a nonce of its own and an HMAC of
all three under the secret, and the follower answers with its own HMAC (``proof``).
Every frame the leader sends after that carries an HMAC, under a key of that connection
(``session_key``), of the frame and its number: a process that passes a follower's nonce
on to a true leader, and its answer back, can then delay what it passes on or cut it,
but neither forge, change, drop nor reorder a frame without the follower noticing and
leaving it, nor change which handoffs the leader sends it. A process without the
database's credentials can read the secret no more than it can write a lock's document.
The frames are not encrypted: such a process can read what it passes on.

Health: a leader tells each follower whether its stream is open when it joins, at once
when that changes, and every ``HEARTBEAT`` seconds, each time with the time it sent it
(``clock.now()``, which the processes of a host share unless they run in time
namespaces of their own: a heartbeat from a clock ahead of the follower's ends the
connection, and one from a clock behind it by more than ``FIRST_WORD_AGE`` is refused
at the handshake). A follower counts the stream healthy from the moment it heard so
(events after that reach it), and gives up on a leader whose latest heartbeat was sent
``SILENCE`` seconds ago (stopped, stuck, or held back on its way; a follower too slow
to read it in time gives up the same way): its waiters then try again at once and back
off, as they do when any stream breaks, while the watcher leads or follows anew, or
opens a stream of its own. A follower that cannot keep up (``BACKLOG`` bytes behind) is
dropped, and falls back the same way.

Only Linux has abstract sockets; elsewhere every process keeps its own stream.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import math
import os
import re
import secrets
import socket
import struct
import sys
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import bson
from bson.codec_options import CodecOptions

from django_mongolock import clock
from django_mongolock.queries.changes import reaches

__all__ = [
    "HEARTBEAT",
    "MAC_BYTES",
    "NONCE_BYTES",
    "SILENCE",
    "Follower",
    "Foreign",
    "Leader",
    "Place",
    "RelayLost",
    "Skewed",
    "Unproven",
    "bind",
    "place",
    "proof",
    "seal",
    "session_key",
    "supported",
]

logger = logging.getLogger("django_mongolock.relay")

# How often a leader tells its followers it is alive (and whether its stream is open).
HEARTBEAT = 1.0
# The golden ratio's fractional part: consecutive multiples of it spread evenly over 1.
_GOLDEN = (math.sqrt(5) - 1) / 2
# A leader silent this long is taken for gone.
SILENCE = 3.0
# How long a follower waits for each of a leader's first two words, and a leader for
# each of a follower's (a leader reads them between two events, or two empty waits of
# its stream, ``watcher.LEAD_AWAIT``, or while its stream is down ``MAX_AWAIT``).
HELLO_TIMEOUT = 1.0
# No message of the relay comes near this; a longer frame means a broken peer.
MAX_FRAME = 1 << 20
# What a leader keeps for a follower its socket will not take yet (thousands of events,
# a TTL sweep's): past that, the follower is dropped.
BACKLOG = 4 << 20
# Connections a leader takes in between two events, at most, and that it has not taken
# in yet (a process that connects in a loop gets no more than that).
ADMIT_AT_ONCE = 64
MAX_NEWCOMERS = 256
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid
# Each side's nonce: fresh per connection, so that no answer can be replayed.
NONCE_BYTES = 16
# The HMAC after each sealed frame (SHA-256).
MAC_BYTES = 32

# Every relay socket of this process. A child forked while one is open closes its copies:
# a listener kept open by a child that never accepts would hold the name after its
# leader is gone, and followers would wait on it in vain.
_open: weakref.WeakSet[socket.socket] = weakref.WeakSet()


def _next_beat_after(now: float, phase: float) -> float:
    """The first time after ``now`` that lies a whole number of ``HEARTBEAT`` from
    ``phase``: a follower's beats keep their phase however late the loop comes round."""
    return now + HEARTBEAT - (now - phase) % HEARTBEAT


def _tracked(sock: socket.socket) -> socket.socket:
    _open.add(sock)
    return sock


def _close_inherited() -> None:
    for sock in list(_open):
        sock.close()


os.register_at_fork(after_in_child=_close_inherited)


def supported() -> bool:
    """Whether this system has abstract Unix sockets (Linux)."""
    return sys.platform.startswith("linux")


class Foreign(Exception):
    """The relay's name is held by a process of another user: never joined."""


class RelayLost(Exception):
    """The leader is gone, silent, or sent something unreadable."""


class Skewed(Exception):
    """The leader's clock is not this process's (another time namespace): its heartbeats
    cannot be timed."""


class Unproven(Exception):
    """The process at the relay's name could not prove it holds the relay secret."""


@dataclass(frozen=True, slots=True)
class Place:
    """Where the relay of one lock collection is found, and what its stream lets through.

    ``prefix`` is what the holder ids of every process on this host start with: the
    manager's ``OWNER``, else the host name (an ``OWNER`` shared by several hosts makes
    each leader's stream carry the handoffs of all of them, a cost, not a miss). The
    leader's stream carries the handoffs to all of them, and each follower gets those
    to its own.
    """

    address: bytes
    prefix: str


def place(url: str, database: str, collection: str, prefix: str) -> Place:
    """The relay of ``database.collection`` at ``url``, for this user and host prefix.

    Anyone on the host can list abstract socket names: the name holds a hash of the URL
    without its credentials (a fast hash of a password could be guessed offline).
    """
    where = _USERINFO.sub("//", url, count=1)
    digest = hashlib.sha256("\0".join((where, database, collection, prefix)).encode()).hexdigest()
    return Place(f"\0django-mongolock/{os.geteuid()}/{digest[:32]}".encode(), prefix)


# The ``user:password@`` of a MongoDB URL.
_USERINFO = re.compile(r"//[^/?#]*@")


def _peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
    return int(_CREDENTIALS.unpack(creds)[1])


def _mac(key: bytes, *parts: bytes) -> bytes:
    """An HMAC of ``parts``, each with its length: no two lists of parts read alike."""
    message = b"".join(len(part).to_bytes(4, "little") + part for part in parts)
    return hmac.digest(key, message, "sha256")


def proof(
    side: str, secret: bytes, address: bytes, follower: bytes, leader: bytes, prefix: str
) -> bytes:
    """The proof that the ``side`` ("leader" or "follower") of the connection at
    ``address``, with the ``follower``'s nonce and the ``leader``'s, knows ``secret``;
    ``prefix`` is the follower's, so that nobody in between can change which handoffs it
    is sent (each side's proof differs, so neither can be sent back as the other's)."""
    if side not in ("leader", "follower"):
        raise ValueError(f"side must be 'leader' or 'follower', not {side!r}")
    return _mac(
        secret, b"django-mongolock relay", side.encode(), address, follower, leader, prefix.encode()
    )


def session_key(
    secret: bytes, address: bytes, follower: bytes, leader: bytes, prefix: str
) -> bytes:
    """The key of the HMACs of one connection's frames (``seal``)."""
    parts = (address, follower, leader, prefix.encode())
    return _mac(secret, b"django-mongolock relay", b"session", *parts)


def seal(key: bytes, number: int, frame: bytes) -> bytes:
    """``frame``, the ``number``-th the leader sends on a connection, and its HMAC."""
    return frame + _frame_mac(key, number, frame)


def _frame_mac(key: bytes, number: int, frame: bytes) -> bytes:
    return _mac(key, number.to_bytes(8, "little"), frame)


def _frame(message: Mapping[str, Any]) -> bytes:
    return bson.encode(message)


class _Reader:
    """Splits a byte stream into BSON documents (each starts with its length); once
    ``sealed``, each is followed by its HMAC, checked in order (``seal``)."""

    __slots__ = ("_buffer", "_codec", "_key", "_number")

    def __init__(self, codec: CodecOptions[Any]) -> None:
        self._buffer = bytearray()
        self._codec = codec
        self._key: bytes | None = None
        self._number = 0

    def sealed(self, key: bytes) -> None:
        """Check the HMAC of every frame from now on."""
        self._key = key

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self._buffer += data
        messages = []
        mac = 0 if self._key is None else MAC_BYTES
        while len(self._buffer) >= 4:
            size = int.from_bytes(self._buffer[:4], "little")
            if not 5 <= size <= MAX_FRAME:
                raise RelayLost(f"unreadable frame of {size} bytes")
            if len(self._buffer) < size + mac:
                break
            frame = bytes(self._buffer[:size])
            if self._key is not None:
                told = bytes(self._buffer[size : size + mac])
                if not hmac.compare_digest(told, _frame_mac(self._key, self._number, frame)):
                    raise RelayLost(f"frame {self._number} is not the leader's")
                self._number += 1
            try:
                messages.append(bson.decode(frame, codec_options=self._codec))
            except (bson.errors.BSONError, ValueError) as exc:
                raise RelayLost(f"unreadable frame: {exc}") from exc
            del self._buffer[: size + mac]
        return messages


def _read_first(
    sock: socket.socket, reader: _Reader, timeout: float
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The first message on ``sock`` within ``timeout`` seconds, and any that came with it
    (a leader may send a heartbeat or an event right after its first word)."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            data = sock.recv(4096)
        except TimeoutError:
            break
        if not data:
            raise RelayLost("closed before its first message")
        messages = reader.feed(data)
        if messages:
            return messages[0], messages[1:]
    raise RelayLost(f"no first message within {timeout:g} s")


def bind(where: Place) -> socket.socket | None:
    """A listening socket at ``where``, or None if a process holds the name already."""
    sock = _tracked(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
    try:
        sock.bind(where.address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            return None
        raise
    sock.listen(256)
    sock.setblocking(False)
    return sock


@dataclass(slots=True)
class _Member:
    sock: socket.socket
    prefix: str
    key: bytes  # of the HMACs of what it is sent (``seal``)
    # When its next heartbeat is due (``time.monotonic``), at a phase of its own.
    due: float = 0.0
    # What the socket buffer would not take yet, sent before anything else.
    backlog: bytearray = field(default_factory=bytearray)
    sent: int = 0  # frames sealed for it so far

    def add(self, frame: bytes) -> None:
        self.backlog += seal(self.key, self.sent, frame)
        self.sent += 1


@dataclass(slots=True)
class _Newcomer:
    sock: socket.socket
    reader: _Reader
    until: float
    # Set by its hello: which handoffs are its, and the two nonces.
    prefix: str = ""
    theirs: bytes = b""
    ours: bytes = b""


class Leader:
    """The leading side: takes followers in, and passes the stream's events on.

    Used by the watcher thread only (no lock), between events; nothing here blocks it:
    a newcomer's hello is read when it has come, and what a follower's socket buffer
    will not take waits in its backlog, up to ``BACKLOG`` bytes.
    """

    def __init__(self, listener: socket.socket, where: Place, secret: bytes) -> None:
        self._listener = listener
        self._address = where.address
        self.secret = secret
        self.closed = False
        self._members: list[_Member] = []
        self._newcomers: list[_Newcomer] = []
        self._healthy = False
        self._next_beat = math.inf  # the earliest member's ``due``
        self._joined = 0
        self._origin = time.monotonic()  # of the members' phases
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._members)

    def admit(self) -> None:
        """Take in every follower that connected, said hello and proved it knows the
        secret; tell each whether the stream is open. A newcomer silent for
        ``HELLO_TIMEOUT`` at either step is turned away."""
        if self.closed:
            return
        for _ in range(ADMIT_AT_ONCE):
            try:
                sock = _tracked(self._listener.accept()[0])
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                logger.warning("relay: accept failed: %s", exc)
                break
            if _peer_uid(sock) != os.geteuid():
                logger.info("relay: a process of another user was turned away")
                sock.close()
                continue
            if len(self._newcomers) >= MAX_NEWCOMERS:
                logger.info("relay: %d connections in their handshake already", MAX_NEWCOMERS)
                sock.close()
                continue
            sock.setblocking(False)
            reader = _Reader(CodecOptions())
            self._newcomers.append(_Newcomer(sock, reader, time.monotonic() + HELLO_TIMEOUT))
        waiting = []
        for newcomer in self._newcomers:
            try:
                member = self._greet(newcomer)
            except (RelayLost, OSError) as exc:
                logger.info("relay: a follower was turned away: %s", exc)
                newcomer.sock.close()
                continue
            if member is None:
                waiting.append(newcomer)
            else:
                # Its heartbeats at a phase of its own, spread over HEARTBEAT by join
                # order (the golden ratio's steps) from one origin, whenever the
                # followers joined; the first within HEARTBEAT of its first word.
                self._joined += 1
                phase = self._origin + HEARTBEAT * ((self._joined * _GOLDEN) % 1.0)
                member.due = _next_beat_after(time.monotonic(), phase)
                self._next_beat = min(self._next_beat, member.due)
                self._members.append(member)
        self._newcomers = waiting

    def _greet(self, newcomer: _Newcomer) -> _Member | None:
        """The follower ``newcomer`` becomes once its hello came, was answered, and its
        proof came (None: not yet)."""
        if time.monotonic() > newcomer.until:
            raise RelayLost("no hello and proof in time")
        try:
            data = newcomer.sock.recv(4096)
        except BlockingIOError:
            return None
        if not data:
            raise RelayLost("closed before its proof")
        messages = newcomer.reader.feed(data)
        if len(messages) > 1:
            raise RelayLost("a follower spoke twice before it was answered")
        if not messages:
            return None
        if not newcomer.ours:
            self._answer(newcomer, messages[0])
            return None
        told = messages[0].get("proof")
        expected = proof("follower", self.secret, *self._connection(newcomer))
        if messages[0].get("t") != "proof" or not isinstance(told, bytes):
            raise RelayLost(f"not a follower's proof: {messages[0]!r:.200}")
        if not hmac.compare_digest(told, expected):
            raise RelayLost("a follower that does not know the relay secret")
        key = session_key(self.secret, *self._connection(newcomer))
        member = _Member(newcomer.sock, newcomer.prefix, key)
        # Its first sealed word: whether the stream is open (it counts on nothing before).
        member.add(self._health_frame())
        if not self._flush(member):
            raise RelayLost("its socket takes nothing")
        return member

    def _answer(self, newcomer: _Newcomer, hello: Mapping[str, Any]) -> None:
        """Answer a follower's hello with this leader's nonce and proof."""
        prefix, theirs = hello.get("prefix"), hello.get("nonce")
        if hello.get("t") != "hello" or not isinstance(prefix, str) or not prefix:
            raise RelayLost(f"not a follower's hello: {hello!r:.200}")
        if not isinstance(theirs, bytes) or len(theirs) != NONCE_BYTES:
            raise RelayLost("a follower's hello without its nonce")
        ours = secrets.token_bytes(NONCE_BYTES)
        newcomer.prefix, newcomer.theirs, newcomer.ours = prefix, theirs, ours
        newcomer.until = time.monotonic() + HELLO_TIMEOUT  # for its proof
        said = proof("leader", self.secret, *self._connection(newcomer))
        # A newcomer's socket buffer is empty: this small frame goes whole, at once.
        newcomer.sock.sendall(_frame({"t": "a", "nonce": ours, "proof": said}), socket.MSG_NOSIGNAL)

    def _connection(self, newcomer: _Newcomer) -> tuple[bytes, bytes, bytes, str]:
        """What a newcomer's proofs and session key are made for."""
        return self._address, newcomer.theirs, newcomer.ours, newcomer.prefix

    def _health_frame(self) -> bytes:
        return _frame({"t": "h", "ok": self._healthy, "at": clock.now()})

    def health(self, healthy: bool) -> None:
        """Tell every follower whether the stream is open (at once, when it changes)."""
        self._healthy = healthy
        frame = self._health_frame()
        self._send(lambda member: frame)

    def beat(self) -> None:
        """The heartbeat of each follower whose own is due, every ``HEARTBEAT`` at the
        phase it was given when it joined: all of them at once would wake every waiting
        process of the host together each second, a burst on its cores in the way of
        the handoffs."""
        now = time.monotonic()
        if now < self._next_beat:
            return
        frame = self._health_frame()

        def frame_for(member: _Member) -> bytes | None:
            if now < member.due:
                return None
            # The next one a whole number of beats on: its phase stays where it was.
            member.due = _next_beat_after(now, member.due)
            return frame

        self._send(frame_for)
        self._next_beat = min((member.due for member in self._members), default=math.inf)

    def pass_on(self, change: Mapping[str, Any]) -> None:
        """Send ``change`` to the followers it concerns (``queries.changes.reaches``)."""
        frame = _frame({"t": "e", "c": change})
        self._send(lambda member: frame if reaches(change, member.prefix) else None)

    def flush(self) -> None:
        """Send on what followers' sockets would not take before (between events)."""
        if any(member.backlog for member in self._members):
            self._send(lambda member: None)

    def _send(self, frame_for: Callable[[_Member], bytes | None]) -> None:
        kept = []
        for member in self._members:
            frame = frame_for(member)
            if frame is not None:
                member.add(frame)
            if member.backlog and not self._flush(member):
                # Gone, or so far behind that its waiters are better off on their own.
                self.dropped += 1
                logger.info("relay: a follower %r was dropped", member.prefix)
                member.sock.close()
                continue
            kept.append(member)
        self._members = kept

    @staticmethod
    def _flush(member: _Member) -> bool:
        """Send what ``member``'s socket takes; False if it is gone or too far behind."""
        try:
            sent = member.sock.send(member.backlog, socket.MSG_NOSIGNAL)
        except BlockingIOError:
            sent = 0
        except OSError:
            return False
        del member.backlog[:sent]
        return len(member.backlog) <= BACKLOG

    def close(self) -> None:
        """Stop leading: the followers see the socket close and lead or follow anew."""
        self.closed = True
        self._listener.close()
        for member in self._members:
            member.sock.close()
        for newcomer in self._newcomers:
            newcomer.sock.close()
        self._members, self._newcomers = [], []


# How far ahead of a follower's clock a heartbeat's time may be: none, on one clock.
_AHEAD = 0.05
# How old a leader's first sealed word may be when it comes (sent as it took the
# follower in): older, its clock is behind, and its heartbeats would soon look silent.
FIRST_WORD_AGE = SILENCE - 2 * HEARTBEAT


def _sent_at(heartbeat: Mapping[str, Any]) -> float:
    """When a leader sent ``heartbeat`` (``clock.now()``); Skewed if that is ahead of
    this process's clock."""
    at = heartbeat.get("at")
    if not isinstance(at, float):
        raise RelayLost(f"a heartbeat without its time: {heartbeat!r:.200}")
    if at > clock.now() + _AHEAD:
        raise Skewed(f"the relay's leader has a clock {at - clock.now():.1f} s ahead")
    return at


class Follower:
    """The following side: one connection to a leader, read by the watcher thread."""

    def __init__(
        self,
        sock: socket.socket,
        reader: _Reader,
        first: Mapping[str, Any],
        pending: list[dict[str, Any]],
    ) -> None:
        self._sock = sock
        self._reader = reader
        self.healthy = bool(first.get("ok"))
        # When the leader sent its latest heartbeat (``clock.now()``; never ahead).
        self._beat_at = _sent_at(first)
        # What the leader sent right after its first word, read with it.
        self._pending = pending

    @classmethod
    def join(
        cls, where: Place, prefix: str, codec: CodecOptions[Any], secret: bytes
    ) -> Follower | None:
        """Connect to the leader at ``where`` (None: nobody leads there, or it did not
        answer in time); ``prefix`` says which handoffs are this process's. Foreign: the
        name is another user's; Unproven: its holder does not know ``secret``; Skewed:
        its first word was old (a clock behind, or a leader far too slow to answer)."""
        try:
            sock = _tracked(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
        except OSError as exc:
            logger.debug("relay: could not follow: %s", exc)
            return None
        try:
            sock.settimeout(HELLO_TIMEOUT)
            sock.connect(where.address)
            if _peer_uid(sock) != os.geteuid():
                raise Foreign(f"the relay's name is held by uid {_peer_uid(sock)}")
            reader = _Reader(codec)
            first, more = cls._handshake(sock, reader, where.address, prefix, secret)
        except (OSError, RelayLost) as exc:
            sock.close()
            logger.debug("relay: could not follow: %s", exc)
            return None
        except (Foreign, Skewed, Unproven):
            sock.close()
            raise
        return cls(sock, reader, first, more)

    @staticmethod
    def _handshake(
        sock: socket.socket, reader: _Reader, address: bytes, prefix: str, secret: bytes
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Prove to each other that both know ``secret``; the leader's first sealed word
        (whether its stream is open), and any sealed frames that came with it."""
        ours = secrets.token_bytes(NONCE_BYTES)
        sock.sendall(_frame({"t": "hello", "prefix": prefix, "nonce": ours}), socket.MSG_NOSIGNAL)
        answer, more = _read_first(sock, reader, HELLO_TIMEOUT)
        theirs, told = answer.get("nonce"), answer.get("proof")
        if answer.get("t") != "a" or more:
            raise RelayLost(f"not a leader's answer: {answer!r:.200}")
        if not isinstance(theirs, bytes) or len(theirs) != NONCE_BYTES:
            raise RelayLost("a leader's answer without its nonce")
        connection = (address, ours, theirs, prefix)
        if not isinstance(told, bytes) or not hmac.compare_digest(
            told, proof("leader", secret, *connection)
        ):
            raise Unproven("the relay's leader did not prove it knows the relay secret")
        said = proof("follower", secret, *connection)
        sock.sendall(_frame({"t": "proof", "proof": said}), socket.MSG_NOSIGNAL)
        reader.sealed(session_key(secret, *connection))
        first, more = _read_first(sock, reader, HELLO_TIMEOUT)
        if first.get("t") != "h":
            raise RelayLost(f"not a leader's first word: {first!r:.200}")
        if clock.now() - _sent_at(first) > FIRST_WORD_AGE:
            raise Skewed("the relay's leader has a clock behind, or took too long to answer")
        return first, more

    def read(self, timeout: float) -> list[dict[str, Any]]:
        """The messages that come within ``timeout`` seconds (maybe none); RelayLost if
        the leader closed, garbled, or sent its latest heartbeat ``SILENCE`` seconds ago
        (whatever else came since): a follower that keeps reading is held back no longer.
        """
        messages, self._pending = self._pending, []
        if not messages:
            left = self._silent_at() - clock.now()
            if left <= 0:
                raise RelayLost(f"no heartbeat sent in the last {SILENCE:g} s")
            self._sock.settimeout(min(timeout, left))
            try:
                data = self._sock.recv(65536)
            except TimeoutError:
                data = None
            except OSError as exc:
                raise RelayLost(str(exc)) from exc
            if data == b"":
                raise RelayLost("the leader closed the connection")
            if data:
                messages = self._reader.feed(data)
        try:
            for message in messages:
                if message.get("t") == "h":
                    self._beat_at = max(self._beat_at, _sent_at(message))
        except Skewed as exc:
            raise RelayLost(str(exc)) from exc
        if clock.now() >= self._silent_at():
            raise RelayLost(f"no heartbeat sent in the last {SILENCE:g} s")
        return messages

    def _silent_at(self) -> float:
        """When the leader counts as silent, if no heartbeat comes before."""
        return self._beat_at + SILENCE

    def close(self) -> None:
        self._sock.close()
