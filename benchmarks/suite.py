"""The suite's command line: the servers, the workloads in turn, the report."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

from pymongo import MongoClient

import django_mongolock
from benchmarks import report
from benchmarks.contenders import DATABASE
from benchmarks.servers import mongo_server, redis_server
from benchmarks.workers import Pool
from benchmarks.workloads import FULL, HOLD, PROCESSES, QUICK, WORKLOADS, Bench, Plan, say

__all__ = ["WORKLOADS", "Plan", "main"]

ROOT: Final = Path(__file__).resolve().parent.parent
RESULTS: Final = ROOT / "benchmarks" / "results"


# -- the run ------------------------------------------------------------------------------------


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def _wait_for_load(limit: float, patience: float = 300.0) -> None:
    deadline = time.monotonic() + patience
    while os.getloadavg()[0] > limit and time.monotonic() < deadline:
        say(f"waiting for the load average ({os.getloadavg()[0]:.2f}) to fall below {limit}")
        time.sleep(15)


def _meta(plan: Plan, argv: Sequence[str], selected: Sequence[str]) -> dict[str, Any]:
    commit = _git("rev-parse", "--short", "HEAD")
    engine = Path(django_mongolock.__file__).resolve().parent
    in_tree = engine == ROOT / "django_mongolock"
    changed = [
        part
        for part, path in (("engine", "django_mongolock"), ("benchmarks", "benchmarks"))
        if (in_tree or part == "benchmarks") and _git("status", "--porcelain", "--", path)
    ]
    return {
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python", "benchmarks/run.py", *map(shlex.quote, argv)]),
        "mode": plan.mode,
        "plan": asdict(plan),
        "workloads": list(selected),
        "commit": commit
        + (f" ({' and '.join(changed)} with uncommitted changes)" if changed else ""),
        "engine_path": str(engine),
        "engine_label": os.environ.get("MONGOLOCK_BENCH_ENGINE", ""),
        "engine_in_tree": in_tree,
        "django_mongolock": django_mongolock.__version__,
        "python": platform.python_version(),
        "django": _version("django"),
        "pymongo": _version("pymongo"),
        "redis_py": _version("redis"),
        "python_redis_lock": _version("python-redis-lock"),
        "platform": platform.platform(),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "load_start": os.getloadavg(),
    }


def _prepare(url: str) -> None:
    client: MongoClient[dict[str, Any]] = MongoClient(url)
    try:
        client.drop_database(DATABASE)
    finally:
        client.close()


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="benchmarks/run.py",
        description=(
            "Benchmarks of django-mongolock beside a raw-driver floor lock and "
            "python-redis-lock, on one MongoDB (MONGOLOCK_URL, or a single-node replica "
            "set started for the run) and one local redis-server when installed."
        ),
    )
    parser.add_argument("--quick", action="store_true", help="a shorter run (about a minute)")
    parser.add_argument(
        "--only",
        action="append",
        choices=list(WORKLOADS),
        metavar="NAME",
        help=f"run only this workload (repeatable): {', '.join(WORKLOADS)}",
    )
    parser.add_argument("--rounds", type=int, help="rounds of the interleaved workloads")
    parser.add_argument(
        "--processes",
        type=int,
        default=PROCESSES,
        help=f"processes blocking on one key in the handoff workload (default {PROCESSES})",
    )
    parser.add_argument(
        "--hold",
        type=float,
        default=HOLD,
        help=f"seconds each holder keeps the key in handoff and scale (default {HOLD:g})",
    )
    parser.add_argument(
        "--scale-processes",
        type=lambda text: tuple(int(n) for n in text.split(",")),
        metavar="P1,P2,...",
        help="process counts of the scale workload (default: 4,16,48; quick: 4,12)",
    )
    parser.add_argument(
        "--docs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="copy the report to docs/benchmarks.md and the plot to docs/img "
        "(default: after a full run of every workload)",
    )
    parser.add_argument(
        "--wait-for-load",
        type=float,
        metavar="LOAD",
        help="before starting, wait (up to 5 min) for the 1-minute load average to fall below LOAD",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    args = parse(arguments)
    plan = QUICK if args.quick else FULL
    if args.rounds:
        plan = replace(
            plan, rounds=args.rounds, handoff_rounds=args.rounds, many_rounds=args.rounds
        )
    if args.scale_processes:
        plan = replace(plan, scale_processes=args.scale_processes)
    if args.processes < 2 or args.hold < 0:
        raise SystemExit("--processes must be at least 2 and --hold at least 0")
    selected = args.only or list(WORKLOADS)
    selected = [name for name in WORKLOADS if name in selected]
    docs = args.docs if args.docs is not None else (plan.mode == "full" and not args.only)
    if args.wait_for_load:
        _wait_for_load(args.wait_for_load)
    meta = _meta(plan, arguments, selected)
    started = time.monotonic()
    results: dict[str, Any] = {}
    with mongo_server() as mongo, redis_server() as redis:
        meta["mongodb"] = mongo.version
        meta["topology"] = mongo.topology
        meta["mongodb_started_here"] = mongo.started_here
        meta["mongodb_storage"] = mongo.storage
        meta["redis"] = redis.version if redis is not None else None
        say(f"MongoDB {mongo.version} ({mongo.topology}); Redis {meta['redis'] or 'skipped'}")
        _prepare(mongo.url)
        pool = Pool(max(PROCESSES, args.processes))
        try:
            bench = Bench(plan, mongo, redis, pool, processes=args.processes, hold=args.hold)
            for name in selected:
                say(f"{name}:")
                began = time.monotonic()
                results[name] = WORKLOADS[name](bench)
                results[name]["seconds_spent"] = time.monotonic() - began
        finally:
            pool.close()
            _prepare(mongo.url)
    meta["load_end"] = os.getloadavg()
    meta["seconds"] = time.monotonic() - started
    written = report.write(meta, results, RESULTS, docs=docs, root=ROOT)
    for path in written:
        say(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return 0
