"""Reentrant holds: the same thread (or asyncio task) taking a lock it holds gets it again.

A manager keeps, per holder (the running asyncio task, else the thread) and key,
the handle it took with ``reentrant=True``. Taking the key again from the same holder
counts one more hold on that handle instead of asking the server; ``release()`` counts
down, and only the outermost one gives the lock up. A handle that is no longer valid
(released, lost, or inherited by a forked child) is never handed out again: its entry is
dropped when found, and when the handle is released.
"""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from django_mongolock.lock import Lock

__all__ = ["Reentries", "current_holder"]


def current_holder(*, task: bool) -> object:
    """Who is acquiring: with ``task=True`` the running asyncio task, if this thread runs
    one; else the current thread."""
    if task:
        try:
            running = asyncio.current_task()
        except RuntimeError:  # no loop runs in this thread
            running = None
        if running is not None:
            return running
    return threading.current_thread()


class Reentries:
    """The reentrant handles of one manager, by holder and key; thread-safe."""

    __slots__ = ("_by_holder", "_mutex", "_of_lock")

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._by_holder: dict[tuple[object, str], Lock] = {}
        self._of_lock: dict[Lock, tuple[object, str]] = {}

    def __len__(self) -> int:
        return len(self._of_lock)

    def enter(self, holder: object, key: str) -> Lock | None:
        """The valid handle ``holder`` holds for ``key``, with one more hold; else None."""
        with self._mutex:
            lock = self._by_holder.get((holder, key))
            if lock is None:
                return None
            if lock.valid and lock._add_hold():
                return lock
            self._drop(lock)
            return None

    def add(self, holder: object, lock: Lock) -> None:
        """Remember a handle just taken with ``reentrant=True``."""
        with self._mutex:
            old = self._by_holder.get((holder, lock.key))
            if old is not None:
                self._drop(old)
            self._by_holder[holder, lock.key] = lock
            self._of_lock[lock] = (holder, lock.key)

    def forget(self, lock: Lock) -> None:
        """Drop ``lock``'s entry (it was released); cheap when there are none."""
        if not self._of_lock:
            return
        with self._mutex:
            self._drop(lock)

    def _drop(self, lock: Lock) -> None:
        where = self._of_lock.pop(lock, None)
        if where is not None and self._by_holder.get(where) is lock:
            del self._by_holder[where]
