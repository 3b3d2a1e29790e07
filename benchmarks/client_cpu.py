"""What one uncontended cycle costs the calling thread's CPU, layer by layer, beside the floor.

``python -m benchmarks.client_cpu [BLOCKS [CYCLES]]`` (default 12 blocks of 500 cycles):
in one thread, five ways of taking and releasing a random key out of 1,000 take turns,
cycle by cycle (in an order shuffled every cycle), so that all five meet the same
moments of a shared machine:

* ``ours``: ``LockManager.acquire(key, blocking=False)`` and ``release()``, with the
  manager's defaults: everything a caller's thread runs;
* ``ours, no limit``: the same with the operation limit lifted around the cycle
  (``lifted``, whose patch, a microsecond or two, is timed with it). A reference for
  what the limit costs, not a configuration the manager offers: the limit is what keeps
  a lock call from hanging;
* ``store alone``: the same manager's store, ``acquire`` and ``release``: the one write
  each, with its limit, and the reply read into a ``LockInfo``, without the lease, the
  refresher, the deadline watch, the signals or the observers; and ``store alone, no
  limit``;
* ``floor``: the raw driver's lock (``benchmarks.contenders``).

Each cycle is timed by the thread's CPU clock (``time.thread_time_ns``), and its
voluntary context switches counted (``getrusage(RUSAGE_THREAD)``, Linux). Per block, the
mean per cycle; the table gives the median over blocks (min to max), and each way's
difference to the floor taken block by block. Every cycle must take its key: a refused
one stops the probe.

``python -m benchmarks.client_cpu --only WAY [CYCLES]`` (default 1,000 cycles) runs one
way alone (``ours``, ``unlimited``, ``store``, ``store-unlimited`` or ``floor``), for a
tracer or a profiler of the calling thread: for example ``strace -c`` (without ``-f``,
the main thread only) or ``py-spy record``.

``python -m benchmarks.client_cpu --processes [N [ROUNDS [SECONDS]]]`` (default 4
processes, 6 rounds of 3 s) is the shape of the many-keys workload: N processes try
random keys out of 1,000 and release at once, with ours, the floor and the floor on a
collection with ours' TTL index taking turns by round. Per acquisition, the CPU of the
processes (every thread) and of the server, a ``mongod`` of this host: where two cores
are shared by clients and server, their sum sets the rate.

``python -m benchmarks.client_cpu --replayed [BLOCKS [CYCLES]]`` (default 6 blocks of
2,000 cycles) runs the whole call with the manager's store answering from a reply it
recorded from the server (``replayed``): the layers above the store, with no I/O of the
calling thread's. Three orders: cycles back to back (the code run again and again, as
warm as it gets), each after a floor cycle (as in a real cycle, where the driver's work
comes between), and each after a sleep of 0.5 ms. Per block, the median per cycle.

Against the server in ``MONGOLOCK_URL``, or a development server started for the run.
See docs/performance.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import random
import resource
import secrets
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from typing import Any, Final

from pymongo import MongoClient

from benchmarks.contenders import DATABASE, TTL, Contender, Spec, build
from benchmarks.idle_streams import local_mongod, server_cpu
from benchmarks.markdown import span, table, x
from benchmarks.servers import mongo_server
from benchmarks.workloads import deployed, ttl_indexed
from django_mongolock import LockInfo, LockManager, LockNotAcquired, mongo

__all__ = ["drop_collections", "floor_cycle", "main", "measure", "report", "spin"]

KEYS: Final = 1000
WAYS: Final = ("ours", "unlimited", "store", "store-unlimited", "floor")
LABELS: Final = {
    "ours": "ours",
    "unlimited": "ours, no limit",
    "store": "store alone",
    "store-unlimited": "store alone, no limit",
    "floor": "floor",
}
COLLECTION: Final = "client-cpu"
# Bounds every wait on a worker process.
BOUND: Final = 120.0

Cycle = Callable[[str], None]


@contextlib.contextmanager
def lifted() -> Iterator[None]:
    """No operation limit inside: ``mongo.operation_limit`` patched to 0, so that the store
    enters ``pymongo.timeout(0)``, which sets no deadline and keeps the client's
    ``timeoutMS`` from applying. Process-wide while inside: a refresher write that runs
    meanwhile is unlimited too."""
    limit = mongo.operation_limit
    mongo.operation_limit = lambda options: 0.0
    try:
        yield
    finally:
        mongo.operation_limit = limit


def _refused(way: str, key: str) -> RuntimeError:
    # A key still held (by a run killed within the lease) would make a cycle cheaper.
    return RuntimeError(f"{way}: {key!r} was refused; every cycle must take its key")


@contextlib.contextmanager
def manager_and_floor(url: str) -> Iterator[tuple[LockManager, Contender]]:
    """One manager and the floor, on its own client."""
    with contextlib.ExitStack() as stack:
        manager = stack.enter_context(
            LockManager(url, database=DATABASE, collection=COLLECTION, ttl=TTL)
        )
        floor = build(Spec("floor", "floor", url, collection=f"{COLLECTION}-floor"))
        stack.callback(floor.close)
        yield manager, floor


def spin(seconds: float) -> None:
    """Keep the thread busy (holding the GIL, as code would) for ``seconds``."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def floor_cycle(floor: Contender, think: float = 0.0) -> Cycle:
    """The floor's cycle: take ``key`` and release it, the thread kept busy ``think``
    seconds before each of the two writes (``spin``); a refused key stops the probe."""

    def floored(key: str) -> None:
        if think:
            spin(think)
        handle = floor.try_acquire(key)
        if handle is None:
            raise _refused("floor", key)
        if think:
            spin(think)
        floor.release(handle)

    return floored


@contextlib.contextmanager
def _ways(url: str) -> Iterator[dict[str, Cycle]]:
    """The ways' cycles, on one manager and the floor's own client."""
    with manager_and_floor(url) as (manager, floor):
        store = manager.store

        def ours(key: str) -> None:
            try:
                manager.acquire(key, blocking=False).release()
            except LockNotAcquired:
                raise _refused("ours", key) from None

        def unlimited(key: str) -> None:
            with lifted():
                ours(key)

        def alone(key: str) -> None:
            owner = manager.new_owner()
            info = store.acquire(key, owner, TTL)
            if info.owner != owner:
                raise _refused("store", key)
            store.release(key, owner, info.token)

        def alone_unlimited(key: str) -> None:
            with lifted():
                alone(key)

        floored = floor_cycle(floor)

        yield {
            "ours": ours,
            "unlimited": unlimited,
            "store": alone,
            "store-unlimited": alone_unlimited,
            "floor": floored,
        }


def random_key() -> str:
    return f"k{random.randrange(KEYS)}"


@dataclass(frozen=True, slots=True)
class Usage:
    """A way's cost per cycle over one block: the thread's CPU time (µs) and its
    voluntary context switches."""

    cpu: float
    switches: float


def measure(url: str, blocks: int, cycles: int) -> dict[str, list[Usage]]:
    """Per way, per block, what a cycle cost. A first block warms the connections up and
    is left out.

    The CPU time is the thread's CPU clock, which counts the running slice up to the
    moment it is read: a way's work after its last reply is its own, not the next way's
    (the thread's ``getrusage`` times would move only at its next sleep or tick).
    """
    usage: dict[str, list[Usage]] = {way: [] for way in WAYS}
    order = list(WAYS)
    clock = time.thread_time_ns
    with _ways(url) as ways:
        for block in range(blocks + 1):
            spent = dict.fromkeys(WAYS, 0)
            switched = dict.fromkeys(WAYS, 0)
            for _ in range(cycles):
                random.shuffle(order)  # no way follows the same one every time
                for way in order:
                    cycle, key = ways[way], random_key()
                    slept = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
                    started = clock()
                    cycle(key)
                    spent[way] += clock() - started
                    switched[way] += resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw - slept
            if block:
                for way in WAYS:
                    usage[way].append(Usage(spent[way] / cycles / 1e3, switched[way] / cycles))
    return usage


def report(usage: dict[str, list[Usage]]) -> list[str]:
    """A markdown table: each way's cost per cycle and its difference to the floor's,
    taken block by block."""
    floor = usage["floor"]
    rows = []
    for way in WAYS:
        mine = usage[way]
        above = [m.cpu - f.cpu for m, f in zip(mine, floor, strict=True)]
        rows.append(
            [
                LABELS[way],
                span([m.cpu for m in mine]),
                span(above) if way != "floor" else "",
                span([m.switches for m in mine], 2),
            ]
        )
    header = ["way", "CPU µs/cycle", "above the floor, µs", "voluntary switches/cycle"]
    return table(header, rows)


@contextlib.contextmanager
def replayed(manager: LockManager) -> Iterator[None]:
    """Inside, the manager's store answers every acquire (with the exclusive lock it
    recorded from the server) and every release at once: the layers above the store run
    as they do for an exclusive lock, with no I/O. A reference for what those layers
    cost, not a way to take a lock."""
    store = manager.store
    owner, key = manager.new_owner(), f"replayed-{secrets.token_hex(4)}"
    reply = store.acquire(key, owner, TTL)
    if reply.owner != owner:
        raise _refused("replayed", key)
    store.release(key, owner, reply.token)

    def acquire(**arguments: Any) -> LockInfo:  # the store is called with keywords only
        return dataclasses.replace(reply, key=arguments["key"], owner=arguments["owner"])

    def release(*arguments: Any, **options: Any) -> bool:
        return True

    # Instance attributes shadow the store's methods for this store alone.
    vars(store).update(acquire=acquire, release=release)
    try:
        yield
    finally:
        for name in ("acquire", "release"):
            vars(store).pop(name)


def replayed_cycle(manager: LockManager) -> None:
    """One cycle of the ``--replayed`` mode: the whole call, with the manager's defaults."""
    manager.acquire("replayed", blocking=False).release()


ORDERS: Final = ("back to back", "after a floor cycle", "after a 0.5 ms sleep")


def measure_replayed(url: str, blocks: int, cycles: int) -> dict[str, list[float]]:
    """Per order, per block, the median thread CPU (µs) of one replayed cycle. A first
    block warms up and is left out."""
    medians: dict[str, list[float]] = {order: [] for order in ORDERS}
    clock = time.thread_time_ns
    with manager_and_floor(url) as (manager, floor):
        floored = floor_cycle(floor)
        between: dict[str, Callable[[], None]] = {
            ORDERS[0]: lambda: None,
            ORDERS[1]: lambda: floored(random_key()),
            ORDERS[2]: lambda: time.sleep(0.0005),
        }
        with replayed(manager):
            for block in range(blocks + 1):
                for order in ORDERS:
                    spent = []
                    for _ in range(cycles):
                        between[order]()
                        started = clock()
                        replayed_cycle(manager)
                        spent.append(clock() - started)
                    if block:
                        medians[order].append(statistics.median(spent) / 1e3)
    return medians


def replayed_report(medians: dict[str, list[float]]) -> list[str]:
    """A markdown table: each order's median per cycle, over blocks."""
    rows = [[order, span(medians[order], 1)] for order in ORDERS]
    return table(["order", "CPU µs/cycle, store replayed"], rows)


def _trying(spec: Spec, seconds: float, ready: Barrier, out: Queue[Any]) -> None:
    """One process of the many-keys shape: acquisitions, and its CPU (s) meanwhile. It
    takes one key before the round starts, so that its connections are up by then."""
    lock = build(spec)
    try:
        handle = lock.try_acquire(random_key())
        if handle is not None:
            lock.release(handle)
        ready.wait(BOUND)  # every worker, and the parent reading the server's CPU
        before, began, acquired = resource.getrusage(resource.RUSAGE_SELF), time.monotonic(), 0
        while time.monotonic() - began < seconds:
            handle = lock.try_acquire(random_key())
            if handle is not None:
                lock.release(handle)
                acquired += 1
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
        out.put((acquired, cpu))
        ready.wait(BOUND)  # the parent reads the server's CPU before anyone closes
    finally:
        lock.close()


@dataclass(frozen=True, slots=True)
class Round:
    """One lock's round of the many-keys shape: acquisitions/s, and the client processes'
    and the server's CPU per acquisition (µs)."""

    rate: float
    client: float
    server: float


def _processes_round(spec: Spec, processes: int, seconds: float, server: int) -> Round:
    context = multiprocessing.get_context("spawn")
    ready, out = context.Barrier(processes + 1), context.Queue()
    workers = [
        context.Process(target=_trying, args=(spec, seconds, ready, out)) for _ in range(processes)
    ]
    for worker in workers:
        worker.start()
    try:
        ready.wait(BOUND)
        served = server_cpu(server)
        done = [out.get(timeout=BOUND + seconds) for _ in workers]
        served = server_cpu(server) - served
        ready.wait(BOUND)
        for worker in workers:
            worker.join(BOUND)
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.terminate()
                worker.join(BOUND)
        out.close()
    acquired = sum(n for n, _ in done)
    if not acquired:
        raise RuntimeError(f"{spec.label}: no process took a key in {seconds:g} s")
    client = sum(cpu for _, cpu in done)
    return Round(acquired / seconds, client / acquired * 1e6, served / acquired * 1e6)


def processes(url: str, count: int, rounds: int, seconds: float) -> dict[str, list[Round]]:
    """The many-keys shape: per lock, its rounds, the locks taking turns."""
    client: MongoClient[dict[str, Any]]
    with MongoClient(url) as client:
        server = local_mongod(client)
    ttl_indexed(url, f"{COLLECTION}-ttl")
    deployed(url, COLLECTION)
    specs = {
        "floor": Spec("floor", "floor", url, collection=f"{COLLECTION}-floor"),
        "floor + TTL index": Spec("ttl", "floor", url, collection=f"{COLLECTION}-ttl"),
        "ours": Spec("ours", "ours", url, collection=COLLECTION, blocking=False),
    }
    rows: dict[str, list[Round]] = {label: [] for label in specs}
    labels = list(specs)
    for number in range(rounds):
        turn = number % len(labels)
        for label in labels[turn:] + labels[:turn]:
            rows[label].append(_processes_round(specs[label], count, seconds, server))
    return rows


def processes_report(rows: dict[str, list[Round]]) -> list[str]:
    """A markdown table: medians of the rounds, then ours against the floor that keeps the
    same index, round by round: what the code adds."""
    cells = [
        [
            label,
            span([r.rate for r in measured]),
            span([r.client for r in measured]),
            span([r.server for r in measured]),
            span([r.client + r.server for r in measured]),
        ]
        for label, measured in rows.items()
    ]
    paired = list(zip(rows["ours"], rows["floor + TTL index"], strict=True))
    cells.append(
        [
            "ours above the floor + TTL index (by round)",
            span([m.rate / f.rate for m, f in paired], cell=x),
            span([m.client - f.client for m, f in paired]),
            span([m.server - f.server for m, f in paired]),
            span([m.client + m.server - f.client - f.server for m, f in paired]),
        ]
    )
    header = [
        "lock",
        "acquisitions/s",
        "client CPU µs/acquisition",
        "server CPU µs/acquisition",
        "both",
    ]
    return table(header, cells)


def _only(url: str, way: str, cycles: int) -> str:
    """``cycles`` of one way, for a tracer or a profiler."""
    with _ways(url) as ways:
        for _ in range(cycles):
            ways[way](random_key())
    return f"{cycles} cycles of {LABELS[way]}"


USAGE: Final = (
    "[BLOCKS [CYCLES]], --replayed [BLOCKS [CYCLES]], --only WAY [CYCLES] "
    "or --processes [N [ROUNDS [SECONDS]]]"
)


def _arguments(argv: Sequence[str]) -> tuple[str, list[int]]:
    """The mode (a way for ``--only``, ``--processes``, ``--replayed`` or empty) and its
    numbers."""
    mode, rest, most = "", list(argv), 2
    if rest[:1] == ["--only"]:
        if len(rest) < 2 or rest[1] not in WAYS:
            raise SystemExit(f"--only takes one of {', '.join(WAYS)}")
        mode, rest, most = rest[1], rest[2:], 1
    elif rest[:1] == ["--processes"]:
        mode, rest, most = rest[0], rest[1:], 3
    elif rest[:1] == ["--replayed"]:
        mode, rest = rest[0], rest[1:]
    if len(rest) > most or not all(a.isdigit() and int(a) > 0 for a in rest):
        raise SystemExit(f"expected {USAGE}, not {' '.join(argv)!r}")
    return mode, [int(a) for a in rest]


def _run(url: str, mode: str, numbers: list[int]) -> list[str]:
    if mode == "--processes":
        count, rounds, seconds = (numbers + [4, 6, 3][len(numbers) :])[:3]
        head = f"{count} processes, {rounds} rounds of {seconds} s"
        return [head, *processes_report(processes(url, count, rounds, seconds))]
    if mode == "--replayed":
        blocks, cycles = (numbers + [6, 2000][len(numbers) :])[:2]
        measured = measure_replayed(url, blocks, cycles)
        return [f"{blocks} blocks of {cycles} cycles", *replayed_report(measured)]
    if mode:
        return [_only(url, mode, numbers[0] if numbers else 1000)]
    blocks, cycles = (numbers + [12, 500][len(numbers) :])[:2]
    return [f"{blocks} blocks of {cycles} cycles", *report(measure(url, blocks, cycles))]


def drop_collections(url: str, prefix: str = COLLECTION) -> None:
    """Drop the collections of the bench database whose names start with ``prefix``
    (this probe's, ``client-cpu...``, by default)."""
    cleaner: MongoClient[dict[str, Any]]
    with MongoClient(url) as cleaner:
        for name in cleaner[DATABASE].list_collection_names():
            if name.startswith(prefix):
                cleaner[DATABASE].drop_collection(name)


@contextlib.contextmanager
def probe_server() -> Iterator[str]:
    """The URL of the server in ``MONGOLOCK_URL``, or of one started for the probe, its
    version printed; the probe's collections are dropped after."""
    with mongo_server() as server:
        try:
            print(f"MongoDB {server.version} ({server.topology})")
            yield server.url
        finally:
            drop_collections(server.url)


def main(argv: Sequence[str] | None = None) -> int:
    mode, numbers = _arguments(sys.argv[1:] if argv is None else argv)
    with probe_server() as url:
        print("\n".join(_run(url, mode, numbers)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
