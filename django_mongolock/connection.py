"""One manager's way to the server: a client per process, an async store per event loop.

pymongo clients are not fork-safe and async clients cannot cross event loops, so both
are built lazily where they are used: a process forked after the first use builds its
own client (and its own waiters and change stream watcher), and each event loop gets
its own async client, closed when the loop shuts down.
"""

from __future__ import annotations

import asyncio
import os
import threading
import weakref
from collections.abc import AsyncGenerator, Callable
from typing import Any

from pymongo import AsyncMongoClient, MongoClient
from pymongo.errors import ConfigurationError as PyMongoConfigurationError
from pymongo.errors import InvalidURI

from django_mongolock import relay
from django_mongolock.astore import AsyncLockStore
from django_mongolock.exceptions import ConfigurationError, MongoLockError
from django_mongolock.mongo import redact
from django_mongolock.store import LockStore
from django_mongolock.waiters import Waiters
from django_mongolock.watcher import Watcher

__all__ = ["DEFAULT_URL", "Connection", "client_options"]

DEFAULT_URL = "mongodb://localhost:27017/"

# Closes an event loop's async client when the loop finalizes its async generators.
_Closer = AsyncGenerator[None, None]

# Every connection of this process, so that a forked child can renew their mutexes.
_connections: weakref.WeakSet[Connection] = weakref.WeakSet()


def _renew_in_child() -> None:
    for connection in list(_connections):
        connection.after_fork_in_child()


os.register_at_fork(after_in_child=_renew_in_child)


def client_options(server_selection_timeout: float) -> dict[str, Any]:
    """The driver's options: every operation, retries included, ends within the server
    selection timeout, so an outage is reported instead of hanging a waiter or the refresher.
    """
    timeout_ms = round(server_selection_timeout * 1000)
    return {
        "appname": "django-mongolock",
        "serverSelectionTimeoutMS": timeout_ms,
        "connectTimeoutMS": timeout_ms,
        "timeoutMS": timeout_ms,
        "retryWrites": True,
        "w": "majority",
        "tz_aware": True,
    }


class Connection:
    """The client, store, async stores, waiters and watcher of one lock collection.

    ``options`` gives the driver's options when a client is built (a manager's
    ``_client_options``, which a subclass may extend). ``name`` is what errors call it
    (the manager's repr): a closed connection refuses any further use, naming it.
    ``prefix_of`` tells what the holder ids of this process's waiters start with, so that
    the watcher streams only the handoffs to them (None: every handoff);
    ``shared_prefix_of``, what those of every process on the host start with when they
    share one stream through a relay (None: they do not).
    """

    def __init__(
        self,
        url: str | None,
        client: MongoClient[Any] | None,
        database: str,
        collection: str,
        options: Callable[[], dict[str, Any]],
        name: str,
        prefix_of: Callable[[], str | None] = lambda: None,
        shared_prefix_of: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.url = url
        self.database = database
        self.collection = collection
        self._options = options
        self.name = name
        self._prefix_of = prefix_of
        self._shared_prefix_of = shared_prefix_of
        self._waiters = Waiters()
        self._given_client = client
        self._client: MongoClient[Any] | None = None
        self._store: LockStore | None = None
        self._pid = 0
        self._build_mutex = threading.Lock()
        self._watcher: Watcher | None = None
        self.closed = False
        # One async client per event loop (they cannot cross loops), closed and dropped
        # when the loop shuts down; a loop closed without that is swept out later. The
        # client refers to its loop, so weak keys would never let go: a plain dict.
        self._astores: dict[asyncio.AbstractEventLoop, tuple[AsyncLockStore, _Closer]] = {}
        self._astores_mutex = threading.Lock()
        _connections.add(self)

    def after_fork_in_child(self) -> None:
        """New mutexes (a parent's thread may have held one at the fork), no async clients."""
        self._build_mutex = threading.Lock()
        self._astores_mutex = threading.Lock()
        self._astores = {}

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

    def _connect(self) -> LockStore:
        with self._build_mutex:
            if self.closed:
                raise MongoLockError(f"{self.name} is closed")
            if self._store is not None and self._pid == os.getpid():
                return self._store
            given = self._given_client
            self._client = given if given is not None else self._new_client()
            self._store = LockStore(self._client[self.database][self.collection])
            self._pid = os.getpid()
            return self._store

    def _new_client(self) -> MongoClient[Any]:
        assert self.url is not None
        try:
            return MongoClient(self.url, **self._options())
        except (InvalidURI, PyMongoConfigurationError, ValueError, TypeError) as exc:
            raise ConfigurationError(f"invalid MongoDB URL: {redact(str(exc))}") from exc

    async def astore(self) -> AsyncLockStore:
        """This event loop's async store, built on first use, closed and dropped with the loop.

        A client given to the manager is sync, so its URL is unknown: the async API needs
        a manager built from a URL.
        """
        loop = asyncio.get_running_loop()
        entry = self._astores.get(loop)
        if entry is not None:
            return entry[0]
        if self.closed:
            raise MongoLockError(f"{self.name} is closed")
        if self.url is None:
            raise ConfigurationError("the async API needs a LockManager built from a URL")
        try:
            client: AsyncMongoClient[Any] = AsyncMongoClient(self.url, **self._options())
        except (InvalidURI, PyMongoConfigurationError, ValueError, TypeError) as exc:
            raise ConfigurationError(f"invalid MongoDB URL: {redact(str(exc))}") from exc
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
                    self._watcher = Watcher(
                        lambda: self.store, waiters, self._prefix_of, self._relay
                    )
                watcher = self._watcher
        return watcher

    def _relay(self) -> relay.Place | None:
        """Where this collection's relay is, when the processes of the host share one
        stream (only for a connection built from a URL: a given client may differ)."""
        prefix = self._shared_prefix_of()
        if prefix is None or self.url is None:
            return None
        return relay.place(self.url, self.database, self.collection, prefix)

    def close(self) -> None:
        """Stop the watcher and close the client built here (a given one stays open)."""
        watcher = self._watcher
        if watcher is not None and watcher.pid == os.getpid():
            watcher.stop()
        with self._astores_mutex:
            astores, self._astores = self._astores, {}
        for loop, (_, closer) in astores.items():
            if loop.is_running() and not loop.is_closed():
                asyncio.run_coroutine_threadsafe(closer.aclose(), loop)
        with self._build_mutex:
            self.closed = True
            if self._client is not None and self._given_client is None and self._pid == os.getpid():
                self._client.close()
            self._client = None
            self._store = None
