"""The error hierarchy: every error this package raises derives from MongoLockError."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

__all__ = [
    "ConfigurationError",
    "FenceKeyConflict",
    "LimitConflict",
    "LineFull",
    "LockLost",
    "LockNotAcquired",
    "MongoLockError",
    "ReplicaSetRequired",
    "ServerUnavailable",
    "StaleTokenError",
]


class MongoLockError(Exception):
    """Base class of every django-mongolock error.

    An error's ``args`` are its constructor's arguments and its message is built from
    them, so that ``type(error)(*error.args)`` is the same error: pickling (process pools)
    and Celery's JSON results rebuild it whole, class and attributes.
    """


class LockNotAcquired(MongoLockError):
    """The lock is held by somebody else and the caller would not, or could no longer, wait."""

    def __init__(
        self,
        key: str,
        holder: str | None = None,
        expires_at: datetime | None = None,
        waited: float | None = None,
        waiting: int = 0,
        detail: str | None = None,
    ) -> None:
        super().__init__(key, holder, expires_at, waited, waiting, detail)
        self.key = key
        self.holder = holder
        self.expires_at = expires_at
        self.waited = waited
        self.waiting = waiting
        self.detail = detail

    def __str__(self) -> str:
        if self.detail is not None:
            return self.detail
        if self.holder is None and self.waiting:
            message = f"lock {self.key!r} is free, but {self.waiting} waiter(s) are ahead in line"
        else:
            message = f"lock {self.key!r} is held"
        if self.holder is not None:
            message += f" by {self.holder}"
        if self.expires_at is not None:
            message += f"; its lease ends at {self.expires_at.isoformat()} (server time)"
        if self.waited is not None:
            message += f"; gave up after waiting {self.waited:.3f}s"
        return message


class LineFull(LockNotAcquired):
    """The key's line of waiters, or its list of shared holders, is at its cap.

    A ``LockNotAcquired``: the key is busy, and so crowded that waiting would mean
    growing its document without bound; the caller is refused at once, even when it
    would wait, and may try again later.
    """

    def __init__(self, key: str, cap: int, what: str) -> None:
        super().__init__(key)
        self.args = (key, cap, what)
        self.cap = cap
        self.what = what

    def __str__(self) -> str:
        return f"lock {self.key!r} is busy and has {self.cap} {self.what}, the most a key takes"


class LimitConflict(MongoLockError):
    """A shared acquire asked for another limit than the one the key's live holders share.

    The limit belongs to the key while it has live holders (the first holder set it), so
    no caller can exceed the limit the others rely on. A ``MongoLockError``, not a
    ``ValueError``: the argument is valid on its own and would be accepted once those
    holders are gone; it conflicts with the server's state, which only the server knows.
    """

    def __init__(self, key: str, limit: int | None, wanted: int | None) -> None:
        super().__init__(key, limit, wanted)
        self.key = key
        self.limit = limit
        self.wanted = wanted

    def __str__(self) -> str:
        def shown(value: int | None) -> str:
            return "no limit" if value is None else f"limit {value}"

        return (
            f"lock {self.key!r} is held under {shown(self.limit)}; {shown(self.wanted)} was "
            "asked for (the limit belongs to the key while it has holders)"
        )


class LockLost(MongoLockError):
    """The holder no longer holds the lock: its lease ended, or it was force-released."""

    def __init__(self, key: str, owner: str, token: int, reason: str = "no longer held") -> None:
        super().__init__(key, owner, token, reason)
        self.key = key
        self.owner = owner
        self.token = token
        self.reason = reason

    def __str__(self) -> str:
        return f"lock {self.key!r} (owner {self.owner}, token {self.token}) is lost: {self.reason}"


class StaleTokenError(LockLost):
    """A fenced write was refused: the resource already holds a greater token of the key.

    A ``LockLost``: a newer holder of the key has written, so this holder's lock is gone
    whatever its handle says. ``fence`` is the greater token the resource holds.
    """

    def __init__(self, key: str, owner: str, token: int, fence: int) -> None:
        super().__init__(
            key, owner, token, f"a newer holder wrote first (the resource's fence is {fence})"
        )
        self.args = (key, owner, token, fence)
        self.fence = fence


class FenceKeyConflict(MongoLockError):
    """A fenced write with a lock of one key met a resource fenced by another key.

    Tokens are ordered within one key only, so comparing them across keys would decide
    nothing: the write is refused. Not a ``LockLost``: the lock may well be held; the code
    fences one resource with two keys, which is a bug to fix, not a race to retry.
    """

    def __init__(self, key: str, token: int, fence_key: str, fence: int) -> None:
        super().__init__(key, token, fence_key, fence)
        self.key = key
        self.token = token
        self.fence_key = fence_key
        self.fence = fence

    def __str__(self) -> str:
        return (
            f"lock {self.key!r} (token {self.token}) cannot write a resource fenced by lock "
            f"{self.fence_key!r} (fence {self.fence}): one resource is fenced by one key"
        )


class ConfigurationError(MongoLockError):
    """The settings, or the MongoDB deployment they point to, cannot give the promised safety."""


class ReplicaSetRequired(ConfigurationError):
    """The server is a standalone mongod; fencing and durable locks need a replica set."""

    def __init__(self, servers: Sequence[str]) -> None:
        super().__init__(tuple(servers))
        self.servers = tuple(servers)

    def __str__(self) -> str:
        return (
            f"MongoDB at {', '.join(self.servers) or '?'} is a standalone server; "
            "django-mongolock requires a replica set (a single-node one is fine: start mongod "
            "with --replSet NAME and run rs.initiate())"
        )


class ServerUnavailable(MongoLockError):
    """MongoDB could not be reached, or did not answer, within the configured time."""

    def __init__(self, servers: Sequence[str], timeout: float | None, detail: str) -> None:
        super().__init__(tuple(servers), timeout, detail)
        self.servers = tuple(servers)
        self.timeout = timeout
        self.detail = detail

    def __str__(self) -> str:
        within = f" within {self.timeout:g}s" if self.timeout is not None else ""
        return f"MongoDB at {', '.join(self.servers) or '?'} did not answer{within}: {self.detail}"
