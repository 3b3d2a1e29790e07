"""LockManager: the facade that checks every argument, then hands the work to the layer below.

Connections live in ``connection.py``, the acquire loops in ``acquiring.py`` (following
the wait plan of ``acquirer.py``), the handle in ``lock.py``, semaphores, groups and
elections in ``recipes/``, the queries in ``queries/``, sent by ``store/``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any

from pymongo import MongoClient

from django_mongolock import acquiring
from django_mongolock.acquirer import Request
from django_mongolock.astore import AsyncLockStore
from django_mongolock.connection import DEFAULT_URL, Connection, client_options
from django_mongolock.context import LockContext
from django_mongolock.lock import Lock
from django_mongolock.operations import Operations
from django_mongolock.owners import host_prefix, new_owner, owner_prefix
from django_mongolock.queries import check_limit
from django_mongolock.recipes import Election, LockGroup, Semaphore
from django_mongolock.reentry import Reentries, current_holder
from django_mongolock.refresher import get_refresher
from django_mongolock.store import LockStore
from django_mongolock.validation import (
    check_callback,
    validate_flag,
    validate_keep,
    validate_key,
    validate_limit,
    validate_name,
    validate_owner,
    validate_reentrant,
    validate_retention,
    validate_timeout,
    validate_ttl,
)
from django_mongolock.waiters import Waiters
from django_mongolock.watcher import Watcher

__all__ = ["DEFAULT_URL", "LockContext", "LockManager"]

logger = logging.getLogger("django_mongolock.manager")


class LockManager(Operations):
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
        shared_stream: bool = False,
    ) -> None:
        if url is not None and client is not None:
            raise ValueError("give either url or client, not both")
        if url is not None and not isinstance(url, str):
            raise TypeError(f"url must be a str, not {type(url).__name__}")
        validate_retention(retention)
        if audit_retention is not None:
            validate_retention(audit_retention, name="audit_retention")
        validate_flag("refresh", refresh)
        validate_flag("shared_stream", shared_stream)
        validate_owner(owner)
        validate_name("database", database)
        validate_name("collection", collection)
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
        # Whether the processes of this user on this host share one change stream.
        self.shared_stream = shared_stream
        self._reentries = Reentries()
        self._connection = Connection(
            self.url,
            client,
            database,
            collection,
            self._client_options,
            repr(self),
            lambda: owner_prefix(self.owner),
            lambda: host_prefix(self.owner) if self.shared_stream else None,
        )

    def __repr__(self) -> str:
        return f"<LockManager {self.database}.{self.collection}>"

    # -- connection (see connection.py) ------------------------------------------------------

    @property
    def client(self) -> MongoClient[Any]:
        """This process's client (a child process after fork gets a new one)."""
        return self._connection.client

    @property
    def store(self) -> LockStore:
        return self._connection.store

    async def astore(self) -> AsyncLockStore:
        """This event loop's async store (one client per loop, closed with the loop)."""
        return await self._connection.astore()

    @property
    def closed(self) -> bool:
        return self._connection.closed

    @property
    def waiters(self) -> Waiters:
        """This process's blocked acquirers, by key (a forked child starts with none)."""
        return self._connection.waiters

    @property
    def watcher(self) -> Watcher:
        """This process's change stream watcher for the lock collection (started on need)."""
        return self._connection.watcher

    def _client_options(self) -> dict[str, Any]:
        """The driver's options for this manager's clients (a subclass may add to them)."""
        return client_options(self.server_selection_timeout)

    async def aclose(self) -> None:
        """Close the async client of the running event loop (``close()`` does the rest)."""
        await self._connection.aclose()

    def close(self) -> None:
        """Stop the watcher and close the client this manager built (a given one stays open).

        A closed manager cannot be used again; locks it still holds are no longer refreshed.
        """
        self._connection.close()

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

    def _resolved(self) -> LockManager:
        """This manager (the lazy default manager answers the one its settings describe)."""
        return self

    def new_owner(self) -> str:
        """A holder id unique per acquisition: ``host:pid:random`` (or ``OWNER:pid:random``)."""
        return new_owner(self.owner)

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
        request, wait, keep = self._check(key, ttl, blocking, timeout, shared, limit, refresh)
        check_callback("on_lost", on_lost)
        if not validate_reentrant(reentrant, shared=shared):
            return acquiring.acquire(self, request, wait, keep, on_lost)
        # The running asyncio task if there is one: tasks sharing a loop's thread are
        # separate holders, and one must not be handed another's handle.
        holder = current_holder(task=True)
        lock = self._reentries.enter(holder, request.key)
        if lock is None:
            lock = acquiring.acquire(self, request, wait, keep, on_lost)
            self._reentries.add(holder, lock)
        return lock

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
        request, wait, keep = self._check(key, ttl, blocking, timeout, shared, limit, refresh)
        check_callback("on_lost", on_lost)
        if not validate_reentrant(reentrant, shared=shared):
            return await acquiring.aacquire(self, request, wait, keep, on_lost)
        holder = current_holder(task=True)
        lock = self._reentries.enter(holder, request.key)
        if lock is None:
            lock = await acquiring.aacquire(self, request, wait, keep, on_lost)
            self._reentries.add(holder, lock)
        return lock

    def _check(
        self,
        key: str,
        ttl: float | None,
        blocking: bool,
        timeout: float | None,
        shared: bool,
        limit: int | None,
        refresh: bool | None,
    ) -> tuple[Request, float | None, bool]:
        """Check every argument before any I/O: the request, the wait, whether to keep it."""
        key = validate_key(key)
        lease = self.ttl if ttl is None else validate_ttl(ttl)
        validate_flag("shared", shared)
        limit = validate_limit(limit, shared=shared)
        check_limit(shared, limit)
        wait = validate_timeout(timeout, blocking=blocking)
        keep = validate_keep(refresh, self.refresh)
        return Request(key, self.new_owner(), lease, shared, limit), wait, keep

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

        ``with`` acquires and releases; ``async with`` (also spelled ``alock()``) does the
        same through ``aacquire`` and ``arelease``. ``cancel_on_loss=True`` works with
        ``async with`` only: it cancels the task running the block the moment the lock is
        lost, and the block then ends with LockLost (see ``docs/locks.md``).
        """
        self._check(key, ttl, blocking, timeout, shared, limit, refresh)
        check_callback("on_lost", on_lost)
        validate_reentrant(reentrant, shared=shared)
        validate_flag("cancel_on_loss", cancel_on_loss)
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

    # The same context: ``async with manager.alock(key)`` reads better in async code.
    alock = lock

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

    def on_release(self, lock: Lock) -> None:
        """A holder in this process let ``lock`` go: stop refreshing, wake local waiters."""
        if lock.refreshable:
            get_refresher().unregister(lock)
        self._reentries.forget(lock)
        self.waiters.notify(lock.key)
