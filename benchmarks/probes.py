"""Measurements that need a process of their own: footprint and the admin's pages.

Each probe runs in a freshly spawned process (``run_fresh``), so that its thread count,
its memory and its Django set-up start from nothing and leave nothing behind.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.queues import Queue
from typing import Any

from pymongo import MongoClient
from pymongo.collection import Collection

from benchmarks.contenders import DATABASE, Spec, build, quiet_peers
from benchmarks.labels import CONTENTION_PAGE, KEY_PAGE
from django_mongolock import LockManager, LockNotAcquired

__all__ = ["admin_probe", "footprint_probe", "rss", "run_fresh"]


def run_fresh(function: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """``function(*args)`` in a new spawned process; its result, or its traceback raised."""
    ctx = multiprocessing.get_context("spawn")
    queue: Queue[tuple[str, Any]] = ctx.Queue()
    process = ctx.Process(target=_call, args=(queue, function, args), daemon=True)
    process.start()
    try:
        status, payload = queue.get(timeout=600)
    finally:
        process.join(30)
        if process.is_alive():
            process.terminate()
    if status != "ok":
        raise RuntimeError(f"{function.__name__} failed:\n{payload}")
    result: dict[str, Any] = payload
    return result


def _call(queue: Queue[tuple[str, Any]], function: Callable[..., Any], args: Any) -> None:
    quiet_peers()
    try:
        queue.put(("ok", function(*args)))
    except BaseException:
        queue.put(("error", traceback.format_exc()))


def rss() -> int:
    """Resident memory of this process, in bytes."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


# -- background threads -----------------------------------------------------------------------


def footprint_probe(spec: Spec) -> dict[str, Any]:
    """Threads a process has once it holds locks and has waited for one, by name."""
    before = {thread.ident for thread in threading.enumerate()}
    os_before = _os_threads()
    contender = build(spec)
    held = [contender.acquire(f"footprint-{n}") for n in range(3)]
    if spec.kind == "ours":
        # Wait briefly for a busy key, so that whatever serves waiters is running too.
        manager: LockManager = contender.manager  # type: ignore[attr-defined]
        with contextlib.suppress(LockNotAcquired):
            manager.acquire("footprint-0", timeout=0.3)
    elif spec.kind == "redis":
        # python-redis-lock renews with one thread per lock when asked to.
        lock_class = importlib.import_module("redis_lock").Lock
        client = contender.client  # type: ignore[attr-defined]
        renewed = [
            lock_class(client, f"footprint-renewed-{n}", expire=30, auto_renewal=True)
            for n in range(3)
        ]
        for lock in renewed:
            lock.acquire(blocking=False)
        held.extend(renewed)
    time.sleep(0.2)
    threads = [t for t in threading.enumerate() if t.ident not in before]
    names = sorted(thread.name for thread in threads)
    os_threads = _os_threads() - os_before
    for handle in held:
        contender.release(handle)
    contender.close()
    return {
        "names": names,
        "python_threads": len(threads),
        "os_threads": os_threads,
        "mongolock_threads": sum(1 for name in names if name.startswith("mongolock-")),
        "held": len(held),
    }


# -- the admin list page -------------------------------------------------------------------------


# The processes whose hour of statistics the contention view reads, each at its bound of
# keys per minute.
STATS_PROCESSES = 4


def admin_probe(url: str, documents: int, requests: int) -> dict[str, Any]:
    """Time the admin's pages with ``documents`` locks and an hour of statistics, through
    Django's test client: the lock list (several ways), the contention view, a key's page."""
    os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.test import Client, override_settings

    from benchmarks.admin_contention import CONTENTION_MARKER, KEY_MARKER, fill_locks, fill_stats

    collection_name = "admin"
    # Through override_settings: the default manager, built at setup, is built afresh.
    override_settings(
        MONGOLOCK={"URL": url, "DATABASE": DATABASE, "COLLECTION": collection_name}
    ).enable()
    call_command("migrate", verbosity=0)
    user = get_user_model().objects.create_superuser("bench", "bench@example.com", "bench")
    client = Client()
    client.force_login(user)

    from django_mongolock.conf import get_manager

    manager = get_manager()
    collection = manager.store.collection
    database = collection.database
    database.drop_collection(collection_name)
    database.drop_collection(f"{collection_name}.stats")
    manager.ensure_indexes()
    # A client of its own for the fill: bulk inserts need more than the lock client's
    # timeout on a busy machine.
    filler: MongoClient[dict[str, Any]] = MongoClient(url)
    lines = fill_locks(filler[DATABASE][collection_name], documents)
    filler.close()
    stats_documents = fill_stats(manager, STATS_PROCESSES, documents)

    listed = b"result_list"
    pages = {
        "list": ("/admin/django_mongolock/lock/", listed),
        "list, ordered by expiry": ("/admin/django_mongolock/lock/?o=expires", listed),
        "list, last page": (f"/admin/django_mongolock/lock/?p={max(1, documents // 100)}", listed),
        "list, key prefix search": ("/admin/django_mongolock/lock/?q=job-01", listed),
        "list, expired only": ("/admin/django_mongolock/lock/?state=expired", listed),
        CONTENTION_PAGE: ("/admin/django_mongolock/lock/contention/", CONTENTION_MARKER),
        KEY_PAGE: ("/admin/django_mongolock/lock/job-00001/change/", KEY_MARKER),
    }
    timings: dict[str, list[float]] = {}
    for name, (path, marker) in pages.items():
        for _ in range(2):  # warm-up: templates, URL resolver, connection pool
            _get(client, path, marker)
        timings[name] = []
    for _ in range(requests):  # interleaved, so drifting load touches every page alike
        for name, (path, marker) in pages.items():
            started = time.perf_counter()
            _get(client, path, marker)
            timings[name].append(time.perf_counter() - started)
    floor = _admin_floor(collection, requests)
    database.drop_collection(collection_name)
    database.drop_collection(f"{collection_name}.stats")
    manager.close()
    return {
        "documents": documents,
        "lines": lines,
        "stats_documents": stats_documents,
        "stats_processes": STATS_PROCESSES,
        "pages": timings,
        "floor": floor,
    }


def _get(client: Any, path: str, marker: bytes) -> None:
    response = client.get(path)
    if response.status_code != 200 or marker not in response.content:
        raise RuntimeError(f"GET {path} answered {response.status_code} without {marker!r}")


def _admin_floor(collection: Collection[Any], requests: int) -> list[float]:
    """The reads a list page cannot do without: counts by state and one page of 100."""
    live = {"$gt": ["$expires_at", "$$NOW"]}
    timings: list[float] = []
    for _ in range(requests):
        started = time.perf_counter()
        list(
            collection.aggregate(
                [
                    {"$match": {"owner": {"$ne": None}}},
                    {
                        "$group": {
                            "_id": None,
                            "live": {"$sum": {"$cond": [live, 1, 0]}},
                            "all": {"$sum": 1},
                        }
                    },
                ]
            )
        )
        list(collection.find({"owner": {"$ne": None}}, sort=[("_id", 1)], limit=100))
        timings.append(time.perf_counter() - started)
    return timings
