"""What a burst of processes asking at once does to a lock's writes, and whether it
matters that they write to the lock's document.

``python -m benchmarks.arrival_load [PROCESSES [RUNS]]`` (default 200 processes, 2 runs
of each kind): ``PROCESSES`` processes connect, then wait on one barrier; let through it
together (one after another as fast as the machine wakes them), each sends one request,
as the processes of the scale benchmark do when they all ask for one key at once, and
stays connected until the run ends, as a waiting process does. Meanwhile this process
writes the lock's document 5 ms after each of its writes (a majority update, as a
handing release is) and times each write. The kinds of request, taking turns run by
run:

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
import sys
import time
from collections.abc import Sequence
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier, Event
from typing import Any, Final, TypedDict

from pymongo import MongoClient

from benchmarks.scale import server_counters
from benchmarks.servers import mongo_server
from benchmarks.stats import ms, summary

__all__ = ["KINDS", "Run", "burst", "main", "row", "split"]

DATABASE: Final = "mongolock_arrival_load"
LOCK: Final = "lock"
KINDS: Final = {"read": "read", "own": "own document", "same": "lock's document"}
# The writer's pause between writes: a release every hold of 5 ms, as in the scale benchmark.
PACE: Final = 0.005
# Quiet writes before the burst, and after it.
BEFORE: Final = 0.5
AFTER: Final = 1.0
# Bounds every wait on the processes: hundreds of them forking and connecting on two cores.
BOUND: Final = 120.0
# About the size of a waiter's place in a lock's line.
PAD: Final = "p" * 60

Sample = list[tuple[float, float]]
"""(when a write was sent, how long it took)"""


class Run(TypedDict):
    kind: str
    burst: float
    requests: list[float]
    before: list[float]
    during: list[float]
    after: list[float]
    writes: int
    conflicts: int
    line: int
    own: int


def _appended(index: int) -> list[dict[str, Any]]:
    """A pipeline that appends one place to the document's line."""
    place = {"owner": f"host:{os.getpid()}:{index}", "until": time.time() + 30, "pad": PAD}
    line = {"$ifNull": ["$waiters", []]}
    return [{"$set": {"waiters": {"$concatArrays": [line, [{"$literal": place}]]}}}]


def _asker(
    url: str,
    database: str,
    kind: str,
    index: int,
    gates: tuple[Barrier, Barrier, Event],
    out: Queue[tuple[float, float]],
) -> None:
    """Connect and say so (``ready``), send one request of ``kind`` once every process
    and the writer are through ``go``, put when it was sent and answered, and stay
    connected until ``finish``: a process that closes its client and ends within the
    burst would weigh on the writes as the scale benchmark's waiting processes do not."""
    ready, go, finish = gates
    client: MongoClient[dict[str, Any]] = MongoClient(url, w="majority")
    try:
        locks = client[database].locks
        locks.find_one({"_id": LOCK}, projection={"_id": 1})  # connected before the burst
        ready.wait(BOUND)
        go.wait(BOUND)
        sent = time.monotonic()
        if kind == "read":
            locks.find_one({"_id": LOCK})
        elif kind == "own":
            locks.update_one({"_id": f"own-{index}"}, _appended(index))
        else:
            locks.update_one({"_id": LOCK}, _appended(index))
        out.put((sent, time.monotonic()))
        finish.wait(BOUND)
    except BaseException:
        # The others, and the writer, learn of it at once instead of at their bound.
        ready.abort()
        go.abort()
        raise
    finally:
        client.close()


def split(writes: Sample, released: float, last: float) -> tuple[list[float], ...]:
    """The writes' times before the burst (sent before ``released``), during it (up to
    the ``last`` answer) and after it."""
    return (
        [took for at, took in writes if at < released],
        [took for at, took in writes if released <= at <= last],
        [took for at, took in writes if at > last],
    )


def burst(url: str, kind: str, processes: int, database: str = DATABASE) -> Run:
    """One run: ``processes`` processes send a request of ``kind`` at once while this one
    writes the lock's document, ``PACE`` seconds after each write. ``database`` is
    dropped before and after."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}; got {kind!r}")
    if processes < 1:
        raise ValueError(f"processes must be at least 1; got {processes}")
    # Fork: hundreds of processes start in seconds, where spawn takes a minute on two
    # cores. They inherit the parent's threads and any client it holds (a test's), but
    # use neither: each opens its own client, and pymongo resets its locks after a fork.
    ctx = multiprocessing.get_context("fork")
    ready, go, finish = ctx.Barrier(processes + 1), ctx.Barrier(processes + 1), ctx.Event()
    out: Queue[tuple[float, float]] = ctx.Queue()
    askers = [
        ctx.Process(
            target=_asker, args=(url, database, kind, i, (ready, go, finish), out), daemon=True
        )
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
        # Every kind's request an update of a document that exists, or a read.
        locks.insert_many([{"_id": f"own-{i}", "waiters": []} for i in range(processes)])
        writes: Sample = []

        def write() -> None:
            time.sleep(PACE)
            started = time.monotonic()
            locks.update_one({"_id": LOCK}, [{"$set": {"n": {"$add": ["$n", 1]}}}])
            writes.append((started, time.monotonic() - started))

        def write_for(seconds: float) -> None:
            end = time.monotonic() + seconds
            write()
            while time.monotonic() < end:
                write()

        ready.wait(BOUND)  # every process connected: the quiet before starts now
        conflicts = server_counters(client)["conflicts"]
        write_for(BEFORE)
        released = time.monotonic()  # nobody passes go before the writer arrives
        go.wait(BOUND)
        answers: list[tuple[float, float]] = []
        while len(answers) < processes:
            while not out.empty() and len(answers) < processes:
                answers.append(out.get(timeout=BOUND))
            if len(answers) == processes:
                break
            if dead := [a.exitcode for a in askers if a.exitcode not in (None, 0)]:
                raise RuntimeError(f"{len(dead)} processes ended without answering: {dead}")
            if time.monotonic() - released > BOUND:
                raise TimeoutError(f"{processes - len(answers)} processes did not answer")
            write()
        last = max(answered for _sent, answered in answers)
        write_for(AFTER)
        conflicts = server_counters(client)["conflicts"] - conflicts
        lock = locks.find_one({"_id": LOCK}) or {}
        own = locks.count_documents({"_id": {"$ne": LOCK}, "waiters.0": {"$exists": True}})
    finally:
        finish.set()
        ready.abort()
        go.abort()
        deadline = time.monotonic() + BOUND
        for asker in askers:
            asker.join(max(0.0, deadline - time.monotonic()))
        for asker in askers:
            if asker.is_alive():
                asker.terminate()
                asker.join(5)
        client.drop_database(database)
        client.close()
    before, during, after = split(writes, released, last)
    return {
        "kind": kind,
        "burst": last - released,
        "requests": [answered - sent for sent, answered in answers],
        "before": before,
        "during": during,
        "after": after,
        "writes": int(lock.get("n", 0)),
        "conflicts": conflicts,
        "line": len(lock.get("waiters", [])),
        "own": own,
    }


def row(run: Run) -> str:
    """One run as a table row."""
    phases = [summary(run[phase]) for phase in ("before", "during", "after")]
    cells = [
        KINDS[run["kind"]],
        ms(run["burst"], 0),
        ms(summary(run["requests"])["p50"]),
        *(f"{ms(p['p50'])} / {ms(p['max'])} ({p['n']:.0f})" for p in phases),
        str(run["conflicts"]),
    ]
    return "| " + " | ".join(cells) + " |"


def main(argv: Sequence[str] | None = None) -> int:
    """Print a table of ``RUNS`` runs of each kind, the kinds taking turns."""
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
