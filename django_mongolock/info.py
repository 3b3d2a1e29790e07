"""What the server told about locks, as plain values: no I/O, no driver calls.

``LockInfo`` (a lock document read at server time), its shared ``Holder``s, an
``AuditEntry`` of the force-release record, and the ``IndexAction`` that
``migrate_mongolock`` reports. The store builds them from documents; the manager, the
commands and the admin only read them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

__all__ = [
    "AuditEntry",
    "Holder",
    "IndexAction",
    "LockInfo",
    "Order",
    "State",
    "process_of",
    "processes_of",
]

State = Literal["live", "expired", "all"]
Order = Literal["key", "-key", "expires", "-expires", "acquired", "-acquired"]


@dataclass(frozen=True, slots=True)
class Holder:
    """One shared holder of a key (a shared lock or a semaphore slot)."""

    owner: str
    token: int
    acquired_at: datetime
    expires_at: datetime
    ttl: float

    def as_dict(self, now: datetime) -> dict[str, Any]:
        return {
            "owner": self.owner,
            "token": self.token,
            "acquired_at": self.acquired_at.isoformat(),
            "expires_at": self.expires_at.isoformat(),
            "ttl": self.ttl,
            "live": self.expires_at > now,
        }


@dataclass(frozen=True, slots=True)
class LockInfo:
    """A lock document as the server saw it at ``now`` (server time).

    An exclusive lock has its holder in ``owner``; a shared lock or a semaphore has
    ``mode == "shared"``, an empty ``owner``, and its holders in ``holders`` (then
    ``token`` is the latest token handed out and ``expires_at`` the latest lease end).
    """

    key: str
    owner: str
    token: int
    acquired_at: datetime
    refreshed_at: datetime
    expires_at: datetime
    ttl: float
    now: datetime
    waiting: int = 0
    position: int = -1
    """The asker's place in the line of waiters (0: first), -1 when not in line."""
    mode: Literal["exclusive", "shared"] = "exclusive"
    limit: int | None = None
    group: str | None = None
    kind: str | None = None
    holders: tuple[Holder, ...] = ()
    holder_alive: bool | None = None
    """Whether the holder's process sent a heartbeat within its bound; None: unknown
    (no heartbeat on record, a shared lock, or not asked for)."""
    holder_silent_for: float | None = None
    """Seconds since the holder's process's last heartbeat (server time), None if unknown."""

    @property
    def shared(self) -> bool:
        return self.mode == "shared"

    @property
    def live_holders(self) -> tuple[Holder, ...]:
        return tuple(holder for holder in self.holders if holder.expires_at > self.now)

    @property
    def held(self) -> bool:
        """Somebody holds it (it may be free, with waiters in line, after a release)."""
        return bool(self.owner) or bool(self.live_holders)

    @property
    def live(self) -> bool:
        return self.expires_at > self.now

    @property
    def state(self) -> Literal["live", "expired"]:
        return "live" if self.live else "expired"

    @property
    def remaining(self) -> float:
        """Seconds until the lease ends (negative once it has ended), by the server's clock."""
        return (self.expires_at - self.now).total_seconds()

    @property
    def next_free_in(self) -> float:
        """Seconds until a waiter may get in: the first shared lease end, or the lease end."""
        live = self.live_holders
        if self.owner or not live:
            return self.remaining
        return min((holder.expires_at - self.now).total_seconds() for holder in live)

    @property
    def holder_label(self) -> str:
        """Who holds it, for people: the owner, or a count of shared holders."""
        if self.owner or not self.shared:
            return self.owner
        count = len(self.live_holders)
        of = f"/{self.limit}" if self.limit else ""
        return f"{count}{of} shared holder{'s' if count != 1 else ''}"

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready mapping (ISO 8601 times) for ``--json`` output and APIs."""
        data: dict[str, Any] = {
            "key": self.key,
            "state": self.state,
            "mode": self.mode,
            "owner": self.owner,
            "token": self.token,
            "acquired_at": self.acquired_at.isoformat(),
            "refreshed_at": self.refreshed_at.isoformat(),
            "expires_at": self.expires_at.isoformat(),
            "ttl": self.ttl,
            "remaining": round(self.remaining, 3),
            "waiting": self.waiting,
            "server_time": self.now.isoformat(),
        }
        if self.shared:
            data["limit"] = self.limit
            data["holders"] = [holder.as_dict(self.now) for holder in self.holders]
        if self.group:
            data["group"] = self.group
        if self.kind:
            data["kind"] = self.kind
        data["holder_alive"] = self.holder_alive
        data["holder_silent_for"] = (
            None if self.holder_silent_for is None else round(self.holder_silent_for, 3)
        )
        return data

    def as_holder(self, owner: str) -> LockInfo | None:
        """The live lease of shared holder ``owner``, as an exclusive-looking LockInfo."""
        for holder in self.holders:
            if holder.owner == owner and holder.expires_at > self.now:
                return LockInfo(
                    key=self.key,
                    owner=owner,
                    token=holder.token,
                    acquired_at=holder.acquired_at,
                    refreshed_at=self.refreshed_at,
                    expires_at=holder.expires_at,
                    ttl=holder.ttl,
                    now=self.now,
                    mode="shared",
                    limit=self.limit,
                )
        return None

    @classmethod
    def from_document(cls, doc: Mapping[str, Any]) -> LockInfo:
        epoch = datetime.fromtimestamp(0, UTC)
        holders = tuple(
            Holder(
                owner=str(entry.get("owner", "")),
                token=int(entry.get("token", 0)),
                acquired_at=entry.get("acquired_at", epoch),
                expires_at=entry.get("expires_at", epoch),
                ttl=float(entry.get("ttl", 0.0)),
            )
            for entry in doc.get("holders") or ()
        )
        return cls(
            key=doc["_id"],
            owner=str(doc.get("owner") or ""),
            token=int(doc.get("token", 0)),
            acquired_at=doc.get("acquired_at", epoch),
            refreshed_at=doc.get("refreshed_at", doc.get("acquired_at", epoch)),
            expires_at=doc.get("expires_at", epoch),
            ttl=float(doc.get("ttl", 0.0)),
            # A retried write is answered from the server's record of the first attempt,
            # without the projection's computed fields: that write's own time is the
            # refresh (or acquisition) time it stored.
            now=doc.get("now") or doc.get("refreshed_at") or doc.get("acquired_at", epoch),
            waiting=int(doc.get("waiting", 0)),
            position=int(doc.get("position", -1)),
            mode="shared" if doc.get("mode") == "shared" else "exclusive",
            limit=doc.get("limit"),
            group=doc.get("group"),
            kind=doc.get("kind"),
            holders=holders,
        )


def process_of(owner: str) -> str:
    """The process part of an owner id: ``host:pid:serial`` without its ``:serial``."""
    head, sep, _ = owner.rpartition(":")
    return head if sep and head else owner


def processes_of(owners: Iterable[str]) -> set[str]:
    """``{process_of(owner) for owner in owners}``, for the refresher's heartbeat: an
    owner id is parsed only where the one before it has no process part or belongs to
    another process (at 10,000 leases of one process, one parse instead of 10,000)."""
    processes: set[str] = set()
    prefix: str | None = None  # with ``:``: the owner ids of the last process parsed
    for owner in owners:
        # The same process only with no ``:`` after the prefix (a host may hold one).
        if prefix is None or not owner.startswith(prefix) or owner.find(":", len(prefix)) >= 0:
            process = process_of(owner)
            processes.add(process)
            prefix = f"{process}:" if process != owner else None
    return processes


@dataclass(frozen=True, slots=True)
class AuditEntry:
    """One force release as the audit collection recorded it (``at`` is server time)."""

    key: str
    owner: str
    token: int
    by: str
    reason: str
    at: datetime
    expired: bool = False
    """The lease had already ended when it was removed."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "owner": self.owner,
            "token": self.token,
            "by": self.by,
            "reason": self.reason,
            "at": self.at.isoformat(),
            "expired": self.expired,
        }

    @classmethod
    def from_document(cls, doc: Mapping[str, Any]) -> AuditEntry:
        return cls(
            key=str(doc.get("key", "")),
            owner=str(doc.get("owner") or ""),
            token=int(doc.get("token", 0)),
            by=str(doc.get("by") or ""),
            reason=str(doc.get("reason") or ""),
            at=doc.get("at") or datetime.fromtimestamp(0, UTC),
            expired=bool(doc.get("expired", False)),
        )


@dataclass(frozen=True, slots=True)
class IndexAction:
    """What ``ensure_indexes`` did, or would do, to one index."""

    name: str
    description: str
    action: Literal["created", "unchanged", "updated", "missing", "differs"]
    detail: str = ""
