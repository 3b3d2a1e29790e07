"""Several exclusive locks taken all or nothing, in one global order, released together."""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import Iterable, Sequence
from types import TracebackType

from django_mongolock import acquiring, clock
from django_mongolock.exceptions import MongoLockError
from django_mongolock.lock import Lock
from django_mongolock.recipes.source import LockSource, tagged_request
from django_mongolock.validation import validate_keep, validate_key, validate_timeout, validate_ttl

__all__ = ["LockGroup"]

logger = logging.getLogger("django_mongolock.primitives")

# Each release of a group still gets this long when those before it spent the group's
# operation limit: enough for a write to a server that answers.
LAST_RELEASE_TIME = 0.5


class LockGroup:
    """Several exclusive locks taken all or nothing under one group id, released together."""

    def __init__(self, group_id: str, locks: Iterable[Lock]) -> None:
        self.group_id = group_id
        self.locks: dict[str, Lock] = {lock.key: lock for lock in locks}

    def __repr__(self) -> str:
        return f"<LockGroup {self.group_id} keys={list(self.locks)}>"

    @property
    def tokens(self) -> dict[str, int]:
        """The fencing token of each key."""
        return {key: lock.token for key, lock in self.locks.items()}

    @property
    def valid(self) -> bool:
        """True while every lock of the group is held."""
        return all(lock.valid for lock in self.locks.values())

    def refresh(self, ttl: float | None = None) -> LockGroup:
        """Extend every lease of the group (LockLost if any of them is gone)."""
        for lock in self.locks.values():
            lock.refresh(ttl)
        return self

    def release(self) -> bool:
        """Release every lock, the last taken first; True if all of them were still held.

        Each lock is released even when another's release fails (that lease lapses at
        its end, no longer refreshed); the first failure is raised once every lock was
        tried. All of them are bounded by one operation limit together, like the release
        of one lock, rather than one limit each.
        """
        held, errors = _release_every(list(reversed(self.locks.values())))
        for key, error in errors[1:]:
            logger.warning("could not release %r of a group either: %s", key, error)
        if errors:
            raise errors[0][1]
        return held

    def __enter__(self) -> LockGroup:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    @classmethod
    def acquire(
        cls,
        manager: LockSource,
        keys: Iterable[str],
        *,
        ttl: float | None = None,
        blocking: bool = True,
        timeout: float | None = None,
        refresh: bool | None = None,
    ) -> LockGroup:
        if isinstance(keys, str | bytes):
            raise TypeError("keys must be an iterable of keys, not a single key")
        ordered = sorted({validate_key(key) for key in keys})
        if not ordered:
            raise ValueError("a lock group needs at least one key")
        if ttl is not None:
            validate_ttl(ttl)
        wait = validate_timeout(timeout, blocking=blocking)
        keep = validate_keep(refresh, manager.refresh)
        group_id = secrets.token_hex(8)
        deadline = None if wait is None else clock.now() + wait
        taken: list[Lock] = []
        try:
            for key in ordered:
                left = None if deadline is None else max(0.0, deadline - clock.now())
                request = tagged_request(manager, key, ttl, "group", group_id)
                taken.append(acquiring.acquire(manager, request, left, keep, None))
        except BaseException:
            _, errors = _release_every(taken[::-1])
            for key, error in errors:
                logger.warning("could not release %r after a failed group: %s", key, error)
            raise
        return cls(group_id, taken)


def _release_every(locks: Sequence[Lock]) -> tuple[bool, list[tuple[str, MongoLockError]]]:
    """Release each of ``locks`` in turn within one operation limit in all: whether all
    were still held, and the failures (key, error). Once the limit is spent, each of the
    rest gets ``LAST_RELEASE_TIME`` rather than a limit of its own: a group of twenty
    keys on a server that stopped answering gives up in about one limit, not twenty,
    and one write the server holds leaves the others time to go."""
    if not locks:
        return True, []
    limit = 0.0  # in a forked child no release writes: no client is built for the limit
    if not all(lock.forked for lock in locks):
        with contextlib.suppress(MongoLockError):  # closed: each release says so at once
            limit = locks[0].backend.store.timeout
    deadline = clock.now() + limit
    held, errors = True, []
    for place, lock in enumerate(locks):
        try:
            held = lock._release_within(max(LAST_RELEASE_TIME, deadline - clock.now())) and held
        except MongoLockError as exc:
            held = False
            errors.append((lock.key, exc))
        except BaseException:
            # Interrupted (KeyboardInterrupt, SystemExit from a signal handler): the rest
            # are still given up, briefly each, rather than left held and refreshed.
            # A second interruption ends this too: the exit's own release is left.
            for rest in locks[place + 1 :]:
                try:
                    rest._release_within(LAST_RELEASE_TIME)
                except MongoLockError as error:
                    logger.warning(
                        "could not release %r of an interrupted group: %s", rest.key, error
                    )
            raise
    return held, errors
