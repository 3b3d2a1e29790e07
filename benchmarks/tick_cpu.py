"""What a refresher tick costs its thread's CPU beside its writes.

``python -m benchmarks.tick_cpu [LOCKS [SHARED [TICKS]]]`` (default 10,000 exclusive
locks, 900 shared ones and 60 ticks): one process takes the locks with the defaults (so
its refresher keeps them), then runs its lane's tick again and again with the manager's
lock collection answering at once: each refresh write's command is encoded
(``bson.encode``, the bulk of what the driver does; a filter and pipeline that the store
kept encoded are copied as they are) and every document it names is reported extended,
and the heartbeat is not sent. What is left is the tick's own work, timed by
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
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

import bson
from pymongo import MongoClient
from pymongo.collection import Collection
from pymongo.results import UpdateResult

from benchmarks.contenders import DATABASE
from benchmarks.markdown import span
from benchmarks.refreshing import FILL_THREADS, REFRESH_TTL
from benchmarks.servers import mongo_server
from django_mongolock import Lock, LockManager
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


class _Answering:
    """The store's lock collection, but for ``update_many``: each is encoded as the
    driver would encode its command, and answered at once with every document of the
    lane's leases modified, without being sent."""

    def __init__(self, manager: LockManager, collection: Collection[Any]) -> None:
        self._manager = manager
        self._collection = collection
        self.encoded: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._collection, name)

    def update_many(self, query: Mapping[str, Any], pipeline: Any, **kwargs: Any) -> Any:
        update = {"q": query, "u": pipeline, "multi": True, **kwargs}
        self.encoded.append(len(bson.encode({"update": COLLECTION, "updates": [update]})))
        # Counted from the lane's list, not read back from the filter, which would be
        # this harness's own work (a kept filter is encoded, and reading it decodes it).
        lane = get_refresher().lane_of(self._manager)
        batch = None if lane is None else lane.batch
        if batch is None:
            raise RuntimeError("a refresh write came from outside the manager's lane")
        shared = "owner" not in query  # the shared leases' filter names "holders.owner"
        modified = len({key for key, _, _ in batch.shared}) if shared else len(batch.exclusive)
        return UpdateResult({"n": modified, "nModified": modified}, acknowledged=True)


@contextlib.contextmanager
def answering_at_once(manager: LockManager) -> Iterator[list[int]]:
    """The manager's store encodes each refresh write's command and reports every
    document it names extended, without sending it (``_Answering``); the heartbeat is
    dropped. Yields the sizes of the commands encoded, in bytes."""
    store = manager.store
    collection, heartbeat = store.collection, vars(store).get("heartbeat")
    answering = _Answering(manager, collection)
    store.collection = answering  # type: ignore[assignment]
    store.heartbeat = lambda process_ids, interval: None  # type: ignore[method-assign]
    try:
        yield answering.encoded
    finally:
        store.collection = collection
        if heartbeat is None:
            del store.heartbeat
        else:
            store.heartbeat = heartbeat  # type: ignore[method-assign]


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
