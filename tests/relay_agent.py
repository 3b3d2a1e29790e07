"""Processes for the relay fault tests (``python -m tests.relay_agent MODE ...``).

``lead URL DB``: a ``shared_stream`` manager whose watcher leads the relay of ``DB``;
prints ``role <role>`` once its stream is healthy (``leader`` unless another process
led already), then keeps the watcher running until killed.

``listen UID ADDRESS FRAME``: as ``UID``, an impostor leader at the abstract socket
``ADDRESS`` (hex): it answers every connection with ``FRAME`` (hex; a leader's hello) and
a heartbeat every second, and prints ``listening <euid>`` once bound, then ``closed <n>``
when a connection ends, ``n`` the bytes it heard on it.

``connect UID ADDRESS FRAME``: as ``UID``, connects to ``ADDRESS``, sends ``FRAME`` (a
follower's hello) and prints what comes back within five seconds: ``eof`` or ``reset`` (closed
on it), ``data <n>`` or ``silent`` (``refused <errno>`` if it could not connect).

The uid is dropped after the interpreter started (it cannot read the project's Python
otherwise), before any socket is made: the peer credentials the relay checks
(``SO_PEERCRED``) are those of ``UID``.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import sys
import time


def _become(uid: int) -> None:
    if uid >= 0 and uid != os.geteuid():
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)


def lead(url: str, database: str) -> None:
    from django_mongolock import LockManager

    manager = LockManager(url, database=database, shared_stream=True)
    watcher = manager.watcher
    watcher.ensure_running()
    deadline = time.monotonic() + 60
    while not watcher.healthy:
        if time.monotonic() > deadline:
            print("role none", flush=True)
            return
        time.sleep(0.02)
    print(f"role {watcher.role}", flush=True)
    while True:  # the thread ends after a minute without waiters: start it again
        watcher.ensure_running()
        time.sleep(0.5)


def listen(uid: int, address: bytes, frame: bytes) -> None:
    _become(uid)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(address)
    server.listen(16)
    print(f"listening {os.geteuid()}", flush=True)
    heard: dict[socket.socket, int] = {}
    beat_at = time.monotonic()
    while True:
        ready, _, _ = select.select([server, *heard], [], [], 0.2)
        for sock in ready:
            if sock is server:
                conn, _ = server.accept()
                heard[conn] = 0
                with contextlib.suppress(OSError):
                    conn.sendall(frame)
                continue
            try:
                data = sock.recv(65536)
            except OSError:
                data = b""
            if data:
                heard[sock] += len(data)
            else:
                print(f"closed {heard.pop(sock)}", flush=True)
                sock.close()
        if time.monotonic() - beat_at >= 1.0:
            beat_at = time.monotonic()
            for sock in list(heard):
                with contextlib.suppress(OSError):
                    sock.send(frame)


def connect(uid: int, address: bytes, frame: bytes) -> None:
    _become(uid)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5.0)
    try:
        sock.connect(address)
    except OSError as exc:
        print(f"refused {exc.errno}", flush=True)
        return
    sock.sendall(frame)
    try:
        data = sock.recv(65536)
    except TimeoutError:
        print("silent", flush=True)
        return
    except ConnectionResetError:  # closed by the leader with the hello unread
        print("reset", flush=True)
        return
    print("eof" if not data else f"data {len(data)}", flush=True)


def main(mode: str, *args: str) -> None:
    if mode == "lead":
        lead(*args)
    elif mode == "listen":
        listen(int(args[0]), bytes.fromhex(args[1]), bytes.fromhex(args[2]))
    elif mode == "connect":
        connect(int(args[0]), bytes.fromhex(args[1]), bytes.fromhex(args[2]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(*sys.argv[1:])
