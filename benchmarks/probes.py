"""Measurements that need a process of their own: refresh, footprint and the admin page.

Each probe runs in a freshly spawned process (``run_fresh``), so that its thread count,
its memory and its Django set-up start from nothing and leave nothing behind.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import multiprocessing
import os
import secrets
import threading
import time
import traceback
import tracemalloc
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from multiprocessing.queues import Queue
from typing import Any, Final

from pymongo import MongoClient, monitoring
from pymongo.collection import Collection
from pymongo.write_concern import WriteConcern

from benchmarks.contenders import DATABASE, Spec, build, quiet_peers
from django_mongolock import Lock, LockManager, LockNotAcquired

__all__ = ["admin_probe", "footprint_probe", "refresh_probe", "run_fresh"]

# Long leases: the refresher's own thread (a third of the lease) never ticks mid-measure.
REFRESH_TTL: Final = 120.0
# Threads that take the many locks of the refresh probe (their round trips overlap).
FILL_THREADS: Final = 16
# Held locks whose allocations tracemalloc measures, the last ones taken.
TRACED: Final = 1000
# Beside the exclusive locks of the largest size: shared locks on keys of their own, and
# the permits of one semaphore, refreshed by the same tick.
SHARED_KEYS: Final = 900
PERMITS: Final = 100
PROFILE_BYTES: Final = 64 * 1024 * 1024


class _Writes(monitoring.CommandListener):
    """Server time of each command the manager's client sends, by collection."""

    def __init__(self) -> None:
        self.spent: list[tuple[str, str, float]] = []
        self._names: dict[int, tuple[str, str]] = {}

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        target = event.command.get(event.command_name)
        self._names[event.request_id] = (event.command_name, str(target))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        name, target = self._names.pop(event.request_id, (event.command_name, ""))
        self.spent.append((name, target, event.duration_micros / 1e6))

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        self._names.pop(event.request_id, None)


class _Monitored(LockManager):
    """The bench's manager, its client reporting command times to ``listener``."""

    listener = _Writes()

    def _client_options(self) -> dict[str, Any]:
        return {**super()._client_options(), "event_listeners": [self.listener]}


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


def _rss() -> int:
    """Resident memory of this process, in bytes."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


# -- refresh and memory per held lock ---------------------------------------------------------


def refresh_probe(
    url: str, sizes: Sequence[int], ticks: int, redis_url: str | None
) -> dict[str, Any]:
    """Hold ``max(sizes)`` locks; time refresh ticks against one raw ``update_many`` per size.

    The locks are taken with the defaults (registered with the process's refresher); the
    memory per held lock comes from tracemalloc while the last of them are taken, and
    tracemalloc is stopped before anything is timed. The largest size is refreshed by the
    process's own refresher (``get_refresher().tick()``), smaller ones by a ``Refresher``
    holding a prefix of them.
    """
    from django_mongolock.refresher import Refresher, get_refresher

    largest = max(sizes)
    manager = _Monitored(url, database=DATABASE, collection="refresh", ttl=REFRESH_TTL)
    manager.ensure_indexes()
    raw_client: MongoClient[dict[str, Any]] = MongoClient(url)
    raw = raw_client[DATABASE]["refresh"].with_options(write_concern=WriteConcern(w="majority"))
    run = secrets.token_hex(3)
    keys = [f"refresh-{run}-{n:05d}" for n in range(largest)]

    # Memory: RSS over all the locks, and tracemalloc over the last ones taken (tracing
    # every allocation slows the taking of them all about threefold).
    traced_count = min(TRACED, largest)
    with ThreadPoolExecutor(FILL_THREADS) as pool:

        def take(names: Sequence[str]) -> list[Lock]:
            return list(pool.map(lambda key: manager.acquire(key, blocking=False), names))

        list(pool.map(time.sleep, [0.01] * FILL_THREADS))  # start the threads first
        gc.collect()
        rss_before = _rss()
        filled = time.perf_counter()
        locks = take(keys[: largest - traced_count])
        gc.collect()
        tracemalloc.start()
        traced_before = tracemalloc.get_traced_memory()[0]
        locks += take(keys[largest - traced_count :])
        gc.collect()
        traced = tracemalloc.get_traced_memory()[0] - traced_before
        tracemalloc.stop()
        filled = time.perf_counter() - filled
        rss = _rss() - rss_before

    per_size: dict[str, Any] = {}
    for size in sorted(sizes):
        held = locks[:size]
        if size == largest:
            refresher = get_refresher()
            own = False
        else:
            refresher = Refresher()
            for lock in held:
                refresher.register(lock)
            own = True
        _Monitored.listener.spent.clear()
        ours, floor = _time_ticks(refresher.tick, raw, [lock.key for lock in held], ticks)
        if own:
            refresher.stop()
        per_size[str(size)] = {"ours": ours, "floor": floor, "writes": _tick_writes(ticks)}
    # Shared locks and a semaphore's permits beside the exclusive locks: the same tick.
    mixed = _mixed(manager, raw, locks, ticks, run)
    lost = sum(1 for lock in locks if lock.lost.is_set() or not lock.valid)
    released = time.perf_counter()
    freed = get_refresher().release_all()
    released = time.perf_counter() - released
    raw_client.close()
    manager.close()
    result: dict[str, Any] = {
        "sizes": per_size,
        "largest": largest,
        "fill_seconds": filled,
        "traced_per_lock": traced / traced_count,
        "traced_count": traced_count,
        "rss_per_lock": rss / largest,
        "lost": lost,
        "release_all_seconds": released,
        "release_all_count": freed,
        "mixed": mixed,
    }
    if redis_url is not None:
        # One round trip per lock: a few turns say enough.
        result["redis"] = _redis_refresh(redis_url, sizes, min(ticks, 3), run)
    return result


def _time_ticks(
    tick: Callable[[], object], raw: Collection[dict[str, Any]], keys: list[str], ticks: int
) -> tuple[list[float], list[float]]:
    """Alternate one refresher tick and one raw update_many over the same documents."""
    update = [
        {"$set": {"expires_at": {"$add": ["$$NOW", REFRESH_TTL * 1000]}, "refreshed_at": "$$NOW"}}
    ]
    ours: list[float] = []
    floor: list[float] = []
    for turn in range(ticks + 1):  # the first turn warms up and is not kept
        started = time.perf_counter()
        tick()
        spent = time.perf_counter() - started
        if turn:
            ours.append(spent)
        started = time.perf_counter()
        result = raw.update_many({"_id": {"$in": keys}}, update)
        spent = time.perf_counter() - started
        if result.matched_count != len(keys):
            raise RuntimeError(f"raw update_many matched {result.matched_count} of {len(keys)}")
        if turn:
            floor.append(spent)
    return ours, floor


def _tick_writes(ticks: int) -> dict[str, list[float]]:
    """Server time per tick of its writes, by collection (lock documents, heartbeats)."""
    by: dict[str, list[float]] = {}
    for name, target, spent in _Monitored.listener.spent:
        by.setdefault(f"{name} {target}", []).append(spent)
    # The first tick warmed up and is not kept: keep the last ``ticks`` of each.
    return {what: times[-ticks:] for what, times in by.items()}


def _mixed(
    manager: LockManager,
    raw: Collection[dict[str, Any]],
    locks: list[Lock],
    ticks: int,
    run: str,
) -> dict[str, Any]:
    """Add shared locks and a semaphore's permits; time the process's tick over all of
    them against raw update_many over the same documents; profile one tick."""
    from django_mongolock.refresher import get_refresher

    shared_keys = [f"refresh-{run}-shared-{n:04d}" for n in range(SHARED_KEYS)]
    shared = [manager.acquire(key, shared=True, blocking=False) for key in shared_keys]
    semaphore = manager.semaphore(f"refresh-{run}-semaphore", limit=PERMITS)
    permits = [semaphore.acquire(blocking=False) for _ in range(PERMITS)]
    keys = [lock.key for lock in locks] + shared_keys + [semaphore.key]
    _Monitored.listener.spent.clear()
    ours, floor = _time_ticks(get_refresher().tick, raw, keys, ticks)
    writes = _tick_writes(ticks)
    database = raw.database
    # Room for the profile of a write that names 10,000 keys (the default is 1 MB).
    database["system.profile"].drop()
    database.create_collection("system.profile", capped=True, size=PROFILE_BYTES)
    database.command("profile", 2)
    try:
        get_refresher().tick()
    finally:
        database.command("profile", 0)
    plans = [
        {
            "op": entry.get("op"),
            "collection": entry.get("ns", "").split(".", 1)[-1],
            "plan": entry.get("planSummary", ""),
            "keys_examined": entry.get("keysExamined", 0),
            "docs_examined": entry.get("docsExamined", 0),
            "matched": entry.get("nMatched", entry.get("nreturned", 0)),
        }
        for entry in database["system.profile"].find(
            {"op": {"$in": ["update", "query", "getmore"]}}
        )
    ]
    database["system.profile"].drop()
    for lock in shared + permits:
        lock.release()
    return {
        "exclusive": len(locks),
        "shared": len(shared),
        "permits": len(permits),
        "documents": len(keys),
        "ours": ours,
        "floor": floor,
        "writes": writes,
        "plans": plans,
    }


def _redis_refresh(url: str, sizes: Sequence[int], ticks: int, run: str) -> dict[str, Any]:
    """python-redis-lock has no bulk renewal: one ``extend()`` per held lock."""
    lock_class = importlib.import_module("redis_lock").Lock
    client = importlib.import_module("redis").Redis.from_url(url)
    largest = max(sizes)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    locks = []
    for n in range(largest):
        lock = lock_class(client, f"refresh-{run}-{n:05d}", expire=round(REFRESH_TTL))
        if not lock.acquire(blocking=False):
            raise RuntimeError("a fresh Redis key was busy")
        locks.append(lock)
    gc.collect()
    traced = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    per_size: dict[str, list[float]] = {}
    for size in sorted(sizes):
        spent: list[float] = []
        for turn in range(ticks + 1):
            started = time.perf_counter()
            for lock in locks[:size]:
                lock.extend()
            if turn:
                spent.append(time.perf_counter() - started)
        per_size[str(size)] = spent
    for lock in locks:
        lock.release()
    client.close()
    return {"sizes": per_size, "traced_per_lock": traced / largest}


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


def admin_probe(url: str, documents: int, requests: int) -> dict[str, Any]:
    """Time the admin's lock list with ``documents`` locks, through Django's test client."""
    os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"
    import django

    django.setup()
    from django.conf import settings
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.test import Client

    collection_name = "admin"
    settings.MONGOLOCK = {"URL": url, "DATABASE": DATABASE, "COLLECTION": collection_name}
    call_command("migrate", verbosity=0)
    user = get_user_model().objects.create_superuser("bench", "bench@example.com", "bench")
    client = Client()
    client.force_login(user)

    from django_mongolock.conf import get_manager

    manager = get_manager()
    collection = manager.store.collection
    collection.drop()
    manager.ensure_indexes()
    _fill_admin(collection, documents)

    pages = {
        "list": "/admin/django_mongolock/lock/",
        "list, ordered by expiry": "/admin/django_mongolock/lock/?o=expires",
        "list, last page": f"/admin/django_mongolock/lock/?p={max(1, documents // 100)}",
        "list, key prefix search": "/admin/django_mongolock/lock/?q=job-01",
        "list, expired only": "/admin/django_mongolock/lock/?state=expired",
    }
    timings: dict[str, list[float]] = {}
    for name, path in pages.items():
        for _ in range(2):  # warm-up: templates, URL resolver, connection pool
            _get(client, path)
        timings[name] = []
    for _ in range(requests):  # interleaved, so drifting load touches every page alike
        for name, path in pages.items():
            started = time.perf_counter()
            _get(client, path)
            timings[name].append(time.perf_counter() - started)
    floor = _admin_floor(collection, requests)
    collection.drop()
    manager.close()
    return {"documents": documents, "pages": timings, "floor": floor}


def _get(client: Any, path: str) -> None:
    response = client.get(path)
    if response.status_code != 200 or b"result_list" not in response.content:
        raise RuntimeError(f"GET {path} answered {response.status_code} without a lock list")


def _fill_admin(collection: Collection[Any], documents: int) -> None:
    """``documents`` lock documents as the store writes them: nine in ten live, the rest expired."""
    now = datetime.now(UTC)
    docs = []
    for n in range(documents):
        live = n % 10 != 0
        acquired = now - timedelta(seconds=5 + n % 50)
        expires = (
            now + timedelta(seconds=60 + n % 240) if live else now - timedelta(seconds=n % 300)
        )
        docs.append(
            {
                "_id": f"job-{n:05d}",
                "key": f"job-{n:05d}",
                "owner": f"worker-{n % 16}.example:{1000 + n % 97}:{n:012x}",
                "token": 7_000_000_000_000 + n,
                "acquired_at": acquired,
                "refreshed_at": acquired,
                "expires_at": expires,
                "ttl": 60.0,
            }
        )
    collection.insert_many(docs, ordered=False)


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
