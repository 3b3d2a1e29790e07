"""Distributed locks stored in MongoDB, with fencing tokens, for Django and plain Python."""

from __future__ import annotations

from importlib import metadata
from typing import Any, Final

from django_mongolock.context import LockContext, current_lock
from django_mongolock.decorators import BUSY_EXIT_CODE, LOST_EXIT_CODE, locked
from django_mongolock.exceptions import (
    ConfigurationError,
    FenceKeyConflict,
    LimitConflict,
    LineFull,
    LockLost,
    LockNotAcquired,
    MongoLockError,
    ReplicaSetRequired,
    ServerUnavailable,
    StaleTokenError,
)
from django_mongolock.info import Holder, LockInfo
from django_mongolock.lock import Lock
from django_mongolock.manager import LockManager
from django_mongolock.recipes import Election, LockGroup, Semaphore


def _installed_version(distribution: str) -> str:
    """The version the installed package's metadata declares; a checkout that was never
    installed has none, and says so instead of claiming a release it may not be."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "0+unknown"


__version__: Final = _installed_version("django-mongolock")

__all__ = [
    "BUSY_EXIT_CODE",
    "LOST_EXIT_CODE",
    "ConfigurationError",
    "Election",
    "FenceKeyConflict",
    "Holder",
    "LimitConflict",
    "LineFull",
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
    "StaleTokenError",
    "__version__",
    "current_lock",
    "locked",
    "locks",
]


# The attributes the default manager answers itself; everything else is the current
# manager's (see _DefaultManager.__getattribute__).
_OWN: Final = frozenset({"__class__", "__dict__", "__repr__", "close"})


class _DefaultManager(LockManager):
    """``locks``: a LockManager built from ``settings.MONGOLOCK`` on first use, not at import.

    It is a LockManager (``isinstance`` holds, so it goes wherever a manager does), but
    holds no state: every attribute is looked up on the manager that the settings describe
    now (``conf.get_manager()``). When a test overrides ``MONGOLOCK``, that manager is
    closed and the next use builds one from the new settings, so ``locks`` never goes stale.
    """

    def __init__(self) -> None:  # no LockManager state of its own: nothing to connect
        pass

    def __getattribute__(self, name: str) -> Any:
        if name in _OWN:
            return object.__getattribute__(self, name)
        from django_mongolock.conf import get_manager

        return getattr(get_manager(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"cannot set {name!r} on the default manager: it is built from "
            "settings.MONGOLOCK; change the setting, or build a LockManager of your own"
        )

    def __repr__(self) -> str:
        return "<default LockManager (from settings.MONGOLOCK)>"

    def close(self) -> None:
        """Close the current manager's client; the next use connects afresh from settings."""
        from django_mongolock.conf import reset

        reset()


locks: LockManager = _DefaultManager()
