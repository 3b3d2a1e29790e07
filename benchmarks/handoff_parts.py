"""Where a handoff's time goes, beside the server's own floor for it.

``python -m benchmarks.handoff_parts [HANDOFFS] [--processes N] [--at-once]`` (defaults
400 and 2): N processes take turns on one key, HANDOFFS times each, each holding it
5 ms and asking for it again 2.5 ms after its release (``--at-once``: as soon as the
release returned, as in the benchmarks' handoff workload). Every process times its
``release()``, and stamps the moment
its watcher thread receives the change event of a handoff to it and the moment its
``acquire()`` returns (one host: the processes share CLOCK_MONOTONIC). Then the same
server's floor for those two steps, with the raw driver: one majority update's round
trip, when a change stream in another process delivers its event, and the two together
(the limit, which the benchmarks' handoff workload also times after each of its
rounds). A gap at the floor is the release's round trip plus that delivery. Each
handoff is paired with the release that made it by the releasing holder's id
(``pair``); a lease a process took by an attempt of its own is left out.

A release is sent after the holder's 5 ms hold, during which the server had little to
do (the others wait in line), and a request after such a pause may be answered later
than one sent right after another. So last, in one process that no other takes the
lock with (``lone``), a raw majority update and an uncontended ``acquire()``, each sent
back to back and after the same pause as a release, in alternating blocks: alone, with
a change stream with the watcher's filter open on the lock collection in another
process (as waiters' streams are during a handoff; with one awaiting, requests after a
pause returned sooner on the machine measured), and alone again. ``python -m
benchmarks.handing_write`` shows what the release's own write costs the server. See
docs/performance.md.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import queue
import sys
import time
from collections.abc import Callable, Sequence
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier, Event
from typing import TYPE_CHECKING, Any, Final, TypeVar

from pymongo import MongoClient

from benchmarks.idle_streams import held_open
from benchmarks.servers import mongo_server
from benchmarks.stats import table

if TYPE_CHECKING:
    from django_mongolock import Lock

__all__ = ["lone", "main", "ours", "paced", "pair", "raw"]

_T = TypeVar("_T")

DATABASE: Final = "mongolock_handoff_parts"
KEY: Final = "parts"
HOLD: Final = 0.005
# Leading handoffs left out: the streams opening, the first leases.
WARM_UP: Final = 20
# Bounds every wait on the other process.
BOUND: Final = 120.0
# ``HOLD`` as the rows name it.
_AFTER_HOLD: Final = f"{HOLD * 1000:g} ms"
# The requests of one kind timed in a row by ``lone``, before the next kind's turn.
BLOCK: Final = 50
# The keys ``lone`` acquires in turn, as many as the handoff target's reference uses
# (``workloads.handoff``'s uncontended job): each is free again when its turn comes.
LONE_KEYS: Final = 10
# Bounds each of ``lone``'s acquires: its key is free, unless a release went wrong.
LONE_WAIT: Final = 10.0


def _taker(
    url: str, database: str, handoffs: int, pause: float, start: Barrier, out: Queue[Any]
) -> None:
    """Acquire, hold, release, wait ``pause``; again. For each lease it got: when its
    watcher heard of the handoff (by token, None when it took the key itself), when
    ``acquire`` returned, and whose release handed it over; for each release: its holder
    id and when it was called and returned."""
    from django_mongolock import LockManager
    from django_mongolock.waiters import Handoff, Waiters

    heard: dict[int, tuple[float, str]] = {}
    notify = Waiters.notify

    def stamped(self: Waiters, key: str, handoff: Handoff | None = None) -> int:
        if handoff is not None:
            heard[handoff.token] = (time.monotonic(), handoff.previous)
        return notify(self, key, handoff)

    Waiters.notify = stamped  # type: ignore[method-assign]
    manager = LockManager(url, database=database)
    turns, releases = [], []
    start.wait(BOUND)
    for _ in range(handoffs):
        lock = manager.acquire(KEY, timeout=BOUND)
        returned = time.monotonic()
        at, previous = heard.pop(lock.token, (None, ""))
        if at is not None and at > returned:
            at = None  # its own attempt found the key handed over before the event came
        turns.append((at, returned, previous))
        time.sleep(HOLD)
        sent = time.monotonic()
        lock.release()
        releases.append((lock.owner, sent, time.monotonic()))
        if pause:
            time.sleep(pause)
    manager.close()
    out.put((turns, releases))


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


def ours(
    url: str,
    handoffs: int,
    processes: int = 2,
    database: str = DATABASE,
    *,
    pause: float = HOLD / 2,
) -> dict[str, list[float]]:
    """Release round trip, event after the release returned, return after the event, gap:
    for each handoff from one of ``processes`` processes (each taking turns on the key
    ``handoffs`` times, and asking for it again ``pause`` after its release) to another."""
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(processes)
    outs: list[Queue[Any]] = [ctx.Queue() for _ in range(processes)]
    takers = [
        ctx.Process(target=_taker, args=(url, database, handoffs, pause, start, out))
        for out in outs
    ]
    return pair(_run(takers, outs, BOUND + handoffs * processes * 0.1))


def pair(results: Sequence[tuple[Sequence[Any], Sequence[Any]]]) -> dict[str, list[float]]:
    """The steps of each handoff in ``results`` (each process's turns and releases, as
    ``_taker`` reports them), paired with the release that made it by its holder id,
    which is unique per acquisition. A turn taken by an attempt of its own (nothing
    heard), or handed over by a release not reported (an unnamed one), is left out, and
    so are each process's first ``WARM_UP`` turns."""
    released = {owner: (sent, done) for _, releases in results for owner, sent, done in releases}
    parts: dict[str, list[float]] = {"release": [], "event": [], "wake": [], "gap": []}
    for turns, _ in results:
        for heard, returned, previous in turns[WARM_UP:]:
            if heard is None or previous not in released:
                continue
            sent, done = released[previous]
            parts["release"].append(done - sent)
            # The event may come before the release's reply does: a negative "event".
            parts["event"].append(heard - done)
            parts["wake"].append(returned - heard)
            parts["gap"].append(returned - sent)
    return parts


def _raw_watch(url: str, database: str, ready: Event, out: Queue[Any]) -> None:
    """In a process of its own, as a waiter's watcher is: when each update's event came."""
    client: MongoClient[dict[str, Any]] = MongoClient(url)
    heard: dict[int, float] = {}
    stages = [{"$match": {"operationType": "update"}}]
    with client[database].raw.watch(stages, max_await_time_ms=500) as stream:
        ready.set()
        for change in stream:
            n = change["updateDescription"]["updatedFields"]["n"]
            heard[n] = time.monotonic()
            if n < 0:
                break
    client.close()
    out.put(heard)


def raw(
    url: str, writes: int, database: str = DATABASE, *, pause: float = HOLD
) -> dict[str, list[float]]:
    """A majority update's round trip (each sent ``pause`` after the previous returned),
    when a change stream on another connection, in another process, delivers its event
    after the update returned, and the two together (``limit``: from sending the update
    to its event heard, what the server allows a handoff: one majority write and its
    notification). Every update after the warm-up must be heard."""
    writer: MongoClient[dict[str, Any]] = MongoClient(url, w="majority")
    collection = writer[database].raw
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    heard_out: Queue[Any] = ctx.Queue()
    watcher = ctx.Process(target=_raw_watch, args=(url, database, ready, heard_out))
    sent: dict[int, tuple[float, float]] = {}
    try:
        collection.update_one({"_id": KEY}, {"$set": {"n": 0}}, upsert=True)
        watcher.start()
        until = time.monotonic() + BOUND
        while not ready.wait(0.5):  # a watcher that died says so at once
            if watcher.exitcode is not None or time.monotonic() > until:
                raise RuntimeError(f"the change stream did not open ({watcher.exitcode=})")
        for n in range(1, writes + 1):
            started = time.monotonic()
            collection.update_one({"_id": KEY}, {"$set": {"n": n}})
            sent[n] = (started, time.monotonic())
            time.sleep(pause)
        collection.update_one({"_id": KEY}, {"$set": {"n": -1}})
        heard: dict[int, float] = _result(heard_out, [watcher], time.monotonic() + BOUND)
        watcher.join(BOUND)
    finally:
        if watcher.is_alive():
            watcher.terminate()
            watcher.join(BOUND)
        writer.close()
    measured = range(WARM_UP + 1, writes + 1)
    if missed := [n for n in measured if n not in heard]:
        raise RuntimeError(f"the change stream missed {len(missed)} of {len(measured)} updates")
    return {
        "write": [sent[n][1] - sent[n][0] for n in measured],
        "event": [heard[n] - sent[n][1] for n in measured],
        "limit": [heard[n] - sent[n][0] for n in measured],
    }


def paced(
    send: Callable[[int], _T],
    count: int,
    pause: float,
    then: Callable[[_T], object] = lambda _: None,
) -> list[float]:
    """How long each of ``count`` calls of ``send`` (given its number) took. Each call is
    made ``pause`` seconds (0: none) after the previous one and ``then`` (untimed, given
    what ``send`` returned) were done; the first call too waits ``pause``, so that it
    comes after as long a quiet as the others."""
    times = []
    for n in range(count):
        if pause:
            time.sleep(pause)
        started = time.perf_counter()
        answer = send(n)
        times.append(time.perf_counter() - started)
        then(answer)
    return times


def lone(
    url: str, count: int, database: str = DATABASE, block: int = BLOCK, *, stream: bool = False
) -> dict[str, list[float]]:
    """One process, no other taker of the lock: a raw majority update and an uncontended
    ``acquire()`` (the default, blocking call, as the handoff target's reference makes it;
    released at once, untimed), each back to back and ``HOLD`` apart: ``count`` round trips of each,
    by the row name ``main`` prints. With ``stream``, a change stream with the watcher's
    filter is open on the lock collection in another process meanwhile
    (``idle_streams.held_open``), as waiters' streams are during a handoff: the rows say
    so.

    The kinds take turns in blocks of ``block``, so that a slower minute of a shared
    machine weighs on all of them alike; each block's first request is left out (it
    follows another kind's), and so are ``WARM_UP`` requests of each kind first.
    """
    opened = held_open(url, 1, database=database, collection="locks") if stream else None
    with opened or contextlib.nullcontext():
        return _lone(url, count, database, block, ", a change stream open" if stream else "")


def _lone(url: str, count: int, database: str, block: int, suffix: str) -> dict[str, list[float]]:
    from django_mongolock import LockManager

    writer: MongoClient[dict[str, Any]] = MongoClient(url, w="majority")
    try:
        collection = writer[database].lone
        manager = LockManager(url, database=database)
        try:

            def update(n: int) -> None:
                collection.update_one({"_id": KEY}, {"$set": {"n": n}}, upsert=True)

            def acquire(n: int) -> Lock:
                return manager.acquire(f"lone-{n % LONE_KEYS}", timeout=LONE_WAIT)

            def release(lock: Lock | None) -> None:
                if lock is not None:
                    lock.release()

            requests: dict[str, Callable[[int], Lock | None]] = {
                "raw: majority update": update,
                "ours: acquire()": acquire,
            }
            pacings = {"back to back": 0.0, f"{_AFTER_HOLD} after the previous request": HOLD}
            kinds = {
                f"{request}, {pacing}{suffix}": (send, pause)
                for request, send in requests.items()
                for pacing, pause in pacings.items()
            }
            times: dict[str, list[float]] = {name: [] for name in kinds}
            for send, pause in kinds.values():
                paced(send, WARM_UP, pause, release)
            while min(len(values) for values in times.values()) < count:
                for name, (send, pause) in kinds.items():
                    times[name].extend(paced(send, block + 1, pause, release)[1:])
        finally:
            manager.close()
    finally:
        writer.close()
    return {name: values[:count] for name, values in times.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.handoff_parts")
    parser.add_argument("handoffs", nargs="?", type=int, default=400, help="per process")
    parser.add_argument("--processes", type=int, default=2, help="taking turns on the key")
    parser.add_argument(
        "--at-once",
        action="store_true",
        help="each process asks for the key again as soon as its release returned, as in the "
        f"benchmarks' handoff workload (default: {HOLD / 2 * 1000:g} ms after)",
    )
    options = parser.parse_args(argv)
    handoffs, processes = options.handoffs, options.processes
    pause = 0.0 if options.at_once else HOLD / 2
    if handoffs <= WARM_UP or processes < 2:
        parser.error(f"needs more than {WARM_UP} handoffs and at least 2 processes")
    with mongo_server() as server:
        print(
            f"MongoDB {server.version} ({server.topology}); "
            f"{processes} processes, {handoffs} turns each, asking again "
            + ("at once" if options.at_once else f"{pause * 1000:g} ms after a release")
        )
        try:
            mine = ours(server.url, handoffs, processes, pause=pause)
            floor = raw(server.url, handoffs)
            # Alone, with a stream, alone again: neither goes only first.
            count = handoffs - WARM_UP
            first = lone(server.url, count // 2)
            streamed = lone(server.url, count, stream=True)
            last = lone(server.url, count - count // 2)
            single = {name: first[name] + last[name] for name in first} | streamed
        finally:
            cleaner: MongoClient[dict[str, Any]] = MongoClient(server.url)
            cleaner.drop_database(DATABASE)
            cleaner.close()
        steps = {
            f"raw: majority update, round trip ({_AFTER_HOLD} apart)": floor["write"],
            "raw: its change event, after the update returned": floor["event"],
            "raw: the update sent to its event heard (the limit)": floor["limit"],
            "ours: release(), round trip": mine["release"],
            "ours: the release's event at the new holder, after it returned": mine["event"],
            "ours: the new holder's acquire() returns, after its event": mine["wake"],
            "ours: gap, release() called to the next acquire() returned": mine["gap"],
        }
        print(table("step", steps))
        print()
        print(
            "One process: requests back to back, or after a pause as a release is; alone, or "
            "with a change stream open in another process:"
        )
        print()
        print(table("request", single))
    return 0


if __name__ == "__main__":
    sys.exit(main())
