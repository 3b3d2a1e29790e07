"""Where a handoff's time goes, beside the server's own floor for it.

``python -m benchmarks.handoff_parts [HANDOFFS]`` (default 400): two processes take
turns on one key, each holding it 5 ms; the holder times its ``release()``, and the
waiter stamps the moment its watcher thread receives the release's change event and the
moment its ``acquire()`` returns (one host: the processes share CLOCK_MONOTONIC). Then
the same server's floor for those two steps, with the raw driver: one majority update's
round trip, and when a change stream in another process delivers its event. A gap at
the floor is the release's round trip plus that delivery. Handoffs are told apart by
their tokens; a lease the waiter took by an attempt of its own is left out. See
docs/performance.md.
"""

from __future__ import annotations

import multiprocessing
import queue
import sys
import time
from collections.abc import Sequence
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from typing import Any, Final

from pymongo import MongoClient

from benchmarks.servers import mongo_server
from benchmarks.stats import quantile

__all__ = ["main", "ours", "raw"]

DATABASE: Final = "mongolock_handoff_parts"
KEY: Final = "parts"
HOLD: Final = 0.005
# Leading handoffs left out: the streams opening, the first leases.
WARM_UP: Final = 20
# Bounds every wait on the other process.
BOUND: Final = 120.0


def _holder(url: str, handoffs: int, ready: Event, out: Queue[Any]) -> None:
    """Acquire, hold, time the release; again. Each release is named by its holder id."""
    from django_mongolock import LockManager

    manager = LockManager(url, database=DATABASE)
    releases = []
    if ready.wait(BOUND):
        for _ in range(handoffs):
            lock = manager.acquire(KEY, timeout=BOUND)
            time.sleep(HOLD)
            sent = time.monotonic()
            lock.release()
            releases.append((lock.owner, sent, time.monotonic()))
            time.sleep(HOLD / 2)  # the other process's turn comes first
    manager.close()
    out.put(releases)


def _waiter(url: str, handoffs: int, ready: Event, out: Queue[Any]) -> None:
    """Acquire, hold, release; again. For each lease it got, when its watcher heard of the
    handoff (by token, None when it took the key itself), when ``acquire`` returned, and
    whose release handed it over."""
    from django_mongolock import LockManager
    from django_mongolock.waiters import Handoff, Waiters

    heard: dict[int, tuple[float, str]] = {}
    notify = Waiters.notify

    def stamped(self: Waiters, key: str, handoff: Handoff | None = None) -> int:
        if handoff is not None:
            heard[handoff.token] = (time.monotonic(), handoff.previous)
        return notify(self, key, handoff)

    Waiters.notify = stamped  # type: ignore[method-assign]
    manager = LockManager(url, database=DATABASE)
    ready.set()
    turns = []
    for _ in range(handoffs):
        lock = manager.acquire(KEY, timeout=BOUND)
        returned = time.monotonic()
        at, previous = heard.pop(lock.token, (None, ""))
        turns.append((at, returned, previous))
        time.sleep(HOLD)
        lock.release()
        time.sleep(HOLD / 2)
    manager.close()
    out.put(turns)


def _run(processes: Sequence[BaseProcess], outs: Sequence[Queue[Any]], bound: float) -> list[Any]:
    """Start ``processes``, and what each put on its queue (``bound`` for them all)."""
    until = time.monotonic() + bound
    for process in processes:
        process.start()
    try:
        results = [_result(out, processes, until) for out in outs]
        for process in processes:
            process.join(max(1.0, until - time.monotonic()))
        return results
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()


def _result(out: Queue[Any], processes: Sequence[BaseProcess], until: float) -> Any:
    """What a process put on ``out``; an error naming a process that died first."""
    while True:
        try:
            return out.get(timeout=0.5)
        except queue.Empty:
            for process in processes:
                if process.exitcode not in (None, 0):
                    raise RuntimeError(f"{process.name} exited with {process.exitcode}") from None
            if time.monotonic() > until:
                raise RuntimeError("the handoff processes did not finish in time") from None


def ours(url: str, handoffs: int) -> dict[str, list[float]]:
    """Release round trip, event after the release returned, return after the event, gap:
    for each handoff from the holder process to the waiter process."""
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    releases_out: Queue[Any] = ctx.Queue()
    turns_out: Queue[Any] = ctx.Queue()
    processes = [
        ctx.Process(target=_waiter, args=(url, handoffs, ready, turns_out)),
        ctx.Process(target=_holder, args=(url, handoffs, ready, releases_out)),
    ]
    turns, releases = _run(processes, [turns_out, releases_out], BOUND + handoffs * 0.1)
    released = {owner: (sent, done) for owner, sent, done in releases}
    parts: dict[str, list[float]] = {"release": [], "event": [], "wake": [], "gap": []}
    for heard, returned, previous in turns[WARM_UP:]:
        if heard is None or previous not in released:
            continue  # taken by an attempt of its own, or from somebody else's release
        sent, done = released[previous]
        parts["release"].append(done - sent)
        # The event may come before the release's reply does: a negative "event".
        parts["event"].append(heard - done)
        parts["wake"].append(returned - heard)
        parts["gap"].append(returned - sent)
    return parts


def _raw_watch(url: str, ready: Event, out: Queue[Any]) -> None:
    """In a process of its own, as a waiter's watcher is: when each update's event came."""
    client: MongoClient[dict[str, Any]] = MongoClient(url)
    heard: dict[int, float] = {}
    stages = [{"$match": {"operationType": "update"}}]
    with client[DATABASE].raw.watch(stages, max_await_time_ms=500) as stream:
        ready.set()
        for change in stream:
            n = change["updateDescription"]["updatedFields"]["n"]
            heard[n] = time.monotonic()
            if n < 0:
                break
    client.close()
    out.put(heard)


def raw(url: str, writes: int) -> dict[str, list[float]]:
    """A majority update's round trip, and when a change stream on another connection, in
    another process, delivers its event after the update returned."""
    writer: MongoClient[dict[str, Any]] = MongoClient(url, w="majority")
    collection = writer[DATABASE].raw
    collection.update_one({"_id": KEY}, {"$set": {"n": 0}}, upsert=True)
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    heard_out: Queue[Any] = ctx.Queue()
    watcher = ctx.Process(target=_raw_watch, args=(url, ready, heard_out))
    watcher.start()
    sent: dict[int, tuple[float, float]] = {}
    try:
        if not ready.wait(BOUND):
            raise RuntimeError("the change stream did not open")
        for n in range(1, writes + 1):
            started = time.monotonic()
            collection.update_one({"_id": KEY}, {"$set": {"n": n}})
            sent[n] = (started, time.monotonic())
            time.sleep(HOLD)
        collection.update_one({"_id": KEY}, {"$set": {"n": -1}})
        heard: dict[int, float] = heard_out.get(timeout=BOUND)
        watcher.join(BOUND)
    finally:
        if watcher.is_alive():
            watcher.terminate()
        writer.close()
    parts: dict[str, list[float]] = {"write": [], "event": []}
    for n in range(WARM_UP + 1, writes + 1):
        if n in heard:
            parts["write"].append(sent[n][1] - sent[n][0])
            parts["event"].append(heard[n] - sent[n][1])
    return parts


def _row(name: str, values: Sequence[float]) -> str:
    p50, p90 = quantile(values, 0.5), quantile(values, 0.9)
    return f"| {name} | {p50 * 1e3:.3f} ms | {p90 * 1e3:.3f} ms | {len(values)} |"


def main(argv: Sequence[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else argv
    handoffs = int(arguments[0]) if arguments else 400
    with mongo_server() as server:
        print(f"MongoDB {server.version} ({server.topology}); {handoffs} handoffs")
        try:
            mine = ours(server.url, handoffs)
            floor = raw(server.url, handoffs)
        finally:
            cleaner: MongoClient[dict[str, Any]] = MongoClient(server.url)
            cleaner.drop_database(DATABASE)
            cleaner.close()
        print("| step | p50 | p90 | n |")
        print("|---|---|---|---|")
        print(_row("raw: majority update, round trip", floor["write"]))
        print(_row("raw: its change event, after the update returned", floor["event"]))
        print(_row("ours: release(), round trip", mine["release"]))
        print(_row("ours: the release's event at the waiter, after it returned", mine["event"]))
        print(_row("ours: the waiter's acquire() returns, after its event", mine["wake"]))
        print(_row("ours: gap, release() called to the next acquire() returned", mine["gap"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
