"""What open change streams cost the server per write, with nobody waiting for a lock.

``python -m benchmarks.stream_cost [STREAMS ...]`` (default 0 50 200): for each count, a
separate process keeps that many idle change streams open, each on a thread of its own
with the watcher's filter (``queries.wakeups``), and this process times 1,000 majority
updates of one document of the watched collection. The server's CPU is read from
``/proc`` (the server must run on this host: started here, or ``MONGOLOCK_URL`` naming a
local ``mongod``) over the writes, less what it spends in as long with the streams open
and no writes (their idle getMores). A last row repeats the largest count with a filter
that lets through deletes only, which tells the wake-up itself from the filter. See
docs/performance.md.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Sequence
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any, Final

from pymongo import MongoClient

from benchmarks.servers import mongo_server
from benchmarks.stats import quantile
from django_mongolock.queries import changes

__all__ = ["main", "measure"]

DATABASE: Final = "mongolock_stream_cost"
WRITES: Final = 1000
WARM_UP: Final = 100
DELETES_ONLY: Final[list[dict[str, Any]]] = [{"$match": {"operationType": "delete"}}]

Pipeline = list[dict[str, Any]] | None


def _server_cpu(pid: int) -> float:
    """The server process's user and system CPU seconds so far."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _local_mongod(client: MongoClient[dict[str, Any]]) -> int:
    """The server's pid, once it is known to be a ``mongod`` of this host."""
    pid = int(client.admin.command("serverStatus")["pid"])
    comm = Path(f"/proc/{pid}/comm")
    if not comm.exists() or comm.read_text().strip() != "mongod":
        raise SystemExit(f"the server's pid {pid} is no mongod of this host: its CPU is unseen")
    return pid


def _watch(url: str, streams: int, pipeline: Pipeline, ready: Event, stop: Event) -> None:
    """Keep ``streams`` change streams open until ``stop`` (in a process of its own, so
    that their replies take no interpreter time from the writer)."""
    client: MongoClient[dict[str, Any]] = MongoClient(url, maxPoolSize=streams + 10)
    opened = threading.Semaphore(0)
    failures: list[BaseException] = []

    def watch(index: int) -> None:
        stages = changes.wakeups(f"bench:{index}:") if pipeline is None else pipeline
        try:
            with client[DATABASE].locks.watch(stages, max_await_time_ms=500) as stream:
                opened.release()
                while not stop.is_set():
                    stream.try_next()
        except BaseException as exc:
            failures.append(exc)
            opened.release()

    threads = [threading.Thread(target=watch, args=(n,), daemon=True) for n in range(streams)]
    for thread in threads:
        thread.start()
    for _ in threads:
        opened.acquire()
    if not failures:
        ready.set()
    stop.wait()
    for thread in threads:
        thread.join(5)
    client.close()


def measure(url: str, streams: int, pipeline: Pipeline) -> dict[str, float]:
    """Server CPU per write and write latencies with ``streams`` idle streams open."""
    ctx = multiprocessing.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    watcher = ctx.Process(target=_watch, args=(url, streams, pipeline, ready, stop), daemon=True)
    writer: MongoClient[dict[str, Any]] = MongoClient(url, w="majority")
    try:
        pid = _local_mongod(writer)
        collection = writer[DATABASE].locks
        collection.update_one({"_id": "k"}, {"$set": {"n": 0}}, upsert=True)
        watcher.start()
        if not ready.wait(60):
            raise RuntimeError(f"{streams} change streams did not all open within 60 s")
        time.sleep(1)  # every stream waiting in its first getMore
        for _ in range(WARM_UP):
            collection.update_one({"_id": "k"}, {"$inc": {"n": 1}})
        latencies = []
        cpu, started = _server_cpu(pid), time.perf_counter()
        for _ in range(WRITES):
            sent = time.perf_counter()
            collection.update_one({"_id": "k"}, {"$inc": {"n": 1}})
            latencies.append(time.perf_counter() - sent)
        elapsed = time.perf_counter() - started
        cpu = _server_cpu(pid) - cpu
        idle = _server_cpu(pid)
        time.sleep(elapsed)  # the same streams as long without writes
        idle = _server_cpu(pid) - idle
    finally:
        stop.set()
        watcher.join(10)
        writer.drop_database(DATABASE)
        writer.close()
    return {
        "cpu_per_write": max(0.0, cpu - idle) / WRITES,
        "p50": quantile(latencies, 0.5),
        "p99": quantile(latencies, 0.99),
    }


def main(argv: Sequence[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else argv
    counts = sorted({int(arg) for arg in arguments} or {0, 50, 200})
    with mongo_server() as server:
        print(f"MongoDB {server.version} ({server.topology}); {WRITES} writes per row")
        print("| open change streams | server CPU per write | write p50 | write p99 |")
        print("|---|---|---|---|")
        rows: list[tuple[int, Pipeline, str]] = [(n, None, "the watcher's filter") for n in counts]
        if counts[-1]:
            rows.append((counts[-1], DELETES_ONLY, "a filter on `delete` only"))
        for streams, pipeline, label in rows:
            row = measure(server.url, streams, pipeline)
            name = "none" if streams == 0 else f"{streams}, {label}"
            print(
                f"| {name} | {row['cpu_per_write'] * 1e3:.2f} ms | {row['p50'] * 1e3:.2f} ms "
                f"| {row['p99'] * 1e3:.2f} ms |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
