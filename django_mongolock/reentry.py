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
import os
import threading
import weakref

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

    __slots__ = ("__weakref__", "_by_holder", "_mutex", "_of_lock")

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._by_holder: dict[tuple[object, str], Lock] = {}
        self._of_lock: dict[Lock, tuple[object, str]] = {}
        _all.add(self)

    def after_fork_in_child(self) -> None:
        """Start empty with a new mutex: a parent's thread may have held it at the fork, and
        the parent's handles are not this process's."""
        self._mutex = threading.Lock()
        self._by_holder = {}
        self._of_lock = {}

    def __len__(self) -> int:
        return len(self._of_lock)

    def enter(self, holder: object, key: str) -> Lock | None:
        """The valid handle ``holder`` holds for ``key``, with one more hold; else None."""
        with self._mutex:
            lock = self._by_holder.get((holder, key))
            if lock is None:
                return None
            if lock.valid and lock.add_hold():
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


# Every registry of this process, so that a forked child can renew them.
_all: weakref.WeakSet[Reentries] = weakref.WeakSet()


def _renew_in_child() -> None:
    for reentries in list(_all):
        reentries.after_fork_in_child()


os.register_at_fork(after_in_child=_renew_in_child)
