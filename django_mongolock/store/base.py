"""What every part of the lock store shares: the collection and how its errors read."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pymongo.client_session import ClientSession
from pymongo.collection import Collection
from pymongo.errors import OperationFailure

from django_mongolock import mongo, queries

__all__ = ["StoreBase"]


class StoreBase:
    """The lock collection with majority reads and writes, and the server's identity."""

    def __init__(self, collection: Collection[Any]) -> None:
        self.collection: Collection[Any] = mongo.majority(collection)
        self._translate = mongo.Translate(self)

    def servers(self) -> list[str]:
        """The seed or discovered addresses, as ``host:port`` (never credentials)."""
        client = self.collection.database.client
        return [
            f"{host}:{port}" for host, port in client.topology_description.server_descriptions()
        ]

    @property
    def timeout(self) -> float:
        """The time limit of one lock operation (``mongo.operation_limit``)."""
        return mongo.operation_limit(self.collection.database.client.options)

    def server_kind(self) -> Literal["replica set", "sharded", "standalone"]:
        """How the deployment runs: only a replica set (or sharded cluster) is safe."""
        with self._translate:
            hello = self.collection.database.client.admin.command("hello")
        if hello.get("msg") == "isdbgrid":
            return "sharded"
        return "replica set" if "setName" in hello else "standalone"

    def _held(self, keys: Sequence[str], session: ClientSession | None = None) -> list[Any]:
        """The documents of ``keys`` with a holder on record, live or expired: one read,
        all in its first reply (one document a key at most), so no ``getMore``."""
        return list(
            self.collection.find(
                queries.find_many(keys),
                projection=queries.PROJECTION,
                session=session,
                limit=len(keys),
                batch_size=len(keys),
            )
        )

    def _side(self, suffix: str) -> Collection[Any]:
        """A collection next to the lock collection (``locks.<suffix>``), used alike."""
        return mongo.majority(self.collection.database[f"{self.collection.name}.{suffix}"])

    def _index_information(self, collection: Collection[Any]) -> dict[str, Any]:
        """A collection's indexes; none while it does not exist."""
        with self._translate:
            try:
                return dict(collection.index_information())
            except OperationFailure as exc:
                if exc.code == mongo.NAMESPACE_NOT_FOUND:  # no collection yet
                    return {}
                raise

    @staticmethod
    def _set_ttl(collection: Collection[Any], name: str, seconds: int) -> None:
        """Change a TTL index's ``expireAfterSeconds`` in place (collMod): records kept."""
        collection.database.command(
            "collMod", collection.name, index={"name": name, "expireAfterSeconds": seconds}
        )
