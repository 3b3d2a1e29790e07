"""LockManager: the client, owner ids, acquiring (with waiting), status and listing."""

from __future__ import annotations

import builtins
import logging
import os
import random
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

from pymongo import MongoClient
from pymongo.errors import ConfigurationError as PyMongoConfigurationError
from pymongo.errors import InvalidURI

from django_mongolock.exceptions import ConfigurationError, LockNotAcquired, MongoLockError
from django_mongolock.lock import Lock
from django_mongolock.refresher import get_refresher
from django_mongolock.signals import lock_acquired
from django_mongolock.store import IndexAction, LockInfo, LockStore, Order, State
from django_mongolock.validation import validate_key, validate_timeout, validate_ttl
from django_mongolock.waiters import Waiters
from django_mongolock.watcher import Watcher

__all__ = ["DEFAULT_URL", "LockManager"]

logger = logging.getLogger("django_mongolock.manager")

DEFAULT_URL = "mongodb://localhost:27017/"

# Back-off of a blocked acquirer: doubling from 10 ms up to 500 ms, each sleep drawn from
# [half, full] of that, and never past the holder's lease end or the caller's timeout.
_BACKOFF_BASE = 0.01
_BACKOFF_CAP = 0.5


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
    ) -> None:
        if url is not None and client is not None:
            raise ValueError("give either url or client, not both")
        if url is not None and not isinstance(url, str):
            raise TypeError(f"url must be a str, not {type(url).__name__}")
        if type(retention) is not int or retention < 0:
            raise ValueError(f"retention must be a whole number of seconds >= 0, got {retention!r}")
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
        self.refresh = refresh
        self.server_selection_timeout = validate_ttl(
            server_selection_timeout, name="server_selection_timeout"
        )
        self.owner = owner
        self._waiters = Waiters()
        self._given_client = client
        self._client: MongoClient[Any] | None = None
        self._store: LockStore | None = None
        self._pid = 0
        self._build_mutex = threading.Lock()
        self._watcher: Watcher | None = None
        self._closed = False

    def __repr__(self) -> str:
        return f"<LockManager {self.database}.{self.collection}>"

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

    def _new_client(self) -> MongoClient[Any]:
        assert self.url is not None
        timeout_ms = round(self.server_selection_timeout * 1000)
        try:
            return MongoClient(
                self.url,
                appname="django-mongolock",
                serverSelectionTimeoutMS=timeout_ms,
                connectTimeoutMS=timeout_ms,
                # Every operation, retries included, ends within this time, so an outage
                # is reported instead of hanging a waiter or the refresher.
                timeoutMS=timeout_ms,
                retryWrites=True,
                w="majority",
                tz_aware=True,
            )
        except (InvalidURI, PyMongoConfigurationError, ValueError, TypeError) as exc:
            raise ConfigurationError(f"invalid MongoDB URL: {exc}") from exc

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
        prefix = self.owner or socket.gethostname()
        return f"{prefix}:{os.getpid()}:{secrets.token_hex(6)}"

    def acquire(
        self,
        key: str,
        *,
        ttl: float | None = None,
        blocking: bool = True,
        timeout: float | None = None,
        on_lost: Callable[[Lock], object] | None = None,
        refresh: bool | None = None,
    ) -> Lock:
        """Take ``key``; wait while it is busy if ``blocking``, at most ``timeout`` seconds.

        Raises LockNotAcquired naming the holder when busy and not waiting, or when the
        timeout passes; ServerUnavailable at once when MongoDB cannot be reached. The
        lease is kept alive in the background unless ``refresh`` (default: the manager's
        ``refresh``) is False; ``on_lost`` is called once if the lock is lost.
        """
        key = validate_key(key)
        lease = self.ttl if ttl is None else validate_ttl(ttl)
        limit = validate_timeout(timeout, blocking=blocking)
        keep = self.refresh if refresh is None else refresh
        if type(keep) is not bool:
            raise TypeError(f"refresh must be True, False or None, not {refresh!r}")
        store = self.store
        owner = self.new_owner()
        if limit == 0:
            sent_at = time.monotonic()
            info = store.acquire(key, owner, lease)
            if info.owner != owner:
                raise _busy(info)
        else:
            # Subscribe before the first attempt: a release right after it must wake us.
            with self.waiters.subscribe(key) as wake:
                sent_at = time.monotonic()
                info = store.acquire(key, owner, lease, queue=True)
                if info.owner != owner:
                    sent_at, info = self._wait(key, owner, lease, limit, sent_at, info, wake)
        lock = Lock(self, info, sent_at, on_lost=on_lost, refresh=keep)
        if keep:
            get_refresher().register(lock)
        lock_acquired.send(sender=self, lock=lock)
        return lock

    def _wait(
        self,
        key: str,
        owner: str,
        lease: float,
        limit: float | None,
        sent_at: float,
        info: LockInfo,
        wake: threading.Event,
    ) -> tuple[float, LockInfo]:
        """Retry until ``key`` is ours: woken by a release, the holder's lease end, or back-off.

        While the change stream was open before the last attempt, any release after that
        attempt wakes this waiter, so it sleeps until the holder's lease end; otherwise it
        backs off with jitter, never past the lease end or the timeout.
        """
        started = sent_at
        deadline = None if limit is None else started + limit
        store = self.store
        watcher = self.watcher
        attempt = 0
        watcher.ensure_running()
        while True:
            since = watcher.healthy_since()
            if info.held and since is not None and since <= sent_at:
                delay = max(info.remaining, 0.0) + 0.001
            else:
                # No stream to wake us, or the lock is free with others ahead in line.
                backoff = min(_BACKOFF_CAP, _BACKOFF_BASE * 2**attempt)
                delay = backoff * random.uniform(0.5, 1.0)
                if info.held:
                    delay = min(delay, max(info.remaining, 0.0) + 0.001)
                attempt = min(attempt + 1, 16)
            now = time.monotonic()
            if deadline is not None:
                if now >= deadline:
                    self._leave_queue(key, owner)
                    raise _busy(info, waited=now - started)
                delay = min(delay, deadline - now)
            wake.wait(delay)
            wake.clear()
            watcher.ensure_running()
            sent_at = time.monotonic()
            info = store.acquire(key, owner, lease, queue=True)
            if info.owner == owner:
                return sent_at, info

    def _leave_queue(self, key: str, owner: str) -> None:
        try:
            self.store.leave_queue(key, owner)
        except MongoLockError as exc:  # the place lapses by itself soon
            logger.info("could not leave the line of %r: %s", key, exc)

    def lock(
        self,
        key: str,
        *,
        ttl: float | None = None,
        blocking: bool = True,
        timeout: float | None = None,
        on_lost: Callable[[Lock], object] | None = None,
        refresh: bool | None = None,
    ) -> LockContext:
        """A context manager that acquires ``key`` on entry and releases it on exit."""
        validate_key(key)
        if ttl is not None:
            validate_ttl(ttl)
        validate_timeout(timeout, blocking=blocking)
        return LockContext(
            self,
            key,
            ttl=ttl,
            blocking=blocking,
            timeout=timeout,
            on_lost=on_lost,
            refresh=refresh,
        )

    def _released(self, lock: Lock, held: bool) -> None:
        """A holder in this process let ``lock`` go: stop refreshing, wake local waiters."""
        if lock.refreshable:
            get_refresher().unregister(lock)
        self.waiters.notify(lock.key)

    # -- inspecting and operating ------------------------------------------------------------

    def status(self, key: str) -> LockInfo | None:
        """The lock document of ``key`` (live or expired), or None when there is none."""
        return self.store.find(validate_key(key))

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
        return [
            *self.store.scan(state, prefix, owner=owner, limit=limit, offset=offset, order=order)
        ]

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

    def force_release(self, key: str, *, token: int | None = None) -> LockInfo | None:
        """Remove ``key`` whoever holds it (only while its token is ``token``, if given).

        Returns the removed lock, or None when there was none (or the token had changed).
        The former holder finds out at its next refresh: its lock is then lost.
        """
        key = validate_key(key)
        if token is not None and (type(token) is not int):
            raise TypeError(f"token must be an int, not {type(token).__name__}")
        info = self.store.force_release(key, token)
        if info is not None:
            logger.info("force-released %r (owner %s, token %s)", key, info.owner, info.token)
            self.waiters.notify(key)
        return info

    def server_kind(self) -> str:
        """``"replica set"``, ``"sharded"`` or ``"standalone"`` (the last one is refused)."""
        return self.store.server_kind()

    def ensure_indexes(self) -> builtins.list[IndexAction]:
        """Create or update the unique and TTL indexes (what ``migrate_mongolock`` runs)."""
        return self.store.ensure_indexes(self.retention)

    def check_indexes(self) -> builtins.list[IndexAction]:
        """What ``ensure_indexes`` would do, without doing it."""
        return self.store.check_indexes(self.retention)


class LockContext:
    """``with manager.lock(key) as lk:``: acquire on entry, release on exit.

    Leaving the block after the lock was lost does not raise: the loss was already
    signalled (``lk.lost``, ``lock_lost``) and is logged again here.
    """

    __slots__ = ("_kwargs", "_lock", "_manager", "key")

    def __init__(self, manager: LockManager, key: str, **kwargs: Any) -> None:
        self._manager = manager
        self.key = key
        self._kwargs = kwargs
        self._lock: Lock | None = None

    def __enter__(self) -> Lock:
        if self._lock is not None:
            raise RuntimeError(f"the lock context for {self.key!r} is already entered")
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


def _busy(info: LockInfo, waited: float | None = None) -> LockNotAcquired:
    if info.held:
        return LockNotAcquired(info.key, info.owner, info.expires_at, waited=waited)
    return LockNotAcquired(info.key, None, None, waited=waited, waiting=info.waiting)


def _check_page(limit: int | None, offset: int) -> None:
    if limit is not None and (type(limit) is not int or limit < 0):
        raise ValueError(f"limit must be a whole number >= 0 or None, got {limit!r}")
    if type(offset) is not int or offset < 0:
        raise ValueError(f"offset must be a whole number >= 0, got {offset!r}")
