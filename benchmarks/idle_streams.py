"""Idle change streams held open by another process, and the local server's CPU.

Shared by ``benchmarks.stream_cost`` (what the streams cost the server per write) and
``benchmarks.stream_load`` (what they do to a contended key). The streams live in a
process of their own, so that their replies take no interpreter time from the process
that measures; the server's CPU is read from ``/proc``, so it must run on this host.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any, Final

from pymongo import MongoClient

from django_mongolock.queries import changes

__all__ = ["Pipeline", "held_open", "local_mongod", "server_cpu"]

# How long all the streams are given to open.
OPEN_TIMEOUT: Final = 60.0

Pipeline = list[dict[str, Any]] | None


def server_cpu(pid: int) -> float:
    """The server process's user and system CPU seconds so far."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def local_mongod(client: MongoClient[dict[str, Any]]) -> int:
    """The server's pid, once it is known to be a ``mongod`` of this host."""
    pid = int(client.admin.command("serverStatus")["pid"])
    comm = Path(f"/proc/{pid}/comm")
    if not comm.exists() or comm.read_text().strip() != "mongod":
        raise SystemExit(f"the server's pid {pid} is no mongod of this host: its CPU is unseen")
    return pid


@contextmanager
def held_open(
    url: str,
    streams: int,
    *,
    database: str,
    collection: str,
    pipeline: Pipeline = None,
    poll: float = 0.0,
) -> Iterator[None]:
    """``streams`` idle change streams on ``database.collection`` while the block runs,
    each with the watcher's filter for a process of no lock (or ``pipeline``), waiting
    on the server for its next event, or, with ``poll``, asking for it every ``poll``
    seconds without waiting there. The block starts once every stream waits; a stream
    that failed meanwhile is an error once it ended (what the block measured was not
    what it was named)."""
    ctx = multiprocessing.get_context("spawn")
    ready, stop, broken = ctx.Event(), ctx.Event(), ctx.Event()
    holder = ctx.Process(
        target=_watch,
        args=(url, streams, pipeline, poll, ready, stop, broken, database, collection),
        daemon=True,
    )
    holder.start()
    try:
        if not ready.wait(OPEN_TIMEOUT + 5):
            raise RuntimeError(f"{streams} change streams did not open in {OPEN_TIMEOUT:g} s")
        time.sleep(1)  # every stream waiting in its first getMore
        if broken.is_set():
            raise RuntimeError("a change stream closed before the block started")
        yield
        if broken.is_set() or not holder.is_alive():
            raise RuntimeError("a change stream closed before the block ended")
    finally:
        stop.set()
        holder.join(10)
        if holder.is_alive():
            holder.terminate()


def _watch(
    url: str,
    streams: int,
    pipeline: Pipeline,
    poll: float,
    ready: Event,
    stop: Event,
    broken: Event,
    database: str,
    collection: str,
) -> None:
    """The streams of ``held_open``, until ``stop``; ``ready`` once all are open,
    ``broken`` if one fails."""
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
                while not stop.is_set() and stream.alive:
                    if stream.try_next() is None and poll:
                        stop.wait(poll)  # asked again at once after an event
                if not stop.is_set():
                    broken.set()  # closed by the server (an invalidate): not waiting
        except BaseException as exc:
            failures.append(exc)
            broken.set()
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
