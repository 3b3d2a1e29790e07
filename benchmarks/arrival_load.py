"""What a burst of processes asking at once does to a lock's writes, and whether it
matters that they write to the lock's document.

``python -m benchmarks.arrival_load [PROCESSES [RUNS]]`` (default 200 processes, 2 runs
of each kind): ``PROCESSES`` processes connect, then wait on one barrier; released
together, each sends one request, as the processes of the scale benchmark do when they
all ask for one key at once. Meanwhile this process writes the lock's document every
5 ms (a majority update, as a handing release is) and times each write. The kinds of
request, taking turns run by run:

* ``read``: each process reads the lock's document (no write);
* ``own document``: each appends a place to the line of a document of its own;
* ``lock's document``: each appends a place to the line of the lock's document, as a
  waiter's join does, so that the writes meet on one document.

Per run: how long the burst lasted (from the barrier to the last answer), the requests'
p50, and the writes' p50 and max before, during and after it, and the write conflicts the
server counted (``serverStatus().metrics.operation.writeConflicts``). If the writes slow
as much when the processes only read, what slows a handing release during the scale
benchmark's arrival is the burst itself, not its writes to the key's document.

Against the server in ``MONGOLOCK_URL``, or a single-node replica set started for the run.
See docs/performance.md.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Sequence
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from typing import Any, Final

from pymongo import MongoClient

from benchmarks.servers import mongo_server

__all__ = ["KINDS", "burst", "main"]

DATABASE: Final = "mongolock_arrival_load"
LOCK: Final = "lock"
KINDS: Final = {"read": "read", "own": "own document", "same": "lock's document"}
# The writer's pace: a release every hold of 5 ms, as in the scale benchmark.
PACE: Final = 0.005
# Quiet writes before the burst, and after it.
BEFORE: Final = 0.5
AFTER: Final = 1.0
# Bounds every wait on the processes.
BOUND: Final = 120.0

Sample = list[tuple[float, float]]


def _place(index: int) -> dict[str, Any]:
    return {"owner": f"host:{os.getpid()}:{index}", "until": time.time() + 30, "pad": "p" * 60}


def _appended(index: int) -> list[dict[str, Any]]:
    """A pipeline that appends one place to the document's line."""
    line = {"$ifNull": ["$waiters", []]}
    return [{"$set": {"waiters": {"$concatArrays": [line, [{"$literal": _place(index)}]]}}}]


def _asker(
    url: str, database: str, kind: str, index: int, barrier: Barrier, out: Queue[Any]
) -> None:
    """Connect, wait for the others, send one request of ``kind``; put when it was sent
    and when it was answered."""
    client: MongoClient[dict[str, Any]] = MongoClient(url, w="majority")
    try:
        locks = client[database].locks
        locks.find_one({"_id": LOCK}, projection={"_id": 1})  # connected
        barrier.wait(BOUND)
        sent = time.monotonic()
        if kind == "read":
            locks.find_one({"_id": LOCK})
        elif kind == "own":
            locks.update_one({"_id": f"own-{index}"}, _appended(index), upsert=True)
        else:
            locks.update_one({"_id": LOCK}, _appended(index))
        out.put((sent, time.monotonic()))
    finally:
        client.close()


def _conflicts(client: MongoClient[dict[str, Any]]) -> int:
    status = client.admin.command("serverStatus")
    return int(status["metrics"]["operation"]["writeConflicts"])


def burst(url: str, kind: str, processes: int, database: str = DATABASE) -> dict[str, Any]:
    """One run: ``processes`` processes send a request of ``kind`` at once while this one
    writes the lock's document every ``PACE`` seconds. ``database`` is dropped before and
    after."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}; got {kind!r}")
    ctx = multiprocessing.get_context("fork")  # hundreds of processes start in seconds
    barrier = ctx.Barrier(processes + 1)
    out: Queue[Any] = ctx.Queue()
    askers = [
        ctx.Process(target=_asker, args=(url, database, kind, i, barrier, out), daemon=True)
        for i in range(processes)
    ]
    for asker in askers:
        asker.start()
    # Opened after the fork: no process inherits this client.
    client: MongoClient[dict[str, Any]] = MongoClient(url, w="majority")
    try:
        client.drop_database(database)
        locks = client[database].locks
        locks.insert_one({"_id": LOCK, "n": 0, "waiters": []})
        conflicts = _conflicts(client)
        writes: Sample = []

        def write_for(seconds: float) -> None:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                time.sleep(PACE)
                started = time.monotonic()
                locks.update_one({"_id": LOCK}, [{"$set": {"n": {"$add": ["$n", 1]}}}])
                writes.append((started, time.monotonic() - started))

        write_for(BEFORE)
        barrier.wait(BOUND)  # every process has connected
        released = time.monotonic()
        answers: list[tuple[float, float]] = []
        while len(answers) < processes:
            write_for(0.0 if not out.empty() else PACE)
            while not out.empty() and len(answers) < processes:
                answers.append(out.get(timeout=BOUND))
            if time.monotonic() - released > BOUND:
                raise TimeoutError(f"{processes - len(answers)} processes did not answer")
        last = max(answered for _sent, answered in answers)
        write_for(AFTER)
        conflicts = _conflicts(client) - conflicts
        line = len((locks.find_one({"_id": LOCK}) or {}).get("waiters", []))
        own = locks.count_documents({"_id": {"$ne": LOCK}})
        client.drop_database(database)
    finally:
        client.close()
        for asker in askers:
            asker.join(BOUND)
    return {
        "kind": kind,
        "burst": last - released,
        "requests": [answered - sent for sent, answered in answers],
        "before": [took for at, took in writes if at < released],
        "during": [took for at, took in writes if released <= at <= last],
        "after": [took for at, took in writes if at > last],
        "conflicts": conflicts,
        "line": line,
        "own": own,
    }


def _ms(values: Sequence[float], pick: str) -> str:
    if not values:
        return "-"
    value = statistics.median(values) if pick == "p50" else max(values)
    return f"{value * 1000:.2f}"


def row(run: dict[str, Any]) -> str:
    """One run as a table row."""
    cells = [
        KINDS[run["kind"]],
        f"{run['burst'] * 1000:.0f} ms",
        f"{_ms(run['requests'], 'p50')} ms",
        *(
            f"{_ms(run[phase], 'p50')} / {_ms(run[phase], 'max')} ms ({len(run[phase])})"
            for phase in ("before", "during", "after")
        ),
        str(run["conflicts"]),
    ]
    return "| " + " | ".join(cells) + " |"


def main(argv: Sequence[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else argv
    processes = int(arguments[0]) if arguments else 200
    runs = int(arguments[1]) if len(arguments) > 1 else 2
    with mongo_server() as server:
        print(
            f"MongoDB {server.version} ({server.topology}); {processes} processes asking "
            f"at once, a majority write every {PACE * 1000:g} ms"
        )
        print()
        print(
            "| processes send | burst | request p50 | write p50 / max before (writes) "
            "| during | after | write conflicts |"
        )
        print("|---|---|---|---|---|---|---|")
        for _ in range(runs):
            for kind in KINDS:
                print(row(burst(server.url, kind, processes)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
