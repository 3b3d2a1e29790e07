"""Where blocked acquirers sleep until their key may have become free.

A waiter subscribes to its key and sleeps on an event with a back-off timeout; a
release in this process (and, through the watcher, anywhere) sets the events of that
key only, so the waiters try again at once instead of at their next poll.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["Waiters"]


class Waiters:
    """Per-key wake-up events shared by all threads of one process."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._mutex = threading.Lock()
        self._events: dict[str, set[threading.Event]] = {}

    @contextmanager
    def subscribe(self, key: str) -> Iterator[threading.Event]:
        event = threading.Event()
        with self._mutex:
            self._events.setdefault(key, set()).add(event)
        try:
            yield event
        finally:
            with self._mutex:
                events = self._events.get(key)
                if events is not None:
                    events.discard(event)
                    if not events:
                        del self._events[key]

    def notify(self, key: str) -> None:
        """Wake every waiter of ``key`` (they re-check by trying to acquire)."""
        with self._mutex:
            events = tuple(self._events.get(key, ()))
        for event in events:
            event.set()

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
