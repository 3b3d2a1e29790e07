"""The admin's check of the server before it lists anything, and what its 503 page says.

The list page needs a replica set with the lock collection's indexes in place. Asking
costs two round trips, so a passed check is remembered for a while (per admin, per
manager); a failed one is asked again on the next page, so that a fix shows at once.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from django.utils.translation import gettext as _

from django_mongolock.exceptions import (
    ConfigurationError,
    MongoLockError,
    ReplicaSetRequired,
    ServerUnavailable,
)
from django_mongolock.info import IndexAction
from django_mongolock.manager import LockManager

__all__ = ["Health", "HealthCheck", "Problem", "problem_of", "unavailable_context"]

Problem = Literal["unreachable", "standalone", "configuration", "error", "indexes"]


@dataclass(frozen=True, slots=True)
class Health:
    """What the list page needs to know of the server before it lists anything."""

    error: ReplicaSetRequired | None
    """Set when the server is a standalone mongod: no lock can be taken there."""
    indexes: tuple[IndexAction, ...] = ()

    @property
    def missing(self) -> list[IndexAction]:
        return [item for item in self.indexes if item.action == "missing"]

    @property
    def warnings(self) -> list[IndexAction]:
        """Indexes that exist but differ from the settings (a changed retention)."""
        return [item for item in self.indexes if item.action == "differs"]

    @property
    def ok(self) -> bool:
        return self.error is None and not self.missing


class HealthCheck:
    """The server's kind and the indexes, asked once per ``interval`` seconds, not per page.

    Only a passed check is remembered, and only for the manager that passed it (a changed
    ``MONGOLOCK`` builds a new one): a failure is asked again on the next page, so that a
    fix (``migrate_mongolock``) shows at once.
    """

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._passed: tuple[weakref.ref[LockManager], float, Health] | None = None

    def __call__(self, manager: LockManager, interval: float) -> Health:
        with self._mutex:
            passed = self._passed
        if passed is not None:
            ref, checked_at, health = passed
            if ref() is manager and time.monotonic() - checked_at < interval:
                return health
        health = self.run(manager)
        if health.ok and interval > 0:
            with self._mutex:
                self._passed = (weakref.ref(manager), time.monotonic(), health)
        return health

    @staticmethod
    def run(manager: LockManager) -> Health:
        kind = manager.server_kind()
        if kind == "standalone":
            # Reads work on a standalone mongod, but no lock can be taken there: say so.
            return Health(ReplicaSetRequired(manager.store.servers()))
        return Health(None, tuple(manager.check_indexes(kind=kind)))

    def clear(self) -> None:
        """Forget the passed check: the next page asks the server."""
        with self._mutex:
            self._passed = None


def problem_of(error: MongoLockError | None) -> Problem:
    """What the 503 page explains: ``error``'s kind, or missing indexes when there is none."""
    if isinstance(error, ServerUnavailable):
        return "unreachable"
    if isinstance(error, ReplicaSetRequired):
        return "standalone"
    if isinstance(error, ConfigurationError):
        return "configuration"
    return "error" if error is not None else "indexes"


def unavailable_context(
    manager: LockManager | None, error: MongoLockError | None, missing: Sequence[IndexAction]
) -> dict[str, Any]:
    """What the 503 page says: the problem, the error, the missing indexes, the collection."""
    return {
        "title": _("MongoDB locks are unavailable"),
        "problem": problem_of(error),
        "error": error,
        "missing": missing,
        "collection": f"{manager.database}.{manager.collection}" if manager else None,
    }
