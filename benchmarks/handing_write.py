"""What the release that hands a lock on costs the server, beside a plain write.

``python -m benchmarks.handing_write [WRITES] [--places N]`` (defaults 400 and 3): a lock
document with a holder and N waiters in line, made by the store itself, is copied to a
document of its own before each timed write, with its lease and its places renewed
(by this host's clock) as behind a held lease of the default 30 s, so that every write
meets the same line, whose places behind its head the handoff cuts. Then, each after a
quiet of ``HOLD`` (as a release after a hold is) and in alternating blocks:

* ``handing``: the release that hands the lock to the first in line
  (``queries.handing_release``), which must change the copy;
* ``same fields``: an update that writes literal values into the fields the handing
  release changes: what the write costs without the pipeline's work;
* ``handing, no document``: the same handing release sent for a key that has no
  document: the server parses it and finds nothing to change;
* ``small pipeline, no document``: a one-field pipeline for that key.

Each with ``w: 1`` (the server's own work: parse, evaluate, apply) and with ``w:
"majority"`` (as a release is sent). The first two differ by what the pipeline costs,
the last two by what parsing its 3 KB costs. A change stream stays open on the database
in another process meanwhile (``stream_open``), as the waiters' streams are during a
handoff: with one awaiting, a majority write after a quiet returns sooner on the
machines measured (docs/performance.md). Against the server in ``MONGOLOCK_URL``, or a
development server started for the run.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import secrets
import sys
import time
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta
from multiprocessing.synchronize import Event
from typing import Any, Final

from pymongo import MongoClient

from benchmarks.servers import mongo_server
from benchmarks.stats import quantile
from django_mongolock.queries import handing_release
from django_mongolock.queries.common import LINE_CHECK_MS, PLACE_GRACE_MS

__all__ = ["KINDS", "copy_of", "main", "measure", "stream_open"]

DATABASE: Final = "mongolock_handing_write"
COLLECTION: Final = "locks"
KEY: Final = "handed"
COPY: Final = "handed-copy"
ABSENT: Final = "no-such-lock"
HOLD: Final = 0.005
# Writes of one kind timed in a row before the next kind's turn; each block's first is
# left out (it follows another kind's).
BLOCK: Final = 50
# Bounds every wait on the stream's process.
BOUND: Final = 60.0
# How long the copy's lease lasts from each reset (the default ttl), and its places the
# grace period beyond it, as waiters' places behind a held lease do: the handoff cuts
# the places behind its new head (to the line check and the grace period from now).
LEASE_LEFT: Final = timedelta(seconds=30)
PLACE_LEFT: Final = LEASE_LEFT + timedelta(milliseconds=PLACE_GRACE_MS)
# Where the handoff cuts the places behind its new head.
CUT: Final = timedelta(milliseconds=LINE_CHECK_MS + PLACE_GRACE_MS)
KINDS: Final = ("handing", "same fields", "handing, no document", "small pipeline, no document")
CONCERNS: Final = {"w: 1": {"w": 1}, "majority": {"w": "majority"}}


def _watch(url: str, database: str, ready: Event, stop: Event) -> None:
    """In a process of its own: a change stream on ``database`` until ``stop``; it reports
    only drops, which nothing measured makes."""
    client: MongoClient[dict[str, Any]] = MongoClient(url)
    try:
        stages = [{"$match": {"operationType": "drop"}}]
        with client[database].watch(stages, max_await_time_ms=200) as stream:
            ready.set()
            while not stop.is_set() and stream.alive:
                stream.try_next()
    finally:
        client.close()


@contextlib.contextmanager
def stream_open(url: str, database: str) -> Iterator[None]:
    """A change stream awaiting events on ``database``, in another process, while the
    block runs (it is open before the block starts)."""
    ctx = multiprocessing.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    watcher = ctx.Process(target=_watch, args=(url, database, ready, stop), daemon=True)
    watcher.start()
    try:
        until = time.monotonic() + BOUND
        while not ready.wait(0.1):
            if not watcher.is_alive() or time.monotonic() > until:
                raise RuntimeError("the change stream did not open")
        yield
    finally:
        stop.set()
        watcher.join(BOUND)
        if watcher.is_alive():
            watcher.terminate()
            watcher.join(BOUND)


def copy_of(lock: dict[str, Any], now: datetime) -> dict[str, Any]:
    """``lock`` as the document ``COPY``, its lease and its places renewed from ``now``."""
    return {
        **lock,
        "_id": COPY,
        "expires_at": now + LEASE_LEFT,
        "waiters": [{**place, "until": now + PLACE_LEFT} for place in lock["waiters"]],
    }


def _line(url: str, database: str, places: int) -> dict[str, Any]:
    """A lock document of ``KEY`` with a holder and ``places`` waiters in line (at least
    two), as the store writes them."""
    from django_mongolock import LockManager

    manager = LockManager(url, database=database, collection=COLLECTION)
    try:
        store = manager.store
        store.acquire(KEY, secrets.token_hex(16), 60)
        for _ in range(places):
            store.acquire(KEY, secrets.token_hex(16), 60, queue=True)
        lock: dict[str, Any] | None = store.collection.find_one({"_id": KEY})
    finally:
        manager.close()
    if lock is None or len(lock.get("waiters") or ()) != places:
        raise RuntimeError(f"the line of {KEY!r} is not {places} places long")
    return lock


def _commands(lock: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The update command of each kind (without its write concern)."""
    copy = copy_of(lock, datetime.now(UTC))
    handing = handing_release(COPY, copy["owner"], copy["token"])
    same = {
        "owner": secrets.token_hex(16),
        "token": copy["token"] + 1,
        "acquired_at": copy["acquired_at"],
        "refreshed_at": copy["acquired_at"],
        "expires_at": copy["expires_at"],
        "ttl": copy["ttl"],
        "released_at": copy["acquired_at"],
        "head": secrets.token_hex(16),
        "ended": [secrets.token_hex(16), *copy.get("ended", ())][:16],
        # The new holder's place marked lapsed, the new head's cut, and those behind it
        # cut, as a handoff changes them.
        "waiters.0.until": None,
        "waiters.1.until": copy["acquired_at"],
        **{f"waiters.{n}.until": copy["acquired_at"] + CUT for n in range(2, len(copy["waiters"]))},
    }
    updates = {
        "handing": (handing.filter, handing.pipeline),
        "same fields": ({"_id": COPY}, {"$set": same}),
        "handing, no document": ({**handing.filter, "_id": ABSENT}, handing.pipeline),
        "small pipeline, no document": ({"_id": ABSENT}, [{"$set": {"n": 1}}]),
    }
    return {
        kind: {"update": COLLECTION, "updates": [{"q": query, "u": update}]}
        for kind, (query, update) in updates.items()
    }


def measure(
    url: str,
    writes: int,
    places: int = 3,
    database: str = DATABASE,
    block: int = BLOCK,
) -> dict[str, list[float]]:
    """``writes`` round trips of each kind with each write concern (``"handing, w: 1"``
    ...), each after ``HOLD`` of quiet, with a change stream open on ``database``.

    Raises RuntimeError when a handing release did not hand the lock on, or a write for
    no document changed one: the figures would not be what they are named.
    """
    client: MongoClient[dict[str, Any]] = MongoClient(url)
    try:
        db = client[database]
        lock = _line(url, database, places)
        commands = _commands(lock)
        times: dict[str, list[float]] = {
            f"{kind}, {concern}": [] for kind in KINDS for concern in CONCERNS
        }
        with stream_open(url, database):
            while min(len(values) for values in times.values()) < writes:
                for kind in KINDS:
                    for concern, write_concern in CONCERNS.items():
                        command = {**commands[kind], "writeConcern": write_concern}
                        timed = _block(db, lock, kind, command, block + 1)[1:]
                        times[f"{kind}, {concern}"].extend(timed)
        return {name: values[:writes] for name, values in times.items()}
    finally:
        client.drop_database(database)
        client.close()


def _block(
    db: Any, lock: dict[str, Any], kind: str, command: dict[str, Any], count: int
) -> list[float]:
    """``count`` sends of ``command``, each after the copy was reset and ``HOLD`` passed."""
    times = []
    for _ in range(count):
        db[COLLECTION].replace_one({"_id": COPY}, copy_of(lock, datetime.now(UTC)), upsert=True)
        time.sleep(HOLD)
        started = time.perf_counter()
        reply = db.command(command)
        times.append(time.perf_counter() - started)
        changed = 1 if kind in ("handing", "same fields") else 0
        if reply.get("nModified") != changed:
            raise RuntimeError(
                f"{kind!r} changed {reply.get('nModified')} documents, not {changed}"
            )
    return times


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.handing_write")
    parser.add_argument("writes", nargs="?", type=int, default=400, help="of each kind")
    parser.add_argument(
        "--places", type=int, default=3, help="waiters in line (default 3, at least 2)"
    )
    options = parser.parse_args(argv)
    if options.writes < 1 or options.places < 2:
        parser.error("needs at least one write and two places in line")
    with mongo_server() as server:
        print(
            f"MongoDB {server.version} ({server.topology}); {options.places} places in line, "
            f"each write {HOLD * 1000:g} ms after the previous one, a change stream open"
        )
        times = measure(server.url, options.writes, options.places)
    print("| write | p50 | p90 | n |")
    print("|---|---|---|---|")
    for name, values in times.items():
        p50, p90 = quantile(values, 0.5), quantile(values, 0.9)
        print(f"| {name} | {p50 * 1e3:.3f} ms | {p90 * 1e3:.3f} ms | {len(values)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
