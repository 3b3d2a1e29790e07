"""Scale: how a release's wake-up and its cost on the server grow with the waiters.

The shapes of django-mongolock (python-redis-lock's processes run beside them as a
reference, with no target of their own):

* *keys*: one process, ``W`` threads each waiting on a key of its own (``W`` keys) held by
  another client; the holder releases the keys one by one, and each wake-up is timed
  from the release call to the waiter's return from ``acquire``.
* *processes*: ``P`` processes blocking on one key, each holding it ``hold`` and
  releasing, as in the handoff workload; each wake-up is the gap from one holder's
  release call to the next holder's return (CLOCK_MONOTONIC is shared by the processes).
* *relay*: the processes again, with one change stream per host passed on to the others
  (``SHARED_STREAM``).

For each, the server's operation counters (``serverStatus().opcounters``) over the
releases give the server operations per release (every write, read, command and getMore
any process sent, change streams included), and its open cursors while the waiters wait
tell how many change streams they hold open.
"""

from __future__ import annotations

import importlib
import itertools
import math
import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Final

from pymongo import MongoClient

from benchmarks import line_cost
from benchmarks.contenders import DATABASE, TTL, Spec
from benchmarks.stats import ms, ratio, summary
from benchmarks.workers import Job, Pool
from django_mongolock import LockManager, queries

__all__ = [
    "after_arrival",
    "keys_probe",
    "plot",
    "processes_point",
    "render",
    "run",
    "server_counters",
    "targets",
]

PLOT_NAME: Final = "scale.png"
# The shapes measured, as the targets name them.
SHAPES: Final = {
    "keys": "waiters on as many keys",
    "processes": "processes on one key",
    "relay": "processes on one key, one shared stream",
    "redis": "python-redis-lock processes on one key",
}
# Shapes of other locks, shown for the machine's limit: no target, no server counters.
REFERENCES: Final = frozenset({"redis"})
# Our shapes of many processes on one key, which python-redis-lock's shape matches.
ON_ONE_KEY: Final = frozenset({"processes", "relay"})
PLOT_LABELS: Final = {
    "keys": "W waiters on W keys, 1 process",
    "processes": "P processes, 1 key",
    "relay": "P processes, 1 key, SHARED_STREAM",
    "redis": "P processes, 1 key, python-redis-lock",
}
# Between two releases of the keys shape: each wake-up is timed on its own.
SPACING: Final = 0.01
# Wake-ups timed per size in the keys shape, at least (small sizes repeat).
KEY_SAMPLES: Final = 200
WAKE_GOAL: Final = 2.0
OPS: Final = ("insert", "query", "update", "delete", "getmore", "command")
# The server's write commands (``serverStatus().metrics.commands``): about the writes that
# wake every open change stream (one that changes nothing wakes none, one that changes
# many documents counts once; see docs/performance.md).
WRITE_COMMANDS: Final = ("insert", "update", "delete", "findAndModify")
# What ``server_counters`` counts beside the operations: the write commands, and the write
# conflicts (``metrics.operation.writeConflicts``): each a write to a document another
# write was changing, which the server undid and ran again, after a back-off once it
# had met several in a row.
COUNTED: Final = (*OPS, "writes", "conflicts")


def _open_cursors(client: MongoClient[dict[str, Any]]) -> int:
    """The server's open cursors, now (change streams among them)."""
    return _cursors(client.admin.command("serverStatus"))


def _cursors(status: dict[str, Any]) -> int:
    return int(status["metrics"]["cursor"]["open"]["total"])


def server_counters(client: MongoClient[dict[str, Any]]) -> dict[str, int]:
    """The server's operation counters, its write commands and its open cursors, now."""
    status = client.admin.command("serverStatus")
    counters = {name: int(status["opcounters"][name]) for name in OPS}
    counters["cursors"] = _cursors(status)
    commands = status["metrics"]["commands"]
    counters["writes"] = sum(int(commands.get(name, {}).get("total", 0)) for name in WRITE_COMMANDS)
    counters["conflicts"] = int(status["metrics"]["operation"]["writeConflicts"])
    return counters


def _ops(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The operations between two counts, and (under ``writes`` and ``conflicts``) the
    write commands and the write conflicts the server met and retried."""
    return {name: after[name] - before[name] for name in COUNTED}


def _per_release(ops: dict[str, int], releases: int) -> dict[str, float]:
    """Every operation, and the write commands alone, per release; write conflicts per
    write command."""
    releases = max(1, releases)
    return {
        "ops_per_release": sum(ops[name] for name in OPS) / releases,
        "writes_per_release": ops["writes"] / releases,
        "conflicts_per_write": ops["conflicts"] / max(1, ops["writes"]),
    }


@contextmanager
def _peak_cursors(client: MongoClient[dict[str, Any]]) -> Iterator[list[int]]:
    """Sample the server's open cursors every 50 ms while the block runs; the samples."""
    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.05):
            samples.append(_open_cursors(client))

    thread = threading.Thread(target=sample, name="bench-cursor-sampler", daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join(5)


# -- keys: one process, W waiters on W keys ---------------------------------------------------


def keys_probe(url: str, sizes: Sequence[int]) -> dict[str, Any]:
    """In a fresh process: ``W`` waiting threads on ``W`` keys, released one by one."""
    client: MongoClient[dict[str, Any]] = MongoClient(url)
    idle = _open_cursors(client)
    holder = LockManager(url, database=DATABASE, collection="scale_keys", ttl=TTL)
    waiting = LockManager(url, database=DATABASE, collection="scale_keys", ttl=TTL)
    holder.ensure_indexes()
    points: dict[str, Any] = {}
    for size in sizes:
        wakes: list[float] = []
        ops = dict.fromkeys(COUNTED, 0)
        releases = 0
        cursors: list[int] = []
        for repeat in range(max(1, math.ceil(KEY_SAMPLES / size))):
            keys = [f"w{size}-{repeat}-{n}" for n in range(size)]
            woken, spent, opened = _wake_keys(client, holder, waiting, keys, idle)
            wakes.extend(woken)
            for name, count in spent.items():
                ops[name] += count
            releases += len(keys)
            cursors.append(opened)
        points[str(size)] = {
            "waiters": size,
            "wake": summary(wakes),
            "ops": ops,
            **_per_release(ops, releases),
            "cursors": max(cursors),
        }
    holder.close()
    waiting.close()
    client.close()
    return {"points": points, "spacing": SPACING}


def _wake_keys(
    client: MongoClient[dict[str, Any]],
    holder: LockManager,
    waiting: LockManager,
    keys: list[str],
    idle: int,
) -> tuple[list[float], dict[str, int], int]:
    """One pass: hold ``keys``, queue a thread on each, release them one by one."""
    held = [holder.acquire(key, blocking=False) for key in keys]
    returned: dict[str, float] = {}
    got: list[Any] = []

    def wait(key: str) -> None:
        lock = waiting.acquire(key, timeout=120)
        returned[key] = time.monotonic()
        got.append(lock)

    threads = [threading.Thread(target=wait, args=(key,), daemon=True) for key in keys]
    for thread in threads:
        thread.start()
    _wait_queued(client, keys, 1)
    opened = _open_cursors(client) - idle
    before = server_counters(client)
    released: dict[str, float] = {}
    for key, lock in zip(keys, held, strict=True):
        released[key] = time.monotonic()
        lock.release()
        time.sleep(SPACING)
    for thread in threads:
        thread.join(120)
    after = server_counters(client)
    for lock in got:
        lock.release()
    if len(returned) != len(keys):
        raise RuntimeError(f"{len(keys) - len(returned)} waiter(s) never returned")
    return [returned[key] - released[key] for key in keys], _ops(before, after), opened


def _wait_queued(client: MongoClient[dict[str, Any]], keys: list[str], each: int) -> None:
    """Until every key has ``each`` waiters in line (bounded)."""
    collection = client[DATABASE]["scale_keys"]
    query = {"_id": {"$in": keys}, "$expr": {"$gte": [{"$size": queries.LIVE_WAITERS}, each]}}
    deadline = time.monotonic() + 120
    while collection.count_documents(query) < len(keys):
        if time.monotonic() > deadline:
            raise RuntimeError("the waiters did not all get in line")
        time.sleep(0.05)


# -- processes: P processes on one key --------------------------------------------------------


def waves(parties: int, first: int = 4) -> list[int]:
    """The warm-up rounds' sizes: ``parties`` halved until ``first``, smallest first."""
    sizes = [parties]
    while sizes[0] > first:
        sizes.insert(0, max(first, sizes[0] // 2))
    return sizes


def processes_point(
    url: str, spec: Spec, parties: int, seconds: float, hold: float
) -> dict[str, Any]:
    """``parties`` fresh processes blocking on one key for ``seconds``; wake-ups and costs."""
    client: MongoClient[dict[str, Any]] = MongoClient(url)
    before = _open_cursors(client)
    pool = Pool(parties)
    try:
        # Every process connected as it comes up, then short rounds of more and more of
        # them, each opening its change stream while those before it already stream: a
        # server on a small machine, asked for hundreds of new streams in one instant, may
        # not answer some within the operations' time limit. Idle streams stay open.
        pool.run(Job("connect", spec, parties=parties))
        # A call of theirs that timed out may leave a place or a lease that holds up the
        # measured round: it is counted with the point's.
        warm_up = 0
        for wave in waves(parties):
            rounds = pool.run(Job("handoff", spec, parties=wave, duration=0.5, hold=hold))
            warm_up += sum(worker["timeouts"] for worker in rounds.workers)
        idle = server_counters(client)
        with _peak_cursors(client) as samples:
            done = pool.run(Job("handoff", spec, parties=parties, duration=seconds, hold=hold))
        after = server_counters(client)
    finally:
        pool.close()
        client.close()
    turns = sorted(
        (t1, t2, worker["worker"])
        for worker in done.workers
        for _t0, t1, t2, _t3 in worker["records"]
    )
    gaps = [b[0] - a[1] for a, b in itertools.pairwise(turns)]
    arrival, settled, releases, arriving = after_arrival(done.workers)
    ops = _ops(idle, after)
    counts = [len(worker["records"]) for worker in done.workers]
    return {
        "waiters": parties,
        "wake": summary(gaps),
        "arrival": arrival,
        "wake_settled": summary(settled),
        "release": summary(releases),
        "release_arriving": summary(arriving),
        "ops": ops,
        **_per_release(ops, len(turns)),
        "cursors": max(samples, default=idle["cursors"]) - before,
        "rate": len(turns) / seconds,
        "to_other": sum(a[2] != b[2] for a, b in itertools.pairwise(turns)) / max(1, len(gaps)),
        "fewest": min(counts) / (sum(counts) / len(counts)) if sum(counts) else 0.0,
        "lost": len(turns) - done.counted,
        "overlaps": done.overlaps,
        "timeouts": warm_up + sum(worker["timeouts"] for worker in done.workers),
    }


def after_arrival(
    workers: Sequence[dict[str, Any]],
) -> tuple[float, list[float], list[float], list[float]]:
    """The run once every process has asked for the key: how long they took to ask
    (from the first call to ``acquire`` to the last process's first), then the wake-ups
    and the release calls' times of the releases that began at or after that, and the
    release calls' times of those that began before it (while other processes were still
    calling ``acquire``).

    They set what each release costs once every process waits in line (its document,
    and the write that hands it on, grow with the places in it) apart from the start,
    when all of them call at once. The last to ask may still be joining just after:
    the split is by the calls, not by the joins' writes. Each process's first call
    counts, whether it returned or timed out.
    """
    firsts = [w["asked"] for w in workers]
    if not firsts:
        return math.nan, [], [], []
    asked = max(firsts)
    turns = sorted((t1, t2, t3) for w in workers for _t0, t1, t2, t3 in w["records"])
    wakes = [b[0] - a[1] for a, b in itertools.pairwise(turns) if a[1] >= asked]
    releases = [t3 - t2 for _t1, t2, t3 in turns if t2 >= asked]
    arriving = [t3 - t2 for _t1, t2, t3 in turns if t2 < asked]
    return asked - min(firsts), wakes, releases, arriving


def run(
    url: str,
    spec: Spec,
    keys: Sequence[int],
    processes: Sequence[int],
    seconds: float,
    hold: float,
    say: Any,
    reference: Spec | None = None,
) -> dict[str, Any]:
    """Every shape, each size in turn (the keys shape in a fresh process of its own);
    ``reference``, python-redis-lock's processes on one key, the machine's own limit."""
    from benchmarks.probes import run_fresh

    result: dict[str, Any] = {
        "hold": hold,
        "seconds": seconds,
        "cores": len(os.sched_getaffinity(0)),
        "process_counts": list(processes),
    }
    if keys:
        result["keys"] = run_fresh(keys_probe, url, list(keys))
        for point in result["keys"]["points"].values():
            say(f"  {point['waiters']} waiters on as many keys: {_line(point)}")
    shapes = [("processes", spec), ("relay", replace(spec, shared_stream=True))]
    if reference is not None:
        shapes.append(("redis", reference))
    for shape, each in shapes:
        points: dict[str, Any] = {}
        for parties in processes:
            points[str(parties)] = point = processes_point(url, each, parties, seconds, hold)
            say(f"  {parties} {SHAPES[shape]}: {_line(point, ours=shape not in REFERENCES)}")
        result[shape] = {"points": points}
    return result


def _line(point: dict[str, Any], ours: bool = True) -> str:
    wake = point["wake"]
    timed_out = f", {point['timeouts']} calls timed out" if point.get("timeouts") else ""
    if not ours:
        return f"wake-up p50 {ms(wake['p50'])}, p99 {ms(wake['p99'])}{timed_out}"
    settled = (
        f" (after the {ms(point['arrival'], 0)} arrival: p99 "
        f"{ms(point['wake_settled']['p99'])}, release p50 {ms(point['release']['p50'])};"
        f" during it, release p50 {_arriving(point.get('release_arriving'))})"
        if "arrival" in point
        else ""
    )
    return (
        f"wake-up p50 {ms(wake['p50'])}, p99 {ms(wake['p99'])}{settled}, "
        f"{point['ops_per_release']:.1f} ops and {point['writes_per_release']:.1f} writes "
        f"per release, {_optional(point.get('conflicts_per_write'), 2)} write conflicts per "
        f"write, {point['cursors']} cursors{timed_out}"
    )


# -- targets, report and plot -----------------------------------------------------------------


def targets(data: dict[str, Any]) -> list[tuple[str, str, str, float, bool]]:
    """(target, goal, figure, ratio, met): wake-up p99 at the most waiters vs the fewest;
    for the processes shapes, the figure also gives python-redis-lock's at the same two
    counts (``_redis_reference``), which the verdict does not use."""
    rows = []
    for shape, title in SHAPES.items():
        if shape in REFERENCES:
            continue
        points = data.get(shape, {}).get("points", {})
        if len(points) < 2:
            continue
        ordered = sorted(points.values(), key=lambda p: p["waiters"])
        first, last = ordered[0], ordered[-1]
        value = last["wake"]["p99"] / first["wake"]["p99"]
        # A call that timed out is a failure the wake-ups leave out: no target is met with
        # one at any size (results recorded before they were counted say nothing of them).
        counted = any("timeouts" in point for point in ordered)
        timeouts = sum(point.get("timeouts", 0) for point in ordered)
        rows.append(
            (
                f"scale: {last['waiters']} {title}, wake-up p99",
                f"≤ {WAKE_GOAL:g}x the {first['waiters']}-waiter case"
                + (", no call timed out" if counted else ""),
                f"{ms(last['wake']['p99'], 1)} vs {ms(first['wake']['p99'], 1)}"
                + (f"; {timeouts} calls timed out" if timeouts else "")
                + (
                    _redis_reference(data, first["waiters"], last["waiters"])
                    if shape in ON_ONE_KEY
                    else ""
                ),
                value,
                value <= WAKE_GOAL and not timeouts,
            )
        )
    return rows


def _redis_reference(data: dict[str, Any], fewest: int, most: int) -> str:
    """python-redis-lock's wake-up p99 at the same two counts of processes, on the same
    cores in the same run (a lock that keeps no line and wakes one waiter per release);
    nothing when it was not timed at both, or a call of its timed out (its p99 would
    leave that call out)."""
    points = data.get("redis", {}).get("points", {})
    low, high = points.get(str(fewest)), points.get(str(most))
    if not (low and high) or low.get("timeouts") or high.get("timeouts"):
        return ""
    value = ratio(high["wake"]["p99"], low["wake"]["p99"])
    if math.isnan(value):
        return ""
    return (
        f"; python-redis-lock {ms(high['wake']['p99'], 2)} vs "
        f"{ms(low['wake']['p99'], 2)} ({value:.2f}x)"
    )


def render(data: dict[str, Any], image: str | None) -> list[str]:
    lines = [
        "## 7. Scale",
        "",
        "*Keys*: one process, one thread waiting on each of W keys "
        "that another client holds; the keys are released one by one "
        f"({SPACING * 1000:g} ms apart) and each wake-up runs from the release call to the "
        "waiter's return from `acquire`. *Processes*: P processes block on one key, "
        f"holding it {data['hold'] * 1000:g} ms, for {data['seconds']:g} s, after each "
        "took a key of its own as it came up (its connections open) and 0.5 s rounds "
        "of more and more of them (their change streams open); a wake-up is "
        "the gap from a holder's release call to the next holder's return (both on "
        "CLOCK_MONOTONIC, shared by the processes of one host). *Arrival*: from the "
        "first process's call to `acquire` to the last one's, all starting together; "
        "*p99 after arrival* and *release p50 after arrival* count only the releases "
        "that began at or after it (a release call's time is mostly its handing write): "
        "they set what each release costs once every process has asked apart from the "
        "start, when all of them call at once. *Release p50 during arrival* counts the "
        "release calls that began before it, while other processes were still calling "
        "`acquire` (how many, in parentheses). *Ops per release*: every "
        "operation the server counted (`serverStatus().opcounters`: writes, reads, "
        "commands, change-stream getMores of every process) over the releases, divided by "
        "them. *Writes per release*: the server's write commands alone "
        "(`serverStatus().metrics.commands`: insert, update, delete, findAndModify), about "
        "the writes that wake every open change stream (one that changes nothing wakes "
        "none; one that changes many documents counts once). *Write conflicts per write*: the "
        "server's count of writes it undid and ran again because another write was "
        "changing the same document (`serverStatus().metrics.operation.writeConflicts`), "
        "divided by the write commands: how often the joins, renewals and handing releases "
        "of one key collide on its document. *Cursors*: the most cursors "
        "open on the server while they wait, over its count before the waiters' processes "
        "and clients started (change streams among them). *Calls timed out*: the lock "
        "calls of the processes, in the measured round and the rounds before it, that "
        "the server did not answer within their time limit (5 s for django-mongolock's); "
        "each is counted and its process goes on, an acquire that timed out has no "
        "wake-up, and no target is met with one (the keys shape does not count them). "
        "*Relay*: the processes shape "
        "again with `SHARED_STREAM` on, so that one process per host opens the change "
        "stream and passes the events on to the others over a local socket. *Redis*: "
        "python-redis-lock's processes on one key, for the limit of this machine (the "
        "server counters and cursors are MongoDB's: n/a).",
        "",
        f"The machine has {data['cores']} cores, shared by the server and every waiting "
        "process: at the largest counts, scheduling that many processes on them is part "
        "of each figure. A handoff wakes only the new holder's process and the new head's "
        "(the others renew their places every 5 s while they wait, which the ops per "
        "release would include; a line that turns over within that renews none).",
        "",
    ]
    rows = []
    for shape in SHAPES:
        for point in sorted(data.get(shape, {}).get("points", {}).values(), key=_waiters):
            ops = point["ops"]
            wake = point["wake"]
            figures = [shape, str(point["waiters"]), ms(wake["p50"], 2), ms(wake["p99"], 2)]
            figures += _arrived(point)
            timed_out = str(point["timeouts"]) if "timeouts" in point else "n/a"
            if shape in REFERENCES:
                rows.append([*figures, *["n/a"] * 5, timed_out])
                continue
            rows.append(
                [
                    *figures,
                    f"{point['ops_per_release']:.1f}",
                    _optional(point.get("writes_per_release")),
                    _optional(point.get("conflicts_per_write"), 2),
                    ", ".join(f"{name} {ops[name]}" for name in OPS if ops[name]),
                    str(point["cursors"]),
                    timed_out,
                ]
            )
    header = [
        "shape",
        "waiters",
        "wake-up p50",
        "wake-up p99",
        "p99 after arrival",
        "release p50 after arrival",
        "release p50 during arrival",
        "arrival",
        "ops per release",
        "writes per release",
        "write conflicts per write",
        "ops",
        "cursors",
        "calls timed out",
    ]
    lines += _table(header, rows)
    if image:
        lines += [f"![Wake-up and server operations per release against waiters]({image})", ""]
    if "line" in data:
        lines += line_cost.render(data["line"])
    return lines


def _arrived(point: dict[str, Any]) -> list[str]:
    """Wake-up p99 and release p50 after every process asked, release p50 (and count)
    before, and the time they took to ask; "n/a" for the keys shape, and in results
    recorded before they were measured."""
    if "arrival" not in point:
        return ["n/a"] * 4
    return [
        ms(point["wake_settled"]["p99"], 2),
        ms(point["release"]["p50"], 2),
        _arriving(point.get("release_arriving")),
        ms(point["arrival"], 0),
    ]


def _arriving(release: dict[str, float] | None) -> str:
    """The release p50 while the processes were still asking, with how many there were."""
    if release is None:
        return "n/a"
    if not release["n"]:
        return "none"
    return f"{ms(release['p50'], 2)} ({release['n']:.0f})"


def _optional(value: float | None, digits: int = 1) -> str:
    """A figure, or "n/a" in results recorded before it was measured."""
    return "n/a" if value is None else f"{value:.{digits}f}"


def _waiters(point: dict[str, Any]) -> int:
    return int(point["waiters"])


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines.extend("| " + " | ".join(row) + " |" for row in rows)
    return [*lines, ""]


def plot(data: dict[str, Any], path: Path) -> bool:
    """Wake-up p50/p99 and ops per release against waiters, both shapes; False without
    matplotlib."""
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError:
        return False
    matplotlib.use("Agg")
    pyplot = importlib.import_module("matplotlib.pyplot")
    figure, (waits, costs) = pyplot.subplots(1, 2, figsize=(10, 4.2), dpi=110)
    for shape, colour in (
        ("keys", "tab:blue"),
        ("processes", "tab:orange"),
        ("relay", "tab:green"),
        ("redis", "tab:red"),
    ):
        points = sorted(data.get(shape, {}).get("points", {}).values(), key=_waiters)
        if not points:
            continue
        xs = [p["waiters"] for p in points]
        label = PLOT_LABELS[shape]
        for q, style in (("p50", "-o"), ("p99", "--s")):
            ys = [p["wake"][q] * 1000 for p in points]
            waits.plot(xs, ys, style, color=colour, label=f"{label}: {q}")
        if shape not in REFERENCES:
            ops = [p["ops_per_release"] for p in points]
            costs.plot(xs, ops, "-o", color=colour, label=label)
    for axes in (waits, costs):
        axes.set_xscale("log")
        axes.set_xlabel("waiters")
        axes.grid(True, which="both", linewidth=0.3)
        axes.legend(fontsize="x-small")
    waits.set_ylabel("wake-up, release call to acquire return (ms)")
    waits.set_yscale("log")
    costs.set_ylabel("server operations per release")
    costs.set_ylim(bottom=0)
    figure.suptitle("django-mongolock: wake-up and server cost against waiters")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    pyplot.close(figure)
    return True
