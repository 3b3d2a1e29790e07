"""What other processes' change streams, and other processes, do to a contended key.

``python -m benchmarks.stream_load [EXTRA]`` (default 196): the scale benchmark's
processes shape with 4 processes on one key (each holding it 5 ms, 3 s per point, two
points per row), first alone, then beside ``EXTRA`` idle change streams that another
process holds open (waiting on the server for events, or asking for them every 250 ms),
then beside ``EXTRA`` idle processes that each wake once a second. The streams watch the
contended lock collection with the watcher's filter (naming no process of the run), and
in one row a collection of another database that nobody writes to. Per point: the
wake-up p50 and p99 (release call to the next holder's return), releases per second,
and the server's CPU in cores (``/proc``: the server must run on this host). This tells
how much of the wake-up of many processes on one key the streams explain, and how much
the processes themselves. See docs/performance.md.
"""

from __future__ import annotations

import multiprocessing
import socket
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from multiprocessing.synchronize import Event
from typing import Any, Final

from pymongo import MongoClient

from benchmarks import scale
from benchmarks.contenders import DATABASE, Spec
from benchmarks.idle_streams import held_open, local_mongod, server_cpu
from benchmarks.servers import mongo_server
from django_mongolock import LockManager

__all__ = ["main"]

COLLECTION: Final = "stream_load"
# Streams that watch a database nobody writes to: woken all the same?
OTHER_DATABASE: Final = "mongolock_stream_load_other"
CONTENDERS: Final = 4
HOLD: Final = 0.005
SECONDS: Final = 3.0
POINTS: Final = 2
POLL: Final = 0.25


def _idle(stop: Event) -> None:
    """A process that sleeps in ``recv`` and wakes once a second, as an idle worker does."""
    mine, _peer = socket.socketpair()
    mine.settimeout(1.0)
    while not stop.is_set():
        with suppress(TimeoutError):
            mine.recv(1)


@contextmanager
def _processes(count: int) -> Iterator[None]:
    """``count`` idle processes while the block runs."""
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    idle = [ctx.Process(target=_idle, args=(stop,), daemon=True) for _ in range(count)]
    for process in idle:
        process.start()
    try:
        time.sleep(5)  # every one started and asleep
        yield
    finally:
        stop.set()
        for process in idle:
            process.join(5)
            if process.is_alive():
                process.terminate()


def _point(url: str, spec: Spec, pid: int) -> dict[str, float]:
    started, cpu = time.perf_counter(), server_cpu(pid)
    point = scale.processes_point(url, spec, CONTENDERS, SECONDS, HOLD)
    cores = (server_cpu(pid) - cpu) / (time.perf_counter() - started)
    return {
        "p50": point["wake"]["p50"],
        "p99": point["wake"]["p99"],
        "rate": point["rate"],
        "cores": cores,
    }


def _row(name: str, points: Sequence[dict[str, float]]) -> str:
    def span(key: str, scale_by: float, digits: int) -> str:
        low, high = (min(p[key] for p in points), max(p[key] for p in points))
        return f"{low * scale_by:.{digits}f} to {high * scale_by:.{digits}f}"

    return (
        f"| {name} | {span('p50', 1e3, 2)} ms | {span('p99', 1e3, 2)} ms "
        f"| {span('rate', 1, 0)} | {span('cores', 1, 2)} |"
    )


def main(argv: Sequence[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else argv
    extra = int(arguments[0]) if arguments else 196
    with mongo_server() as server:
        url = server.url
        with LockManager(url, database=DATABASE, collection=COLLECTION) as manager:
            manager.ensure_indexes()
        spec = Spec("django-mongolock", "ours", url, collection=COLLECTION)
        client: MongoClient[dict[str, Any]] = MongoClient(url)
        pid = local_mongod(client)
        client.close()
        print(
            f"MongoDB {server.version} ({server.topology}); {CONTENDERS} processes on one "
            f"key, {HOLD * 1000:g} ms held, {SECONDS:g} s per point, {POINTS} points per row"
        )
        print("| beside | wake-up p50 | wake-up p99 | releases/s | server CPU (cores) |")
        print("|---|---|---|---|---|")

        def measure(name: str) -> None:
            print(_row(name, [_point(url, spec, pid) for _ in range(POINTS)]), flush=True)

        measure("nothing")
        with held_open(url, extra, database=DATABASE, collection=COLLECTION):
            measure(f"{extra} change streams, waiting on the server")
        with held_open(url, extra, database=OTHER_DATABASE, collection=COLLECTION):
            measure(f"{extra} change streams on another database, waiting on the server")
        with held_open(url, extra, database=DATABASE, collection=COLLECTION, poll=POLL):
            measure(f"{extra} change streams, polled every {POLL * 1000:g} ms")
        with _processes(extra):
            measure(f"{extra} idle processes, no streams")
        measure("nothing, again")
    return 0


if __name__ == "__main__":
    sys.exit(main())
