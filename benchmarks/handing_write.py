"""What the release that hands a lock on costs the server, beside a plain write.

``python -m benchmarks.handing_write [WRITES] [--places N]`` (defaults 400 and 3): a lock
document with a holder and N waiters in line, made by the store itself, is copied to a
document of its own before each timed write, with its lease and its places renewed
(by this host's clock) as behind a held lease of the default 30 s, so that every write
meets the same line, whose places behind its head the handoff cuts. Then, each after a
quiet of ``HOLD`` (as a release after a hold is) and in alternating blocks:

* ``handing``: the release that hands the lock to the first in line
  (``queries.handing_release``); checked, untimed, to have made the first in line its
  holder and the second its head;
* ``same fields``: an update that writes literal values into every field the handing
  release changes (``same_fields``): what the write costs without the pipeline's
  work;
* ``handing, no document``: the same handing release sent for a key that has no
  document: the server parses it and finds nothing to change;
* ``small pipeline, no document``: a one-field pipeline for that key.

Each with ``w: 1`` (the server's own work: parse, evaluate, apply) and with ``w:
"majority"`` (as a release is sent). The first two differ by what the pipeline costs,
the last two by what the server does with its 3 KB before it looks for the document
(parsing it, mostly; not measured apart). A change stream with the watcher's filter stays
open on the lock collection in another process meanwhile (``idle_streams.held_open``),
as waiters' streams are during a handoff: on the machine measured, a majority write
after a quiet returned sooner with one open (docs/performance.md). Against the server
in ``MONGOLOCK_URL``, or a development server started for the run.
"""

from __future__ import annotations

import argparse
import secrets
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from pymongo import MongoClient
from pymongo.database import Database

from benchmarks.idle_streams import held_open
from benchmarks.servers import mongo_server
from benchmarks.stats import table
from django_mongolock.queries import HEAD_MARK, Release, handing_release, head_owner
from django_mongolock.queries.common import (
    ENDED_KEEP,
    HANDOFF_LEASE_MS,
    LAPSED_PLACE,
    LINE_CHECK_MS,
    PLACE_GRACE_MS,
)

__all__ = ["KINDS", "copy_of", "main", "measure", "same_fields"]

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
        ttl = LEASE_LEFT.total_seconds()
        store.acquire(KEY, secrets.token_hex(16), ttl)
        for _ in range(places):
            store.acquire(KEY, secrets.token_hex(16), ttl, queue=True)
        lock: dict[str, Any] | None = store.collection.find_one({"_id": KEY})
    finally:
        manager.close()
    if lock is None or len(lock.get("waiters") or ()) != places:
        raise RuntimeError(f"the line of {KEY!r} is not {places} places long")
    return lock


def same_fields(lock: dict[str, Any], now: datetime) -> dict[str, Any]:
    """The ``$set`` of literal values into every field a handoff of ``copy_of(lock)``
    changes (``handing.release_stage``): the holder's, ``released_at``, ``head``,
    ``ended``, ``group`` and ``kind``, the new holder's place replaced by a lapsed one,
    and the places behind it cut. ``now``: a time later than the lock's acquisition."""
    places = lock["waiters"]
    return {
        "owner": places[0]["owner"],
        "token": lock["token"] + 1,
        "acquired_at": now,
        "refreshed_at": now,
        "expires_at": now + timedelta(milliseconds=HANDOFF_LEASE_MS),
        "ttl": places[0]["ttl"],
        "released_at": now,
        "head": f"{places[1]['owner']}{HEAD_MARK}{lock['token'] + 1}",
        "ended": [lock["owner"], *lock.get("ended", ())][:ENDED_KEEP],
        "group": None,
        "kind": None,
        "waiters.0": LAPSED_PLACE,
        "waiters.1.until": now + timedelta(milliseconds=PLACE_GRACE_MS),
        **{f"waiters.{n}.until": now + CUT for n in range(2, len(places))},
    }


def _commands(lock: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The update command of each kind (without its write concern). Each filters as a
    release does, on key, holder and token: the filter's cost is in every kind alike."""
    handing = handing_release(COPY, lock["owner"], lock["token"])
    same = {"$set": same_fields(lock, datetime.now(UTC))}
    absent = {**handing.filter, "_id": ABSENT}
    return {
        "handing": handing.command(COLLECTION),
        # An update document, not a pipeline: a pipeline's ``$set`` would read
        # ``waiters.0`` as a field of every place.
        "same fields": {"update": COLLECTION, "updates": [{"q": handing.filter, "u": same}]},
        "handing, no document": Release(absent, handing.pipeline).command(COLLECTION),
        "small pipeline, no document": Release(absent, [{"$set": {"n": 1}}]).command(COLLECTION),
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
        with held_open(url, 1, database=database, collection=COLLECTION):
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
    db: Database[dict[str, Any]],
    lock: dict[str, Any],
    kind: str,
    command: dict[str, Any],
    count: int,
) -> list[float]:
    """``count`` sends of ``command``, each after the copy was reset and ``HOLD`` passed;
    each checked (untimed) for what its kind must do."""
    times = []
    locks = db[COLLECTION]
    for _ in range(count):
        locks.replace_one({"_id": COPY}, copy_of(lock, datetime.now(UTC)), upsert=True)
        time.sleep(HOLD)
        started = time.perf_counter()
        reply = db.command(command)
        times.append(time.perf_counter() - started)
        # Only a handoff's outcome is read back: the other kinds' replies tell theirs.
        copy = locks.find_one({"_id": COPY}, {"owner": 1, "head": 1}) if kind == "handing" else None
        _check(kind, reply, lock, copy)
    return times


def _check(
    kind: str, reply: dict[str, Any], lock: dict[str, Any], copy: dict[str, Any] | None
) -> None:
    """Raise RuntimeError unless the write did what ``kind`` names: the handing release
    handed the copy to the first in line (its head the second), a write for no document
    matched none."""
    if kind.endswith("no document"):
        wrong = reply.get("n") != 0
    else:
        wrong = reply.get("nModified") != 1
        if kind == "handing" and copy is not None:
            places = lock["waiters"]
            wrong = wrong or (copy.get("owner"), head_owner(copy.get("head"))) != (
                places[0]["owner"],
                places[1]["owner"],
            )
    if wrong:
        raise RuntimeError(f"{kind!r} did not do what it is timed for: {reply}, then {copy}")


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
    print(table("write", times))
    return 0


if __name__ == "__main__":
    sys.exit(main())
