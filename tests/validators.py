"""A collection validator that makes the server refuse the writes to some lock keys."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from pymongo import MongoClient
from pymongo.database import Database

from django_mongolock import LockManager


@contextlib.contextmanager
def refusing(url: str, manager: LockManager, *keys: str) -> Iterator[None]:
    """While inside, the server answers any write to ``keys``' documents with a document
    validation failure (a write error, not silence); the validator is removed after."""
    client: MongoClient[dict[str, Any]]
    with MongoClient(url) as client:
        database: Database[dict[str, Any]] = client[manager.database]
        database.command(
            "collMod",
            manager.collection,
            validator={"_id": {"$nin": list(keys)}},
            validationLevel="strict",
            validationAction="error",
        )
        try:
            yield
        finally:
            database.command("collMod", manager.collection, validator={})
