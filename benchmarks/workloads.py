"""The timed workloads, run round by round against the same servers, and what they need."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from pymongo import MongoClient

from benchmarks import handoff_parts, instruments, line_cost, report
from benchmarks import scale as scaling
from benchmarks.contenders import DATABASE, Spec
from benchmarks.labels import INSTRUMENTED
from benchmarks.probes import admin_probe, footprint_probe, run_fresh
from benchmarks.refreshing import refresh_probe
from benchmarks.servers import MongoServer, RedisServer
from benchmarks.stats import ratio, spread, summary
from benchmarks.workers import Job, Pool
from django_mongolock import LockManager

__all__ = [
    "FULL",
    "HOLD",
    "PROCESSES",
    "QUICK",
    "WORKLOADS",
    "Bench",
    "Plan",
    "deployed",
    "say",
    "ttl_indexed",
]

PROCESSES: Final = 4
HOLD: Final = 0.005
# Uncontended acquisitions timed in each handoff round: the unit of the gap's target.
ALONE_CYCLES: Final = 100
# The handoff's limit, timed after each round: raw majority updates, each after a hold,
# and their change events in another process (the first ``handoff_parts.WARM_UP`` left out).
LIMIT_WRITES: Final = handoff_parts.WARM_UP + 80


@dataclass(frozen=True, slots=True)
class Plan:
    """How much of each workload a run does."""

    mode: str
    rounds: int
    cycles: int
    handoff_rounds: int
    handoff_seconds: float
    many_rounds: int
    many_seconds: float
    many_keys: int
    refresh_sizes: tuple[int, ...]
    refresh_ticks: int
    admin_documents: int
    admin_requests: int
    scale_keys: tuple[int, ...] = ()
    scale_processes: tuple[int, ...] = ()
    scale_seconds: float = 3.0
    line_places: tuple[int, ...] = ()
    line_turns: int = 7


# Many short interleaved rounds rather than a few long ones: a ratio is taken between
# contenders that ran seconds apart, so a slow spell of a shared machine moves both.
FULL: Final = Plan(
    mode="full",
    rounds=24,
    cycles=400,
    handoff_rounds=3,
    handoff_seconds=5.0,
    many_rounds=10,
    many_seconds=2.0,
    many_keys=1000,
    refresh_sizes=(1000, 10000),
    refresh_ticks=32,  # even: tick and raw write go first equally often
    admin_documents=10000,
    admin_requests=15,
    scale_keys=(4, 50, 500),
    scale_processes=(4, 16, 48),
    scale_seconds=3.0,
    line_places=line_cost.LINES,
    line_turns=7,
)
QUICK: Final = Plan(
    mode="quick",
    rounds=2,
    cycles=300,
    handoff_rounds=2,
    handoff_seconds=1.5,
    many_rounds=2,
    many_seconds=1.5,
    many_keys=1000,
    refresh_sizes=(500, 2000),
    refresh_ticks=3,
    admin_documents=10000,
    admin_requests=5,
    scale_keys=(4, 100),
    scale_processes=(4, 12),
    scale_seconds=1.5,
    line_places=(4, 64, 200),
    line_turns=3,
)


def deployed(url: str, collection: str) -> None:
    """Ours' collection as deployed: its indexes made, as ``migrate_mongolock`` makes them."""
    with LockManager(url, database=DATABASE, collection=collection) as manager:
        manager.ensure_indexes()


def ttl_indexed(url: str, collection: str) -> None:
    """A floor's collection with the TTL index on ``expires_at`` that ours has."""
    client: MongoClient[dict[str, Any]]
    with MongoClient(url) as client:
        client[DATABASE][collection].create_index("expires_at", expireAfterSeconds=3600)


@dataclass
class Bench:
    """What every workload needs: the plan, the servers and the worker pool."""

    plan: Plan
    mongo: MongoServer
    redis: RedisServer | None
    pool: Pool
    processes: int = PROCESSES
    hold: float = HOLD
    results: dict[str, Any] = field(default_factory=dict)

    def spec(self, label: str, kind: str, collection: str, **options: Any) -> Spec:
        url = self.redis.url if kind == "redis" and self.redis is not None else self.mongo.url
        return Spec(label=label, kind=kind, url=url, collection=collection, **options)  # type: ignore[arg-type]

    def ours(self, collection: str, label: str = report.OURS, **options: Any) -> Spec:
        spec = self.spec(label, "ours", collection, **options)
        deployed(self.mongo.url, collection)
        return spec

    def floor_with_ttl(self, collection: str) -> Spec:
        """The floor on a collection with the TTL index on ``expires_at`` that ours has.

        A reference row, not a target: it shows what the index that purges the documents
        of crashed holders costs any MongoDB lock, whatever its code.
        """
        ttl_indexed(self.mongo.url, collection)
        return self.spec(report.FLOOR_TTL, "floor", collection)

    def peers(self, collection: str) -> list[Spec]:
        if self.redis is None:
            return []
        return [self.spec(report.REDIS, "redis", collection)]


def _rotations(specs: Sequence[Spec], rounds: int) -> list[list[Spec]]:
    """Each round's order: rotated, so that no contender always runs first or last."""
    count = len(specs)
    return [[specs[(start + r) % count] for start in range(count)] for r in range(rounds)]


def say(message: str) -> None:
    print(message, flush=True)


# -- 1. uncontended ---------------------------------------------------------------------------


def _cycle_rounds(
    bench: Bench, specs: Sequence[Spec], *, fresh: bool = False
) -> dict[str, dict[str, Any]]:
    """Uncontended acquire+release cycles of every spec, one job each per round, in rotated
    order; per label: cycles/s and CPU seconds per cycle of each round, pooled latencies and
    the safety counts. ``fresh``: each job builds its contender and closes it after."""
    plan = bench.plan
    rows: dict[str, dict[str, Any]] = {
        spec.label: {"cps": [], "cpu": [], "acquire": [], "release": [], "lost": 0, "overlaps": 0}
        for spec in specs
    }
    for number, order in enumerate(_rotations(specs, plan.rounds), 1):
        for spec in order:
            job = Job("uncontended", spec, cycles=plan.cycles, keys=100, fresh=fresh)
            done = bench.pool.run(job)
            worker = done.workers[0]
            row = rows[spec.label]
            row["cps"].append(worker["cycles"] / worker["elapsed"])
            row["cpu"].append(worker["cpu"] / worker["cycles"])
            row["acquire"].extend(worker["acquire"])
            row["release"].extend(worker["release"])
            row["lost"] += worker["cycles"] - done.counted
            row["overlaps"] += done.overlaps
        say(
            f"  round {number}/{plan.rounds}: "
            + ", ".join(f"{s.label} {rows[s.label]['cps'][-1]:.0f}/s" for s in specs)
        )
    return rows


def _against(rows: dict[str, dict[str, Any]], baseline: str) -> None:
    """Each row's time per cycle over ``baseline``'s in the same round (rounds kept in
    order: the baseline ran beside it), then the per-round lists summed up in place."""
    base, base_cpu = rows[baseline]["cps"], rows[baseline]["cpu"]
    for row in rows.values():
        row["time_ratio"] = spread(ratio(b, c) for b, c in zip(base, row["cps"], strict=True))
        row["cpu_added"] = spread(c - b for b, c in zip(base_cpu, row["cpu"], strict=True))
        row["cps"] = spread(row["cps"])
        row["cpu"] = spread(row["cpu"])
        row["acquire"] = summary(row["acquire"])
        row["release"] = summary(row["release"])


def uncontended(bench: Bench) -> dict[str, Any]:
    plan = bench.plan
    specs = [
        bench.spec(report.FLOOR, "floor", "uncontended_floor"),
        bench.floor_with_ttl("uncontended_floor_ttl"),
        bench.ours("uncontended_ours"),
        bench.ours("uncontended_ours", label=report.OURS_TRY, blocking=False),
        *bench.peers("uncontended"),
    ]
    rows = _cycle_rounds(bench, specs)
    _against(rows, report.FLOOR)
    return {"floor": report.FLOOR, "cycles": plan.cycles, "rounds": plan.rounds, "rows": rows}


# -- 2. contended handoff -------------------------------------------------------------------------


def handoff(bench: Bench) -> dict[str, Any]:
    plan = bench.plan
    specs = [
        bench.ours("handoff_ours"),
        bench.spec(report.FLOOR_POLL_10, "floor", "handoff_floor", poll=0.01),
        bench.spec(report.FLOOR_POLL_100, "floor", "handoff_floor", poll=0.1),
        *bench.peers("handoff"),
    ]
    rows: dict[str, dict[str, Any]] = {
        spec.label: {
            "rate": [],
            "waits": [],
            "gaps": [],
            "cross_gaps": [],
            "alone": [],
            "limit": [],
            "limit_write": [],
            "handoffs": 0,
            "to_other": 0,
            "fewest": [],
            "lost": 0,
            "overlaps": 0,
            "timeouts": 0,
        }
        for spec in specs
    }
    for number, order in enumerate(_rotations(specs, plan.handoff_rounds), 1):
        for spec in order:
            row = rows[spec.label]
            if spec.kind == "ours":
                # One uncontended acquire, beside the round: what the gap is measured against.
                alone = bench.pool.run(Job("uncontended", spec, cycles=ALONE_CYCLES, keys=10))
                row["alone"].extend(alone.workers[0]["acquire"])
            job = Job(
                "handoff",
                spec,
                parties=bench.processes,
                duration=plan.handoff_seconds,
                hold=bench.hold,
            )
            done = bench.pool.run(job)
            if spec.kind == "ours":
                # And the limit: one majority write after the same hold, and its event,
                # after the round, with the streams its waiters opened still open.
                floor = handoff_parts.raw(
                    bench.mongo.url, LIMIT_WRITES, database=DATABASE, pause=bench.hold
                )
                row["limit"].extend(floor["limit"])
                row["limit_write"].extend(floor["write"])
            turns = sorted(
                (t1, t2, worker["worker"], t1 - t0)
                for worker in done.workers
                for t0, t1, t2, _t3 in worker["records"]
            )
            row["waits"].extend(wait for _t1, _t2, _w, wait in turns)
            row["gaps"].extend(b[0] - a[1] for a, b in itertools.pairwise(turns))
            row["cross_gaps"].extend(
                b[0] - a[1] for a, b in itertools.pairwise(turns) if a[2] != b[2]
            )
            row["handoffs"] += len(turns) - 1
            row["to_other"] += sum(a[2] != b[2] for a, b in itertools.pairwise(turns))
            counts = [len(worker["records"]) for worker in done.workers]
            row["fewest"].append(min(counts) / (sum(counts) / len(counts)) if sum(counts) else 0.0)
            row["rate"].append(len(turns) / plan.handoff_seconds)
            row["lost"] += len(turns) - done.counted
            row["overlaps"] += done.overlaps
            row["timeouts"] += sum(worker["timeouts"] for worker in done.workers)
        say(
            f"  round {number}/{plan.handoff_rounds}: "
            + ", ".join(f"{s.label} {rows[s.label]['rate'][-1]:.0f}/s" for s in specs)
        )
    for row in rows.values():
        row["rate"] = spread(row["rate"])
        row["wait"] = summary(row["waits"])
        row["gap"] = summary(row["gaps"])
        row["cross_gap"] = summary(row["cross_gaps"])
        row["alone"] = summary(row["alone"])
        row["limit"] = summary(row["limit"])
        row["limit_write"] = summary(row["limit_write"])
        row["other_share"] = row["to_other"] / row["handoffs"] if row["handoffs"] else math.nan
        row["fewest_share"] = min(row["fewest"])
        del row["gaps"], row["cross_gaps"]
    return {
        "floor": report.FLOOR_POLL_10,
        "processes": bench.processes,
        "hold": bench.hold,
        "seconds": plan.handoff_seconds,
        "rounds": plan.handoff_rounds,
        "rows": rows,
    }


# -- 3. many keys -------------------------------------------------------------------------------


def many_keys(bench: Bench) -> dict[str, Any]:
    plan = bench.plan
    specs = [
        bench.spec(report.FLOOR, "floor", "many_floor"),
        bench.floor_with_ttl("many_floor_ttl"),
        bench.ours("many_ours", blocking=False),
        *bench.peers("many"),
    ]
    rows: dict[str, dict[str, Any]] = {
        spec.label: {"rate": [], "tries": [], "busy": [], "lost": 0, "overlaps": 0}
        for spec in specs
    }
    for number, order in enumerate(_rotations(specs, plan.many_rounds), 1):
        for spec in order:
            job = Job(
                "many_keys",
                spec,
                parties=PROCESSES,
                duration=plan.many_seconds,
                keys=plan.many_keys,
                seed=number,
            )
            done = bench.pool.run(job)
            row = rows[spec.label]
            acquired = sum(worker["acquired"] for worker in done.workers)
            tries = sum(worker["tries"] for worker in done.workers)
            elapsed = max(worker["elapsed"] for worker in done.workers)
            row["rate"].append(acquired / elapsed)
            row["tries"].append(tries / elapsed)
            row["busy"].append(1 - acquired / tries if tries else math.nan)
            row["lost"] += acquired - done.counted
            row["overlaps"] += done.overlaps
        say(
            f"  round {number}/{plan.many_rounds}: "
            + ", ".join(f"{s.label} {rows[s.label]['rate'][-1]:.0f}/s" for s in specs)
        )
    floor = rows[report.FLOOR]["rate"]
    for row in rows.values():
        row["rate_ratio"] = spread(ratio(r, f) for r, f in zip(row["rate"], floor, strict=True))
        row["rate"] = spread(row["rate"])
        row["tries"] = spread(row["tries"])
        row["busy"] = spread(row["busy"])
    return {
        "floor": report.FLOOR,
        "processes": PROCESSES,
        "keys": plan.many_keys,
        "seconds": plan.many_seconds,
        "rounds": plan.many_rounds,
        "rows": rows,
    }


# -- 4. refresh, 5. footprint, 6. admin -----------------------------------------------------------


def refresh(bench: Bench) -> dict[str, Any]:
    plan = bench.plan
    redis_url = bench.redis.url if bench.redis is not None else None
    result = run_fresh(
        refresh_probe, bench.mongo.url, plan.refresh_sizes, plan.refresh_ticks, redis_url
    )
    for size, timings in result["sizes"].items():
        ours, floor = summary(timings["ours"]), summary(timings["floor"])
        say(
            f"  {size} locks: tick {ours['p50'] * 1000:.1f} ms, "
            f"raw update_many {floor['p50'] * 1000:.1f} ms"
        )
    say(f"  memory per held lock: {result['traced_per_lock']:.0f} B (tracemalloc)")
    return result


def footprint(bench: Bench) -> dict[str, Any]:
    specs = [
        bench.ours("footprint_ours"),
        bench.spec(report.FLOOR, "floor", "footprint_floor"),
        *bench.peers("footprint"),
    ]
    rows = {spec.label: run_fresh(footprint_probe, spec) for spec in specs}
    for label, row in rows.items():
        say(f"  {label}: {row['python_threads']} thread(s): {', '.join(row['names']) or '-'}")
    return {"rows": rows}


def admin(bench: Bench) -> dict[str, Any]:
    plan = bench.plan
    result = run_fresh(admin_probe, bench.mongo.url, plan.admin_documents, plan.admin_requests)
    for name, timings in result["pages"].items():
        say(f"  {name}: median {summary(timings)['p50'] * 1000:.1f} ms")
    return result


def scale(bench: Bench) -> dict[str, Any]:
    plan = bench.plan
    spec = bench.ours("scale_processes")
    reference = None
    if bench.redis is not None:
        reference = bench.spec("python-redis-lock", "redis", "scale_processes")
    result = scaling.run(
        bench.mongo.url,
        spec,
        plan.scale_keys,
        plan.scale_processes,
        plan.scale_seconds,
        bench.hold,
        say,
        reference,
    )
    if plan.line_places:
        result["line"] = line = line_cost.run(
            bench.mongo.url, plan.line_places, turns=plan.line_turns
        )
        for places, point in line["points"].items():
            say(
                f"  a handoff over {places} places: "
                f"{(point['handoff'] - point['plain']) * 1e6:,.0f} µs of server work"
            )
    return result


# -- 8. instrumentation ------------------------------------------------------------------------


def instrumentation(bench: Bench) -> dict[str, Any]:
    """Our lock's uncontended cycle with each set of observers against none, round by round."""
    plan = bench.plan
    specs: list[Spec] = []
    skipped: dict[str, list[str]] = {}
    for label, names in INSTRUMENTED:
        absent = instruments.missing(names)
        if absent:
            skipped[label] = absent
            say(f"  {label}: skipped ({', '.join(absent)} not installed)")
            continue
        specs.append(bench.ours("instrumentation", label=label, instrument=names))
    baseline = INSTRUMENTED[0][0]
    # Every contender built for its own job: the observers are process-wide.
    rows = _cycle_rounds(bench, specs, fresh=True)
    _against(rows, baseline)
    cycle = 1 / rows[baseline]["cps"]["median"]
    for row in rows.values():
        # The CPU a cycle gained, as a share of the baseline's time per cycle.
        row["cpu_share"] = row["cpu_added"]["median"] / cycle
    return {
        "baseline": baseline,
        "instruments": dict(INSTRUMENTED),
        "cycles": plan.cycles,
        "rounds": plan.rounds,
        "rows": rows,
        "skipped": skipped,
    }


WORKLOADS: Final[dict[str, Callable[[Bench], dict[str, Any]]]] = {
    "uncontended": uncontended,
    "handoff": handoff,
    "many-keys": many_keys,
    "refresh": refresh,
    "footprint": footprint,
    "admin": admin,
    "scale": scale,
    "instrumentation": instrumentation,
}
