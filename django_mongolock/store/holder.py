"""The holder's queries: acquire, refresh, release, alone or in bulk; one round trip each
(a release that finds a waiter in line: two writes, within one timeout)."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import bson
import pymongo
from bson.raw_bson import RawBSONDocument
from pymongo import ASCENDING, ReturnDocument, UpdateOne
from pymongo.errors import BulkWriteError, DuplicateKeyError, OperationFailure, PyMongoError

from django_mongolock import mongo, queries
from django_mongolock.info import LockInfo
from django_mongolock.store.base import StoreBase

__all__ = ["HolderQueries", "Kept"]

# The keys select the documents of a bulk refresh: without this hint the planner also
# tries the TTL index, because the filter mentions expires_at.
_BY_ID = [("_id", ASCENDING)]
# A bulk refresh of this many leases or more keeps its encoded filter and pipeline in the
# caller's ``kept``: below it, encoding them again costs well under a tenth of a millisecond.
_KEEP_FROM = 64

Kept = dict[object, tuple[Sequence[Any], RawBSONDocument, list[RawBSONDocument]]]
"""Bulk writes kept encoded (``HolderQueries._bulk``): by query builder, the leases it was
built for, its filter and its pipeline."""


class HolderQueries(StoreBase):
    """The operations of a lock's holder, each filtered on its owner (and token)."""

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
        or LineFull when the key refused the caller for good (see ``queries.refused``).
        """
        queries.check_limit(shared, limit)
        op = queries.acquire(owner, ttl, queue=queue, shared=shared, limit=limit, tags=tags)
        with self._translate:
            try:
                try:
                    doc = self._upsert(key, op)
                except DuplicateKeyError:
                    # Two upserts raced to create the document; the loser tries again.
                    doc = self._upsert(key, op)
            except OperationFailure:  # write concern and write errors among them
                # The server answered, but maybe after applying the write: give back
                # whatever this owner got rather than leave it held by nobody. A round
                # trip of its own, bounded like the first.
                undo = queries.give_up(key, owner, shared=shared)
                with contextlib.suppress(PyMongoError), pymongo.timeout(self.timeout):
                    self.collection.update_one(undo.filter, undo.pipeline)
                raise
        info = LockInfo.from_document(doc)
        return queries.refused(info, owner, queue=queue, shared=shared, limit=limit)

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
                return mongo.checked(database.command(command, codec_options=mongo.CODEC)), False
            except PyMongoError as exc:
                if not mongo.retryable(exc):
                    raise
            return mongo.checked(database.command(command, codec_options=mongo.CODEC)), True

    def leave(self, key: str, owner: str) -> None:
        """Stop waiting: leave the line, or give back a lock a release handed over (one
        write, see ``queries.leave``)."""
        with self._translate:
            self._send(queries.leave(key, owner).command(self.collection.name))

    def abandon(self, key: str, owner: str, *, shared: bool = False) -> None:
        """Give up an acquisition whose caller was stopped (an interrupt, a cancelled
        task, a handle that could not be made): leave the line, give back a lease it
        got, and refuse an attempt of it that reaches the server later (``queries.leave``
        with ``final``): stopped mid-attempt, the caller cannot know where that is.

        With ``shared``, a second write then gives back a shared lease ``owner`` took
        (the lease and the place are in different arrays): an attempt the server applied
        before the first write is undone by it, one applied after is refused.
        """
        with self._translate:
            self._send(queries.leave(key, owner, final=True).command(self.collection.name))
            if shared:
                undo = queries.give_up(key, owner, shared=True)
                self._send(undo.command(self.collection.name))

    def _update(self, op: queries.Update) -> Any:
        """One holder's write (a refresh by hand, a shared release), bounded like an
        acquire: a given client without ``timeoutMS`` sets no limit of its own."""
        with pymongo.timeout(self.timeout):
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

    def release(
        self, key: str, owner: str, token: int, *, shared: bool = False, contended: bool = False
    ) -> bool:
        """Give the holder's lock up: one write, or two when a waiter is in line, all within
        one timeout; True only if its lease was live.

        The document is freed in place (see ``queries.release``); a shared holder's entry
        is removed. The change stream wakes the waiters, and the filter on owner and
        token means a release never touches somebody else's lock.
        """
        if shared:
            with self._translate:
                doc = self._update(queries.release_shared(key, owner, token))
            return queries.released_live(doc)
        # One time budget for every write and read below: a release is one operation,
        # bounded like an acquire by the operation limit (``timeout``).
        with self._translate, pymongo.timeout(self.timeout):
            # Nobody in line to hand it to (the common case): one small write. Else, or
            # when that matched nothing, the write that hands it on decides; a lock
            # taken with others in line (``contended``) sends that one at once.
            for release in queries.release_writes(contended=contended):
                reply, retried = self._send(
                    release(key, owner, token).command(self.collection.name)
                )
                if reply["nModified"]:
                    return True
                # Sent twice and the second changed nothing: the first freed the
                # document (or handed it on) if the document records this owner's release.
                freed = queries.still_freed(key, owner)
                if retried and self.collection.find_one(freed, projection={"_id": 1}):
                    return True
            return False

    def refresh_many(
        self, held: Sequence[tuple[str, str, int]], *, kept: Kept | None = None
    ) -> set[str]:
        """Extend every live lease in ``held`` (key, owner, token) in one write.

        Each document keeps its own lease length (its ``ttl`` field). Returns the owners
        whose lease could not be extended (released by somebody else, or already over);
        finding those costs a second query, and only when something was lost. ``kept``:
        see ``_bulk``.
        """
        if not held:
            return set()
        with self._translate:
            query, pipeline = self._bulk(queries.refresh_many, held, kept)
            result = self.collection.update_many(query, pipeline, hint=_BY_ID)
            # Every live lease is modified (its refreshed_at moves on); one refreshed
            # in the same millisecond is not, and the read below finds it live.
            if result.modified_count == len(held):
                return set()
            return self._lost_exclusive(held)

    def _lost_exclusive(self, held: Sequence[tuple[str, str, int]]) -> set[str]:
        """The owners in ``held`` without a live exclusive lease, read after a refresh."""
        query, _ = queries.refresh_many(held)
        live = {**query, **queries.REFRESHED_LIVE}
        alive = {
            doc["owner"] for doc in self.collection.find(live, projection={"owner": 1}, hint=_BY_ID)
        }
        return {owner for _, owner, _ in held} - alive

    def refresh_shared_many(
        self, held: Sequence[tuple[str, str, int]], *, kept: Kept | None = None
    ) -> set[str]:
        """Extend every live shared lease in ``held`` (key, owner, token) in one write.

        Returns the owners whose lease could not be extended. A document is modified
        only when a lease in it was extended (owner ids are unique per acquisition), so
        when every document is, the leases alone on their key were all extended, and
        only the keys with several (permits of one semaphore, readers of one key) are
        read to tell which of theirs were; otherwise every document is read.
        """
        if not held:
            return set()
        per_key = Counter(key for key, _, _ in held)
        with self._translate:
            query, pipeline = self._bulk(queries.refresh_shared_many, held, kept)
            result = self.collection.update_many(query, pipeline, hint=_BY_ID)
            # A lease refreshed twice in one millisecond is not modified: the read finds it.
            if result.modified_count != len(per_key):
                return self._lost_shared(held)
            several = [(key, owner, token) for key, owner, token in held if per_key[key] > 1]
            return self._lost_shared(several) if several else set()

    def _bulk(
        self,
        build: Callable[[Sequence[tuple[str, str, int]]], tuple[Mapping[str, Any], list[Any]]],
        held: Sequence[tuple[str, str, int]],
        kept: Kept | None,
    ) -> tuple[Mapping[str, Any], list[Any]]:
        """``build(held)``, the filter and pipeline of a bulk write, encoded once and kept
        in ``kept`` for the next write of the same ``held`` (the same object): the
        refresher keeps one per lane until its leases change. Over 10,000 leases the
        filter, which lists every key and owner id, is over 600 KB of BSON to encode;
        sent encoded, the driver copies it as it is.
        """
        if kept is None or len(held) < _KEEP_FROM:
            return build(held)
        entry = kept.get(build)
        if entry is None or entry[0] is not held:
            query, pipeline = build(held)
            options = self.collection.codec_options
            entry = kept[build] = (
                held,
                RawBSONDocument(bson.encode(query, codec_options=options)),
                [RawBSONDocument(bson.encode(stage, codec_options=options)) for stage in pipeline],
            )
        return entry[1], list(entry[2])

    def _lost_shared(self, held: Sequence[tuple[str, str, int]]) -> set[str]:
        """The owners in ``held`` without a live shared lease, read after a refresh."""
        owners = {owner for _, owner, _ in held}
        docs = self.collection.find(
            queries.shared_leases_filter(held), projection=queries.SHARED_LEASES, hint=_BY_ID
        )
        return owners - queries.live_shared_owners(docs, owners)

    def refresh_each(
        self, held: Sequence[tuple[str, str, int]], *, shared: bool = False
    ) -> tuple[set[str], set[str]]:
        """Extend each lease in ``held`` with a write of its own, all in one unordered bulk
        write: the way round a document the server refuses to update (a validator that
        rejects it), which stops ``refresh_many`` there and leaves the rest undone.

        Returns the owners whose lease could not be extended, and the owners whose write
        the server refused (named by the bulk write's errors, one per refused document).
        Raises for any other error, as ``refresh_many`` does.
        """
        if not held:
            return set(), set()
        writes = [
            UpdateOne(*self._refresh_one(key, owner, token, shared), hint=_BY_ID)
            for key, owner, token in held
        ]
        refused: set[str] = set()
        with self._translate:
            try:
                self.collection.bulk_write(writes, ordered=False)
            except BulkWriteError as exc:
                errors = exc.details.get("writeErrors") or []
                # Only documents the server refuses (a validator): any other error (a time
                # limit, an interruption) may have left later writes undone.
                if (
                    exc.details.get("writeConcernErrors")
                    or not errors
                    or any(error.get("code") != mongo.DOCUMENT_REFUSED for error in errors)
                ):
                    raise
                refused = {held[error["index"]][1] for error in errors}
            rest = [lease for lease in held if lease[1] not in refused]
            if not rest:
                return set(), refused
            lost = self._lost_shared(rest) if shared else self._lost_exclusive(rest)
        return lost, refused

    @staticmethod
    def _refresh_one(
        key: str, owner: str, token: int, shared: bool
    ) -> tuple[dict[str, Any], list[Any]]:
        if shared:
            return queries.refresh_shared_many([(key, owner, token)])
        return {"_id": key, "owner": owner}, list(queries.REFRESH_MANY_PIPELINE)

    def release_many(self, held: Sequence[tuple[str, str, int]]) -> int:
        """Free the holders' exclusive locks in one write (at exit); how many were freed."""
        if not held:
            return 0
        with self._translate:
            result = self.collection.update_many(*queries.release_many(held))
        return result.modified_count

    def release_shared_many(self, held: Sequence[tuple[str, str, int]]) -> int:
        """Drop the holders' shared leases in one write (at exit); how many documents
        it changed (the permits of one semaphore share one)."""
        if not held:
            return 0
        with self._translate:
            result = self.collection.update_many(*queries.release_shared_many(held), hint=_BY_ID)
        return result.modified_count
