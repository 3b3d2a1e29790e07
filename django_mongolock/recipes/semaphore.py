"""At most ``limit`` holders of one key at once: a shared lock with a limit."""

from __future__ import annotations

from collections.abc import Callable

from django_mongolock.context import LockContext
from django_mongolock.info import Holder
from django_mongolock.lock import Lock
from django_mongolock.recipes.source import LockSource
from django_mongolock.validation import validate_key, validate_ttl

__all__ = ["Semaphore"]


class Semaphore:
    """At most ``limit`` holders of ``key`` at once, each with its own lease and token.

    Holders are shared leases of the key, so the same waiting, refreshing, fencing and
    loss detection apply as to any lock. Build it at import time if you like: it
    touches no server until ``acquire``.
    """

    def __init__(
        self, manager: LockSource, key: str, limit: int, *, ttl: float | None = None
    ) -> None:
        self.key = validate_key(key)
        if type(limit) is not int:
            raise TypeError(f"limit must be an int, not {type(limit).__name__}")
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        self.limit = limit
        self.ttl = None if ttl is None else validate_ttl(ttl)
        self._manager = manager

    def __repr__(self) -> str:
        return f"<Semaphore {self.key!r} limit={self.limit}>"

    def acquire(
        self,
        *,
        blocking: bool = True,
        timeout: float | None = None,
        ttl: float | None = None,
        on_lost: Callable[[Lock], object] | None = None,
        refresh: bool | None = None,
    ) -> Lock:
        """Take one of the ``limit`` slots (a shared lease); LockNotAcquired when all are taken."""
        return self._manager.acquire(
            self.key,
            ttl=self.ttl if ttl is None else ttl,
            blocking=blocking,
            timeout=timeout,
            shared=True,
            limit=self.limit,
            on_lost=on_lost,
            refresh=refresh,
        )

    def lock(
        self, *, blocking: bool = True, timeout: float | None = None, ttl: float | None = None
    ) -> LockContext:
        """``with sem.lock():`` takes a slot on entry and gives it back on exit."""
        return self._manager.lock(
            self.key,
            ttl=self.ttl if ttl is None else ttl,
            blocking=blocking,
            timeout=timeout,
            shared=True,
            limit=self.limit,
        )

    def holders(self) -> tuple[Holder, ...]:
        """The live holders right now (by the server's clock)."""
        info = self._manager.store.find(self.key)
        return () if info is None else info.live_holders
