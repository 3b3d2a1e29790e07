"""The modes of one write's round trip, by write concern and by where the data lives.

``python -m benchmarks.write_modes [WRITES] [--pauses MS,...] [--dirs DIR,...]
[--server-args ARGS]`` (defaults 1000 writes, pauses of 0 and 5 ms, and the system's
temporary directory beside ``/dev/shm``, memory, where there is one): for each
directory, a one-node replica set of its own (``ARGS``: more ``mongod`` options, such
as ``"--journalCommitInterval 1"``), its data in a fresh directory under it, and
WRITES updates of one document by the raw driver for each write concern (``w: 1``, and
``w: "majority"`` as every lock write is sent) and each pause: each update sent that
long after the previous one's reply (0: at once, back to back; 5 ms: as a release
after a 5 ms hold is). The kinds take turns in blocks of ``BLOCK``. For each: p10, p50,
p90 and the round trip's modes (``modes``). ``MONGOLOCK_URL`` is not used: the point
is the server's own.

Written for the two modes about 1 ms apart that the uncontended cycle's writes fell
into, and for the handoff's release, sent after a hold: whether the modes are the
server's, with no lock code in the way, and whether they follow the write concern,
the pause before the write, the disk or the journal's flushing. See
docs/performance.md.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import math
import os
import shlex
import shutil
import sys
import tempfile
from collections.abc import Sequence
from typing import Any, Final

from pymongo import MongoClient
from pymongo.collection import Collection
from pymongo.write_concern import WriteConcern

from benchmarks.handoff_parts import paced
from benchmarks.markdown import table
from benchmarks.stats import ms, quantile
from django_mongolock.testing import MongoReplicaSet

__all__ = ["CONCERNS", "PAUSES", "kind", "main", "measure", "modes"]

CONCERNS: Final = {"w: 1": WriteConcern(w=1), "majority": WriteConcern(w="majority")}
# The pauses before each write (seconds) when none are named.
PAUSES: Final = (0.0, 0.005)
# Writes of one kind in a row, before the next kind's turn.
BLOCK: Final = 100
# Leading writes of each kind left out: the server's and the client's first ones.
WARM_UP: Final = 100
# A mode: a bin this wide (seconds) that holds at least ``MODE_SHARE`` of the round
# trips and more than every other bin within ``MODE_SPAN`` bins on either side.
BIN: Final = 0.0001
MODE_SHARE: Final = 0.02
MODE_SPAN: Final = 3
# Where the data lives when no directory is named: memory, when the system has it.
MEMORY: Final = "/dev/shm"
# Bounds each write (ms): a server that stops answering ends the run with an error.
WRITE_LIMIT_MS: Final = 10_000


def modes(
    samples: Sequence[float],
    *,
    width: float = BIN,
    share: float = MODE_SHARE,
    span: int = MODE_SPAN,
) -> list[float]:
    """The modes of ``samples``, lowest first: the middle of each bin ``width`` wide that
    holds at least ``share`` of them and more than any other bin within ``span`` bins
    (of two equal neighbours, the lower counts)."""
    if not samples:
        return []
    counts = collections.Counter(math.floor(sample / width) for sample in samples)
    least = share * len(samples)
    found = []
    for bin_, count in sorted(counts.items()):
        if count < least:
            continue
        lower = all(counts[bin_ - d] < count for d in range(1, span + 1))
        higher = all(counts[bin_ + d] <= count for d in range(1, span + 1))
        if lower and higher:
            found.append((bin_ + 0.5) * width)
    return found


def kind(concern: str, pause: float) -> str:
    """A kind of write as the table names it."""
    if not pause:
        return f"{concern}, back to back"
    return f"{concern}, {pause * 1000:g} ms after the previous reply"


def measure(
    directory: str,
    writes: int,
    server_args: Sequence[str] = (),
    pauses: Sequence[float] = PAUSES,
) -> dict[str, list[float]]:
    """The round trips of each write concern after each of ``pauses`` (``writes`` of
    each, after ``WARM_UP``), by ``kind``, on a one-node replica set started with
    ``server_args`` whose data is in a fresh directory under ``directory``; the server
    and its data are gone when this returns. The set has the test suite's small cache
    and oplog (one document is written)."""
    dbpath = tempfile.mkdtemp(prefix="mongolock-write-modes-", dir=directory)
    try:
        with MongoReplicaSet(
            name="writemodes", dbpaths=[dbpath], extra_args=server_args
        ) as replica_set:
            client: MongoClient[dict[str, Any]] = MongoClient(
                replica_set.url, timeoutMS=WRITE_LIMIT_MS
            )
            try:
                return _timed(client["mongolock_write_modes"]["one"], writes, pauses)
            finally:
                client.close()
    finally:
        shutil.rmtree(dbpath, ignore_errors=True)


def _timed(
    collection: Collection[dict[str, Any]], writes: int, pauses: Sequence[float]
) -> dict[str, list[float]]:
    collection.insert_one({"_id": 1, "n": 0})
    each = {
        kind(name, pause): (collection.with_options(write_concern=concern), pause)
        for name, concern in CONCERNS.items()
        for pause in dict.fromkeys(pauses)
    }
    times: dict[str, list[float]] = {name: [] for name in each}
    serial = itertools.count(1)  # every update changes the document
    while min(len(values) for values in times.values()) < WARM_UP + writes:
        for name, (target, pause) in each.items():

            def update(_: int, target: Collection[dict[str, Any]] = target) -> None:
                target.update_one({"_id": 1}, {"$set": {"n": next(serial)}})

            times[name].extend(paced(update, BLOCK, pause))
    return {name: values[WARM_UP : WARM_UP + writes] for name, values in times.items()}


def _row(where: str, name: str, values: Sequence[float]) -> list[str]:
    found = ", ".join(ms(mode) for mode in modes(values)) or "none"
    quantiles = [ms(quantile(values, q), 3) for q in (0.1, 0.5, 0.9)]
    return [where, name, *quantiles, found, str(len(values))]


def _default_dirs() -> list[str]:
    dirs = [tempfile.gettempdir()]
    if os.path.isdir(MEMORY) and _writable(MEMORY):
        dirs.append(MEMORY)
    return list(dict.fromkeys(os.path.realpath(d) for d in dirs))


def _writable(directory: str) -> bool:
    """Whether a directory can be made in ``directory``: tried, so that a directory
    refused after others were measured does not lose their figures."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix="mongolock-write-modes-", dir=directory))
    except OSError:
        return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.write_modes")
    parser.add_argument("writes", nargs="?", type=int, default=1000)
    parser.add_argument("--pauses", help="milliseconds before each write, comma-separated")
    parser.add_argument("--dirs", help="directories to keep the data under, comma-separated")
    parser.add_argument("--server-args", default="", help="more mongod options, as one string")
    args = parser.parse_args(argv)
    if args.writes < 1:
        parser.error("WRITES must be at least 1")
    try:
        pauses = [float(p) / 1000 for p in args.pauses.split(",")] if args.pauses else PAUSES
    except ValueError:
        parser.error(f"--pauses takes milliseconds, comma-separated: not {args.pauses!r}")
    if not all(0 <= pause <= 1 for pause in pauses):
        parser.error("each pause must be between 0 and 1000 ms")
    dirs = list(dict.fromkeys(args.dirs.split(","))) if args.dirs else _default_dirs()
    for directory in dirs:
        if not _writable(directory):
            parser.error(f"not a directory this user can write to: {directory}")
    try:
        server_args = shlex.split(args.server_args)
    except ValueError as exc:
        parser.error(f"--server-args: {exc}")
    rows = []
    for directory in dirs:
        for name, values in measure(directory, args.writes, server_args, pauses).items():
            rows.append(_row(directory, name, values))
    print(
        f"{args.writes} updates of one document of each kind, in blocks of {BLOCK}; modes: "
        f"{BIN * 1000:g} ms bins holding at least {MODE_SHARE:.0%} of the writes and more "
        f"than the bins within {MODE_SPAN} on either side"
        + (f"; mongod {shlex.join(server_args)}" if server_args else "")
    )
    print("\n".join(table(["data under", "write", "p10", "p50", "p90", "modes", "n"], rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
