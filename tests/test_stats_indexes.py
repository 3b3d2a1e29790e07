"""The statistics' indexes are created off the flush: a slow index build neither holds the
refresher's tick nor costs the counts, and it is not cut off by the flush's short limit."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from pymongo import MongoClient

from django_mongolock import LockManager, stats
from django_mongolock.queries import stats as queries
from django_mongolock.testing import MongoReplicaSet


def test_a_slow_index_build_costs_neither_the_flush_nor_the_counts(
    fail_points: MongoReplicaSet, hang: Callable[..., None]
) -> None:
    client: MongoClient[Any] = MongoClient(fail_points.url, appname="stats-indexes")
    manager = LockManager(client=client, database="stats_indexes")
    recorder = stats.Recorder()
    try:
        # Every index creation is held 1.5 s by the server: three times a flush's limit.
        hang("stats-indexes", ms=1500, times=3, commands=("createIndexes",))
        client.admin.command("ping")  # connected: the flush's limit is for its write
        recorder.acquire(manager, "nightly", "acquired")
        started = time.monotonic()
        assert recorder.flush(manager, manager.store, 0.5) == 1
        took = time.monotonic() - started
        store = stats.stats_store(manager.store)
        [doc] = store.stats.find({"key": "nightly"})
        assert doc["acquired"] == 1
        assert took < 1.5, took  # the flush did not wait for the build
        assert store.wait_indexed(30.0)
        index = store.stats.index_information()[queries.STATS_TTL_INDEX]
        assert index["expireAfterSeconds"] == queries.STATS_RETENTION
        # Once built, no flush starts another creation.
        recorder.acquire(manager, "nightly", "acquired")
        assert recorder.flush(manager, manager.store, 0.5) == 1
        assert store._indexing is None
    finally:
        client.drop_database("stats_indexes")
        manager.close()
        client.close()


def test_the_busiest_keys_are_read_before_their_index_is_built(manager: LockManager) -> None:
    """A process that only reads (the admin's) finds counts that others wrote before the
    indexes were in place, and starts building them."""
    store = stats.stats_store(manager.store)
    recorder = stats.Recorder()
    recorder.acquire(manager, "reports/daily", "busy")
    store.stats.bulk_write(queries.flush(recorder.take(manager)))  # no index creation
    assert queries.STATS_BUSY_INDEX not in store.stats.index_information()
    since = datetime.now(UTC) - timedelta(hours=1)
    [busiest] = store.busiest(since, 10)
    assert busiest["_id"] == "reports/daily"
    assert store.wait_indexed(30.0)
    assert queries.STATS_BUSY_INDEX in store.stats.index_information()
    assert [doc["_id"] for doc in store.busiest(since, 10)] == ["reports/daily"]


EXITING = """
import sys
from django_mongolock import LockManager, stats
stats.install()
manager = LockManager(sys.argv[1], database=sys.argv[2])
manager.acquire("cron/nightly", ttl=30, refresh=False).release()
"""


def test_a_short_process_leaves_its_counts_at_exit(
    mongolock_url: str, mongolock_database: str, manager: LockManager
) -> None:
    """A cron command's first flush is the one at interpreter exit, where no thread can
    start any more (Python 3.12 and later): its counts are written all the same."""
    done = subprocess.run(
        [sys.executable, "-c", EXITING, mongolock_url, mongolock_database],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert "Exception ignored" not in done.stderr
    [doc] = stats.stats_store(manager.store).stats.find({"key": "cron/nightly"})
    assert (doc["acquired"], doc["released"]) == (1, 1)
