"""Two holders of one key, a pause longer than the lease between them, one resource.

Holder A, a process of its own, acquires the key and writes; it is frozen (SIGSTOP) past
its lease; holder B acquires the key (a greater token) and writes; A is woken and writes
again under its old token. The resource refuses A's late write (``StaleTokenError``) and
keeps B's, on each backend.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pymongo import MongoClient
from pymongo.write_concern import WriteConcern

from django_mongolock import LockManager
from django_mongolock.fencing import fenced_update, fenced_update_one
from django_mongolock.lock import Lock
from tests.fencing.process import HolderProcess
from tests.fencingapp.models import Report

TTL = 1.5


def story(
    manager: LockManager, config: dict[str, Any], write_b: Callable[[Lock, str], int]
) -> tuple[int, Lock]:
    """Run the story; the tokens of A and B. The caller checks what the resource holds."""
    holder = HolderProcess(
        {"url": config.pop("url"), "database": manager.database, "key": "report", "ttl": TTL}
        | {"name": "daily", "first": "a-1"}
        | config
    )
    try:
        token_a = int(holder.answer()["held"])
        holder.pause()
        # Blocks until A's lease has run out: A cannot refresh while frozen.
        lock_b = manager.acquire("report", ttl=60, timeout=TTL + 30)
        assert lock_b.token > token_a
        assert write_b(lock_b, "b") == 1
        holder.resume()
        late = holder.write("a-2")
        assert late == {"error": "StaleTokenError", "fence": lock_b.token}
        return token_a, lock_b
    finally:
        holder.close()


def test_sql_a_paused_holder_s_late_write_is_refused(
    db_alias: str,
    fence_databases: dict[str, dict[str, Any]],
    manager: LockManager,
    mongolock_url: str,
) -> None:
    Report.objects.using(db_alias).create(name="daily", body="empty")
    rows = Report.objects.using(db_alias).filter(name="daily")
    config: dict[str, Any] = {"url": mongolock_url, "backend": "sql", "alias": db_alias}
    config["db"] = fence_databases[db_alias]

    def write_b(lock: Lock, body: str) -> int:
        assert rows.get().body == "a-1"  # A's first write landed before the pause
        return fenced_update(rows, lock, body=body)

    _, lock_b = story(manager, config, write_b)
    report = rows.get()
    assert (report.body, report.fence, report.fence_key) == ("b", lock_b.token, "report")


def test_mongo_a_paused_holder_s_late_write_is_refused(
    manager: LockManager, mongolock_url: str
) -> None:
    client: MongoClient[dict[str, Any]] = MongoClient(mongolock_url)
    with client:
        reports = client[manager.database].get_collection(
            "reports", write_concern=WriteConcern("majority")
        )

        def write_b(lock: Lock, body: str) -> int:
            assert reports.find_one({"_id": "daily"}, {"body": 1}) == {
                "_id": "daily",
                "body": "a-1",
            }
            return fenced_update_one(
                reports, {"_id": "daily"}, {"$set": {"body": body}}, lock
            ).modified_count

        config = {"url": mongolock_url, "backend": "mongo", "collection": "reports"}
        _, lock_b = story(manager, config, write_b)
        assert list(reports.find()) == [
            {"_id": "daily", "body": "b", "fence": lock_b.token, "fence_key": "report"}
        ]
