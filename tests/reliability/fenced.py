"""A fenced resource: what a fencing token protects.

A lock service can hand a key to a new holder while the old one still believes it holds it
(a pause, a partition, a failover). A resource that remembers the greatest token it accepted
and refuses any write that does not carry a greater one makes that harmless: the old
holder's late write is refused. This one keeps one document per key in MongoDB; the check
and the write are one atomic, majority-acknowledged update that also appends the write to the
document's log, so that a test can tell that no accepted write was lost.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pymongo
from pymongo import ReturnDocument
from pymongo.collection import Collection
from pymongo.read_concern import ReadConcern
from pymongo.write_concern import WriteConcern

__all__ = ["FencedResource", "Verdict"]


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether a write was accepted, and the resource's fence (greatest accepted token) after it."""

    accepted: bool
    fence: int


class FencedResource:
    """Accepts a write only with a token greater than the last one it accepted."""

    def __init__(self, collection: Collection[dict[str, Any]]) -> None:
        self.collection = collection.with_options(
            write_concern=WriteConcern("majority"), read_concern=ReadConcern("majority")
        )

    def create(self, keys: Iterable[str]) -> None:
        """One document per key, with no token accepted yet."""
        for key in keys:
            self.collection.update_one(
                {"_id": key},
                {"$setOnInsert": {"fence": 0, "log": []}},
                upsert=True,
            )

    def write(self, key: str, token: int, write_id: str) -> Verdict:
        """Write ``write_id`` under ``token``; refused unless ``token`` beats every accepted one.

        The write and the read that says why it was refused share the client's timeout.
        """
        budget = self.collection.database.client.options.timeout
        with pymongo.timeout(budget) if budget else contextlib.nullcontext():
            doc = self.collection.find_one_and_update(
                {"_id": key, "fence": {"$lt": token}},
                {"$set": {"fence": token}, "$push": {"log": {"token": token, "id": write_id}}},
                projection={"_id": 0, "fence": 1},
                return_document=ReturnDocument.AFTER,
            )
            if doc is not None:
                return Verdict(True, int(doc["fence"]))
            current = self.collection.find_one({"_id": key}, projection={"_id": 0, "fence": 1})
        if current is None:
            raise LookupError(f"the fenced resource has no document for {key!r}")
        return Verdict(False, int(current["fence"]))

    def log(self, key: str) -> list[dict[str, Any]]:
        """The accepted writes of ``key``, in the order they were accepted."""
        doc = self.collection.find_one({"_id": key}, projection={"_id": 0, "log": 1})
        return [] if doc is None else list(doc["log"])
