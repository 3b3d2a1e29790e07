"""What every fenced write checks about the lock before it sends anything."""

from __future__ import annotations

from django_mongolock.lock import Lock

__all__ = ["check_lock", "shown"]


def shown(value: object) -> str:
    """A bad argument, for an error message: its repr when simple, else its type.

    A QuerySet's repr runs a query, and an error about arguments must send none.
    """
    if value is None or isinstance(value, str | int | float | bool | bytes):
        return repr(value)[:200]
    return f"a {type(value).__module__}.{type(value).__qualname__}"


def check_lock(lock: object) -> Lock:
    """The lock, if it is an exclusive ``Lock``; a TypeError or ValueError naming it if not.

    A shared lock (a semaphore's slot) is refused: its holders run side by side, so a
    token says nothing about which of them may write.
    """
    if not isinstance(lock, Lock):
        raise TypeError(f"lock must be a django_mongolock Lock, got {shown(lock)}")
    if lock.shared:
        raise ValueError(f"a shared lock cannot fence a write (its holders overlap): {lock!r}")
    return lock
