"""``current_lock()``: the lock the running code holds through ``@locked``.

A context variable rather than a thread-local, so each coroutine (asyncio task) sees its
own lock, and code run through ``asgiref``'s ``sync_to_async``/``async_to_sync`` or
``asyncio.to_thread`` (which copy the context) sees the caller's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from django_mongolock.lock import Lock

__all__ = ["current_lock", "holding"]

# A tuple, never mutated: nested @locked calls push a new tuple, so a context copied
# into another thread or task cannot be changed under it.
_held: ContextVar[tuple[Lock, ...]] = ContextVar("django_mongolock_held", default=())


def current_lock() -> Lock | None:
    """The innermost lock held by ``@locked`` code in this context, or None outside it.

    A thread started by ``threading.Thread`` begins with an empty context: pass the lock
    to it, or run it with ``contextvars.copy_context().run``.
    """
    held = _held.get()
    return held[-1] if held else None


@contextmanager
def holding(lock: Lock) -> Iterator[Lock]:
    """Make ``lock`` the current lock for the duration of the block."""
    reset = _held.set((*_held.get(), lock))
    try:
        yield lock
    finally:
        _held.reset(reset)
