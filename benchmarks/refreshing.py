"""The refresh probe: the refresher's tick over many held locks against one raw write,
and the memory each held lock takes (run in a fresh process, see ``probes.run_fresh``)."""

from __future__ import annotations

import gc
import importlib
import secrets
import time
import tracemalloc
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

from pymongo import MongoClient, monitoring
from pymongo.collection import Collection
from pymongo.write_concern import WriteConcern

from benchmarks.contenders import DATABASE, ListenedManager
from benchmarks.probes import rss as resident
from django_mongolock import Lock, LockManager

__all__ = ["refresh_probe"]

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


# Server time of the commands of the probe's manager.
_WRITES: Final = _Writes()


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
    manager = ListenedManager(
        url, database=DATABASE, collection="refresh", ttl=REFRESH_TTL, listener=_WRITES
    )
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
        rss_before = resident()
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
        rss = resident() - rss_before

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
        _WRITES.spent.clear()
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
    """Alternate one refresher tick and one raw update_many over the same documents, each
    going first every other turn, so that neither always meets the server just after the
    other's write."""
    update = [
        {"$set": {"expires_at": {"$add": ["$$NOW", REFRESH_TTL * 1000]}, "refreshed_at": "$$NOW"}}
    ]

    def floored() -> None:
        result = raw.update_many({"_id": {"$in": keys}}, update)
        if result.matched_count != len(keys):
            raise RuntimeError(f"raw update_many matched {result.matched_count} of {len(keys)}")

    ours: list[float] = []
    floor: list[float] = []
    for turn in range(ticks + 1):  # the first turn warms up and is not kept
        pair = ((tick, ours), (floored, floor))
        for run, spent in pair if turn % 2 else pair[::-1]:
            started = time.perf_counter()
            run()
            if turn:
                spent.append(time.perf_counter() - started)
    return ours, floor


def _tick_writes(ticks: int) -> dict[str, list[float]]:
    """Server time per tick of its writes, by collection (lock documents, heartbeats)."""
    by: dict[str, list[float]] = {}
    for name, target, spent in _WRITES.spent:
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
    them against raw update_many over the same documents; profile one tick. The shared
    leases and permits join ``locks``, held until the release at exit."""
    from django_mongolock.refresher import get_refresher

    shared_keys = [f"refresh-{run}-shared-{n:04d}" for n in range(SHARED_KEYS)]
    shared = [manager.acquire(key, shared=True, blocking=False) for key in shared_keys]
    semaphore = manager.semaphore(f"refresh-{run}-semaphore", limit=PERMITS)
    permits = [semaphore.acquire(blocking=False) for _ in range(PERMITS)]
    keys = [lock.key for lock in locks] + shared_keys + [semaphore.key]
    _WRITES.spent.clear()
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
    # Kept held (a dropped handle would lapse instead): the release at exit
    # (``release_all``) frees them with the exclusive ones.
    exclusive = len(locks)
    locks.extend(shared + permits)
    return {
        "exclusive": exclusive,
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
