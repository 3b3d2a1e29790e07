"""How long a majority write takes, by how soon after the previous reply it is sent.

``python -m benchmarks.think_time [CYCLES] [--think US,...]`` (defaults 300 cycles and
0,20,50,100,200,400 µs): in one thread, uncontended acquire+release cycles of the
benchmarks' floor (``contenders.FloorLock``: two majority writes a cycle), with the
client busy for THINK µs (spinning, as code would) before each of its writes, and of
django-mongolock's ``acquire()`` and ``release()`` as they are. The kinds take turns by
blocks of ``BLOCK`` cycles, in an order shuffled each turn. Per kind, the round trips of
its writes (the floor's as timed around each call, ours' as the driver's command
listener reports them); for ours also the time from each write's reply to its next
write's sending: how long its own code keeps the server waiting.

On the machine of 5 December 2026, where the uncontended cycle measured 1.17 times the
floor's, writes fell into two modes about 1 ms apart, and the floor's writes fell into
the slow one more often when sent 100 to 200 µs after the previous reply than at once
or 400 µs after. Against the server in ``MONGOLOCK_URL``, or a development server
started for the run. See docs/performance.md.
"""

from __future__ import annotations

import argparse
import random
import secrets
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

from pymongo import MongoClient, monitoring

from benchmarks.contenders import DATABASE, FloorLock, Spec
from benchmarks.servers import mongo_server
from benchmarks.stats import table
from django_mongolock import LockManager

__all__ = ["THINKS", "Replies", "main", "measure", "spin"]

THINKS: Final = (0, 20, 50, 100, 200, 400)
# Cycles of one kind in a row before the next kind's turn, and the first ones of each
# kind left out (connections opening, the first documents).
BLOCK: Final = 25
WARM_UP: Final = 20
KEYS: Final = 100
COLLECTION: Final = "think_time"
_WRITES: Final = frozenset({"findAndModify", "update", "delete", "insert"})


def spin(seconds: float) -> None:
    """Keep the thread busy (holding the GIL, as code would) for ``seconds``."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class Replies(monitoring.CommandListener):
    """Each write command's round trip, and the time from a write's reply to the next
    write's sending, of the thread that made the listener: the writes a refresher's
    tick sends from its own thread meanwhile are not the cycle's."""

    def __init__(self) -> None:
        self.trips: list[float] = []
        self.thinks: list[float] = []
        self._replied: float | None = None
        self._thread = threading.get_ident()

    def _counted(self, name: str) -> bool:
        return name in _WRITES and threading.get_ident() == self._thread

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if self._counted(event.command_name) and self._replied is not None:
            self.thinks.append(time.perf_counter() - self._replied)

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        if self._counted(event.command_name):
            self.trips.append(event.duration_micros / 1e6)
            self._replied = time.perf_counter()

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        self._replied = None

    def pause(self) -> None:
        """The next write follows something else: its wait is not counted."""
        self._replied = None


def _floor_cycle(lock: FloorLock, think: float) -> Callable[[str], list[float]]:
    def cycle(key: str) -> list[float]:
        spin(think)
        started = time.perf_counter()
        handle = lock.try_acquire(key)
        acquired = time.perf_counter()
        if handle is None:
            raise RuntimeError(f"the floor found {key!r} busy: the probe's keys are not clean")
        spin(think)
        released = time.perf_counter()
        lock.release(handle)
        return [acquired - started, time.perf_counter() - released]

    return cycle


def measure(url: str, cycles: int, thinks: Sequence[int] = THINKS) -> dict[str, list[float]]:
    """Round trips of the writes of ``cycles`` cycles of each kind (after ``WARM_UP``),
    and ours' time from a reply to its next write, by name."""
    run = secrets.token_hex(3)
    keys = [f"think-{run}-{n}" for n in range(KEYS)]
    floor = FloorLock(Spec("floor", "floor", url, collection=COLLECTION))
    replies = Replies()

    class Listened(LockManager):
        def _client_options(self) -> dict[str, Any]:
            return {**super()._client_options(), "event_listeners": [replies]}

    manager = Listened(url, database=DATABASE, collection=COLLECTION + "_ours")
    ours_name = "django-mongolock, as it is"

    def ours(key: str) -> list[float]:
        manager.acquire(key).release()
        return []  # the listener times its writes

    kinds: dict[str, Callable[[str], list[float]]] = {
        f"floor, {think} µs before each write": _floor_cycle(floor, think / 1e6) for think in thinks
    }
    kinds[ours_name] = ours
    trips: dict[str, list[float]] = {name: [] for name in kinds}
    waits: list[float] = []
    done = dict.fromkeys(kinds, 0)
    try:
        manager.ensure_indexes()
        while min(done.values()) < WARM_UP + cycles:
            for name in random.sample(list(kinds), len(kinds)):
                replies.pause()  # the block's first write follows another kind's
                for _ in range(BLOCK):
                    heard = len(replies.trips), len(replies.thinks)
                    times = kinds[name](random.choice(keys))
                    done[name] += 1
                    if done[name] <= WARM_UP:
                        continue
                    trips[name].extend(times)
                    if name == ours_name:
                        trips[name].extend(replies.trips[heard[0] :])
                        waits.extend(replies.thinks[heard[1] :])
    finally:
        manager.close()
        floor.close()
        cleaner: MongoClient[dict[str, Any]] = MongoClient(url)
        try:  # the floor's, ours' and the side collections the manager made
            mine = {"name": {"$regex": f"^{COLLECTION}"}}
            for name in cleaner[DATABASE].list_collection_names(filter=mine):
                cleaner[DATABASE].drop_collection(name)
        finally:
            cleaner.close()
    trips["django-mongolock: from a write's reply to its next write"] = waits
    return trips


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.think_time")
    parser.add_argument("cycles", nargs="?", type=int, default=300, help="per kind")
    parser.add_argument(
        "--think",
        default=",".join(map(str, THINKS)),
        help="µs the floor's client is busy before each write, comma-separated",
    )
    options = parser.parse_args(argv)
    try:
        thinks = [int(value) for value in options.think.split(",")]
    except ValueError:
        parser.error(f"--think takes whole µs, comma-separated; got {options.think!r}")
    if options.cycles < 1 or any(think < 0 for think in thinks):
        parser.error("needs at least one cycle and no negative think time")
    with mongo_server() as server:
        print(f"MongoDB {server.version} ({server.topology}); {options.cycles} cycles a kind")
        print(table("write round trip, or time", measure(server.url, options.cycles, thinks)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
