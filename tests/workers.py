"""Entry points for worker processes in cross-process tests (importable by spawn)."""

from __future__ import annotations

import time

from pymongo import MongoClient

from django_mongolock import LockManager


def increment(url: str, database: str, rounds: int, key: str = "counter") -> int:
    """Increment a counter ``rounds`` times by read, pause, write under the lock.

    Without mutual exclusion the pause makes lost updates all but certain.
    Returns how many critical sections overlapped (seen through an 'inside' flag).
    """
    manager = LockManager(url, database=database, collection="locks")
    client: MongoClient[dict[str, object]] = MongoClient(url, w="majority")
    counters = client[database]["counters"]
    overlaps = 0
    try:
        for _ in range(rounds):
            with manager.lock(key, ttl=30, timeout=60):
                entered = counters.find_one_and_update(
                    {"_id": key}, {"$inc": {"inside": 1}}, upsert=True
                )
                if entered and entered.get("inside", 0) != 0:
                    overlaps += 1
                doc = counters.find_one({"_id": key}) or {}
                value = doc.get("value", 0)
                assert isinstance(value, int)
                time.sleep(0.002)
                counters.update_one({"_id": key}, {"$set": {"value": value + 1}})
                counters.update_one({"_id": key}, {"$inc": {"inside": -1}})
    finally:
        client.close()
        manager.close()
    return overlaps


def readers_writers(url: str, database: str, rounds: int, seed: int, limit: int) -> dict[str, int]:
    """Mix shared and exclusive holds of one key; count what the observer saw overlap.

    Each holder announces itself in an observer document with an atomic increment and
    checks what it found there: a writer must be alone, readers at most ``limit``.
    """
    import random

    rng = random.Random(seed)
    manager = LockManager(url, database=database, collection="locks")
    client: MongoClient[dict[str, object]] = MongoClient(url, w="majority")
    observer = client[database].get_collection("observer")
    seen = {"reads": 0, "writes": 0, "violations": 0, "max_readers": 0}
    try:
        for _ in range(rounds):
            shared = rng.random() < 0.7
            field = "readers" if shared else "writers"
            with manager.lock(
                "catalog", ttl=30, timeout=120, shared=shared, limit=limit if shared else None
            ):
                doc = observer.find_one_and_update(
                    {"_id": "catalog"}, {"$inc": {field: 1}}, upsert=True, return_document=True
                )
                assert doc is not None
                readers, writers = doc.get("readers", 0), doc.get("writers", 0)
                assert isinstance(readers, int)
                assert isinstance(writers, int)
                if shared:
                    seen["reads"] += 1
                    seen["max_readers"] = max(seen["max_readers"], readers)
                    bad = writers != 0 or readers > limit
                else:
                    seen["writes"] += 1
                    bad = writers != 1 or readers != 0
                seen["violations"] += int(bad)
                time.sleep(rng.uniform(0.001, 0.01))
                observer.update_one({"_id": "catalog"}, {"$inc": {field: -1}})
    finally:
        client.close()
        manager.close()
    return seen


def opposite_groups(url: str, database: str, rounds: int, reverse: bool) -> int:
    """Take the group {a, b, c} ``rounds`` times, listing the keys in one order or the other."""
    manager = LockManager(url, database=database, collection="locks")
    keys = ["a", "b", "c"][::-1] if reverse else ["a", "b", "c"]
    done = 0
    try:
        for _ in range(rounds):
            with manager.acquire_group(keys, ttl=30, timeout=60):
                time.sleep(0.002)
                done += 1
    finally:
        manager.close()
    return done
