"""Distributed locks stored in MongoDB, with fencing tokens, for Django and plain Python."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django_mongolock.context import current_lock
from django_mongolock.decorators import BUSY_EXIT_CODE, locked
from django_mongolock.exceptions import (
    ConfigurationError,
    LockLost,
    LockNotAcquired,
    MongoLockError,
    ReplicaSetRequired,
    ServerUnavailable,
)
from django_mongolock.lock import Lock
from django_mongolock.manager import LockContext, LockManager
from django_mongolock.primitives import Election, LockGroup, Semaphore
from django_mongolock.store import Holder, LockInfo

__version__ = "0.1.0"

__all__ = [
    "BUSY_EXIT_CODE",
    "ConfigurationError",
    "Election",
    "Holder",
    "Lock",
    "LockContext",
    "LockGroup",
    "LockInfo",
    "LockLost",
    "LockManager",
    "LockNotAcquired",
    "MongoLockError",
    "ReplicaSetRequired",
    "Semaphore",
    "ServerUnavailable",
    "__version__",
    "current_lock",
    "locked",
    "locks",
]


class _DefaultManager:
    """``locks``: the manager built from Django settings, on first use, not at import."""

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        from django_mongolock.conf import get_manager

        return getattr(get_manager(), name)

    def __repr__(self) -> str:
        return "<default LockManager (from settings.MONGOLOCK)>"


if TYPE_CHECKING:
    locks: LockManager
else:
    locks = _DefaultManager()
