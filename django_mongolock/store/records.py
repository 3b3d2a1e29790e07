"""The side collections: process heartbeats (is a holder alive?), the audit trail of
force releases (with the transaction that releases a lock and records it together), the
run requests of ``on_busy="coalesce"``, and the secret a shared stream's leader proves
itself with."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

import bson
import pymongo
from pymongo import ASCENDING, DESCENDING, UpdateOne
from pymongo.client_session import ClientSession
from pymongo.collection import Collection
from pymongo.errors import OperationFailure, PyMongoError
from pymongo.read_concern import ReadConcern
from pymongo.write_concern import WriteConcern

from django_mongolock import mongo, queries
from django_mongolock.exceptions import MongoLockError
from django_mongolock.info import AuditEntry, IndexAction, LockInfo, process_of
from django_mongolock.queries import requests as run_requests
from django_mongolock.store.base import StoreBase

__all__ = ["RecordQueries"]

# How often a force release's transaction runs at most (conflicts, lost replies).
_TRANSACTION_ATTEMPTS: Final = 5
# The server's code for a write conflict.
WRITE_CONFLICT: Final = 112
# How many locks one transaction of a bulk force release deletes at most.
FORCE_CHUNK: Final = 200
_UNAUTHORIZED: Final = 13
# The size of a shared stream's secret (``relay_secret``); a shorter one is not ours.
RELAY_SECRET_BYTES: Final = 32


@dataclass(frozen=True, slots=True)
class _SideTTL:
    """A side collection's TTL index, and the collection it belongs on."""

    collection: Collection[Any]
    index: queries.TTLIndex


class RecordQueries(StoreBase):
    """Heartbeats and the audit trail, in collections next to the lock collection."""

    @property
    def processes(self) -> Collection[Any]:
        """Heartbeats of the processes that hold locks, one document per process id."""
        return self._side("processes")

    @property
    def audit(self) -> Collection[Any]:
        """The record of force releases (who, when, key, owner, token, reason)."""
        return self._side("audit")

    @property
    def requests(self) -> Collection[Any]:
        """Run requests of ``on_busy="coalesce"``, one document per key."""
        return self._side("requests")

    @property
    def relay(self) -> Collection[Any]:
        """The secret of this collection's shared streams (``relay``), one document."""
        return self._side("relay")

    def relay_secret(self) -> bytes:
        """The random secret a shared stream's leader proves it knows, made on first use.

        A same-user process that cannot read it is neither followed nor led. Every
        process reads the one document (one read; the first ever makes it, by an upsert
        that only inserts, so that the first writer's secret is everyone's).
        """
        with self._translate:
            # From the primary, whatever the URL's read preference: a secondary may hold
            # a secret that was deleted (a leader would take it for a new one).
            primary = self.relay.with_options(read_preference=pymongo.ReadPreference.PRIMARY)
            found = primary.find_one({"_id": "secret"})
            if found is None:
                found = self.relay.find_one_and_update(
                    {"_id": "secret"},
                    {"$setOnInsert": {"secret": bson.Binary(os.urandom(RELAY_SECRET_BYTES))}},
                    upsert=True,
                    return_document=pymongo.ReturnDocument.AFTER,
                )
        secret = None if found is None else found.get("secret")
        if not isinstance(secret, bytes) or len(secret) < RELAY_SECRET_BYTES:
            raise MongoLockError(
                f"{self.relay.full_name} holds no relay secret of {RELAY_SECRET_BYTES} bytes"
                " or more: delete its document and a new one is made"
            )
        return secret

    def add_request(self, key: str) -> int:
        """Record one request for a run of ``key`` (durable once this returns); its number,
        which a run has covered once ``served`` reaches it."""
        with self._translate:
            found = self.requests.find_one_and_update(
                {"_id": key},
                run_requests.add_request(),
                {"requested": 1},
                upsert=True,
                return_document=pymongo.ReturnDocument.AFTER,
            )
        assert found is not None  # an upsert returns the document after it
        return int(found["requested"])

    def requested(self, key: str) -> run_requests.RequestCount:
        """The counts of ``key`` as a run starting now sees them; keeps the document from
        the TTL monitor for ``IDLE_EXPIRY`` (read while holding the lock)."""
        with self._translate:
            found = self.requests.find_one_and_update(
                {"_id": key},
                run_requests.start_run(),
                {"requested": 1, "served": 1},
                upsert=True,
                return_document=pymongo.ReturnDocument.AFTER,
            )
        assert found is not None  # an upsert returns the document after it
        return run_requests.RequestCount(int(found["requested"]), int(found["served"]))

    def serve_requests(self, key: str, covered: int) -> None:
        """A run that started when ``requested(key)`` counted ``covered`` has finished."""
        if covered > 0:
            with self._translate:
                self.requests.update_one(*run_requests.served(key, covered))

    def request_pending(self, key: str) -> bool:
        """Whether a request of ``key`` came in that no finished run has covered."""
        with self._translate:
            found = self.requests.find_one(run_requests.pending_request(key), {"_id": 1})
        return found is not None

    def ensure_requests_index(self) -> bool:
        """The run requests' TTL index alone, as their first use creates it; False when the
        user may not create indexes (requests are kept and served all the same)."""
        with self._translate:
            try:
                self.requests.create_index(
                    "expires_at", expireAfterSeconds=0, name=run_requests.REQUESTS_TTL_INDEX
                )
            except OperationFailure as exc:
                if exc.code != _UNAUTHORIZED:
                    raise
                return False
        return True

    def heartbeat(self, process_ids: Iterable[str], interval: float) -> None:
        """Record, by server time, that these processes are alive and tick every ``interval``.

        One write for all of them. The document counts as alive until two intervals plus
        ``HEARTBEAT_SLACK`` after this write (``alive_until``, also the TTL index's field).
        """
        writes = queries.heartbeats(process_ids, interval)
        if writes:
            with self._translate:
                self.processes.bulk_write(writes, ordered=False)

    def liveness(self, process_ids: Iterable[str]) -> dict[str, tuple[bool, float]]:
        """``{process id: (alive, seconds silent)}`` by server time, in one query."""
        ids = sorted(set(process_ids))
        if not ids:
            return {}
        with self._translate:
            docs = list(self.processes.find({"_id": {"$in": ids}}, projection=queries.LIVENESS))
        return queries.liveness(docs)

    def with_liveness(self, infos: Sequence[LockInfo]) -> list[LockInfo]:
        """``infos`` with ``holder_alive``/``holder_silent_for`` of exclusive holders: one query.

        A holder with no heartbeat on record (it never refreshed, or its record was purged
        RETENTION seconds after it stopped) stays unknown (None).
        """
        found = self.liveness(process_of(info.owner) for info in infos if info.owner)
        out = []
        for info in infos:
            seen = found.get(process_of(info.owner)) if info.owner else None
            if seen is not None:
                info = replace(info, holder_alive=seen[0], holder_silent_for=seen[1])
            out.append(info)
        return out

    def force_release_recorded(
        self, key: str, token: int | None, *, by: str, reason: str
    ) -> LockInfo | None:
        """``force_release`` and its audit record in one transaction: both or neither."""
        query = queries.force_release(key, token)

        def delete_and_record(session: ClientSession) -> list[LockInfo]:
            doc = self.collection.find_one_and_delete(
                query, projection=queries.PROJECTION, session=session
            )
            if doc is None:
                return []
            info = LockInfo.from_document(doc)
            record = queries.audit_record(key, info, by=by, reason=reason)
            self.audit.update_one(*record, upsert=True, session=session)
            return [info]

        released = self._recorded(delete_and_record)
        return released[0] if released else None

    def force_release_recorded_many(
        self,
        selection: Sequence[tuple[str, int]],
        *,
        by: str,
        reason: str,
        committed: Callable[[list[LockInfo]], object],
    ) -> None:
        """``force_release_recorded`` of each ``(key, token)``, each only at its token, in
        one transaction of four round trips for every ``FORCE_CHUNK`` keys (a read, the
        delete, the audit records, the commit), not three round trips for each lock.
        ``committed`` is called with the locks of each transaction once it is committed:
        when a later one fails, those stay released.

        A holder's refresh of any of the locks between the read and the delete is a write
        conflict that runs the whole transaction again; one that keeps conflicting (many
        live locks, a slow server) is split in halves, each in a transaction of its own,
        and so on down to single locks, all within the chunk's one limit.
        """
        for start in range(0, len(selection), FORCE_CHUNK):
            # One limit for a chunk, its parts included: each part's own is within it.
            with self._translate, pymongo.timeout(self.timeout):
                self._force_release_part(
                    dict(selection[start : start + FORCE_CHUNK]), by, reason, committed
                )

    def _force_release_part(
        self,
        part: dict[str, int],
        by: str,
        reason: str,
        committed: Callable[[list[LockInfo]], object],
    ) -> None:
        def delete_and_record(session: ClientSession) -> list[LockInfo]:
            # Read and deleted in one snapshot: a lock changed by anyone after the read
            # makes the delete a write conflict, and the whole transaction runs again.
            docs = [
                doc
                for doc in self._held(list(part), session)
                if doc.get("token") == part[doc["_id"]]
            ]
            if not docs:
                return []
            at = [(doc["_id"], doc["token"]) for doc in docs]
            deleted = self.collection.delete_many(queries.at_tokens(at), session=session)
            if deleted.deleted_count != len(docs):  # a snapshot cannot lose one: a bug
                raise AssertionError(f"{deleted.deleted_count} of {len(docs)} locks deleted")
            infos = [LockInfo.from_document(doc) for doc in docs]
            records = [
                UpdateOne(*queries.audit_record(info.key, info, by=by, reason=reason), upsert=True)
                for info in infos
            ]
            self.audit.bulk_write(records, session=session)
            return infos

        try:
            released = self._recorded(delete_and_record, splittable=len(part) > 1)
        except _KeptConflicting:
            keys = list(part)
            for half in (keys[: len(keys) // 2], keys[len(keys) // 2 :]):
                self._force_release_part({key: part[key] for key in half}, by, reason, committed)
            return
        if released:
            committed(released)

    def _recorded(
        self, work: Callable[[ClientSession], list[LockInfo]], *, splittable: bool = False
    ) -> list[LockInfo]:
        """Run ``work`` in a majority transaction and commit it, within one operation limit:
        what it released, once committed. ``splittable``: when the last attempt meets a
        write conflict too, raise ``_KeptConflicting`` (the caller splits the work)."""
        client = self.collection.database.client
        done: list[LockInfo] = []
        # Not with_transaction(): it retries for up to two minutes. A write conflict with
        # the holder's refresh is retried a few times, all within one time budget.
        with self._translate, pymongo.timeout(self.timeout), client.start_session() as session:
            for attempt in range(_TRANSACTION_ATTEMPTS):
                last = attempt + 1 == _TRANSACTION_ATTEMPTS
                # Majority whatever the client's own concerns: the release and its record
                # must survive a failover even when the client writes w=1.
                session.start_transaction(
                    read_concern=ReadConcern("majority"),
                    write_concern=WriteConcern("majority"),
                )
                try:
                    done = work(session)
                except PyMongoError as exc:
                    # Nothing is applied until the commit: the whole transaction can be
                    # sent again after a conflict, a lost reply or a dropped connection.
                    with contextlib.suppress(PyMongoError):
                        session.abort_transaction()
                    if last and splittable and _write_conflict(exc):
                        raise _KeptConflicting from exc
                    if last or not mongo.transaction_retryable(exc):
                        raise
                    continue
                if _commit(session, last):
                    break
        return done

    def history(self, key: str, limit: int | None = 100) -> list[AuditEntry]:
        """The force releases of ``key`` still on record, newest first."""
        with self._translate:
            docs = self.audit.find({"key": key}, sort=queries.HISTORY_SORT, limit=limit or 0)
            return [AuditEntry.from_document(doc) for doc in docs]

    # -- their indexes -----------------------------------------------------------------------

    def _side_plan(
        self, retention: int, audit_retention: int
    ) -> list[tuple[_SideTTL | None, IndexAction]]:
        specs = [
            _SideTTL(
                self.processes,
                queries.TTLIndex(queries.PROCESS_TTL_INDEX, "alive_until", retention, "heartbeats"),
            ),
            _SideTTL(
                self.audit,
                queries.TTLIndex(queries.AUDIT_TTL_INDEX, "at", audit_retention, "audit trail"),
            ),
            _SideTTL(
                self.requests,
                queries.TTLIndex(run_requests.REQUESTS_TTL_INDEX, "expires_at", 0, "run requests"),
            ),
        ]
        plan: list[tuple[_SideTTL | None, IndexAction]] = []
        for spec in specs:
            existing = self._index_information(spec.collection)
            plan.append((spec, spec.index.plan(existing.get(spec.index.name))))
        plan.append((None, queries.plan_keyed(self._index_information(self.audit))))
        return plan

    def check_side_indexes(self, retention: int, audit_retention: int) -> list[IndexAction]:
        """What ``ensure_side_indexes`` would do, changing nothing."""
        return [item for _, item in self._side_plan(retention, audit_retention)]

    def ensure_side_indexes(self, retention: int, audit_retention: int) -> list[IndexAction]:
        """The heartbeat and audit collections' indexes: created, or their TTL updated."""
        done: list[IndexAction] = []
        with self._translate:
            for spec, item in self._side_plan(retention, audit_retention):
                if spec is None:
                    if item.action == "missing":
                        self.audit.create_index(
                            [("key", ASCENDING), ("at", DESCENDING)], name=queries.AUDIT_KEY_INDEX
                        )
                        item = IndexAction(item.name, item.description, "created")
                elif item.action == "missing":
                    index = spec.index
                    spec.collection.create_index(
                        index.field, expireAfterSeconds=index.seconds, name=index.name
                    )
                    item = IndexAction(item.name, item.description, "created")
                elif item.action == "differs":
                    self._set_ttl(spec.collection, spec.index.name, spec.index.seconds)
                    item = IndexAction(item.name, item.description, "updated", item.detail)
                done.append(item)
        return done


def _write_conflict(exc: PyMongoError) -> bool:
    """A write conflict (another write to one of the documents since the transaction's
    snapshot), not a server out of reach or out of time: what a split can avoid."""
    return isinstance(exc, OperationFailure) and exc.code == WRITE_CONFLICT and not exc.timeout


class _KeptConflicting(Exception):
    """Every attempt of a transaction met a write conflict: run its work in parts."""


def _commit(session: ClientSession, last: bool) -> bool:
    """Commit; True once committed, False when the whole transaction must run again.

    A commit whose outcome is unknown is sent again (the server applies it once); one
    the server aborted (a transient error) means running the transaction again.
    """
    while True:
        try:
            session.commit_transaction()
            return True
        except PyMongoError as exc:
            if exc.has_error_label("UnknownTransactionCommitResult"):
                if last:
                    raise
                last = True  # one more commit attempt
                continue
            if exc.has_error_label("TransientTransactionError") and not last:
                return False
            raise
