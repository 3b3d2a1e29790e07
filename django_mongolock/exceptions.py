"""The error hierarchy: every error this package raises derives from MongoLockError."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

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
    """Base class of every django-mongolock error."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from the message and attributes, not by calling __init__ again (whose
        # arguments differ per class): an error crosses processes whole, as Celery's
        # results and multiprocessing pools pass it.
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))


def _rebuild(cls: type[MongoLockError], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class LockNotAcquired(MongoLockError):
    """The lock is held by somebody else and the caller would not, or could no longer, wait."""

    def __init__(
        self,
        key: str,
        holder: str | None = None,
        expires_at: datetime | None = None,
        *,
        waited: float | None = None,
        waiting: int = 0,
    ) -> None:
        self.key = key
        self.holder = holder
        self.expires_at = expires_at
        self.waited = waited
        self.waiting = waiting
        if holder is None and waiting:
            message = f"lock {key!r} is free, but {waiting} waiter(s) are ahead in line"
        else:
            message = f"lock {key!r} is held"
        if holder is not None:
            message += f" by {holder}"
        if expires_at is not None:
            message += f"; its lease ends at {expires_at.isoformat()} (server time)"
        if waited is not None:
            message += f"; gave up after waiting {waited:.3f}s"
        super().__init__(message)


class LineFull(LockNotAcquired):
    """The key's line of waiters, or its list of shared holders, is at its cap.

    A ``LockNotAcquired``: the key is busy, and so crowded that waiting would mean
    growing its document without bound; the caller is refused at once, even when it
    would wait, and may try again later.
    """

    def __init__(self, key: str, cap: int, what: str) -> None:
        super().__init__(key)
        self.cap = cap
        self.what = what
        self.args = (f"lock {key!r} is busy and has {cap} {what}, the most a key takes",)


class LimitConflict(MongoLockError):
    """A shared acquire asked for another limit than the one the key's live holders share.

    The limit belongs to the key while it has live holders (the first holder set it), so
    no caller can exceed the limit the others rely on. A ``MongoLockError``, not a
    ``ValueError``: the argument is valid on its own and would be accepted once those
    holders are gone; it conflicts with the server's state, which only the server knows.
    """

    def __init__(self, key: str, limit: int | None, wanted: int | None) -> None:
        self.key = key
        self.limit = limit
        self.wanted = wanted

        def shown(value: int | None) -> str:
            return "no limit" if value is None else f"limit {value}"

        super().__init__(
            f"lock {key!r} is held under {shown(limit)}; {shown(wanted)} was asked for "
            "(the limit belongs to the key while it has holders)"
        )


class LockLost(MongoLockError):
    """The holder no longer holds the lock: its lease ended, or it was force-released."""

    def __init__(self, key: str, owner: str, token: int, reason: str = "no longer held") -> None:
        self.key = key
        self.owner = owner
        self.token = token
        self.reason = reason
        super().__init__(f"lock {key!r} (owner {owner}, token {token}) is lost: {reason}")


class StaleTokenError(LockLost):
    """A fenced write was refused: the resource already holds a greater token of the key.

    A ``LockLost``: a newer holder of the key has written, so this holder's lock is gone
    whatever its handle says. ``fence`` is the greater token the resource holds.
    """

    def __init__(self, key: str, owner: str, token: int, fence: int) -> None:
        super().__init__(
            key, owner, token, f"a newer holder wrote first (the resource's fence is {fence})"
        )
        self.fence = fence


class FenceKeyConflict(MongoLockError):
    """A fenced write with a lock of one key met a resource fenced by another key.

    Tokens are ordered within one key only, so comparing them across keys would decide
    nothing: the write is refused. Not a ``LockLost``: the lock may well be held; the code
    fences one resource with two keys, which is a bug to fix, not a race to retry.
    """

    def __init__(self, key: str, token: int, fence_key: str, fence: int) -> None:
        self.key = key
        self.token = token
        self.fence_key = fence_key
        self.fence = fence
        super().__init__(
            f"lock {key!r} (token {token}) cannot write a resource fenced by lock "
            f"{fence_key!r} (fence {fence}): one resource is fenced by one key"
        )


class ConfigurationError(MongoLockError):
    """The settings, or the MongoDB deployment they point to, cannot give the promised safety."""


class ReplicaSetRequired(ConfigurationError):
    """The server is a standalone mongod; fencing and durable locks need a replica set."""

    def __init__(self, servers: Sequence[str]) -> None:
        self.servers = tuple(servers)
        super().__init__(
            f"MongoDB at {', '.join(self.servers) or '?'} is a standalone server; "
            "django-mongolock requires a replica set (a single-node one is fine: start mongod "
            "with --replSet NAME and run rs.initiate())"
        )


class ServerUnavailable(MongoLockError):
    """MongoDB could not be reached, or did not answer, within the configured time."""

    def __init__(self, servers: Sequence[str], timeout: float | None, detail: str) -> None:
        self.servers = tuple(servers)
        self.timeout = timeout
        within = f" within {timeout:g}s" if timeout is not None else ""
        super().__init__(
            f"MongoDB at {', '.join(self.servers) or '?'} did not answer{within}: {detail}"
        )
