"""The holder's queries on pymongo's async client, for ``aacquire`` and ``alock``.

The same queries as the sync store (built by ``queries``), so both APIs share every
guarantee; only the driver calls differ. Inspection and operator queries stay sync.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import pymongo
from pymongo import AsyncMongoClient, ReturnDocument
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import (
    DuplicateKeyError,
    OperationFailure,
    PyMongoError,
)
from pymongo.read_concern import ReadConcern
from pymongo.write_concern import WriteConcern

from django_mongolock import mongo, queries
from django_mongolock.info import LockInfo

__all__ = ["AsyncLockStore"]


class AsyncLockStore:
    """The lock collection through an ``AsyncMongoClient`` (one per event loop)."""

    def __init__(self, client: AsyncMongoClient[Any], database: str, collection: str) -> None:
        self.client = client
        self.collection: AsyncCollection[Any] = client[database][collection].with_options(
            codec_options=mongo.CODEC,
            write_concern=WriteConcern(w="majority"),
            read_concern=ReadConcern("majority"),
        )
        self._translate = mongo.Translate(self)

    def servers(self) -> list[str]:
        return [
            f"{host}:{port}"
            for host, port in self.client.topology_description.server_descriptions()
        ]

    @property
    def timeout(self) -> float:
        """The time limit of one lock operation (``mongo.operation_limit``)."""
        return mongo.operation_limit(self.client.options)

    async def acquire(
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
        queries.check_limit(shared, limit)
        op = queries.acquire(owner, ttl, queue=queue, shared=shared, limit=limit, tags=tags)
        with self._translate:
            try:
                try:
                    doc = await self._upsert(key, op)
                except DuplicateKeyError:
                    doc = await self._upsert(key, op)  # see LockStore.acquire
            except OperationFailure:
                undo = queries.give_up(key, owner, shared=shared)
                with contextlib.suppress(PyMongoError), pymongo.timeout(self.timeout):
                    await self.collection.update_one(undo.filter, undo.pipeline)
                raise
        info = LockInfo.from_document(doc)
        return queries.refused(info, owner, queue=queue, shared=shared, limit=limit)

    async def _upsert(self, key: str, op: queries.Acquire) -> Mapping[str, Any]:
        reply, _ = await self._send(op.command(self.collection.name, key))
        doc = reply["value"]
        assert doc is not None  # an upsert returning the new document has one
        return doc  # type: ignore[no-any-return]

    async def _send(self, command: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """Send a lock write as a plain command: the reply, and whether it took two sends.

        Like the driver's one retry of a write: sent once more after an error it retries
        writes on, within one time budget for both sends.
        """
        database, codec = self.collection.database, mongo.CODEC
        with pymongo.timeout(self.timeout):
            try:
                return mongo.checked(await database.command(command, codec_options=codec)), False
            except PyMongoError as exc:
                if not mongo.retryable(exc):
                    raise
            return mongo.checked(await database.command(command, codec_options=codec)), True

    async def _update(self, op: queries.Update) -> Any:
        with pymongo.timeout(self.timeout):  # see HolderQueries._update
            return await self.collection.find_one_and_update(
                op.filter,
                op.pipeline,
                projection=op.projection,
                return_document=ReturnDocument.AFTER if op.return_after else ReturnDocument.BEFORE,
            )

    async def leave(self, key: str, owner: str) -> None:
        with self._translate:
            await self._send(queries.leave(key, owner).command(self.collection.name))

    async def abandon(self, key: str, owner: str, *, shared: bool = False) -> None:
        with self._translate:
            await self._send(queries.leave(key, owner, final=True).command(self.collection.name))
            if shared:
                undo = queries.give_up(key, owner, shared=True)
                await self._send(undo.command(self.collection.name))

    async def refresh(
        self, key: str, owner: str, token: int, ttl: float, *, shared: bool = False
    ) -> LockInfo | None:
        op = (queries.refresh_shared if shared else queries.refresh)(key, owner, token, ttl)
        with self._translate:
            doc = await self._update(op)
        if doc is None:
            return None
        info = LockInfo.from_document(doc)
        return info.as_holder(owner) if shared else info

    async def release(
        self, key: str, owner: str, token: int, *, shared: bool = False, contended: bool = False
    ) -> bool:
        if shared:
            with self._translate:
                doc = await self._update(queries.release_shared(key, owner, token))
            return queries.released_live(doc)
        with self._translate, pymongo.timeout(self.timeout):  # see LockStore.release
            for release in queries.release_writes(contended=contended):
                command = release(key, owner, token).command(self.collection.name)
                reply, retried = await self._send(command)
                if reply["nModified"]:
                    return True
                freed = queries.still_freed(key, owner)
                if retried and await self.collection.find_one(freed, projection={"_id": 1}):
                    return True
            return False

    async def close(self) -> None:
        await self.client.close()
