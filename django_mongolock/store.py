"""Every MongoDB query of the package, in one place and free of Django.

One document per key, keyed by ``_id`` so that two documents for one key cannot
exist even before ``migrate_mongolock`` has created the indexes. Every decision
about time is made by the server (``$$NOW``) inside the query, and fencing
tokens come from the cluster time, so they keep growing after the document is
deleted and across a failover.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Final, Literal, Protocol

import pymongo
from bson import ObjectId
from bson.codec_options import CodecOptions
from pymongo import ASCENDING, DESCENDING, ReturnDocument, UpdateOne
from pymongo.client_session import ClientSession
from pymongo.collection import Collection
from pymongo.errors import (
    AutoReconnect,
    ConnectionFailure,
    DuplicateKeyError,
    OperationFailure,
    PyMongoError,
    WriteConcernError,
    WriteError,
)
from pymongo.read_concern import ReadConcern
from pymongo.write_concern import WriteConcern

from django_mongolock import queries
from django_mongolock.exceptions import (
    LimitConflict,
    LineFull,
    LockNotAcquired,
    MongoLockError,
    ReplicaSetRequired,
    ServerUnavailable,
)

__all__ = [
    "AUDIT_TTL_INDEX",
    "HEARTBEAT_SLACK",
    "KEY_INDEX",
    "PROCESS_TTL_INDEX",
    "TTL_INDEX",
    "AuditEntry",
    "IndexAction",
    "LockInfo",
    "LockStore",
    "Order",
    "State",
]

State = Literal["live", "expired", "all"]
Order = Literal["key", "-key", "expires", "-expires", "acquired", "-acquired"]

KEY_INDEX: Final = "key_unique"
TTL_INDEX: Final = "expires_at_ttl"
# The heartbeat and audit collections sit next to the lock collection (``locks.processes``,
# ``locks.audit``), each with a TTL index.
PROCESS_TTL_INDEX: Final = "alive_until_ttl"
AUDIT_TTL_INDEX: Final = "at_ttl"
AUDIT_KEY_INDEX: Final = "key_at"
# A process counts as alive while its last heartbeat is newer than two of its tick
# intervals plus this many seconds (a slow tick, a retried write).
HEARTBEAT_SLACK: Final = 5.0

_LIVE: Final = queries.LIVE
_PROJECTION: Final = queries.PROJECTION
_HELD: Final = queries.HELD
_SORTS: Final[Mapping[str, list[tuple[str, int]]]] = {
    "key": [("_id", ASCENDING)],
    "-key": [("_id", DESCENDING)],
    "expires": [("expires_at", ASCENDING), ("_id", ASCENDING)],
    "-expires": [("expires_at", DESCENDING), ("_id", ASCENDING)],
    "acquired": [("acquired_at", ASCENDING), ("_id", ASCENDING)],
    "-acquired": [("acquired_at", DESCENDING), ("_id", ASCENDING)],
}
_CODEC: Final[CodecOptions[Any]] = CodecOptions(tz_aware=True, tzinfo=UTC)
# Codes the server answers when $$CLUSTER_TIME is used on a standalone mongod.
_NO_CLUSTER_TIME: Final = frozenset({51144, 10071})
# Server errors after which the driver retries a write (not primary, shutting down,
# stepped down, network, time limit): the same set applies to the acquire command.
_RETRYABLE_CODES: Final = frozenset(
    {6, 7, 89, 91, 134, 189, 262, 9001, 10107, 11600, 11602, 13435, 13436}
)


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


def _check_limit(shared: bool, limit: int | None) -> None:
    """A semaphore cannot have more slots than a document takes holders (before any I/O)."""
    if shared and limit is not None and limit > queries.MAX_HOLDERS:
        raise ValueError(
            f"limit must be at most {queries.MAX_HOLDERS} (the shared holders one key "
            f"takes), got {limit}"
        )


def _refused(
    info: LockInfo, owner: str, *, queue: bool, shared: bool, limit: int | None
) -> LockInfo:
    """``info``, unless the acquire was refused for a reason waiting cannot cure.

    A limit other than the live holders' (LimitConflict), a full list of shared holders
    or a full line of waiters (LineFull): the acquire changed nothing, and a blocking
    caller must not wait for a place it will never get. A request that found the lease
    it took already ended (its reply was lost, and the retry came after the lease end)
    gets LockNotAcquired: that acquisition is over, and is not taken twice.
    """
    if shared:
        if info.as_holder(owner) is not None:
            return info
        for holder in info.holders:
            if holder.owner == owner:
                raise _ended(info.key, owner, holder.expires_at)
        live = info.live_holders
        if live and info.limit != limit:
            raise LimitConflict(info.key, info.limit, limit)
        if len(live) >= queries.MAX_HOLDERS:
            raise LineFull(info.key, queries.MAX_HOLDERS, "shared holders")
    elif info.owner == owner:
        if info.live:
            return info
        raise _ended(info.key, owner, info.expires_at)
    if queue and info.position < 0 and info.waiting >= queries.MAX_WAITERS:
        raise LineFull(info.key, queries.MAX_WAITERS, "waiters")
    return info


def _ended(key: str, owner: str, expires_at: datetime) -> LockNotAcquired:
    """The acquisition ``owner`` took a lease whose end passed before its reply arrived."""
    error = LockNotAcquired(key)
    error.args = (
        f"lock {key!r}: the lease acquisition {owner} took ended at "
        f"{expires_at.isoformat()} (server time) before its reply came back; acquire again",
    )
    return error


def _released_live(doc: Mapping[str, Any] | None) -> bool:
    """Whether a release freed a live lease, from the document it matched.

    A retried release is answered without the computed ``live`` field; the document
    matched the holder's owner and token, so it is counted as held.
    """
    return doc is not None and bool(doc.get("live", True))


class _Described(Protocol):
    """What error messages need to know of a store: the servers and the timeout."""

    def servers(self) -> list[str]: ...

    @property
    def timeout(self) -> float | None: ...


class _Translate:
    """Turns driver errors into this package's errors, naming the servers but no credentials."""

    __slots__ = ("_store",)

    def __init__(self, store: _Described) -> None:
        self._store = store

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None or not isinstance(exc, PyMongoError):
            return
        if _authentication_failed(exc):
            # The driver's frames hold the password in local variables, which error pages
            # (Django's DEBUG page) and error reporters print: drop them.
            _without_frames(exc)
        store = self._store
        if isinstance(exc, OperationFailure) and (
            exc.code in _NO_CLUSTER_TIME or "CLUSTER_TIME" in str(exc)
        ):
            raise ReplicaSetRequired(store.servers()) from exc
        # "Not primary", "shutting down" and the like in a reply are the server being
        # unavailable for writes just now, as much as a network error is.
        unavailable = isinstance(exc, OperationFailure) and exc.code in _RETRYABLE_CODES
        if isinstance(exc, ConnectionFailure) or getattr(exc, "timeout", False) or unavailable:
            raise ServerUnavailable(store.servers(), store.timeout, _brief(str(exc))) from exc
        raise MongoLockError(f"MongoDB error: {_redact(str(exc))}") from exc


_AUTHENTICATION_FAILED = 18


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the errors chained to it, each once."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _authentication_failed(exc: BaseException) -> bool:
    return any(
        isinstance(error, OperationFailure) and error.code == _AUTHENTICATION_FAILED
        for error in _chain(exc)
    )


def _without_frames(exc: BaseException) -> None:
    for error in _chain(exc):
        error.__traceback__ = None


def _transaction_retryable(exc: PyMongoError) -> bool:
    return (
        exc.has_error_label("TransientTransactionError")
        or exc.has_error_label("RetryableWriteError")
        or isinstance(exc, ConnectionFailure)
    )


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


def _retryable(exc: PyMongoError) -> bool:
    """Whether a failed acquisition may be sent again: the errors the driver retries writes on.

    A timeout of the operation's own budget is not retried (there is no time left).
    """
    if exc.timeout:  # server selection, network or execution time ran out
        return False
    if isinstance(exc, AutoReconnect):  # network errors and "not primary"
        return True
    return isinstance(exc, OperationFailure) and exc.code in _RETRYABLE_CODES


def _checked(reply: dict[str, Any]) -> dict[str, Any]:
    """The reply, unless it reports a write or write concern failure (in an ``ok`` reply)."""
    for error in reply.get("writeErrors") or ():
        raise WriteError(error.get("errmsg", "write failed"), error.get("code"), reply)
    error = reply.get("writeConcernError")
    if error:
        raise WriteConcernError(
            error.get("errmsg", "write concern failed"), error.get("code"), reply
        )
    return reply


_CREDENTIALS = re.compile(r"(mongodb(?:\+srv)?://)[^@/\s]*@")


def _redact(text: str) -> str:
    """Drop ``user:password@`` from any connection string quoted in a message."""
    return _CREDENTIALS.sub(r"\1***@", text)


def _brief(text: str) -> str:
    """The driver's first sentence, without its dump of timeouts and topology."""
    for cut in (" (configured timeouts", ", Timeout:", ", Topology Description:"):
        text = text.split(cut, 1)[0]
    return _redact(text)


class LockStore:
    """The lock collection: atomic, server-timed operations on one document per key."""

    def __init__(self, collection: Collection[Any]) -> None:
        self.collection: Collection[Any] = collection.with_options(
            codec_options=_CODEC,
            write_concern=WriteConcern(w="majority"),
            read_concern=ReadConcern("majority"),
        )
        self._translate = _Translate(self)

    # -- diagnostics -----------------------------------------------------------------------

    def servers(self) -> list[str]:
        """The seed or discovered addresses, as ``host:port`` (never credentials)."""
        client = self.collection.database.client
        return [
            f"{host}:{port}" for host, port in client.topology_description.server_descriptions()
        ]

    @property
    def timeout(self) -> float | None:
        return float(self.collection.database.client.options.server_selection_timeout)

    def server_kind(self) -> Literal["replica set", "sharded", "standalone"]:
        """How the deployment runs: only a replica set (or sharded cluster) is safe."""
        with self._translate:
            hello = self.collection.database.client.admin.command("hello")
        if hello.get("msg") == "isdbgrid":
            return "sharded"
        return "replica set" if "setName" in hello else "standalone"

    # -- the holder's operations -------------------------------------------------------------

    def acquire(
        self,
        key: str,
        owner: str,
        ttl: float,
        *,
        queue: bool = False,
        shared: bool = False,
        limit: int | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> LockInfo:
        """Take ``key`` for ``owner`` if it is free for it: one round trip either way.

        Returns the document after the update: the caller holds the lock when its owner
        is ``owner`` (or, shared, when it is among ``holders``); otherwise it says who
        holds it and when their leases end. See ``queries.acquire``. Raises LimitConflict
        or LineFull when the key refused the caller for good (see ``_refused``).
        """
        _check_limit(shared, limit)
        op = queries.acquire(owner, ttl, queue=queue, shared=shared, limit=limit, tags=tags)
        with self._translate:
            try:
                doc = self._upsert(key, op)
            except OperationFailure as exc:  # write concern and write errors among them
                if isinstance(exc, DuplicateKeyError):
                    # Two upserts raced to create the document; the loser tries again.
                    doc = self._upsert(key, op)
                else:
                    # The server answered, but maybe after applying the write: give back
                    # whatever this owner got rather than leave it held by nobody.
                    undo = queries.give_up(key, owner, shared=shared)
                    with contextlib.suppress(PyMongoError):
                        self.collection.update_one(undo.filter, undo.pipeline)
                    raise
        info = LockInfo.from_document(doc)
        return _refused(info, owner, queue=queue, shared=shared, limit=limit)

    def _upsert(self, key: str, op: queries.Acquire) -> Mapping[str, Any]:
        reply, _ = self._send(op.command(self.collection.name, key))
        doc = reply["value"]
        assert doc is not None  # an upsert returning the new document has one
        return doc  # type: ignore[no-any-return]

    def _send(self, command: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """Send a lock write as a plain command: the reply, and whether it took two sends.

        Like the driver's one retry of a write: sent once more after an error it retries
        writes on, within one time budget for both sends.
        """
        database = self.collection.database
        with pymongo.timeout(self.timeout):
            try:
                return _checked(database.command(command, codec_options=_CODEC)), False
            except PyMongoError as exc:
                if not _retryable(exc):
                    raise
            return _checked(database.command(command, codec_options=_CODEC)), True

    def leave_queue(self, key: str, owner: str) -> None:
        """Give up a waiter's place in line (it stopped waiting)."""
        with self._translate:
            self.collection.update_one(*queries.leave_queue(key, owner))

    def _update(self, op: queries.Update) -> Any:
        return self.collection.find_one_and_update(
            op.filter,
            op.pipeline,
            projection=op.projection,
            return_document=ReturnDocument.AFTER if op.return_after else ReturnDocument.BEFORE,
        )

    def refresh(
        self, key: str, owner: str, token: int, ttl: float, *, shared: bool = False
    ) -> LockInfo | None:
        """Extend a live lease held by ``owner``/``token``; None when it is no longer held."""
        op = (queries.refresh_shared if shared else queries.refresh)(key, owner, token, ttl)
        with self._translate:
            doc = self._update(op)
        if doc is None:
            return None
        info = LockInfo.from_document(doc)
        return info.as_holder(owner) if shared else info

    def release(self, key: str, owner: str, token: int, *, shared: bool = False) -> bool:
        """Give the holder's lock up in one round trip; True only if its lease was live.

        The document is freed in place (see ``queries.release``); a shared holder's entry
        is removed. The change stream wakes the waiters, and the filter on owner and
        token means a release never touches somebody else's lock.
        """
        if shared:
            with self._translate:
                doc = self._update(queries.release_shared(key, owner, token))
            return _released_live(doc)
        with self._translate:
            command = queries.release(key, owner, token).command(self.collection.name)
            reply, retried = self._send(command)
            if reply["nModified"] or not retried:
                return bool(reply["nModified"])
            # Sent twice and the second changed nothing: the first freed the document if
            # it is still free at this lock's token (nobody has taken the key since).
            freed = {"_id": key, "owner": None, "token": token}
            return self.collection.find_one(freed, projection={"_id": 1}) is not None

    def refresh_many(self, held: Sequence[tuple[str, str, int]]) -> set[str]:
        """Extend every live lease in ``held`` (key, owner, token) in one write.

        Each document keeps its own lease length (its ``ttl`` field). Returns the owners
        whose lease could not be extended (released by somebody else, or already over);
        finding those costs a second query, and only when something was lost.
        """
        if not held:
            return set()
        keys = [key for key, _, _ in held]
        owners = [owner for _, owner, _ in held]
        # An owner id is unique per acquisition and its document holds one token for it,
        # so key and owner name the lease: the tokens need not travel (a third less to
        # send and match).
        query = {"_id": {"$in": keys}, "owner": {"$in": owners}, "$expr": _LIVE}
        with self._translate:
            # The keys select the documents: without the hint the planner also tries the
            # TTL index, because the filter mentions expires_at.
            result = self.collection.update_many(
                query,
                [
                    {
                        "$set": {
                            "expires_at": {"$add": ["$$NOW", {"$multiply": ["$ttl", 1000]}]},
                            "refreshed_at": "$$NOW",
                        }
                    }
                ],
                hint=[("_id", ASCENDING)],
            )
            if result.matched_count == len(held):
                return set()
            alive = {
                doc["owner"]
                for doc in self.collection.find(
                    query, projection={"owner": 1}, hint=[("_id", ASCENDING)]
                )
            }
        return set(owners) - alive

    def refresh_shared_many(self, held: Sequence[tuple[str, str, int]]) -> set[str]:
        """Extend every live shared lease in ``held`` (key, owner, token): one write, one read.

        Returns the owners whose lease could not be extended.
        """
        if not held:
            return set()
        owners = {owner for _, owner, _ in held}
        query, pipeline = queries.refresh_shared_many(held)
        alive: set[str] = set()
        by_id = [("_id", ASCENDING)]
        with self._translate:
            self.collection.update_many(query, pipeline, hint=by_id)
            for doc in self.collection.find(
                query, projection={"holders": 1, "now": "$$NOW"}, hint=by_id
            ):
                alive.update(
                    entry["owner"]
                    for entry in doc.get("holders") or ()
                    if entry.get("owner") in owners and entry["expires_at"] > doc["now"]
                )
        return owners - alive

    def release_many(self, held: Sequence[tuple[str, str, int]]) -> int:
        """Free the holders' exclusive locks in one write (at exit); how many were freed."""
        if not held:
            return 0
        with self._translate:
            result = self.collection.update_many(
                {
                    "_id": {"$in": [key for key, _, _ in held]},
                    "owner": {"$in": [owner for _, owner, _ in held]},
                    "token": {"$in": [token for _, _, token in held]},
                },
                list(queries.RELEASE_PIPELINE),
            )
        return result.modified_count

    # -- operators ---------------------------------------------------------------------------

    def force_release(self, key: str, token: int | None = None) -> LockInfo | None:
        """Delete ``key`` whoever holds it (only at ``token`` when given); the removed lock."""
        query: dict[str, Any] = {"_id": key, **_HELD}
        if token is not None:
            query["token"] = token
        with self._translate:
            doc = self.collection.find_one_and_delete(query, projection=_PROJECTION)
        return None if doc is None else LockInfo.from_document(doc)

    def find(self, key: str) -> LockInfo | None:
        """The document of ``key`` (live or expired), read at majority."""
        with self._translate:
            doc = self.collection.find_one({"_id": key, **_HELD}, projection=_PROJECTION)
        return None if doc is None else LockInfo.from_document(doc)

    @staticmethod
    def _query(state: State, prefix: str | None, owner: str | None = None) -> dict[str, Any]:
        query: dict[str, Any] = dict(_HELD)
        if prefix:
            query["_id"] = {"$regex": "^" + re.escape(prefix)}
        if owner:
            pattern = {"$regex": re.escape(owner)}
            query = {"$and": [query, {"$or": [{"owner": pattern}, {"holders.owner": pattern}]}]}
        if state == "live":
            query["$expr"] = _LIVE
        elif state == "expired":
            query["$expr"] = {"$not": [_LIVE]}
        elif state != "all":
            raise ValueError(f"state must be 'live', 'expired' or 'all', not {state!r}")
        return query

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
        if order not in _SORTS:
            raise ValueError(f"order must be one of {', '.join(_SORTS)}, not {order!r}")
        with self._translate:
            cursor = self.collection.find(
                self._query(state, prefix, owner),
                projection=_PROJECTION,
                sort=_SORTS[order],
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
            return self.collection.count_documents(self._query(state, prefix, owner))

    def counts(self, soon: float = 10.0) -> dict[str, int]:
        """Live, expired and expiring-within-``soon``-seconds counts, in one pass on the server."""
        live = _LIVE
        soon_ms = round(soon * 1000)
        pipeline: list[dict[str, Any]] = [
            {"$match": _HELD},
            {
                "$group": {
                    "_id": None,
                    "live": {"$sum": {"$cond": [live, 1, 0]}},
                    "expired": {"$sum": {"$cond": [live, 0, 1]}},
                    "expiring": {
                        "$sum": {
                            "$cond": [
                                {
                                    "$and": [
                                        live,
                                        {"$lte": ["$expires_at", {"$add": ["$$NOW", soon_ms]}]},
                                    ]
                                },
                                1,
                                0,
                            ]
                        }
                    },
                }
            },
        ]
        with self._translate:
            rows = list(self.collection.aggregate(pipeline))
        row = rows[0] if rows else {}
        return {name: int(row.get(name, 0)) for name in ("live", "expired", "expiring")}

    # -- indexes -----------------------------------------------------------------------------

    def _indexes(self) -> dict[str, Any]:
        with self._translate:
            try:
                return dict(self.collection.index_information())
            except OperationFailure as exc:
                if exc.code == 26:  # NamespaceNotFound: no collection yet
                    return {}
                raise

    def check_indexes(self, retention: int) -> list[IndexAction]:
        """Compare the indexes with what ``ensure_indexes`` would make; nothing is changed."""
        return self._plan(retention, self._indexes())

    def ensure_indexes(self, retention: int) -> list[IndexAction]:
        """Create the unique key index and the TTL index, or bring the TTL in line; idempotent."""
        plan = self._plan(retention, self._indexes())
        done: list[IndexAction] = []
        with self._translate:
            for item in plan:
                if item.action == "missing":
                    if item.name == KEY_INDEX:
                        self.collection.create_index("key", unique=True, name=KEY_INDEX)
                    else:
                        self.collection.create_index(
                            "expires_at", expireAfterSeconds=retention, name=TTL_INDEX
                        )
                    done.append(IndexAction(item.name, item.description, "created", item.detail))
                elif item.action == "differs":
                    self.collection.database.command(
                        "collMod",
                        self.collection.name,
                        index={"name": TTL_INDEX, "expireAfterSeconds": retention},
                    )
                    done.append(IndexAction(item.name, item.description, "updated", item.detail))
                else:
                    done.append(item)
        return done

    @staticmethod
    def _plan(retention: int, existing: Mapping[str, Any]) -> list[IndexAction]:
        key_desc = "unique index on key"
        ttl_desc = f"TTL index on expires_at (expireAfterSeconds={retention})"
        plan = []
        key_index = existing.get(KEY_INDEX)
        if key_index is None:
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

    # -- holder liveness and the audit trail -------------------------------------------------

    @property
    def processes(self) -> Collection[Any]:
        """Heartbeats of the processes that hold locks, one document per process id."""
        return self.collection.database[f"{self.collection.name}.processes"].with_options(
            codec_options=_CODEC,
            write_concern=WriteConcern(w="majority"),
            read_concern=ReadConcern("majority"),
        )

    @property
    def audit(self) -> Collection[Any]:
        """The record of force releases (who, when, key, owner, token, reason)."""
        return self.collection.database[f"{self.collection.name}.audit"].with_options(
            codec_options=_CODEC,
            write_concern=WriteConcern(w="majority"),
            read_concern=ReadConcern("majority"),
        )

    def heartbeat(self, process_ids: Iterable[str], interval: float) -> None:
        """Record, by server time, that these processes are alive and tick every ``interval``.

        One write for all of them. The document counts as alive until two intervals plus
        ``HEARTBEAT_SLACK`` after this write (``alive_until``, also the TTL index's field).
        """
        bound_ms = round((2 * interval + HEARTBEAT_SLACK) * 1000)
        stamp = [
            {
                "$set": {
                    "seen_at": "$$NOW",
                    # Another lane of the process may tick less often: keep its bound.
                    "alive_until": {"$max": ["$alive_until", {"$add": ["$$NOW", bound_ms]}]},
                    "interval": float(interval),
                }
            }
        ]
        writes = [UpdateOne({"_id": pid}, stamp, upsert=True) for pid in sorted(set(process_ids))]
        if writes:
            with self._translate:
                self.processes.bulk_write(writes, ordered=False)

    def liveness(self, process_ids: Iterable[str]) -> dict[str, tuple[bool, float]]:
        """``{process id: (alive, seconds silent)}`` by server time, in one query."""
        ids = sorted(set(process_ids))
        if not ids:
            return {}
        projection = {
            "alive": {"$gt": ["$alive_until", "$$NOW"]},
            "silent": {"$subtract": ["$$NOW", "$seen_at"]},
        }
        with self._translate:
            docs = list(self.processes.find({"_id": {"$in": ids}}, projection=projection))
        return {
            str(doc["_id"]): (
                bool(doc.get("alive")),
                max(0.0, float(doc.get("silent") or 0) / 1000),
            )
            for doc in docs
        }

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
        query: dict[str, Any] = {"_id": key, **_HELD}
        if token is not None:
            query["token"] = token

        def delete_and_record(session: ClientSession) -> Mapping[str, Any] | None:
            doc: Mapping[str, Any] | None = self.collection.find_one_and_delete(
                query, projection=_PROJECTION, session=session
            )
            if doc is not None:
                info = LockInfo.from_document(doc)
                owner = info.owner or ", ".join(h.owner for h in info.live_holders)
                # $literal: a key, owner, name or reason that starts with "$" is text, not
                # a field path or variable of the update pipeline.
                record = {
                    "key": {"$literal": key},
                    "owner": {"$literal": owner},
                    "token": info.token,
                    "by": {"$literal": by},
                    "reason": {"$literal": reason},
                    "expired": not info.live,
                    "at": "$$NOW",
                }
                self.audit.update_one(
                    {"_id": ObjectId()}, [{"$set": record}], upsert=True, session=session
                )
            return doc

        client = self.collection.database.client
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
                    doc = delete_and_record(session)
                except PyMongoError as exc:
                    # Nothing is applied until the commit: the whole transaction can be
                    # sent again after a conflict, a lost reply or a dropped connection.
                    with contextlib.suppress(PyMongoError):
                        session.abort_transaction()
                    if last or not _transaction_retryable(exc):
                        raise
                    continue
                if _commit(session, last):
                    break
        return None if doc is None else LockInfo.from_document(doc)

    def history(self, key: str, limit: int | None = 100) -> list[AuditEntry]:
        """The force releases of ``key`` still on record, newest first."""
        with self._translate:
            docs = self.audit.find(
                {"key": key}, sort=[("at", DESCENDING), ("_id", DESCENDING)], limit=limit or 0
            )
            return [AuditEntry.from_document(doc) for doc in docs]

    def _side_indexes(self, retention: int, audit_retention: int) -> list[_TTLSpec]:
        return [
            _TTLSpec(self.processes, PROCESS_TTL_INDEX, "alive_until", retention, "heartbeats"),
            _TTLSpec(self.audit, AUDIT_TTL_INDEX, "at", audit_retention, "audit trail"),
        ]

    def _side_plan(
        self, retention: int, audit_retention: int
    ) -> list[tuple[_TTLSpec | None, IndexAction]]:
        plan: list[tuple[_TTLSpec | None, IndexAction]] = []
        for spec in self._side_indexes(retention, audit_retention):
            existing = _index_information(spec.collection, self._translate)
            plan.append((spec, spec.plan(existing.get(spec.name))))
        existing = _index_information(self.audit, self._translate)
        desc = "audit trail: index on key, at"
        action: Literal["missing", "unchanged"] = (
            "unchanged" if AUDIT_KEY_INDEX in existing else "missing"
        )
        plan.append((None, IndexAction(AUDIT_KEY_INDEX, desc, action)))
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
                            [("key", ASCENDING), ("at", DESCENDING)], name=AUDIT_KEY_INDEX
                        )
                        item = IndexAction(item.name, item.description, "created")
                elif item.action == "missing":
                    spec.collection.create_index(
                        spec.field, expireAfterSeconds=spec.seconds, name=spec.name
                    )
                    item = IndexAction(item.name, item.description, "created")
                elif item.action == "differs":
                    spec.collection.database.command(
                        "collMod",
                        spec.collection.name,
                        index={"name": spec.name, "expireAfterSeconds": spec.seconds},
                    )
                    item = IndexAction(item.name, item.description, "updated", item.detail)
                done.append(item)
        return done


_TRANSACTION_ATTEMPTS: Final = 5


@dataclass(frozen=True, slots=True)
class _TTLSpec:
    """A TTL index of a side collection, as ``migrate_mongolock`` should find it."""

    collection: Collection[Any]
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


def _index_information(collection: Collection[Any], translate: _Translate) -> dict[str, Any]:
    """A collection's indexes; none while it does not exist."""
    with translate:
        try:
            return dict(collection.index_information())
        except OperationFailure as exc:
            if exc.code == 26:  # NamespaceNotFound
                return {}
            raise
