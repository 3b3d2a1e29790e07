"""The admin's pages with 10,000 locks and a full hour of statistics: list, contention, a key.

``python benchmarks/admin_contention.py [--locks N] [--requests N] [--processes N]``

Starts a single-node replica set (or uses ``MONGOLOCK_URL``), fills the lock collection
with ``--locks`` documents (nine in ten live, one in 45 with a line of waiters) and the
statistics collection with what ``--processes`` processes would have flushed over the
last hour, each at its bound of keys per minute (distinct keys: the worst case for the
view's aggregations). Then renders each page through Django's test client, interleaved,
and prints the median and 90th percentile against the budget (200 ms median).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

from benchmarks.goals import ADMIN_GOAL as BUDGET  # noqa: E402  (seconds, median)
from benchmarks.labels import CONTENTION_PAGE, KEY_PAGE  # noqa: E402

DATABASE = "mongolock_bench_admin"
# What each page shows only with data behind it: the busiest keys' table (statistics were
# read) and a key's line of waiters (its document was read, waiters and all).
CONTENTION_MARKER = b'id="mongolock-busiest"'
KEY_MARKER = b'id="mongolock-line"'


def fill_locks(collection: Any, count: int) -> int:
    """``count`` lock documents as the store writes them: nine in ten live, the rest
    expired, one in 45 (of the live ones) with a line of waiters; how many have a line."""
    now = datetime.now(UTC)
    docs = []
    for n in range(count):
        live = n % 10 != 0
        acquired = now - timedelta(seconds=5 + n % 50)
        doc: dict[str, Any] = {
            "_id": f"job-{n:05d}",
            "key": f"job-{n:05d}",
            "owner": f"worker-{n % 16}.example:{1000 + n % 97}:{n:012x}",
            "token": 7_000_000_000_000 + n,
            "acquired_at": acquired,
            "refreshed_at": acquired,
            "expires_at": now + timedelta(seconds=60 + n % 240)
            if live
            else now - timedelta(seconds=n % 300),
            "ttl": 60.0,
        }
        if live and n % 45 == 1:  # a line of waiters
            doc["waiters"] = [
                {"owner": f"web-{w}:{2000 + w}:{n:08x}", "until": now + timedelta(seconds=300)}
                for w in range(1 + n % 7)
            ]
        docs.append(doc)
    for start in range(0, len(docs), 1000):
        collection.insert_many(docs[start : start + 1000], ordered=False)
    return sum(1 for doc in docs if "waiters" in doc)


def fill_stats(manager: Any, processes: int, locks: int) -> int:
    """An hour of flushes by ``processes`` processes, each with its full share of keys."""
    from django_mongolock import stats
    from django_mongolock.queries import stats as queries

    store = stats.stats_store(manager.store)
    now = time.time()
    for process in range(processes):
        recorder = stats.Recorder()
        for minute in range(60):
            t = now - minute * 60
            for i in range(queries.MAX_KEYS):
                key = f"job-{(process * queries.MAX_KEYS + i * 7 + minute) % locks:05d}"
                recorder.acquire(manager, key, "acquired", wait=(i % 5) * 0.1, at=t)
                if i % 9 == 0:
                    recorder.acquire(manager, key, "busy", at=t)
                if i % 50 == 0 and minute % 10 == 0:
                    recorder.lost(manager, key, "expired", owner="w:1:x", token=1, at=t)
            store.add(recorder.take(manager))
    if not store.wait_indexed(120.0):  # measured with the indexes the pages read through
        raise RuntimeError("the statistics' indexes were not built")
    return int(store.stats.count_documents({}))


def run(url: str, locks: int, requests: int, processes: int) -> dict[str, list[float]]:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    import django

    django.setup()
    from django.conf import settings
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.test import Client, override_settings

    # Through override_settings: the default manager, built at setup, is built afresh.
    override_settings(MONGOLOCK={"URL": url, "DATABASE": DATABASE, "COLLECTION": "admin"}).enable()
    settings.ALLOWED_HOSTS = ["testserver"]
    call_command("migrate", verbosity=0)
    user = get_user_model().objects.create_superuser("bench", "bench@example.com", "bench")
    client = Client()
    client.force_login(user)

    from django_mongolock.conf import get_manager

    manager = get_manager()
    manager.store.collection.database.client.drop_database(DATABASE)
    manager.ensure_indexes()
    started = time.perf_counter()
    # A client of its own for the fill: bulk inserts need more than the lock client's
    # timeout on a busy machine.
    from pymongo import MongoClient

    filler: MongoClient[dict[str, Any]] = MongoClient(url)
    fill_locks(filler[DATABASE]["admin"], locks)
    filler.close()
    documents = fill_stats(manager, processes, locks)
    print(
        f"{locks} locks, {documents} statistics documents "
        f"({processes} processes x 100 keys x 60 minutes), filled in "
        f"{time.perf_counter() - started:.1f} s"
    )
    pages = {
        "list": ("/admin/django_mongolock/lock/", b"result_list"),
        CONTENTION_PAGE: ("/admin/django_mongolock/lock/contention/", CONTENTION_MARKER),
        KEY_PAGE: ("/admin/django_mongolock/lock/job-00001/change/", KEY_MARKER),
    }
    timings: dict[str, list[float]] = {name: [] for name in pages}
    for path, marker in pages.values():  # warm-up: templates, URLs, connection pool
        for _ in range(2):
            _get(client, path, marker)
    for _ in range(requests):  # interleaved, so drifting load touches every page alike
        for name, (path, marker) in pages.items():
            began = time.perf_counter()
            _get(client, path, marker)
            timings[name].append(time.perf_counter() - began)
    manager.store.collection.database.client.drop_database(DATABASE)
    manager.close()
    return timings


def _get(client: Any, path: str, marker: bytes) -> None:
    response = client.get(path)
    if response.status_code != 200 or marker not in response.content:
        raise RuntimeError(f"GET {path} answered {response.status_code} without {marker!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--locks", type=int, default=10_000)
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--processes", type=int, default=4)
    args = parser.parse_args(argv)
    from benchmarks.servers import mongo_server

    with mongo_server() as server:
        print(f"MongoDB {server.version} ({server.topology})")
        timings = run(server.url, args.locks, args.requests, args.processes)
    over = False
    print(f"{'page':<40} {'median':>9} {'p90':>9}  budget {BUDGET * 1000:.0f} ms median")
    for name, values in timings.items():
        median = statistics.median(values)
        p90 = statistics.quantiles(values, n=10)[-1] if len(values) > 1 else values[0]
        verdict = "ok" if median <= BUDGET else "OVER"
        over = over or median > BUDGET
        print(f"{name:<40} {median * 1000:>7.1f}ms {p90 * 1000:>7.1f}ms  {verdict}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
