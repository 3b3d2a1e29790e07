"""Fenced writes across failovers: a paused holder's late write is refused on a new primary.

Holder A (a process of its own) acquires a key and writes a document through
``fenced_update_one``; it is frozen past its lease. The primary steps down; holder B
acquires the key on the new primary (a greater token) and writes. That primary is killed;
A wakes and writes under its old token on the third primary: refused, and B's write, acked
by a majority, is what the document holds.
"""

from __future__ import annotations

import time
from typing import Any

from pymongo import MongoClient
from pymongo.write_concern import WriteConcern

from django_mongolock import LockManager
from django_mongolock.fencing import fenced_update_one
from django_mongolock.testing import MongoReplicaSet
from tests.fencing.process import HolderProcess
from tests.reliability.conftest import Record

TTL = 2.0


def test_a_paused_holder_s_late_write_is_refused_across_two_failovers(
    replica_set: MongoReplicaSet, database: str, record: Record
) -> None:
    holder = HolderProcess(
        {"url": replica_set.url, "database": database, "key": "report", "ttl": TTL}
        | {"name": "daily", "first": "a-1", "backend": "mongo", "collection": "reports"}
    )
    manager = LockManager(replica_set.url, database=database, server_selection_timeout=30)
    client: MongoClient[dict[str, Any]] = MongoClient(
        replica_set.url, serverSelectionTimeoutMS=30000
    )
    reports = client[database].get_collection("reports", write_concern=WriteConcern("majority"))
    try:
        token_a = int(holder.answer()["held"])
        holder.pause()
        first = replica_set.step_down(10)
        second = replica_set.primary(timeout=60)
        assert second is not first
        started = time.monotonic()
        lock_b = manager.acquire("report", ttl=120, timeout=TTL + 60)
        record(ttl=TTL, b_waited_seconds=time.monotonic() - started)
        assert lock_b.token > token_a
        assert reports.find_one({"_id": "daily"}, {"_id": 0, "body": 1}) == {"body": "a-1"}
        written = fenced_update_one(reports, {"_id": "daily"}, {"$set": {"body": "b"}}, lock_b)
        assert written.modified_count == 1
        replica_set.kill(second)
        third = replica_set.primary(timeout=60)
        assert third is not second
        holder.resume()
        late = holder.write("a-2", timeout=90)
        assert late == {"error": "StaleTokenError", "fence": lock_b.token}
        assert list(reports.find()) == [
            {"_id": "daily", "body": "b", "fence": lock_b.token, "fence_key": "report"}
        ]
        again = fenced_update_one(reports, {"_id": "daily"}, {"$inc": {"edits": 1}}, lock_b)
        assert again.modified_count == 1
    finally:
        holder.close()
        client.close()
        manager.close()
