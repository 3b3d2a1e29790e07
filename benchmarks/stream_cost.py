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

import multiprocessing
import os
import random
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
WRITES: Final = 1500
# Writes per second: paced, as a lock's writes come, not back to back.
RATE: Final = 300.0
WARM_UP: Final = 100
# The largest count again, with streams that do not wait on the server for events but
# ask for them this often (seconds): what a waiter far back in line could do.
POLLS: Final = (0.1, 0.25)
# How long all the idle streams are given to open.
OPEN_TIMEOUT: Final = 60.0
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


def _watch(
    url: str,
    streams: int,
    pipeline: Pipeline,
    poll: float,
    ready: Event,
    stop: Event,
    database: str = DATABASE,
    collection: str = "locks",
) -> None:
    """Keep ``streams`` change streams open until ``stop`` (in a process of its own, so
    that their replies take no interpreter time from the writer): each waiting on the
    server for its next event, or, with ``poll``, asking for it every ``poll`` seconds
    without waiting there. They watch ``database.collection``."""
    client: MongoClient[dict[str, Any]] = MongoClient(url, maxPoolSize=streams + 10)
    opened = threading.Semaphore(0)
    failures: list[BaseException] = []

    def watch(index: int) -> None:
        stages = changes.wakeups(f"bench:{index}:") if pipeline is None else pipeline
        try:
            await_ms = 1 if poll else 500
            watched = client[database][collection]
            with watched.watch(stages, max_await_time_ms=await_ms) as stream:
                opened.release()
                if poll:
                    stop.wait(random.uniform(0, poll))  # the streams' polls out of phase
                while not stop.is_set():
                    if stream.try_next() is None and poll:
                        stop.wait(poll)  # asked again at once after an event
        except BaseException as exc:
            failures.append(exc)
            opened.release()

    threads = [threading.Thread(target=watch, args=(n,), daemon=True) for n in range(streams)]
    for thread in threads:
        thread.start()
    # Bounded like the parent's wait: a stream that neither opens nor fails leaves
    # ``ready`` unset, and the parent reports it.
    until = time.monotonic() + OPEN_TIMEOUT
    for _ in threads:
        if not opened.acquire(timeout=max(0.0, until - time.monotonic())):
            break
    else:
        if not failures:
            ready.set()
    stop.wait()
    for thread in threads:
        thread.join(5)
    client.close()


def measure(url: str, streams: int, pipeline: Pipeline, poll: float = 0.0) -> dict[str, float]:
    """Server CPU per write (net of the idle streams' own cost), that idle cost and all of
    it while writing (in cores), and write latencies, with ``streams`` idle streams open
    (polled every ``poll`` s, if given)."""
    ctx = multiprocessing.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    watcher = ctx.Process(
        target=_watch, args=(url, streams, pipeline, poll, ready, stop), daemon=True
    )
    writer: MongoClient[dict[str, Any]] = MongoClient(url, w="majority")
    try:
        pid = _local_mongod(writer)
        collection = writer[DATABASE].locks
        collection.update_one({"_id": "k"}, {"$set": {"n": 0}}, upsert=True)
        watcher.start()
        if not ready.wait(OPEN_TIMEOUT + 5):
            raise RuntimeError(
                f"{streams} change streams did not all open within {OPEN_TIMEOUT:g} s"
            )
        time.sleep(1)  # every stream waiting in its first getMore
        for _ in range(WARM_UP):
            collection.update_one({"_id": "k"}, {"$inc": {"n": 1}})
        latencies = []
        cpu, started = _server_cpu(pid), time.perf_counter()
        for n in range(WRITES):
            pause = started + n / RATE - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
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
