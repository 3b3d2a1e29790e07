"""A TCP proxy between lock clients and mongod that a test can break on purpose.

The network faults that break lock services are not crashes: a link that silently
drops packets (a partition: connections stay open, nothing arrives, every call waits for
its timeout), a slow link, a link that comes and goes, and a half-open connection that
carries requests but no replies. The proxy makes each of them on demand, switched at
runtime from the test, without root or network namespaces:

``pass``
    forward both ways.
``drop``
    black hole: keep every connection (and accept new ones), silently discard the bytes
    both ways.
``delay``
    forward both ways, every chunk ``delay`` seconds late (order kept).
``reset``
    close every connection with a TCP reset, and reset new ones at once.
``half-open``
    forward what the client sends, discard what the server answers: the server applies
    the requests, the client never hears back.

One request can be held on its way (:meth:`hold_next`): the first chunk a client sends
that contains given bytes waits, with what follows it on that connection, until
:meth:`let_go`; the server side of that connection stays open meanwhile, also after the
client closed its side, until the server answered. So the server applies the request
after whatever the client did since, on other connections: as a request already past
a middlebox with connections of its own to the server (``mongos`` forwarding to a
shard) is. The request and the server's reply are kept (``request``, ``reply``).

A connection can also be black-holed by where it comes from (``isolate``): the proxy
looks up which process opened it (through ``/proc``), so that a test can cut mongod
nodes and client processes into two sides of a partition whatever port they use.

The proxy runs an asyncio loop in a daemon thread of the test process.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import bson

__all__ = ["MODES", "Mode", "TcpProxy", "command_of", "pid_of_peer"]

Mode = Literal["pass", "drop", "delay", "reset", "half-open"]
MODES: tuple[Mode, ...] = ("pass", "drop", "delay", "reset", "half-open")
CHUNK = 65536


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with RST (SO_LINGER 0) rather than FIN: what a crashed peer or middlebox sends."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@dataclass(eq=False)
class _Link:
    """One proxied connection: the client's side, the server's side, and where it came from."""

    client: asyncio.StreamWriter
    server: asyncio.StreamWriter
    origin: str
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    # Set for the connection whose request is held: opens when the test lets it go.
    gate: asyncio.Event | None = None
    answered: asyncio.Event = field(default_factory=asyncio.Event)


class TcpProxy:
    """Listens on 127.0.0.1 (a free port unless given) and forwards to ``target``.

    ``classify(peer_port, proxy_port)`` names the origin of a connection from its two
    ports (see :func:`pid_of_peer`); connections from an origin in :meth:`isolate` are
    black-holed.
    """

    def __init__(
        self,
        target: tuple[str, int],
        *,
        port: int = 0,
        classify: Callable[[int, int], str] | None = None,
        name: str = "proxy",
    ) -> None:
        self.target = target
        self.name = name
        self._port = port
        self._classify = classify
        self._mode: Mode = "pass"
        self._delay = 0.0
        self._isolated: frozenset[str] = frozenset()
        self._hold: tuple[bytes, ...] = ()
        self._held: _Link | None = None
        self.held = threading.Event()
        self.answered = threading.Event()
        self.request = b""
        self.reply = bytearray()
        self._links: set[_Link] = set()
        # Connections accepted but not yet linked (their server side still connecting).
        self._accepting: set[asyncio.Task[None]] = set()
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self.connections = 0
        self.forwarded = 0
        self.discarded = 0
        self.resets = 0

    def __repr__(self) -> str:
        return (
            f"<TcpProxy {self.name} :{self._port} -> {self.target[0]}:{self.target[1]} {self.mode}>"
        )

    # -- control (from any thread) ---------------------------------------------------------

    @property
    def port(self) -> int:
        return self._port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self._port}"

    @property
    def direct_url(self) -> str:
        """A URL through the proxy to the one server behind it (which says it is a set member)."""
        return f"mongodb://{self.address}/?directConnection=true"

    @property
    def mode(self) -> Mode:
        return self._mode

    @property
    def pending(self) -> int:
        """Accepted connections not yet linked: their connect to the target is pending."""
        return len(self._accepting)

    def set_mode(self, mode: Mode, delay: float = 0.0) -> None:
        """Switch every connection, open or new, to ``mode`` (``delay`` seconds for ``delay``)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if delay < 0 or (mode == "delay") != (delay > 0):
            raise ValueError(f"delay must be > 0 for mode 'delay' only, got {delay!r}")
        self._delay = delay
        self._mode = mode
        if mode == "reset":
            self._call(self._reset_all)

    def isolate(self, origins: Iterable[str]) -> None:
        """Black-hole connections opened by these origins (empty: none), whatever the mode."""
        self._isolated = frozenset(origins)

    def hold_next(self, *markers: bytes) -> None:
        """Hold the next chunk a client sends that contains every one of ``markers``."""
        if not markers:
            raise ValueError("hold_next needs at least one marker")
        self.disarm()
        self._hold = markers

    def let_go(self) -> None:
        """Forward the held request (and what followed it); ``answered`` is set once the
        server's whole reply to it came back (``reply``)."""
        link = self._held
        if link is None or link.gate is None:
            raise RuntimeError("no request is held")
        if not self._call(link.gate.set):
            raise RuntimeError(f"{self!r} did not let the held request go")

    def disarm(self) -> None:
        """No request held from now on: a hold not met yet is dropped, a held request goes
        on its way (a test that ended early leaves nothing held for the next)."""
        self._hold = ()
        link, self._held = self._held, None
        if link is not None and link.gate is not None:
            self._call(link.gate.set)
        self.held.clear()
        self.answered.clear()
        self.request = b""
        self.reply = bytearray()

    def start(self) -> TcpProxy:
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._server = loop.run_until_complete(
                    asyncio.start_server(self._accept, "127.0.0.1", self._port)
                )
                self._port = self._server.sockets[0].getsockname()[1]
            except BaseException as exc:
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        self._thread = threading.Thread(target=run, name=f"tcp-{self.name}", daemon=True)
        self._thread.start()
        if not ready.wait(10) or failure:
            raise RuntimeError(f"{self!r} did not start: {failure}")
        return self

    def stop(self) -> None:
        """Close the listener and every connection, and end the thread."""
        loop = self._loop
        if loop is None or self._thread is None:
            return
        future = asyncio.run_coroutine_threadsafe(self._close(), loop)
        future.result(10)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(10)
        self._loop = None

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _call(self, function: Callable[[], None]) -> bool:
        """Run ``function`` on the loop; whether it ran within 10 s."""
        loop = self._loop
        if loop is None:
            return False
        done = threading.Event()

        def run() -> None:
            try:
                function()
            finally:
                done.set()

        loop.call_soon_threadsafe(run)
        return done.wait(10)

    # -- the loop --------------------------------------------------------------------------

    async def _close(self) -> None:
        # Every connection is reset before the listener is waited for: from Python 3.12
        # on, ``wait_closed`` also waits for the connections it accepted to close.
        # A connection still being linked is reset too: left to a loop that stops, its
        # transport would be collected open. One accepted as the listener closed may not
        # have reached ``_accept`` yet: it sees ``_closing`` there, or after connecting.
        self._closing = True
        if self._server is not None:
            self._server.close()
        while accepting := list(self._accepting):
            for task in accepting:
                task.cancel()
            await asyncio.gather(*accepting, return_exceptions=True)
            await asyncio.sleep(0)
        self._reset_all()
        if self._server is not None:
            await self._server.wait_closed()
        tasks = [task for link in self._links for task in link.tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._links.clear()

    def _reset_all(self) -> None:
        for link in list(self._links):
            self.resets += 1
            _reset(link.client)
            _reset(link.server)

    def _origin(self, writer: asyncio.StreamWriter) -> str:
        if self._classify is None:
            return "client"
        peer = writer.get_extra_info("peername")
        return self._classify(peer[1], self._port) if peer else "unknown"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self._accepting.add(task)
        try:
            await self._link(reader, writer)
        except asyncio.CancelledError:
            _reset(writer)
            raise
        finally:
            self._accepting.discard(task)

    async def _link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Connect to the target and start forwarding (or reset the connection at once)."""
        if self._mode == "reset" or self._closing:
            self.resets += 1
            _reset(writer)
            return
        origin = self._origin(writer)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            _reset(writer)
            return
        if self._closing:
            _reset(writer)
            _reset(up_writer)
            return
        link = _Link(writer, up_writer, origin)
        self._links.add(link)
        queues: tuple[asyncio.Queue[tuple[float, bytes]], ...] = (asyncio.Queue(), asyncio.Queue())
        link.tasks = [
            asyncio.create_task(self._pump(link, reader, queues[0], upstream=True)),
            asyncio.create_task(self._send(link, up_writer, queues[0], upstream=True)),
            asyncio.create_task(self._pump(link, up_reader, queues[1], upstream=False)),
            asyncio.create_task(self._send(link, writer, queues[1], upstream=False)),
        ]

    def _passes(self, link: _Link, upstream: bool) -> bool:
        if link.origin in self._isolated or self._mode == "drop":
            return False
        return not (self._mode == "half-open" and not upstream)

    async def _pump(
        self,
        link: _Link,
        reader: asyncio.StreamReader,
        queue: asyncio.Queue[tuple[float, bytes]],
        *,
        upstream: bool,
    ) -> None:
        """Read one direction; queue what passes (with its due time), discard the rest."""
        loop = asyncio.get_running_loop()
        try:
            while data := await reader.read(CHUNK):
                if upstream and self._hold and all(marker in data for marker in self._hold):
                    self._hold = ()
                    link.gate = asyncio.Event()
                    self._held = link
                    self.request = data
                    self.held.set()
                elif not upstream and link is self._held and not link.answered.is_set():
                    self.reply += data
                    if len(self.reply) >= max(4, int.from_bytes(self.reply[:4], "little")):
                        link.answered.set()  # the reply's length is its first field
                        self.answered.set()
                if self._passes(link, upstream):
                    due = loop.time() + (self._delay if self._mode == "delay" else 0.0)
                    queue.put_nowait((due, data))
                else:
                    self.discarded += len(data)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            queue.put_nowait((0.0, b""))  # end of this direction

    async def _send(
        self,
        link: _Link,
        writer: asyncio.StreamWriter,
        queue: asyncio.Queue[tuple[float, bytes]],
        *,
        upstream: bool,
    ) -> None:
        """Write what the pump queued, in order, each chunk no sooner than its due time
        (and a held request's once it is let go)."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                due, data = await queue.get()
                if upstream and link.gate is not None:
                    await link.gate.wait()
                if not data:
                    if upstream and link.gate is not None:
                        # The client closed its side: the server still answers the held
                        # request before it learns of that (bounded).
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(link.answered.wait(), 30)
                    break
                if (wait := due - loop.time()) > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
                self.forwarded += len(data)
        except OSError:
            pass
        finally:
            # One side closed: close both, so the other side sees it (unless black-holed,
            # where a closed peer is as invisible as anything else).
            self._links.discard(link)
            for side in (link.client, link.server):
                side.transport.abort()


def command_of(message: bytes) -> dict[str, Any]:
    """The body of one OP_MSG (a request or a reply as the wire carries it, uncompressed):
    after the 16-byte header, 4 bytes of flags and the section kind, one BSON document."""
    opcode = int.from_bytes(message[12:16], "little")
    if opcode != 2013 or message[20] != 0:
        raise ValueError(f"not an OP_MSG with its body first (opcode {opcode})")
    size = int.from_bytes(message[21:25], "little")
    return bson.decode(message[21 : 21 + size])


# -- who opened a connection ----------------------------------------------------------------------


def socket_inode(port: int, remote: int) -> int | None:
    """The inode of the open loopback socket from local ``port`` to ``remote`` (/proc/net/tcp).

    Both ends are matched, and closed sockets (inode 0, such as TIME_WAIT ones) skipped: a
    local port is reused while an earlier connection from it still waits out its close.
    """
    wanted = (f"0100007F:{port:04X}", f"0100007F:{remote:04X}")
    try:
        with open("/proc/net/tcp") as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                if (fields[1], fields[2]) == wanted and fields[9] != "0":
                    return int(fields[9])
    except OSError:
        return None
    return None


def pid_of_peer(port: int, remote: int, candidates: Iterable[int]) -> int | None:
    """The pid, among ``candidates``, of the process whose socket goes from ``port`` to
    ``remote`` on 127.0.0.1, or None."""
    inode = socket_inode(port, remote)
    if inode is None:
        return None
    target = f"socket:[{inode}]"
    for pid in candidates:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                        return pid
        except OSError:
            continue
    return None
