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
