"""Reading and operating on the lock collection: status, listings, force releases and
their audit trail, indexes. The manager's calls for the admin, the commands and scripts.
"""

from __future__ import annotations

import builtins
import logging
from collections.abc import Callable, Iterable, Iterator

from django_mongolock.info import AuditEntry, IndexAction, LockInfo, Order, State
from django_mongolock.owners import operator
from django_mongolock.store import LockStore
from django_mongolock.validation import (
    validate_audit_text,
    validate_key,
    validate_page,
    validate_token,
)
from django_mongolock.waiters import Waiters

__all__ = ["Operations"]

logger = logging.getLogger("django_mongolock.manager")


class Operations:
    """The inspecting and operating half of ``LockManager`` (a base class of it): each
    call checks its arguments before any I/O and hands the query to the store."""

    retention: int
    audit_retention: int

    @property
    def store(self) -> LockStore:
        raise NotImplementedError

    @property
    def waiters(self) -> Waiters:
        raise NotImplementedError

    def status(self, key: str) -> LockInfo | None:
        """The lock document of ``key`` (live or expired), or None when there is none.

        With its holder's liveness (``holder_alive``, ``holder_silent_for``): one more query.
        """
        info = self.store.find(validate_key(key))
        return None if info is None else self.store.with_liveness([info])[0]

    def statuses(self, keys: Iterable[str]) -> dict[str, LockInfo]:
        """``status`` of each of ``keys`` that has a lock, by key: two queries in all."""
        wanted = list(dict.fromkeys(validate_key(key) for key in keys))
        found = self.store.find_many(wanted)
        return {info.key: info for info in self.store.with_liveness([*found.values()])}

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
        validate_page(limit, offset)
        page = [
            *self.store.scan(state, prefix, owner=owner, limit=limit, offset=offset, order=order)
        ]
        return self.store.with_liveness(page)  # one more query for the whole page

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

    def force_release(
        self, key: str, *, token: int | None = None, reason: str = "", by: str | None = None
    ) -> LockInfo | None:
        """Remove ``key`` whoever holds it (only while its token is ``token``, if given).

        Returns the removed lock, or None when there was none (or the token had changed).
        The former holder finds out at its next refresh: its lock is then lost. The
        release and its audit record (``by``, default ``user@host`` of this process, and
        ``reason``) are written in one transaction: see ``history()``.
        """
        key = validate_key(key)
        if token is not None:
            validate_token(token)
        reason = validate_audit_text("reason", reason, allow_empty=True)
        by = validate_audit_text("by", operator() if by is None else by, allow_empty=False)
        info = self.store.force_release_recorded(key, token, by=by, reason=reason)
        if info is not None:
            _log_release(info, by, reason)
            self.waiters.notify(key)
        return info

    def force_release_many(
        self,
        locks: Iterable[tuple[str, int]],
        *,
        reason: str = "",
        by: str | None = None,
        on_released: Callable[[LockInfo], object] | None = None,
    ) -> builtins.list[LockInfo]:
        """``force_release`` of each ``(key, token)``, each only while its token is the one
        given: the locks removed, each with its audit record.

        A few round trips for up to 200 locks (one transaction), not a few for each: the
        admin's bulk action releases a page of locks within one request's time. A key
        given twice keeps its first token. On an error, the locks of the transactions
        committed before it stay released (logged, with their audit records);
        ``on_released`` is called with each lock as soon as its transaction is committed,
        so that a caller can record those too (the admin's log does).
        """
        picked: dict[str, int] = {}
        for key, token in locks:
            picked.setdefault(validate_key(key), validate_token(token))
        reason = validate_audit_text("reason", reason, allow_empty=True)
        by = validate_audit_text("by", operator() if by is None else by, allow_empty=False)
        released: builtins.list[LockInfo] = []

        def committed(infos: builtins.list[LockInfo]) -> None:
            for info in infos:
                _log_release(info, by, reason)
                self.waiters.notify(info.key)
            released.extend(infos)
            if on_released is not None:
                for info in infos:
                    on_released(info)

        self.store.force_release_recorded_many(
            [*picked.items()], by=by, reason=reason, committed=committed
        )
        order = {key: place for place, key in enumerate(picked)}
        return sorted(released, key=lambda info: order[info.key])

    def history(self, key: str, *, limit: int | None = 100) -> builtins.list[AuditEntry]:
        """The force releases of ``key`` still on record (``audit_retention``), newest first."""
        validate_page(limit, 0)
        return self.store.history(validate_key(key), limit)

    def server_kind(self) -> str:
        """``"replica set"``, ``"sharded"`` or ``"standalone"`` (the last one is refused)."""
        return self.store.server_kind()

    def ensure_indexes(self, *, kind: str | None = None) -> builtins.list[IndexAction]:
        """Create or update the unique and TTL indexes (what ``migrate_mongolock`` runs).

        ``kind``: what ``server_kind()`` answered, when the caller has asked it already.
        """
        sharded = (kind or self.server_kind()) == "sharded"
        return [
            *self.store.ensure_indexes(self.retention, sharded=sharded),
            *self.store.ensure_side_indexes(self.retention, self.audit_retention),
        ]

    def check_indexes(self, *, kind: str | None = None) -> builtins.list[IndexAction]:
        """What ``ensure_indexes`` would do, without doing it (``kind`` as there)."""
        sharded = (kind or self.server_kind()) == "sharded"
        return [
            *self.store.check_indexes(self.retention, sharded=sharded),
            *self.store.check_side_indexes(self.retention, self.audit_retention),
        ]


def _log_release(info: LockInfo, by: str, reason: str) -> None:
    logger.info(
        "force-released %r (owner %s, token %s)",
        info.key,
        info.owner,
        info.token,
        extra={
            "key": info.key,
            "owner": info.owner,
            "token": info.token,
            "by": by,
            "reason": reason,
        },
    )
