"""The operator's queries: find, list and count locks, keep the indexes (a force release,
recorded in the audit trail, is in ``records``)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from django_mongolock import queries
from django_mongolock.info import IndexAction, LockInfo, Order, State
from django_mongolock.store.base import StoreBase

__all__ = ["OperatorQueries"]


class OperatorQueries(StoreBase):
    """Reads of the lock collection, read at majority, and the operator's writes."""

    def find(self, key: str) -> LockInfo | None:
        """The document of ``key`` (live or expired), read at majority."""
        with self._translate:
            doc = self.collection.find_one(queries.find(key), projection=queries.PROJECTION)
        return None if doc is None else LockInfo.from_document(doc)

    def find_many(self, keys: Sequence[str]) -> dict[str, LockInfo]:
        """The documents of ``keys`` that are locks, by key: one read at majority."""
        if not keys:
            return {}
        with self._translate:
            docs = self._held(keys)
        return {doc["_id"]: LockInfo.from_document(doc) for doc in docs}

    def scan(
        self,
        state: State = "live",
        prefix: str | None = None,
        *,
        owner: str | None = None,
        limit: int | None = 100,
        offset: int = 0,
        order: Order = "key",
        batch_size: int = 1000,
    ) -> Iterator[LockInfo]:
        """Stream matching locks in ``order``; the server does the paging, never the client."""
        if order not in queries.SORTS:
            raise ValueError(f"order must be one of {', '.join(queries.SORTS)}, not {order!r}")
        with self._translate:
            cursor = self.collection.find(
                queries.listing(state, prefix, owner),
                projection=queries.PROJECTION,
                sort=queries.SORTS[order],
                skip=offset,
                limit=limit or 0,
                batch_size=batch_size,
            )
            try:
                for doc in cursor:
                    yield LockInfo.from_document(doc)
            finally:
                cursor.close()

    def count(
        self, state: State = "all", prefix: str | None = None, owner: str | None = None
    ) -> int:
        with self._translate:
            return self.collection.count_documents(queries.listing(state, prefix, owner))

    def counts(self, soon: float = 10.0) -> dict[str, int]:
        """Live, expired and expiring-within-``soon``-seconds counts, in one pass on the server."""
        with self._translate:
            rows = list(self.collection.aggregate(queries.counts(soon)))
        row = rows[0] if rows else {}
        return {name: int(row.get(name, 0)) for name in queries.COUNTED}

    # -- indexes -----------------------------------------------------------------------------

    def check_indexes(self, retention: int, *, sharded: bool) -> list[IndexAction]:
        """Compare the indexes with what ``ensure_indexes`` would make; nothing is changed.
        ``sharded``: through ``mongos``, where no unique index on ``key`` is wanted."""
        existing = self._index_information(self.collection)
        return queries.plan_locks(retention, existing, sharded=sharded)

    def ensure_indexes(self, retention: int, *, sharded: bool) -> list[IndexAction]:
        """Create the unique key index and the TTL index, or bring the TTL in line; idempotent."""
        plan = self.check_indexes(retention, sharded=sharded)
        done: list[IndexAction] = []
        with self._translate:
            for item in plan:
                if item.action == "missing":
                    if item.name == queries.KEY_INDEX:
                        self.collection.create_index("key", unique=True, name=queries.KEY_INDEX)
                    else:
                        self.collection.create_index(
                            "expires_at", expireAfterSeconds=retention, name=queries.TTL_INDEX
                        )
                    done.append(IndexAction(item.name, item.description, "created", item.detail))
                elif item.action == "differs":
                    self._set_ttl(self.collection, queries.TTL_INDEX, retention)
                    done.append(IndexAction(item.name, item.description, "updated", item.detail))
                else:
                    done.append(item)
        return done
