"""The indexes ``migrate_mongolock`` keeps, and the plan that brings a collection in line.

Planning is pure: it compares ``index_information()`` with what should be there and
says, per index, "missing", "differs" (a TTL to update in place) or "unchanged"; the
store then creates or updates what the plan says.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from django_mongolock.info import IndexAction

__all__ = [
    "AUDIT_KEY_INDEX",
    "AUDIT_TTL_INDEX",
    "KEY_INDEX",
    "PROCESS_TTL_INDEX",
    "SHARDED_KEY_DESC",
    "TTL_INDEX",
    "TTLIndex",
    "plan_keyed",
    "plan_locks",
]

KEY_INDEX: Final = "key_unique"
TTL_INDEX: Final = "expires_at_ttl"
# The heartbeat and audit collections sit next to the lock collection (``locks.processes``,
# ``locks.audit``), each with a TTL index.
PROCESS_TTL_INDEX: Final = "alive_until_ttl"
AUDIT_TTL_INDEX: Final = "at_ttl"
AUDIT_KEY_INDEX: Final = "key_at"
# What stands for the unique key index through mongos: the _id index (the shard key's once
# the collection is sharded as docs/scaling.md says).
SHARDED_KEY_DESC: Final = "unique key: _id (no index on key through mongos)"


@dataclass(frozen=True, slots=True)
class TTLIndex:
    """A TTL index of a side collection, as ``migrate_mongolock`` should find it."""

    name: str
    field: str
    seconds: int
    label: str

    def plan(self, index: Mapping[str, Any] | None) -> IndexAction:
        desc = f"{self.label}: TTL index on {self.field} (expireAfterSeconds={self.seconds})"
        if index is None:
            return IndexAction(self.name, desc, "missing")
        was = index.get("expireAfterSeconds")
        if was != self.seconds:
            return IndexAction(self.name, desc, "differs", f"was {was}")
        return IndexAction(self.name, desc, "unchanged")


def plan_locks(
    retention: int, existing: Mapping[str, Any], *, sharded: bool = False
) -> list[IndexAction]:
    """The lock collection's unique key index and its TTL index on ``expires_at``.

    On a sharded cluster the unique index on ``key`` is not made: a unique index that
    does not start with the shard key (``_id``) is refused there, and it adds nothing,
    since a lock's ``_id`` is its key and the shard key keeps ``_id`` unique cluster-wide.
    """
    key_desc = "unique index on key"
    ttl_desc = f"TTL index on expires_at (expireAfterSeconds={retention})"
    plan = []
    key_index = existing.get(KEY_INDEX)
    if key_index is None and sharded:
        plan.append(IndexAction(KEY_INDEX, SHARDED_KEY_DESC, "unchanged"))
    elif key_index is None:
        plan.append(IndexAction(KEY_INDEX, key_desc, "missing"))
    else:
        plan.append(IndexAction(KEY_INDEX, key_desc, "unchanged"))
    ttl_index = existing.get(TTL_INDEX)
    if ttl_index is None:
        plan.append(IndexAction(TTL_INDEX, ttl_desc, "missing"))
    elif ttl_index.get("expireAfterSeconds") != retention:
        was = ttl_index.get("expireAfterSeconds")
        plan.append(IndexAction(TTL_INDEX, ttl_desc, "differs", f"was {was}"))
    else:
        plan.append(IndexAction(TTL_INDEX, ttl_desc, "unchanged"))
    return plan


def plan_keyed(existing: Mapping[str, Any]) -> IndexAction:
    """The audit trail's index on key and time, for a key's history."""
    desc = "audit trail: index on key, at"
    action: Literal["missing", "unchanged"] = (
        "unchanged" if AUDIT_KEY_INDEX in existing else "missing"
    )
    return IndexAction(AUDIT_KEY_INDEX, desc, action)
