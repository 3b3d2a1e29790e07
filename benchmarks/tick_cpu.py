"""What a refresher tick costs its thread's CPU beside its writes.

``python -m benchmarks.tick_cpu [LOCKS [SHARED [TICKS]]]`` (default 10,000 exclusive
locks, 900 shared ones and 60 ticks): one process takes the locks with the defaults (so
its refresher keeps them), then runs its lane's tick again and again with the manager's
store answering at once: each refresh write's filter and pipeline are encoded
(``bson.encode``, the bulk of what the driver encodes) and every lease is reported
extended, and the heartbeat is not sent. What is left is the tick's own work, timed by
the thread's CPU clock (``time.thread_time``): the pass over the lane's leases, the
queries, each lease's ``renewed()``, and the garbage collector's share. Twice: with the
leases unchanged from tick to tick (the lane lists them once), and with one more lock
taken and released between ticks, untimed, so that every tick lists its leases, and
their processes, again. The first tick of each warms up and is not kept.

The refresh workload of ``make bench`` times the whole tick against one raw
``update_many`` on the server, where this work is a share of a write that varies from
run to run by more than it. Against the server in ``MONGOLOCK_URL``, or a development
server started for the run. See docs/performance.md.
"""

from __future__ import annotations

import contextlib
import secrets
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

import bson
from pymongo import MongoClient

from benchmarks.contenders import DATABASE
from benchmarks.markdown import span
from benchmarks.refreshing import FILL_THREADS, REFRESH_TTL
from benchmarks.servers import mongo_server
from django_mongolock import Lock, LockManager, queries
from django_mongolock.refresher import get_refresher

__all__ = ["COLLECTION", "answering_at_once", "measure", "take"]

COLLECTION: Final = "tick-cpu"
# Releasing 10,900 leases is one write per collection, of many documents.
RELEASE_TIME: Final = 120.0


def take(manager: LockManager, exclusive: int, shared: int) -> list[Lock]:
    """``exclusive`` locks and ``shared`` shared ones on keys of their own, with the
    defaults (kept by the process's refresher), taken by a few threads at once."""
    run = secrets.token_hex(3)
    wanted = [(f"tick-{run}-{n:05d}", False) for n in range(exclusive)]
    wanted += [(f"tick-{run}-shared-{n:05d}", True) for n in range(shared)]
    with ThreadPoolExecutor(FILL_THREADS) as pool:
        return list(pool.map(lambda k: manager.acquire(k[0], shared=k[1], blocking=False), wanted))


@contextlib.contextmanager
def answering_at_once(manager: LockManager) -> Iterator[list[int]]:
    """The manager's store encodes each refresh write's command and reports every lease
    extended, without sending it; the heartbeat is dropped. Yields the sizes of the
    commands encoded, in bytes."""
    store = manager.store
    encoded: list[int] = []

    def write(build: Any) -> Any:
        def send(held: Sequence[tuple[str, str, int]]) -> set[str]:
            query, pipeline = build(held)
            command = {"update": COLLECTION, "updates": [{"q": query, "u": pipeline}]}
            encoded.append(len(bson.encode(command)))
            return set()

        return send

    patched = {
        "refresh_many": write(queries.refresh_many),
        "refresh_shared_many": write(queries.refresh_shared_many),
        "heartbeat": lambda process_ids, interval: None,
    }
    before = {name: vars(store).get(name) for name in patched}
    for name, method in patched.items():
        setattr(store, name, method)
    try:
        yield encoded
    finally:
        for name, method in before.items():
            if method is None:
                delattr(store, name)
            else:
                setattr(store, name, method)


def measure(manager: LockManager, ticks: int, *, churn: bool = False) -> list[float]:
    """The thread's CPU seconds of each of ``ticks`` ticks of ``manager``'s lane (after
    one to warm up), its store answering at once; with ``churn``, a lock taken and
    released before each tick (untimed, on the server)."""
    lane = get_refresher().lane_of(manager)
    if lane is None:
        raise RuntimeError("the manager holds no lock its refresher keeps")
    spent: list[float] = []
    churned = f"tick-churn-{secrets.token_hex(3)}"
    with answering_at_once(manager) as encoded:
        for turn in range(ticks + 1):
            if churn and not manager.acquire(churned, blocking=False).release():
                raise RuntimeError("the lock taken between ticks was not released")
            started = time.thread_time()
            lane.tick()
            if turn:
                spent.append(time.thread_time() - started)
    if not encoded:
        raise RuntimeError("the ticks wrote nothing")
    return spent


def main(argv: Sequence[str] | None = None) -> int:
    numbers = [int(arg) for arg in (sys.argv[1:] if argv is None else argv)]
    exclusive, shared, ticks = (numbers + [10_000, 900, 60][len(numbers) :])[:3]
    with mongo_server() as server:
        manager = LockManager(server.url, database=DATABASE, collection=COLLECTION, ttl=REFRESH_TTL)
        try:
            held = take(manager, exclusive, shared)  # a dropped handle is not kept alive
            spent = {churn: measure(manager, ticks, churn=churn) for churn in (False, True)}
            if sum(lock.valid for lock in held) != len(held):
                raise RuntimeError("a lock was lost while the ticks were timed")
            get_refresher().release_all(timeout=RELEASE_TIME)
        finally:
            manager.close()
            cleaner: MongoClient[dict[str, Any]]
            with MongoClient(server.url) as cleaner:
                cleaner[DATABASE].drop_collection(COLLECTION)
    print(f"{exclusive:,} exclusive and {shared:,} shared leases, {ticks} ticks each:")
    for churn, times in spent.items():
        ms = [seconds * 1000 for seconds in times]
        print(
            f"  {'a lock taken and released between ticks' if churn else 'leases unchanged'}: "
            f"the tick's own CPU {span(ms, 1)} ms, "
            f"{statistics.median(ms) * 1000 / max(1, exclusive + shared):.2f} µs a lease"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
