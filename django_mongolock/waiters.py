"""Where blocked acquirers sleep until their key may have become free.

A waiter subscribes to its key and sleeps on an event with a back-off timeout; a
release in this process (and, through the watcher, anywhere) sets the events of that
key only, so the waiters try again at once instead of at their next poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

__all__ = ["AsyncWake", "Waiters", "Wake"]


class _Wakeable(Protocol):
    def set(self) -> None: ...


class Wake:
    """A waiter's wake-up: set by releases (and counted), waited on by one thread.

    Every blocking acquire subscribes before its first attempt, and most never wait:
    the ``threading.Event`` is built only when the waiter first sleeps.
    """

    __slots__ = ("_event", "_flag", "_mutex", "count")

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._event: threading.Event | None = None
        self._flag = False
        self.count = 0

    def set(self) -> None:
        with self._mutex:
            self.count += 1
            self._flag = True
            event = self._event
        if event is not None:
            event.set()

    def clear(self) -> None:
        with self._mutex:
            self._flag = False
            if self._event is not None:
                self._event.clear()

    def wait(self, timeout: float | None = None) -> bool:
        """Sleep until set (True) or ``timeout`` seconds (False)."""
        event = self._event
        if event is None:
            with self._mutex:
                if self._event is None:
                    self._event = threading.Event()
                    if self._flag:
                        self._event.set()
                event = self._event
        return event.wait(timeout)


class AsyncWake(asyncio.Event):
    """``Wake`` for a coroutine: set (and counted) in its event loop only."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def set(self) -> None:
        self.count += 1
        super().set()


class _LoopEvent:
    """An AsyncWake that any thread may set (through its loop)."""

    __slots__ = ("event", "loop")

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.event = AsyncWake()

    def set(self) -> None:
        # A closed loop raises RuntimeError: nobody waits there any more.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.event.set)


class Waiters:
    """Per-key wake-up events shared by all threads of one process."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._mutex = threading.Lock()
        self._events: dict[str, set[_Wakeable]] = {}

    @contextmanager
    def subscribe(self, key: str) -> Iterator[Wake]:
        """A thread's wake-up event for ``key``, registered while the block runs."""
        event = Wake()
        with self._registered(key, event):
            yield event

    @contextmanager
    def subscribe_async(self, key: str) -> Iterator[AsyncWake]:
        """A coroutine's wake-up event for ``key``, set through its event loop."""
        waker = _LoopEvent()
        with self._registered(key, waker):
            yield waker.event

    @contextmanager
    def _registered(self, key: str, event: _Wakeable) -> Iterator[None]:
        with self._mutex:
            self._events.setdefault(key, set()).add(event)
        try:
            yield
        finally:
            with self._mutex:
                events = self._events.get(key)
                if events is not None:
                    events.discard(event)
                    if not events:
                        del self._events[key]

    def notify(self, key: str) -> int:
        """Wake every waiter of ``key`` (they re-check by trying to acquire); how many."""
        with self._mutex:
            events = tuple(self._events.get(key, ()))
        for event in events:
            event.set()
        return len(events)

    def notify_all(self) -> None:
        """Wake every waiter of every key (their wake-up source changed)."""
        with self._mutex:
            events = [event for events in self._events.values() for event in events]
        for event in events:
            event.set()

    def keys(self) -> set[str]:
        """The keys somebody in this process is waiting for."""
        with self._mutex:
            return set(self._events)

    def __len__(self) -> int:
        with self._mutex:
            return sum(len(events) for events in self._events.values())
