"""Where blocked acquirers sleep until their key may have become free.

A waiter subscribes to its key and sleeps on an event with a back-off timeout; a
release in this process (and, through the watcher, anywhere) sets the events of that
key only, so the waiters try again at once instead of at their next poll. A release
that handed the lock to a waiter says so (a ``Handoff``): that waiter holds it already
and need not try again. The registry also remembers which keys were lately found busy
(``lately_busy``), so that a blocking acquire of such a key joins the line with its
first request.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from django_mongolock import clock

__all__ = ["BUSY_FOR", "BUSY_KEYS", "AsyncWake", "Handoff", "Waiters", "Wake"]

# How long a key found busy counts as lately busy, and how many such keys are kept (the
# oldest forgotten first): a process contending for a key often does so again soon.
BUSY_FOR = 30.0
BUSY_KEYS = 1024


@dataclass(frozen=True, slots=True)
class Handoff:
    """A release made ``owner`` the holder (as the change stream reported it).

    ``expires_at`` is None when the event did not carry it (it was unchanged);
    ``previous`` (the holder that released it) is "" when the event did not say.
    """

    owner: str
    token: int
    acquired_at: datetime
    expires_at: datetime | None
    previous: str = ""


class _Wakeable(Protocol):
    def set(self) -> None: ...

    def offer(self, handoff: Handoff) -> None: ...


class Wake:
    """A waiter's wake-up: set by releases (and counted), waited on by one thread.

    Every blocking acquire subscribes before its first attempt, and most never wait:
    the ``threading.Event`` is built only when the waiter first sleeps.
    """

    __slots__ = ("_event", "_flag", "_mutex", "count", "handed", "owner")

    def __init__(self, owner: str = "") -> None:
        self._mutex = threading.Lock()
        self._event: threading.Event | None = None
        self._flag = False
        self.count = 0
        self.owner = owner
        # The latest release that handed the lock to ``owner``; the waiter clears it
        # before each attempt of its own.
        self.handed: Handoff | None = None

    def offer(self, handoff: Handoff) -> None:
        """Keep ``handoff`` if it is for this waiter (the caller sets the event after)."""
        if self.owner and handoff.owner == self.owner:
            self.handed = handoff

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

    def __init__(self, owner: str = "") -> None:
        super().__init__()
        self.count = 0
        self.owner = owner
        self.handed: Handoff | None = None

    def set(self) -> None:
        self.count += 1
        super().set()


class _LoopEvent:
    """An AsyncWake that any thread may set (through its loop)."""

    __slots__ = ("event", "loop")

    def __init__(self, owner: str) -> None:
        self.loop = asyncio.get_running_loop()
        self.event = AsyncWake(owner)

    def offer(self, handoff: Handoff) -> None:
        # Stored before the event is set through the loop, so the woken task sees it.
        if self.event.owner and handoff.owner == self.event.owner:
            self.event.handed = handoff

    def set(self) -> None:
        # A closed loop raises RuntimeError: nobody waits there any more.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.event.set)


class Waiters:
    """Per-key wake-up events shared by all threads of one process, and the keys
    lately found busy (``lately_busy``)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._mutex = threading.Lock()
        self._events: dict[str, set[_Wakeable]] = {}
        self._busy: OrderedDict[str, float] = OrderedDict()

    def lately_busy(self, key: str) -> bool:
        """Whether an acquire found ``key`` busy (or others in line behind it) in the
        last ``BUSY_FOR`` seconds."""
        with self._mutex:
            at = self._busy.get(key)
        return at is not None and clock.now() - at < BUSY_FOR

    def found_busy(self, key: str) -> None:
        """Note that an acquire found ``key`` busy, waited for it, or took it with
        others in line.

        Only time forgets it: a key contended for now and then is often found free in
        between, and each acquire that forgot it too soon would pay a second request
        when the key is busy again.
        """
        with self._mutex:
            self._busy[key] = clock.now()
            self._busy.move_to_end(key)
            if len(self._busy) > BUSY_KEYS:
                self._busy.popitem(last=False)

    @contextmanager
    def subscribe(self, key: str, owner: str = "") -> Iterator[Wake]:
        """A thread's wake-up event for ``key``, registered while the block runs; with
        ``owner``, it also keeps a release's handoff to that owner."""
        event = Wake(owner)
        with self._registered(key, event):
            yield event

    @contextmanager
    def subscribe_async(self, key: str, owner: str = "") -> Iterator[AsyncWake]:
        """A coroutine's wake-up event for ``key``, set through its event loop."""
        waker = _LoopEvent(owner)
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

    def notify(self, key: str, handoff: Handoff | None = None) -> int:
        """Wake every waiter of ``key`` (they re-check by trying to acquire, except the
        one ``handoff`` made the holder); how many."""
        with self._mutex:
            events = tuple(self._events.get(key, ()))
        for event in events:
            if handoff is not None:
                event.offer(handoff)
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
