"""What open change streams cost the server per write, with nobody waiting for a lock.

``python -m benchmarks.stream_cost [STREAMS ...]`` (default 0 50 200): for each count, a
separate process keeps that many idle change streams open, each on a thread of its own
with the watcher's filter (``queries.wakeups``), and this process times 1,500 majority
updates of one document of the watched collection, paced at 300 a second (about the
write rate of the scale benchmark's 200 processes on one key). The server's CPU is read
from ``/proc`` (the server must run on this host: started here, or ``MONGOLOCK_URL``
naming a local ``mongod``): per write, net of what it spends in as long with the streams
open and no writes; that idle cost itself; and all of it while the writes ran. Further
rows repeat the largest count with a filter that lets through deletes only, which tells
the wake-up itself from the filter, and with streams that do not wait on the server for
their next event but ask for it every 100 or 250 ms. See docs/performance.md.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any, Final

from pymongo import MongoClient

from benchmarks.idle_streams import Pipeline, held_open, local_mongod, server_cpu
from benchmarks.servers import mongo_server
from benchmarks.stats import quantile

__all__ = ["main", "measure"]

DATABASE: Final = "mongolock_stream_cost"
WRITES: Final = 1500
# Writes per second: paced, as a lock's writes come, not back to back.
RATE: Final = 300.0
WARM_UP: Final = 100
# The largest count again, with streams that do not wait on the server for events but
# ask for them this often (seconds): what a waiter far back in line could do.
POLLS: Final = (0.1, 0.25)
DELETES_ONLY: Final[list[dict[str, Any]]] = [{"$match": {"operationType": "delete"}}]


def measure(url: str, streams: int, pipeline: Pipeline, poll: float = 0.0) -> dict[str, float]:
    """Server CPU per write (net of the idle streams' own cost), that idle cost and all of
    it while writing (in cores), and write latencies, with ``streams`` idle streams open
    (polled every ``poll`` s, if given)."""
    writer: MongoClient[dict[str, Any]] = MongoClient(url, w="majority")
    try:
        pid = local_mongod(writer)
        collection = writer[DATABASE].locks
        collection.update_one({"_id": "k"}, {"$set": {"n": 0}}, upsert=True)
        with held_open(
            url, streams, database=DATABASE, collection="locks", pipeline=pipeline, poll=poll
        ):
            for _ in range(WARM_UP):
                collection.update_one({"_id": "k"}, {"$inc": {"n": 1}})
            latencies = []
            cpu, started = server_cpu(pid), time.perf_counter()
            for n in range(WRITES):
                pause = started + n / RATE - time.perf_counter()
                if pause > 0:
                    time.sleep(pause)
                sent = time.perf_counter()
                collection.update_one({"_id": "k"}, {"$inc": {"n": 1}})
                latencies.append(time.perf_counter() - sent)
            elapsed = time.perf_counter() - started
            cpu = server_cpu(pid) - cpu
            idle = server_cpu(pid)
            time.sleep(elapsed)  # the same streams as long without writes
            idle = server_cpu(pid) - idle
    finally:
        writer.drop_database(DATABASE)
        writer.close()
    return {
        "cpu_per_write": max(0.0, cpu - idle) / WRITES,
        "idle_cores": idle / elapsed,
        "writing_cores": cpu / elapsed,
        "p50": quantile(latencies, 0.5),
        "p99": quantile(latencies, 0.99),
    }


def main(argv: Sequence[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else argv
    counts = sorted({int(arg) for arg in arguments} or {0, 50, 200})
    with mongo_server() as server:
        print(
            f"MongoDB {server.version} ({server.topology}); "
            f"{WRITES} writes per row, {RATE:g} a second"
        )
        print(
            "| open change streams | server CPU per write | the streams idle (cores) "
            "| server while writing (cores) | write p50 | write p99 |"
        )
        print("|---|---|---|---|---|---|")
        rows: list[tuple[int, Pipeline, float, str]] = [
            (n, None, 0.0, "the watcher's filter") for n in counts
        ]
        if counts[-1]:
            rows.append((counts[-1], DELETES_ONLY, 0.0, "a filter on `delete` only"))
            for poll in POLLS:
                label = f"the watcher's filter, polled every {poll * 1000:g} ms"
                rows.append((counts[-1], None, poll, label))
        for streams, pipeline, poll, label in rows:
            row = measure(server.url, streams, pipeline, poll)
            name = "none" if streams == 0 else f"{streams}, {label}"
            print(
                f"| {name} | {row['cpu_per_write'] * 1e3:.2f} ms "
                f"| {row['idle_cores']:.2f} | {row['writing_cores']:.2f} "
                f"| {row['p50'] * 1e3:.2f} ms | {row['p99'] * 1e3:.2f} ms |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
