"""LockManager: the client, owner ids, acquiring (with waiting), status and listing."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import functools
import getpass
import itertools
import logging
import os
import random
import secrets
import socket
import threading
import weakref
from collections.abc import AsyncGenerator, Callable, Coroutine, Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

from pymongo import AsyncMongoClient, MongoClient
from pymongo.errors import ConfigurationError as PyMongoConfigurationError
from pymongo.errors import InvalidURI

from django_mongolock import clock
from django_mongolock.astore import AsyncLockStore
from django_mongolock.context import CancelOnLoss
from django_mongolock.exceptions import ConfigurationError, LockNotAcquired, MongoLockError
from django_mongolock.lock import Lock
from django_mongolock.primitives import Election, LockGroup, Semaphore, check_callback
from django_mongolock.queries import PLACE_GRACE_MS
from django_mongolock.reentry import Reentries, current_holder
from django_mongolock.refresher import get_refresher
from django_mongolock.signals import lock_acquired
from django_mongolock.store import (
    AuditEntry,
    IndexAction,
    LockInfo,
    LockStore,
    Order,
    State,
    _redact,
)
from django_mongolock.validation import (
    validate_key,
    validate_timeout,
    validate_token,
    validate_ttl,
)
from django_mongolock.waiters import AsyncWake, Waiters, Wake
from django_mongolock.watcher import Watcher

__all__ = ["DEFAULT_URL", "LockManager"]

logger = logging.getLogger("django_mongolock.manager")

# Every manager of this process, so that a forked child can renew their mutexes.
_managers: weakref.WeakSet[LockManager] = weakref.WeakSet()


def _renew_managers_in_child() -> None:
    for manager in list(_managers):
        manager._after_fork_in_child()


os.register_at_fork(after_in_child=_renew_managers_in_child)

DEFAULT_URL = "mongodb://localhost:27017/"

# Back-off of a blocked acquirer: doubling from 10 ms up to 500 ms, each sleep drawn from
# [half, full] of that, and never past the holder's lease end or the caller's timeout.
_BACKOFF_BASE = 0.01
_BACKOFF_CAP = 0.5
# How long a waiter behind others in line sleeps on the stream between attempts: well
# within the grace period that keeps its place.
_BEHIND_IN_LINE = 0.75 * PLACE_GRACE_MS / 1000

_T = TypeVar("_T")

# Closes an event loop's async client when the loop finalizes its async generators.
_Closer = AsyncGenerator[None, None]


class LockManager:
    """Acquires and inspects locks in one MongoDB collection; usable without Django.

    The pymongo client is built lazily, on first use, in the process that uses it: a
    process forked after that builds its own (pymongo clients are not fork-safe).
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        client: MongoClient[Any] | None = None,
        database: str = "mongolock",
        collection: str = "locks",
        ttl: float = 30.0,
        retention: int = 600,
        refresh: bool = True,
        server_selection_timeout: float = 5.0,
        owner: str | None = None,
        audit_retention: int | None = None,
    ) -> None:
        if url is not None and client is not None:
            raise ValueError("give either url or client, not both")
        if url is not None and not isinstance(url, str):
            raise TypeError(f"url must be a str, not {type(url).__name__}")
        if type(retention) is not int or retention < 0:
            raise ValueError(f"retention must be a whole number of seconds >= 0, got {retention!r}")
        if audit_retention is not None and (
            type(audit_retention) is not int or audit_retention < 0
        ):
            raise ValueError(
                f"audit_retention must be a whole number of seconds >= 0, got {audit_retention!r}"
            )
        if type(refresh) is not bool:
            raise TypeError(f"refresh must be True or False, not {refresh!r}")
        if owner is not None and (not isinstance(owner, str) or not owner or "\x00" in owner):
            raise ValueError(f"owner must be a non-empty str without NUL, got {owner!r}")
        for name, value in (("database", database), ("collection", collection)):
            if not isinstance(value, str) or not value or any(c in value for c in '/\\. "$\x00'):
                raise ValueError(f"{name} must be a valid MongoDB name, got {value!r}")
        self.url = url if url is not None or client is not None else DEFAULT_URL
        self.database = database
        self.collection = collection
        self.ttl = validate_ttl(ttl)
        self.retention = retention
        # How long force releases stay on record (None: as long as RETENTION).
        self.audit_retention = retention if audit_retention is None else audit_retention
        self.refresh = refresh
        self.server_selection_timeout = validate_ttl(
            server_selection_timeout, name="server_selection_timeout"
        )
        self.owner = owner
        self._waiters = Waiters()
        self._reentries = Reentries()
        self._given_client = client
        self._client: MongoClient[Any] | None = None
        self._store: LockStore | None = None
        self._pid = 0
        self._build_mutex = threading.Lock()
        self._watcher: Watcher | None = None
        self._closed = False
        # One async client per event loop (they cannot cross loops), closed and dropped
        # when the loop shuts down; a loop closed without that is swept out later. The
        # client refers to its loop, so weak keys would never let go: a plain dict.
        self._astores: dict[asyncio.AbstractEventLoop, tuple[AsyncLockStore, _Closer]] = {}
        self._astores_mutex = threading.Lock()
        _managers.add(self)

    def __repr__(self) -> str:
        return f"<LockManager {self.database}.{self.collection}>"

    def _after_fork_in_child(self) -> None:
        """New mutexes (a parent's thread may have held one at the fork), no async clients."""
        self._build_mutex = threading.Lock()
        self._astores_mutex = threading.Lock()
        self._astores = {}
        self._reentries = Reentries()

    # -- connection --------------------------------------------------------------------------

    @property
    def client(self) -> MongoClient[Any]:
        """This process's client (a child process after fork gets a new one)."""
        self._connect()
        assert self._client is not None
        return self._client

    @property
    def store(self) -> LockStore:
        store = self._store
        if store is None or self._pid != os.getpid():
            store = self._connect()
        return store

    @property
    def closed(self) -> bool:
        return self._closed

    def _connect(self) -> LockStore:
        with self._build_mutex:
            if self._closed:
                raise MongoLockError(f"{self!r} is closed")
            if self._store is not None and self._pid == os.getpid():
                return self._store
            given = self._given_client
            self._client = given if given is not None else self._new_client()
            self._store = LockStore(self._client[self.database][self.collection])
            self._pid = os.getpid()
            return self._store

    def _client_options(self) -> dict[str, Any]:
        timeout_ms = round(self.server_selection_timeout * 1000)
        return {
            "appname": "django-mongolock",
            "serverSelectionTimeoutMS": timeout_ms,
            "connectTimeoutMS": timeout_ms,
            # Every operation, retries included, ends within this time, so an outage is
            # reported instead of hanging a waiter or the refresher.
            "timeoutMS": timeout_ms,
            "retryWrites": True,
            "w": "majority",
            "tz_aware": True,
        }

    def _new_client(self) -> MongoClient[Any]:
        assert self.url is not None
        try:
            return MongoClient(self.url, **self._client_options())
        except (InvalidURI, PyMongoConfigurationError, ValueError, TypeError) as exc:
            raise ConfigurationError(f"invalid MongoDB URL: {_redact(str(exc))}") from exc

    async def _astore(self) -> AsyncLockStore:
        """This event loop's async store, built on first use, closed and dropped with the loop.

        A client given to the manager is sync, so its URL is unknown: the async API needs
        a manager built from a URL.
        """
        loop = asyncio.get_running_loop()
        entry = self._astores.get(loop)
        if entry is not None:
            return entry[0]
        if self._closed:
            raise MongoLockError(f"{self!r} is closed")
        if self.url is None:
            raise ConfigurationError("the async API needs a LockManager built from a URL")
        try:
            client: AsyncMongoClient[Any] = AsyncMongoClient(self.url, **self._client_options())
        except (InvalidURI, PyMongoConfigurationError, ValueError, TypeError) as exc:
            raise ConfigurationError(f"invalid MongoDB URL: {_redact(str(exc))}") from exc
        store = AsyncLockStore(client, self.database, self.collection)
        closer = self._close_with_the_loop(loop, store)
        # Runs to the first yield without suspending: no other task of this loop can
        # build a second client meanwhile.
        await closer.__anext__()
        with self._astores_mutex:
            # Loops closed without finalizing their async generators (a bare
            # loop.close()) never ran their closer: forget their clients here.
            for old in [old for old in self._astores if old.is_closed()]:
                del self._astores[old]
            self._astores[loop] = (store, closer)
        return store

    async def _close_with_the_loop(
        self, loop: asyncio.AbstractEventLoop, store: AsyncLockStore
    ) -> _Closer:
        """Close ``store``'s client when ``loop`` shuts down, and forget it.

        asyncio.run() finalizes async generators before closing its loop: the last
        moment the client can still be closed on the loop it belongs to.
        """
        try:
            yield
        finally:
            with self._astores_mutex:
                if self._astores.get(loop, (None,))[0] is store:
                    del self._astores[loop]
            await store.close()

    async def aclose(self) -> None:
        """Close the async client of the running event loop (``close()`` does the rest)."""
        with self._astores_mutex:
            entry = self._astores.pop(asyncio.get_running_loop(), None)
        if entry is not None:
            await entry[1].aclose()

    @property
    def waiters(self) -> Waiters:
        """This process's blocked acquirers, by key (a forked child starts with none)."""
        waiters = self._waiters
        if waiters.pid != os.getpid():
            with self._build_mutex:
                if self._waiters.pid != os.getpid():
                    self._waiters = Waiters()
                waiters = self._waiters
        return waiters

    @property
    def watcher(self) -> Watcher:
        """This process's change stream watcher for the lock collection (started on need)."""
        watcher = self._watcher
        if watcher is None or watcher.pid != os.getpid():
            waiters = self.waiters
            with self._build_mutex:
                if self._watcher is None or self._watcher.pid != os.getpid():
                    self._watcher = Watcher(lambda: self.store, waiters)
                watcher = self._watcher
        return watcher

    def close(self) -> None:
        """Stop the watcher and close the client this manager built (a given one stays open).

        A closed manager cannot be used again; locks it still holds are no longer refreshed.
        """
        watcher = self._watcher
        if watcher is not None and watcher.pid == os.getpid():
            watcher.stop()
        with self._astores_mutex:
            astores, self._astores = self._astores, {}
        for loop, (_, closer) in astores.items():
            if loop.is_running() and not loop.is_closed():
                asyncio.run_coroutine_threadsafe(closer.aclose(), loop)
        with self._build_mutex:
            self._closed = True
            if self._client is not None and self._given_client is None and self._pid == os.getpid():
                self._client.close()
            self._client = None
            self._store = None

    def __enter__(self) -> LockManager:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- acquiring ---------------------------------------------------------------------------

    def new_owner(self) -> str:
        """A holder id unique per acquisition: ``host:pid:random`` (or ``OWNER:pid:random``)."""
        ids = _owner_ids()
        return f"{self.owner or ids.host}:{ids.pid}:{next(ids.serial) % 2**48:012x}"

    def acquire(
        self,
        key: str,
        *,
        ttl: float | None = None,
        blocking: bool = True,
        timeout: float | None = None,
        shared: bool = False,
        limit: int | None = None,
        on_lost: Callable[[Lock], object] | None = None,
        refresh: bool | None = None,
        reentrant: bool = False,
    ) -> Lock:
        """Take ``key``; wait while it is busy if ``blocking``, at most ``timeout`` seconds.

        ``shared=True`` takes a shared lease: any number of shared holders (at most
        ``limit``, if given) may hold the key at once, never together with an exclusive
        holder. Raises LockNotAcquired naming the holder when busy and not waiting, or
        when the timeout passes; ServerUnavailable at once when MongoDB cannot be
        reached. The lease is kept alive in the background unless ``refresh`` (default:
        the manager's ``refresh``) is False; ``on_lost`` is called once if it is lost.
        ``reentrant=True``: a thread (inside a running loop, the asyncio task) that
        holds ``key`` through a reentrant acquire of this manager gets the same handle
        again, one more hold, without I/O.
        """
        request = self._request(key, ttl, shared, limit)
        wait = validate_timeout(timeout, blocking=blocking)
        keep = self._keep(refresh)
        check_callback("on_lost", on_lost)
        if not _reentrant(reentrant, shared):
            return self._acquire(request, wait, keep, on_lost)
        # The running asyncio task if there is one: tasks sharing a loop's thread are
        # separate holders, and one must not be handed another's handle.
        holder = current_holder(task=True)
        lock = self._reentries.enter(holder, request.key)
        if lock is None:
            lock = self._acquire(request, wait, keep, on_lost)
            self._reentries.add(holder, lock)
        return lock

    def _keep(self, refresh: bool | None) -> bool:
        """Whether the refresher keeps a new lease alive (None: the manager's setting)."""
        keep = self.refresh if refresh is None else refresh
        if type(keep) is not bool:
            raise TypeError(f"refresh must be True, False or None, not {refresh!r}")
        return keep

    def _request(
        self,
        key: str,
        ttl: float | None,
        shared: bool,
        limit: int | None,
        tags: Mapping[str, str] | None = None,
    ) -> _Request:
        """Check every argument before any I/O and describe one acquisition."""
        key = validate_key(key)
        lease = self.ttl if ttl is None else validate_ttl(ttl)
        if type(shared) is not bool:
            raise TypeError(f"shared must be True or False, not {shared!r}")
        if limit is not None:
            if type(limit) is not int:
                raise TypeError(f"limit must be an int, not {type(limit).__name__}")
            if limit < 1:
                raise ValueError(f"limit must be at least 1, got {limit}")
            if not shared:
                raise ValueError("limit applies to shared locks: pass shared=True")
        return _Request(key, self.new_owner(), lease, shared, limit, tags)

    def _acquire(
        self,
        request: _Request,
        wait: float | None,
        keep: bool,
        on_lost: Callable[[Lock], object] | None,
        *,
        announce: bool = True,
    ) -> Lock:
        """Take the lock (waiting up to ``wait``); ``announce=False`` leaves ``lock_acquired``
        to the caller (an election sends it from its own worker, not the refresher's)."""
        store = self.store
        if wait == 0:
            sent_at = clock.now()
            info = request.attempt(store, queue=False)
            mine = request.taken(info)
            if mine is None:
                raise _busy(info)
        else:
            # Subscribe before the first attempt: a release right after it must wake us.
            with self.waiters.subscribe(request.key) as wake:
                try:
                    sent_at = clock.now()
                    info = request.attempt(store, queue=True)
                    mine = request.taken(info)
                    if mine is None:
                        sent_at, mine = self._wait(request, wait, sent_at, info, wake)
                except BaseException as exc:
                    # A timeout left the line already; a server error leaves the place to
                    # lapse. Anything else (KeyboardInterrupt, ...) must not keep it.
                    if not isinstance(exc, MongoLockError):
                        self._abandon(request)
                    raise
        if _late(sent_at, mine):
            # The answer came so late (server selection during an outage) that the lease,
            # bounded from when the request was sent, has nearly ended by the holder's
            # clock: bound it again from a refresh sent on the connection now ready.
            sent_at = clock.now()
            confirmed = store.refresh(
                request.key, request.owner, mine.token, request.ttl, shared=request.shared
            )
            if confirmed is None:
                raise _busy(mine)
            mine = confirmed
        lock = Lock(self, mine, sent_at, on_lost=on_lost, refresh=keep)
        if keep:
            get_refresher().register(lock)
        return self._announce(lock) if announce else lock

    def _abandon(self, request: _Request) -> None:
        """Leave the line of a wait that was interrupted, and give back what it took.

        The interruption may have cut an attempt short after the server applied it:
        a lease found to be this request's is released rather than left to lapse.
        Best effort: the place lapses by itself soon, the lease at its end.
        """
        with contextlib.suppress(MongoLockError):
            store = self.store
            info = store.find(request.key)
            mine = None if info is None else request.taken(info)
            if mine is not None:
                store.release(mine.key, mine.owner, mine.token, shared=request.shared)
            else:
                store.leave_queue(request.key, request.owner)

    def _announce(self, lock: Lock) -> Lock:
        """Send ``lock_acquired``; if a receiver fails, release the lock and raise its error.

        Every receiver runs (``send_robust``), so each one that is told of the
        acquisition is told of the release too. The caller never gets a handle, so
        the key must not stay taken by nobody's handle until its lease ends.
        """
        try:
            failed = _failure(lock_acquired.send_robust(sender=self, lock=lock))
        except BaseException:  # sys.exit() or KeyboardInterrupt in a receiver
            _give_back_quietly(lock)
            raise
        if failed is not None:
            _give_back_quietly(lock)
            raise failed
        return lock

    async def _aannounce(self, lock: Lock) -> Lock:
        """``_announce`` for coroutines: the release goes through the async client."""
        try:
            failed = _failure(lock_acquired.send_robust(sender=self, lock=lock))
        except BaseException:
            await _agive_back_quietly(lock)
            raise
        if failed is not None:
            await _agive_back_quietly(lock)
            raise failed
        return lock

    def _wait(
        self,
        request: _Request,
        limit: float | None,
        sent_at: float,
        info: LockInfo,
        wake: Wake,
    ) -> tuple[float, LockInfo]:
        """Retry until ``key`` is ours: woken by a release, the holder's lease end, or back-off.

        While the change stream was open before the last attempt, any release after that
        attempt wakes this waiter, so it sleeps until the holder's lease end; otherwise it
        backs off with jitter, never past the lease end or the timeout. A waiter with
        others ahead of it in line sleeps through the releases that are theirs.
        """
        started = sent_at
        deadline = None if limit is None else started + limit
        store = self.store
        watcher = self.watcher
        attempt = 0
        seen = 0  # releases counted before the last attempt
        watcher.ensure_running()
        while True:
            wanted, attempt = _next_delay(info, watcher.healthy_since(), sent_at, attempt)
            delay = _within(wanted, deadline)
            if delay is None:
                self._leave_queue(request.key, request.owner)
                raise _busy(info, waited=clock.now() - started)
            wake_at = clock.now() + delay
            needed = _releases_needed(info, request.shared)
            while (left := wake_at - clock.now()) > 0 and wake.wait(left):
                if wake.count - seen >= needed:
                    break
                # A release that a waiter ahead of us takes; if that waiter is gone, its
                # place lapses within the grace period: look again by then.
                wake.clear()
                wake_at = min(wake_at, clock.now() + _BEHIND_IN_LINE)
            wake.clear()
            watcher.ensure_running()
            seen = wake.count
            sent_at = clock.now()
            info = request.attempt(store, queue=True)
            mine = request.taken(info)
            if mine is not None:
                return sent_at, mine

    async def aacquire(
        self,
        key: str,
        *,
        ttl: float | None = None,
        blocking: bool = True,
        timeout: float | None = None,
        shared: bool = False,
        limit: int | None = None,
        on_lost: Callable[[Lock], object] | None = None,
        refresh: bool | None = None,
        reentrant: bool = False,
    ) -> Lock:
        """``acquire`` for coroutines: the same lock, waiting without blocking the loop.

        Queries go through pymongo's async client; waiting is on an asyncio event woken
        by the same change stream; the lease is kept alive by the same refresher.
        ``reentrant=True`` re-enters per asyncio task (two tasks are two holders).
        """
        request = self._request(key, ttl, shared, limit)
        wait = validate_timeout(timeout, blocking=blocking)
        keep = self._keep(refresh)
        check_callback("on_lost", on_lost)
        if not _reentrant(reentrant, shared):
            return await self._aacquire(request, wait, keep, on_lost)
        holder = current_holder(task=True)
        lock = self._reentries.enter(holder, request.key)
        if lock is None:
            lock = await self._aacquire(request, wait, keep, on_lost)
            self._reentries.add(holder, lock)
        return lock

    async def _aacquire(
        self,
        request: _Request,
        wait: float | None,
        keep: bool,
        on_lost: Callable[[Lock], object] | None,
    ) -> Lock:
        store = await self._astore()
        if wait == 0:
            sent_at = clock.now()
            info = await _shielded(store, request, queue=False)
            mine = request.taken(info)
            if mine is None:
                raise _busy(info)
        else:
            with self.waiters.subscribe_async(request.key) as wake:
                try:
                    sent_at = clock.now()
                    info = await _shielded(store, request, queue=True)
                    mine = request.taken(info)
                    if mine is None:
                        sent_at, mine = await self._await(store, request, wait, sent_at, info, wake)
                except BaseException as exc:
                    # Cancelled (a task cancelled, a request aborted): leave the line as
                    # a timeout does, or the next holder would wait for our place. (A
                    # coroutine closed by its garbage collection may not await any more.)
                    if not isinstance(exc, MongoLockError | GeneratorExit):
                        await _leave_line(store, request)
                    raise
        if _late(sent_at, mine):  # see _acquire
            sent_at = clock.now()
            confirmed = await store.refresh(
                request.key, request.owner, mine.token, request.ttl, shared=request.shared
            )
            if confirmed is None:
                raise _busy(mine)
            mine = confirmed
        lock = Lock(self, mine, sent_at, on_lost=on_lost, refresh=keep)
        if keep:
            get_refresher().register(lock)
        return await self._aannounce(lock)

    async def _await(
        self,
        store: AsyncLockStore,
        request: _Request,
        limit: float | None,
        sent_at: float,
        info: LockInfo,
        wake: AsyncWake,
    ) -> tuple[float, LockInfo]:
        """``_wait`` for coroutines: the same schedule, sleeping on an asyncio event."""
        started = sent_at
        deadline = None if limit is None else started + limit
        watcher = self.watcher
        attempt = 0
        seen = 0
        watcher.ensure_running()
        while True:
            wanted, attempt = _next_delay(info, watcher.healthy_since(), sent_at, attempt)
            delay = _within(wanted, deadline)
            if delay is None:
                await _leave_line(store, request)
                raise _busy(info, waited=clock.now() - started)
            wake_at = clock.now() + delay
            needed = _releases_needed(info, request.shared)
            while (left := wake_at - clock.now()) > 0:
                try:
                    # Not wait_for: on Python 3.11 it loses a cancellation that comes
                    # with the wake-up, and the task would wait in line for good.
                    async with asyncio.timeout(left):
                        await wake.wait()
                except TimeoutError:
                    break
                if wake.count - seen >= needed:
                    break
                wake.clear()
                wake_at = min(wake_at, clock.now() + _BEHIND_IN_LINE)
            wake.clear()
            watcher.ensure_running()
            seen = wake.count
            sent_at = clock.now()
            info = await _shielded(store, request, queue=True)
            mine = request.taken(info)
            if mine is not None:
                return sent_at, mine

    def alock(
        self,
        key: str,
        *,
        ttl: float | None = None,
        blocking: bool = True,
        timeout: float | None = None,
        shared: bool = False,
        limit: int | None = None,
        on_lost: Callable[[Lock], object] | None = None,
        refresh: bool | None = None,
        reentrant: bool = False,
        cancel_on_loss: bool = False,
    ) -> LockContext:
        """``async with manager.alock(key) as lk:``: ``aacquire`` on entry, release on exit.

        The same context as ``lock()``, which works with ``with`` and ``async with``.
        ``cancel_on_loss=True`` cancels the task running the block the moment the lock
        is lost; the ``async with`` then raises LockLost (see ``docs/locks.md``).
        """
        return self.lock(
            key,
            ttl=ttl,
            blocking=blocking,
            timeout=timeout,
            shared=shared,
            limit=limit,
            on_lost=on_lost,
            refresh=refresh,
            reentrant=reentrant,
            cancel_on_loss=cancel_on_loss,
        )

    def _leave_queue(self, key: str, owner: str) -> None:
        with contextlib.suppress(MongoLockError):  # the place lapses by itself soon
            self.store.leave_queue(key, owner)

    def lock(
        self,
        key: str,
        *,
        ttl: float | None = None,
        blocking: bool = True,
        timeout: float | None = None,
        shared: bool = False,
        limit: int | None = None,
        on_lost: Callable[[Lock], object] | None = None,
        refresh: bool | None = None,
        reentrant: bool = False,
        cancel_on_loss: bool = False,
    ) -> LockContext:
        """A context manager that acquires ``key`` on entry and releases it on exit.

        ``cancel_on_loss`` works with ``async with`` only (see ``alock``).
        """
        self._request(key, ttl, shared, limit)
        validate_timeout(timeout, blocking=blocking)
        self._keep(refresh)
        check_callback("on_lost", on_lost)
        _reentrant(reentrant, shared)
        if type(cancel_on_loss) is not bool:
            raise TypeError(f"cancel_on_loss must be True or False, not {cancel_on_loss!r}")
        context = LockContext(
            self,
            key,
            ttl=ttl,
            blocking=blocking,
            timeout=timeout,
            shared=shared,
            limit=limit,
            on_lost=on_lost,
            refresh=refresh,
            reentrant=reentrant,
        )
        context.cancel_on_loss = cancel_on_loss
        return context

    def semaphore(self, key: str, limit: int, *, ttl: float | None = None) -> Semaphore:
        """At most ``limit`` holders of ``key`` at once; each gets its own lease and token."""
        return Semaphore(self, key, limit, ttl=ttl)

    def acquire_group(
        self,
        keys: Iterable[str],
        *,
        ttl: float | None = None,
        blocking: bool = True,
        timeout: float | None = None,
        refresh: bool | None = None,
    ) -> LockGroup:
        """Take every key in ``keys`` or none of them, under one group id.

        Keys are taken in one global order (sorted), so two groups over overlapping keys
        never deadlock, whatever order their callers listed the keys in. On a timeout or
        a busy key, the keys already taken are released and LockNotAcquired is raised.
        """
        return LockGroup.acquire(
            self, keys, ttl=ttl, blocking=blocking, timeout=timeout, refresh=refresh
        )

    def elect(
        self,
        key: str,
        *,
        on_elected: Callable[[Election], object] | None = None,
        on_demoted: Callable[[Election], object] | None = None,
        ttl: float | None = None,
    ) -> Election:
        """Campaign for leadership of ``key`` in the background (see Election)."""
        election = Election(self, key, on_elected=on_elected, on_demoted=on_demoted, ttl=ttl)
        election.start()
        return election

    def leader(self, key: str) -> str | None:
        """The owner id of ``key``'s current leader (its live exclusive holder), or None."""
        info = self.store.find(validate_key(key))  # one query: no liveness needed here
        return info.owner if info is not None and info.live and info.owner else None

    def _released(self, lock: Lock, held: bool) -> None:
        """A holder in this process let ``lock`` go: stop refreshing, wake local waiters."""
        if lock.refreshable:
            get_refresher().unregister(lock)
        self._reentries.forget(lock)
        self.waiters.notify(lock.key)

    # -- inspecting and operating ------------------------------------------------------------

    def status(self, key: str) -> LockInfo | None:
        """The lock document of ``key`` (live or expired), or None when there is none.

        With its holder's liveness (``holder_alive``, ``holder_silent_for``): one more query.
        """
        info = self.store.find(validate_key(key))
        return None if info is None else self.store.with_liveness([info])[0]

    def list(
        self,
        state: State = "live",
        prefix: str | None = None,
        *,
        owner: str | None = None,
        limit: int | None = 100,
        offset: int = 0,
        order: Order = "key",
    ) -> builtins.list[LockInfo]:
        """One page of locks, paged by the server (``limit=None``: all of them)."""
        _check_page(limit, offset)
        page = [
            *self.store.scan(state, prefix, owner=owner, limit=limit, offset=offset, order=order)
        ]
        return self.store.with_liveness(page)  # one more query for the whole page

    def iter_locks(
        self,
        state: State = "live",
        prefix: str | None = None,
        *,
        owner: str | None = None,
        order: Order = "key",
        batch_size: int = 1000,
    ) -> Iterator[LockInfo]:
        """Stream every matching lock in batches, without holding them all in memory."""
        return self.store.scan(
            state, prefix, owner=owner, limit=None, order=order, batch_size=batch_size
        )

    def count(
        self, state: State = "all", prefix: str | None = None, owner: str | None = None
    ) -> int:
        return self.store.count(state, prefix, owner)

    def counts(self, soon: float = 10.0) -> dict[str, int]:
        """``{"live", "expired", "expiring"}``: expiring = live with at most ``soon`` s left."""
        return self.store.counts(soon)

    def force_release(
        self, key: str, *, token: int | None = None, reason: str = "", by: str | None = None
    ) -> LockInfo | None:
        """Remove ``key`` whoever holds it (only while its token is ``token``, if given).

        Returns the removed lock, or None when there was none (or the token had changed).
        The former holder finds out at its next refresh: its lock is then lost. The
        release and its audit record (``by``, default ``user@host`` of this process, and
        ``reason``) are written in one transaction: see ``history()``.
        """
        key = validate_key(key)
        if token is not None:
            validate_token(token)
        reason = _audit_text("reason", reason, allow_empty=True)
        by = _audit_text("by", _operator() if by is None else by, allow_empty=False)
        info = self.store.force_release_recorded(key, token, by=by, reason=reason)
        if info is not None:
            logger.info("force-released %r (owner %s, token %s)", key, info.owner, info.token)
            self.waiters.notify(key)
        return info

    def history(self, key: str, *, limit: int | None = 100) -> builtins.list[AuditEntry]:
        """The force releases of ``key`` still on record (``audit_retention``), newest first."""
        _check_page(limit, 0)
        return self.store.history(validate_key(key), limit)

    def server_kind(self) -> str:
        """``"replica set"``, ``"sharded"`` or ``"standalone"`` (the last one is refused)."""
        return self.store.server_kind()

    def ensure_indexes(self) -> builtins.list[IndexAction]:
        """Create or update the unique and TTL indexes (what ``migrate_mongolock`` runs)."""
        return [
            *self.store.ensure_indexes(self.retention),
            *self.store.ensure_side_indexes(self.retention, self.audit_retention),
        ]

    def check_indexes(self) -> builtins.list[IndexAction]:
        """What ``ensure_indexes`` would do, without doing it."""
        return [
            *self.store.check_indexes(self.retention),
            *self.store.check_side_indexes(self.retention, self.audit_retention),
        ]


class LockContext:
    """``with manager.lock(key) as lk:`` (or ``async with``): acquire on entry, release on exit.

    Leaving the block after the lock was lost does not raise: the loss was already
    signalled (``lk.lost``, ``lock_lost``) and is logged again here; unless
    ``cancel_on_loss`` cancelled the block, which then ends with LockLost.
    """

    __slots__ = ("_guard", "_kwargs", "_lock", "_manager", "cancel_on_loss", "key")

    def __init__(self, manager: LockManager, key: str, **kwargs: Any) -> None:
        self._manager = manager
        self.key = key
        self._kwargs = kwargs
        self._lock: Lock | None = None
        self.cancel_on_loss = False
        self._guard: CancelOnLoss | None = None

    def __enter__(self) -> Lock:
        if self._lock is not None:
            raise RuntimeError(f"the lock context for {self.key!r} is already entered")
        if self.cancel_on_loss:
            raise TypeError(
                f"cancel_on_loss cancels an asyncio task: use 'async with' for {self.key!r}, "
                "or lk.check() and lk.lost in sync code"
            )
        self._lock = self._manager.acquire(self.key, **self._kwargs)
        return self._lock

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.__exit__(exc_type, exc, tb)

    async def __aenter__(self) -> Lock:
        if self._lock is not None:
            raise RuntimeError(f"the lock context for {self.key!r} is already entered")
        if self.cancel_on_loss and asyncio.current_task() is None:
            raise RuntimeError("cancel_on_loss needs to run in an asyncio task")
        lock = await self._manager.aacquire(self.key, **self._kwargs)
        self._lock = lock
        if self.cancel_on_loss:
            self._guard = CancelOnLoss(lock)
        return lock

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        lock, self._lock = self._lock, None
        guard, self._guard = self._guard, None
        lost = None if guard is None else guard.exit(exc)
        if lock is None:
            return
        if lost is None:
            await lock.__aexit__(exc_type, exc, tb)
            return
        try:
            await lock.arelease()
        except MongoLockError as error:  # the lease ends by itself
            logger.warning("could not release lost lock %r: %s", lock.key, error)
        raise lost from exc


class _OwnerIds:
    """This process's source of holder ids: its host, its pid and a counter from a random start.

    A counter rather than fresh randomness per acquisition: unique all the same within
    the process, and no system call on the hot path.
    """

    __slots__ = ("host", "pid", "serial")

    def __init__(self) -> None:
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.serial = itertools.count(secrets.randbits(48))


_ids: _OwnerIds | None = None


def _owner_ids() -> _OwnerIds:
    """The ids of this process (a forked child starts its own)."""
    global _ids
    ids = _ids
    if ids is None or ids.pid != os.getpid():
        ids = _ids = _OwnerIds()
    return ids


@dataclass(frozen=True, slots=True)
class _Request:
    """One acquisition: the key, this attempt's owner id, and what kind of lease."""

    key: str
    owner: str
    ttl: float
    shared: bool = False
    limit: int | None = None
    tags: Mapping[str, str] | None = None

    def arguments(self, *, queue: bool) -> dict[str, Any]:
        """The store's ``acquire`` arguments (the sync and the async store take the same)."""
        return {
            "key": self.key,
            "owner": self.owner,
            "ttl": self.ttl,
            "queue": queue,
            "shared": self.shared,
            "limit": self.limit,
            "tags": self.tags,
        }

    def attempt(self, store: LockStore, *, queue: bool) -> LockInfo:
        return store.acquire(**self.arguments(queue=queue))

    def taken(self, info: LockInfo) -> LockInfo | None:
        """This request's lease, if the attempt that returned ``info`` got one."""
        if self.shared:
            return info.as_holder(self.owner)
        return info if info.owner == self.owner else None


async def _shielded(store: AsyncLockStore, request: _Request, *, queue: bool) -> LockInfo:
    """One attempt that a cancellation cannot cut in half.

    If the caller is cancelled while the attempt is in flight, the attempt still
    completes, and a lock it took is released at once instead of being left to lapse.
    The cancellation waits for the attempt (unless cancelled again), so that leaving
    the line afterwards comes after the attempt that took the place.
    """
    attempt = asyncio.ensure_future(store.acquire(**request.arguments(queue=queue)))
    try:
        return await asyncio.shield(attempt)
    except asyncio.CancelledError:
        attempt.add_done_callback(functools.partial(_give_back, store, request))
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait([attempt])
        raise


def _give_back(store: AsyncLockStore, request: _Request, attempt: asyncio.Future[LockInfo]) -> None:
    if attempt.cancelled() or attempt.exception() is not None:
        return
    mine = request.taken(attempt.result())
    if mine is None:
        return
    _in_background(store.release(mine.key, mine.owner, mine.token, shared=request.shared))


async def _leave_line(store: AsyncLockStore, request: _Request) -> None:
    """Give up a waiter's place in line, even if the caller is cancelled meanwhile.

    The write runs as a task of its own: a cancellation stops the wait for it, not it.
    """
    leave = _in_background(store.leave_queue(request.key, request.owner))
    with contextlib.suppress(MongoLockError):  # the place lapses by itself soon
        await asyncio.shield(leave)


def _in_background(work: Coroutine[Any, Any, _T]) -> asyncio.Future[_T]:
    """Run ``work`` as a task that nobody may be left to await: kept referenced until
    done, its error (the lease or the place lapses by itself) not reported twice.
    """
    task = asyncio.ensure_future(work)
    _ABANDONED.add(task)
    task.add_done_callback(_forget)
    return task


def _forget(task: asyncio.Future[Any]) -> None:
    _ABANDONED.discard(task)
    if not task.cancelled():
        task.exception()  # retrieved: no "exception was never retrieved" at exit


# Clean-up writes of cancelled acquisitions, kept referenced until they finish.
_ABANDONED: set[asyncio.Future[Any]] = set()


def _failure(responses: builtins.list[tuple[Any, Any]]) -> BaseException | None:
    """The first error of ``send_robust`` responses (Django logs each of them)."""
    return next((r for _, r in responses if isinstance(r, BaseException)), None)


def _late(sent_at: float, mine: LockInfo) -> bool:
    """Whether less than half the lease is left by the holder's bound (sent + lease - margin)."""
    left = sent_at + mine.remaining - clock.margin(mine.ttl) - clock.now()
    return left < mine.ttl / 2


def _give_back_quietly(lock: Lock) -> None:
    """Release a lock its caller will never get; if that fails, its lease lapses."""
    try:
        lock.release()
    except MongoLockError as exc:
        logger.warning("could not release %r after a failed receiver: %s", lock.key, exc)


async def _agive_back_quietly(lock: Lock) -> None:
    try:
        await lock.arelease()
    except MongoLockError as exc:
        logger.warning("could not release %r after a failed receiver: %s", lock.key, exc)


def _next_delay(
    info: LockInfo, stream_since: float | None, sent_at: float, attempt: int
) -> tuple[float, int]:
    """How long to sleep before the next attempt, and the next back-off step."""
    lease_end = max(info.next_free_in, 0.0) + 0.001
    streamed = stream_since is not None and stream_since <= sent_at
    # A lease that has ended (its holder crashed) ends no later: no release will come,
    # and trying again at once only spins while a waiter ahead keeps its place.
    running = info.held and info.next_free_in > 0
    if running and streamed:
        # The stream was open before the last attempt: any release after it wakes us.
        return lease_end, attempt
    if streamed and info.position > 0:
        # Free, with others ahead in line: their releases wake us; the timer only keeps
        # our place in line (it lapses PLACE_GRACE after our last attempt).
        return _BEHIND_IN_LINE, attempt
    # No stream to wake us, or the lock is free with others ahead in line.
    delay = min(_BACKOFF_CAP, _BACKOFF_BASE * 2**attempt) * random.uniform(0.5, 1.0)
    if running:
        delay = min(delay, lease_end)
    return delay, min(attempt + 1, 16)


def _releases_needed(info: LockInfo, shared: bool) -> int:
    """Releases to sleep through before trying again: one per waiter ahead, plus the holder's.

    Counting may err (a release seen twice, a place ahead that lapsed): then the waiter
    tries once too early, or sleeps until its timer, never past it. Shared waiters may
    get in together, so they try after every release.
    """
    if shared or info.position <= 0:
        return 1
    return info.position + (1 if info.held else 0)


def _within(delay: float, deadline: float | None) -> float | None:
    """``delay`` cut to the caller's deadline; None once the deadline has passed."""
    if deadline is None:
        return delay
    left = deadline - clock.now()
    return None if left <= 0 else min(delay, left)


def _busy(info: LockInfo, waited: float | None = None) -> LockNotAcquired:
    if info.owner:
        return LockNotAcquired(info.key, info.owner, info.expires_at, waited=waited)
    if info.held:
        first_end = min(holder.expires_at for holder in info.live_holders)
        return LockNotAcquired(info.key, info.holder_label, first_end, waited=waited)
    return LockNotAcquired(info.key, None, None, waited=waited, waiting=info.waiting)


# Longest ``by`` or ``reason`` an audit record keeps.
_AUDIT_TEXT_MAX = 1000


def _audit_text(name: str, value: object, *, allow_empty: bool) -> str:
    """``value`` checked for an audit record: a str, not too long, without NUL."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, not {type(value).__name__}")
    if (not value and not allow_empty) or len(value) > _AUDIT_TEXT_MAX or "\x00" in value:
        raise ValueError(
            f"{name} must be {'' if allow_empty else 'a non-empty '}text of at most "
            f"{_AUDIT_TEXT_MAX} characters without NUL, got {value[:80]!r}"
        )
    return value


def _operator() -> str:
    """Who runs this process, for the audit trail: ``user@host`` (``(sudo from U)``).

    The name comes from the effective uid, not from LOGNAME or USER, which anyone can
    set; a sudo run also names the user who ran sudo.
    """
    who = f"{_user_name()}@{socket.gethostname()}"
    sudo = os.environ.get("SUDO_USER")
    return f"{who} (sudo from {sudo})" if sudo else who


def _user_name() -> str:
    """The effective user's name from the password database; the uid if it has none."""
    try:
        import pwd
    except ImportError:  # pragma: no cover - no pwd (Windows)
        try:
            return getpass.getuser()
        except (KeyError, OSError):
            return "unknown"
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:  # no name for this uid (a bare container)
        return str(os.geteuid())


def _reentrant(reentrant: bool, shared: bool) -> bool:
    if type(reentrant) is not bool:
        raise TypeError(f"reentrant must be True or False, not {reentrant!r}")
    if reentrant and shared:
        raise ValueError("reentrant=True is for exclusive locks; shared locks are not reentrant")
    return reentrant


def _check_page(limit: int | None, offset: int) -> None:
    if limit is not None and (type(limit) is not int or limit < 0):
        raise ValueError(f"limit must be a whole number >= 0 or None, got {limit!r}")
    if type(offset) is not int or offset < 0:
        raise ValueError(f"offset must be a whole number >= 0, got {offset!r}")
