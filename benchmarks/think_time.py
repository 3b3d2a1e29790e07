"""How long a majority write takes, by how soon after the previous reply it is sent.

``python -m benchmarks.think_time [CYCLES] [--think US,...]`` (defaults 300 cycles and
0,20,50,100,200,400 µs): in one thread, uncontended acquire+release cycles of the
benchmarks' floor (``contenders.FloorLock``: two majority writes a cycle), with the
client also kept busy for THINK µs (spinning, as code would) before each of its writes,
and of django-mongolock's ``acquire()`` and ``release()`` as they are. The kinds take
turns by blocks of ``BLOCK`` cycles, in an order shuffled each turn; the first cycle of
each block, which follows another kind's, is left out. For every kind alike, a command
listener of the calling thread gives each write's round trip (from just before it is
sent to its reply read) and the time from each write's reply to the next write's
sending: the driver's own work between the two, the floor's spin, or the lock's code.

Written for the machine of 5 December 2026, where the uncontended cycle measured 1.17
times the floor's and the writes of both fell into two modes about 1 ms apart: to see
whether the lock's writes land in the slow one more often because of when they are
sent (there, the floor's writes sent as late as the lock's mostly did too). Against
the server in ``MONGOLOCK_URL``, or a development server started for the run. See
docs/performance.md.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import secrets
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Final

from pymongo import monitoring

from benchmarks.client_cpu import drop_collections, floor_cycle
from benchmarks.contenders import DATABASE, FloorLock, ListenedManager, Spec
from benchmarks.servers import mongo_server
from benchmarks.stats import table

__all__ = ["THINKS", "Replies", "main", "measure"]

THINKS: Final = (0, 20, 50, 100, 200, 400)
# Cycles of one kind in a row before the next kind's turn; the first ones of each kind
# left out (connections opening, the first documents).
BLOCK: Final = 25
WARM_UP: Final = 20
KEYS: Final = 100
COLLECTION: Final = "think_time"
# Bounds ours' acquire: its key is free, unless a release went wrong.
ACQUIRE_TIMEOUT: Final = 10.0
# The writes of a cycle: ours' acquire (findAndModify) and release (update), the
# floor's acquire (findAndModify) and release (delete).
_WRITES: Final = frozenset({"findAndModify", "update", "delete"})
OURS: Final = "django-mongolock, as it is"


class Replies(monitoring.CommandListener):
    """Each write command's round trip, and the time from a write's reply to the next
    write's sending (a read sent between them counts in it), of the thread that made
    the listener: a refresher's tick or a watcher writes from threads of their own."""

    def __init__(self) -> None:
        self.trips: list[float] = []
        self.waits: list[float] = []
        self._replied: float | None = None
        self._thread = threading.get_ident()

    def _counted(self, name: str) -> bool:
        return name in _WRITES and threading.get_ident() == self._thread

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if self._counted(event.command_name) and self._replied is not None:
            self.waits.append(time.perf_counter() - self._replied)

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        if self._counted(event.command_name):
            self.trips.append(event.duration_micros / 1e6)
            self._replied = time.perf_counter()

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        if self._counted(event.command_name):
            self._replied = None

    def pause(self) -> None:
        """The next write follows something else: its wait is not counted."""
        self._replied = None


def measure(
    url: str, cycles: int, thinks: Sequence[int] = THINKS
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """The round trips of the writes of ``cycles`` cycles of each kind (after
    ``WARM_UP``, the first of each block left out), and the time from each of their
    replies to the next write, by kind."""
    run = secrets.token_hex(3)
    keys = [f"think-{run}-{n}" for n in range(KEYS)]
    prefix = f"{COLLECTION}-{run}"
    replies = Replies()

    trips: dict[str, list[float]] = {}
    waits: dict[str, list[float]] = {}
    with contextlib.ExitStack() as stack:
        # The floor's, ours' and the side collections ours made.
        stack.callback(drop_collections, url, prefix)
        floor = FloorLock(Spec("floor", "floor", url, collection=prefix), [replies])
        stack.callback(floor.close)
        manager = stack.enter_context(
            ListenedManager(url, database=DATABASE, collection=f"{prefix}-ours", listener=replies)
        )
        kinds: dict[str, Callable[[str], None]] = {
            f"floor, {think} µs before each write": floor_cycle(floor, think / 1e6)
            for think in dict.fromkeys(thinks)
        }

        def ours(key: str) -> None:
            manager.acquire(key, timeout=ACQUIRE_TIMEOUT).release()

        kinds[OURS] = ours
        for name in kinds:
            trips[name], waits[name] = [], []
        done = dict.fromkeys(kinds, 0)
        manager.ensure_indexes()
        while min(done.values()) < WARM_UP + cycles:
            for name in random.sample(list(kinds), len(kinds)):
                replies.pause()  # the block's first write follows another kind's
                for turn in range(BLOCK):
                    if done[name] == WARM_UP + cycles:
                        break
                    heard = len(replies.trips), len(replies.waits)
                    kinds[name](random.choice(keys))
                    done[name] += 1
                    if turn and done[name] > WARM_UP:
                        trips[name] += replies.trips[heard[0] :]
                        waits[name] += replies.waits[heard[1] :]
    return trips, waits


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.think_time")
    parser.add_argument("cycles", nargs="?", type=int, default=300, help="per kind")
    parser.add_argument(
        "--think",
        default=",".join(map(str, THINKS)),
        help="µs the floor's client is also busy before each write, comma-separated",
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
        trips, waits = measure(server.url, options.cycles, thinks)
        print(table("write round trip", trips))
        print()
        print(table("from a write's reply to the next write", waits))
    return 0


if __name__ == "__main__":
    sys.exit(main())
