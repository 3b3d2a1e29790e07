"""The locks under test behind one small interface: try once, wait, release.

* ``floor``: the fewest round trips a correct MongoDB lock can make, written here with the
  raw driver. Acquire is one ``find_one_and_update`` upsert whose update pipeline decides
  with ``$$NOW``; release is one ``delete_one`` by key and owner; waiting is polling.
* ``ours``: django-mongolock's ``LockManager`` with its defaults (background refresh, waiters
  woken through the change stream).
* ``redis``: python-redis-lock on a local ``redis-server`` (waiters woken by the release).

``ours`` may also carry instrumentation (``Spec.instrument``): the observers it names are
installed in the worker process when the contender is built and removed by its ``close()``.

A spec is plain data, so that worker processes can build their own clients from it.
"""

from __future__ import annotations

import importlib
import itertools
import logging
import os
import secrets
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol

from pymongo import MongoClient, ReturnDocument, monitoring
from pymongo.collection import Collection
from pymongo.errors import DuplicateKeyError, PyMongoError, ServerSelectionTimeoutError
from pymongo.write_concern import WriteConcern

from benchmarks.instruments import instrument
from django_mongolock import LockManager, LockNotAcquired, ServerUnavailable

__all__ = ["DATABASE", "TTL", "Contender", "ListenedManager", "Spec", "build", "quiet_peers"]

DATABASE: Final = "mongolock_bench"
# Leases long enough that no lock of a workload expires while it is measured.
TTL: Final = 30.0
# Generous bound on a blocking acquire: a workload that waits this long is broken.
ACQUIRE_TIMEOUT: Final = 60.0

Kind = Literal["ours", "floor", "redis"]


@dataclass(frozen=True, slots=True)
class Spec:
    """What a worker builds: the lock kind, its server and, for the floor, how it polls."""

    label: str
    kind: Kind
    url: str
    collection: str = "locks"
    poll: float = 0.1
    blocking: bool = True
    """For the uncontended workload: acquire with the blocking call (the default API)."""
    refresh: bool = True
    shared_stream: bool = False
    """For ``ours``: the processes of the host share one change stream (``SHARED_STREAM``)."""
    instrument: str = ""
    """For ``ours``: observers to install while the contender lives, joined by ``+``
    (``prometheus``, ``otel``, ``stats``); empty for none (``benchmarks.instruments``)."""


def _late(error: BaseException | None) -> bool:
    """A driver error that says a server answered too late; not one that found no server
    to ask, which the driver counts as a timeout too."""
    return (
        isinstance(error, PyMongoError)
        and error.timeout
        and not isinstance(error, ServerSelectionTimeoutError)
    )


class Contender(Protocol):
    def timed_out(self, error: Exception) -> bool:
        """Whether ``error`` says the server did not answer within its time limit (a
        loaded machine): a blocking workload counts such calls and goes on, while any
        other error, a server down among them, ends the run."""

    def try_acquire(self, key: str) -> object | None:
        """Take ``key`` if it is free: a handle, or None when it is busy."""

    def acquire(self, key: str) -> object:
        """Wait until ``key`` is taken: a handle."""

    def release(self, handle: object) -> None: ...

    def close(self) -> None: ...


def quiet_peers() -> None:
    """python-redis-lock logs a warning for every busy try: a busy try is expected here."""
    logging.getLogger("redis_lock").setLevel(logging.ERROR)


def build(spec: Spec) -> Contender:
    if spec.kind == "floor":
        return FloorLock(spec)
    if spec.kind == "ours":
        return OurLock(spec)
    return RedisLock(spec)


class FloorLock:
    """A correct MongoDB lock in the fewest round trips: the baseline every figure divides by."""

    def __init__(self, spec: Spec, listeners: Sequence[monitoring.CommandListener] = ()) -> None:
        """``listeners``: the driver's command listeners, for a probe that times the
        floor's writes as the driver sees them (as it does another client's)."""
        self.poll = spec.poll
        self.client: MongoClient[dict[str, Any]] = MongoClient(
            spec.url, w="majority", event_listeners=list(listeners)
        )
        self.collection: Collection[dict[str, Any]] = self.client[DATABASE][
            spec.collection
        ].with_options(write_concern=WriteConcern(w="majority"))
        self._prefix = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}:"
        self._serial = itertools.count()
        self._ttl_ms = round(TTL * 1000)

    def _pipeline(self, owner: str) -> list[dict[str, Any]]:
        # A missing expires_at sorts below every date: a fresh upsert takes the lock.
        taken = {
            "_id": "$_id",
            "owner": {"$literal": owner},
            "token": {"$add": [{"$ifNull": ["$token", 0]}, 1]},
            "expires_at": {"$add": ["$$NOW", self._ttl_ms]},
        }
        free = {"$lte": ["$expires_at", "$$NOW"]}
        return [{"$replaceWith": {"$cond": [free, taken, "$$ROOT"]}}]

    def try_acquire(self, key: str) -> object | None:
        owner = f"{self._prefix}{next(self._serial)}"
        for attempt in (1, 2):
            try:
                doc = self.collection.find_one_and_update(
                    {"_id": key},
                    self._pipeline(owner),
                    projection={"owner": 1, "token": 1},
                    upsert=True,
                    return_document=ReturnDocument.AFTER,
                )
            except DuplicateKeyError:  # two upserts created the document at once
                if attempt == 2:
                    raise
                continue
            if doc is not None and doc.get("owner") == owner:
                return (key, owner, doc["token"])
            return None
        return None

    def acquire(self, key: str) -> object:
        deadline = time.monotonic() + ACQUIRE_TIMEOUT
        while (handle := self.try_acquire(key)) is None:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"floor lock {key!r} not acquired in {ACQUIRE_TIMEOUT:g}s")
            time.sleep(self.poll)
        return handle

    def release(self, handle: object) -> None:
        assert isinstance(handle, tuple)
        self.collection.delete_one({"_id": handle[0], "owner": handle[1]})

    @staticmethod
    def timed_out(error: Exception) -> bool:
        return _late(error)

    def close(self) -> None:
        self.client.close()


class ListenedManager(LockManager):
    """A ``LockManager`` whose clients report every command to ``listener``, for probes
    that time the manager's own writes (through the manager's hook for subclasses)."""

    def __init__(self, *args: Any, listener: monitoring.CommandListener, **kwargs: Any) -> None:
        self.listener = listener
        super().__init__(*args, **kwargs)

    def _client_options(self) -> dict[str, Any]:
        return {**super()._client_options(), "event_listeners": [self.listener]}


class OurLock:
    """django-mongolock as an application uses it: a ``LockManager`` with its defaults."""

    def __init__(self, spec: Spec) -> None:
        self.blocking = spec.blocking
        self._uninstall = instrument(spec.instrument)
        try:
            self.manager = LockManager(
                spec.url,
                database=DATABASE,
                collection=spec.collection,
                ttl=TTL,
                refresh=spec.refresh,
                shared_stream=spec.shared_stream,
            )
        except BaseException:
            self._uninstall()
            raise

    def try_acquire(self, key: str) -> object | None:
        try:
            if self.blocking:  # the default call, on a lock nobody else holds
                return self.manager.acquire(key, timeout=ACQUIRE_TIMEOUT)
            return self.manager.acquire(key, blocking=False)
        except LockNotAcquired:
            return None

    def acquire(self, key: str) -> object:
        return self.manager.acquire(key, timeout=ACQUIRE_TIMEOUT)

    @staticmethod
    def timed_out(error: Exception) -> bool:
        # The library reports a timeout and an unreachable server alike: the driver's
        # error it stands for tells them apart.
        return isinstance(error, ServerUnavailable) and _late(error.__cause__)

    def release(self, handle: object) -> None:
        handle.release()  # type: ignore[attr-defined]

    def close(self) -> None:
        try:
            self.manager.close()
        finally:
            self._uninstall()


class RedisLock:
    """python-redis-lock: SET NX with an expiry; a release wakes one waiter through BLPOP."""

    def __init__(self, spec: Spec) -> None:
        redis = importlib.import_module("redis")
        self._lock_class: Any = importlib.import_module("redis_lock").Lock
        self._timeout: type[Exception] = importlib.import_module("redis.exceptions").TimeoutError
        self.client: Any = redis.Redis.from_url(spec.url)
        self._expire = round(TTL)

    def try_acquire(self, key: str) -> object | None:
        lock = self._lock_class(self.client, key, expire=self._expire)
        return lock if lock.acquire(blocking=False) else None

    def acquire(self, key: str) -> object:
        lock = self._lock_class(self.client, key, expire=self._expire)
        # timeout must not exceed expire; one BLPOP waits at most expire seconds per try.
        if not lock.acquire(blocking=True):
            raise TimeoutError(f"python-redis-lock {key!r} not acquired")
        return lock

    def release(self, handle: object) -> None:
        handle.release()  # type: ignore[attr-defined]

    def timed_out(self, error: Exception) -> bool:
        return isinstance(error, self._timeout)

    def close(self) -> None:
        self.client.close()
