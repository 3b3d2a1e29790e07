"""The handle a holder gets: its fencing token, its lease, and a way to learn it was lost."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from contextlib import nullcontext
from types import TracebackType
from typing import Protocol

import pymongo

from django_mongolock import clock, events
from django_mongolock.astore import AsyncLockStore
from django_mongolock.exceptions import LockLost
from django_mongolock.info import LockInfo
from django_mongolock.lease import LAPSED, LeaseState
from django_mongolock.refresher import get_refresher
from django_mongolock.signals import lock_released, send_safely
from django_mongolock.store import LockStore
from django_mongolock.validation import validate_ttl

__all__ = ["Lock", "LockBackend"]

logger = logging.getLogger("django_mongolock.lock")


class LockBackend(Protocol):
    """What a handle needs of whoever gave it out (a ``LockManager``): the stores its
    refreshes and releases go through, and a word when it is released. The backend is
    also the ``sender`` of the handle's signals.
    """

    @property
    def store(self) -> LockStore: ...

    async def astore(self) -> AsyncLockStore: ...

    def on_release(self, lock: Lock) -> None: ...


class Lock(LeaseState):
    """A held lock: ``key``, ``owner``, fencing ``token`` and the lease, in server time.

    ``valid`` turns False as soon as the lock is released or lost, and also once the
    lease has ended by this process's clock (measured from before the request that set
    it, less a drift margin, so always before the server's own expiry: see ``clock``).
    ``lost`` is a ``threading.Event`` set once the lock is lost; protected code can check
    or wait on it. The process's deadline watch sets it at that bound even while the
    network hangs, and then sends ``lock_lost`` and calls ``on_lost`` on a worker thread.
    """

    __slots__ = ("backend",)

    def __init__(
        self,
        backend: LockBackend,
        info: LockInfo,
        sent_at: float,
        *,
        on_lost: Callable[[Lock], object] | None = None,
        refresh: bool = False,
    ) -> None:
        self.backend = backend
        super().__init__(backend, info, sent_at, on_lost=on_lost, refresh=refresh)

    def __repr__(self) -> str:
        state = "released" if self._released else "lost" if self._lost else "held"
        mode = " shared" if self.shared else ""
        return f"<Lock {self.key!r}{mode} token={self.token} owner={self.owner!r} {state}>"

    def refresh(self, ttl: float | None = None) -> Lock:
        """Extend the lease to ``ttl`` seconds from now (server time); LockLost if not held."""
        lease, sent_at = self._start_refresh(ttl)
        store = self.backend.store
        info = store.refresh(self.key, self.owner, self.token, lease, shared=self.shared)
        if not self._refreshed(info, sent_at):
            # Its deadline passed while the refresh was on its way: the loss was already
            # announced, so the lease the server just extended is given back.
            store.release(self.key, self.owner, self.token, shared=self.shared)
            raise LockLost(self.key, self.owner, self.token, LAPSED)
        return self

    def release(self) -> bool:
        """Give the lock up; True if it was still held, False (and nothing deleted) otherwise.

        Never removes somebody else's lock: the delete matches this owner and token only.
        A process forked from the holder does not release its parent's lock. A re-entered
        reentrant lock is given up at its outermost release; the inner ones count down.
        """
        return self._release_within(None)

    def _release_within(self, limit: float | None) -> bool:
        """``release``, its write bounded by ``limit`` seconds too (``pymongo.timeout``: a
        lock group's share of one limit), the receivers it then calls not."""
        if self._drop_hold():
            return not self._lost
        if not self.take_release():
            return False
        with pymongo.timeout(limit) if limit is not None else nullcontext():
            held = self.backend.store.release(
                self.key, self.owner, self.token, shared=self.shared, contended=self.contended
            )
        self._released_by_holder(held)
        return held

    async def arefresh(self, ttl: float | None = None) -> Lock:
        """``refresh`` through the async client, without blocking the event loop."""
        lease, sent_at = self._start_refresh(ttl)
        store = await self.backend.astore()
        info = await store.refresh(self.key, self.owner, self.token, lease, shared=self.shared)
        if not self._refreshed(info, sent_at):
            await store.release(self.key, self.owner, self.token, shared=self.shared)
            raise LockLost(self.key, self.owner, self.token, LAPSED)
        return self

    async def arelease(self) -> bool:
        """``release`` through the async client, without blocking the event loop."""
        if self._drop_hold():
            return not self._lost
        if not self.take_release():
            return False
        store = await self.backend.astore()
        held = await store.release(
            self.key, self.owner, self.token, shared=self.shared, contended=self.contended
        )
        self._released_by_holder(held)
        return held

    async def __aenter__(self) -> Lock:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not await self.arelease() and self._pid == os.getpid():
            logger.warning(
                "lock %r (token %s) was no longer held when its block ended", self.key, self.token
            )

    @property
    def store(self) -> LockStore:
        return self.backend.store

    def _start_refresh(self, ttl: float | None) -> tuple[float, float]:
        """Check that a refresh may be sent, and count with a shorter lease from now on:
        the lease to ask for and when the request is sent."""
        lease = self.ttl if ttl is None else validate_ttl(ttl)
        self._check_refreshable()
        sent_at = clock.now()
        before = self.ttl
        self._shorten(lease, sent_at)
        if lease < before and self.refreshable:
            # Its lane ticks at the pace of the leases it was given: a third of this
            # shorter one from now on, or the lease would end before the next tick.
            get_refresher().register(self)
        return lease, sent_at

    def _refreshed(self, info: LockInfo | None, sent_at: float) -> bool:
        """Take a refresh's answer: LockLost if the server refused it; False if the lock
        was lost meanwhile (the caller gives the extended lease back)."""
        if info is None:
            reason = "its lease ended or it was released by somebody else"
            self.mark_lost(reason)
            raise LockLost(self.key, self.owner, self.token, reason)
        return self._extend(info, sent_at)

    def _released_by_holder(self, held: bool) -> None:
        self.backend.on_release(self)
        send_safely(lock_released, self.backend, lock=self, held=held)
        # A lease that lapsed here while the server still had it was told lost: its
        # observers count the loss, not a release as well.
        events.released(self.backend, self, held and not self._lost)
        if not held and not self._lost:
            self.mark_lost("its lease had ended or it was released by somebody else")

    def __enter__(self) -> Lock:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self.release() and self._pid == os.getpid():
            logger.warning(
                "lock %r (token %s) was no longer held when its block ended", self.key, self.token
            )
