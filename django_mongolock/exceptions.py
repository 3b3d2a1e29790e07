"""The error hierarchy: every error this package raises derives from MongoLockError."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

__all__ = [
    "ConfigurationError",
    "LockLost",
    "LockNotAcquired",
    "MongoLockError",
    "ReplicaSetRequired",
    "ServerUnavailable",
]


class MongoLockError(Exception):
    """Base class of every django-mongolock error."""


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


class LockLost(MongoLockError):
    """The holder no longer holds the lock: its lease ended, or it was force-released."""

    def __init__(self, key: str, owner: str, token: int, reason: str = "no longer held") -> None:
        self.key = key
        self.owner = owner
        self.token = token
        self.reason = reason
        super().__init__(f"lock {key!r} (owner {owner}, token {token}) is lost: {reason}")


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
