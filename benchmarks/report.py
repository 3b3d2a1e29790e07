"""The run's markdown report, its JSON twin, and the plot of the handoff wait times."""

from __future__ import annotations

import importlib
import json
import math
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from benchmarks import scale
from benchmarks.stats import ms, ratio

__all__ = [
    "FLOOR",
    "FLOOR_POLL_10",
    "FLOOR_POLL_100",
    "FLOOR_TTL",
    "OURS",
    "OURS_TRY",
    "REDIS",
    "write",
]

OURS: Final = "django-mongolock"
OURS_TRY: Final = "django-mongolock (blocking=False)"
FLOOR: Final = "floor (raw pymongo)"
FLOOR_TTL: Final = "floor + TTL index (reference)"
FLOOR_POLL_10: Final = "floor, polling every 10 ms"
FLOOR_POLL_100: Final = "floor, polling every 100 ms"
REDIS: Final = "python-redis-lock"

PLOT_NAME: Final = "handoff-waits.png"
DOCS_PAGE: Final = "docs/benchmarks.md"
DOCS_PLOT: Final = "docs/img/handoff-waits.png"

# Goals for the code, read off one run; nothing here is a timed assertion.
UNCONTENDED_GOAL: Final = 1.15
HANDOFF_REDIS_GOAL: Final = 2.0
HANDOFF_ALONE_GOAL: Final = 0.015
# The gap from a release to the next holder's return, in uncontended acquires: the limit
# is one majority write plus the notification.
GAP_GOAL: Final = 1.5
HANDOFF_RATE_GOAL: Final = 0.9
OTHER_SHARE_GOAL: Final = 0.95
STARVING_SHARE: Final = 0.5
MANY_KEYS_GOAL: Final = 0.9
REFRESH_GOAL: Final = 1.2
# A refresher lane per manager, the deadline watch, and the watcher once a process waited.
THREADS_GOAL: Final = 3
BYTES_PER_LOCK_GOAL: Final = 2048
ADMIN_GOAL: Final = 0.2


def _x(value: float, digits: int = 2) -> str:
    return "n/a" if math.isnan(value) else f"{value:.{digits}f}x"


def _pct(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value * 100:.1f} %"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines.extend("| " + " | ".join(row) + " |" for row in rows)
    return [*lines, ""]


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


# -- targets ------------------------------------------------------------------------------------


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each goal of the suite with this run's figure, its ratio and whether it was met."""
    rows: list[dict[str, Any]] = []

    def add(
        name: str, goal: str, figure: str, value: float, met: bool | None, to: str = "floor"
    ) -> None:
        rows.append(
            {
                "target": name,
                "goal": goal,
                "figure": figure,
                "ratio": value,
                "ratio_to": to if not math.isnan(value) else "",
                "met": met,
            }
        )

    if "uncontended" in results:
        measured = results["uncontended"]["rows"]
        row = measured[OURS]
        value = row["time_ratio"]["median"]
        add(
            "uncontended acquire+release",
            f"time ≤ {UNCONTENDED_GOAL}x the floor's",
            f"{row['cps']['median']:.0f} cycles/s" + _beside_ttl_floor(measured, "time_ratio"),
            value,
            value <= UNCONTENDED_GOAL,
        )
    if "handoff" in results:
        data = results["handoff"]["rows"]
        ours = data[OURS]
        processes = results["handoff"]["processes"]
        gap, alone = ours["gap"]["p50"], ours["alone"]["p50"]
        value = ratio(gap, alone)
        add(
            "handoff: gap p50 (release to next holder's return)",
            f"≤ {GAP_GOAL:g}x one uncontended acquire (p50, same rounds)",
            f"{ms(gap, 2)}; one acquire {ms(alone, 2)}",
            value,
            value <= GAP_GOAL,
            to="uncontended acquire",
        )
        rate = ours["rate"]["median"]
        value = ratio(rate, data[FLOOR_POLL_10]["rate"]["median"])
        add(
            "handoff: handoffs per second",
            f"≥ {HANDOFF_RATE_GOAL:g}x the floor polling every 10 ms",
            f"{rate:.0f}/s",
            value,
            value >= HANDOFF_RATE_GOAL,
            to=FLOOR_POLL_10,
        )
        p99 = ours["wait"]["p99"]
        if REDIS in data:
            value = ratio(p99, data[REDIS]["wait"]["p99"])
            add(
                f"handoff, {processes} processes: wait p99",
                f"≤ {HANDOFF_REDIS_GOAL:g}x python-redis-lock's",
                ms(p99, 1),
                value,
                value <= HANDOFF_REDIS_GOAL,
                to=REDIS,
            )
        else:
            value = ratio(p99, data[FLOOR_POLL_10]["wait"]["p99"])
            add(
                f"handoff, {processes} processes: wait p99",
                f"≤ {HANDOFF_ALONE_GOAL * 1000:g} ms (no Redis here)",
                ms(p99, 1),
                value,
                p99 <= HANDOFF_ALONE_GOAL,
                to=FLOOR_POLL_10,
            )
        share = ours["other_share"]
        add(
            "handoff: to another waiting process",
            f"≥ {OTHER_SHARE_GOAL:.0%}",
            _pct(share),
            math.nan,
            share >= OTHER_SHARE_GOAL,
        )
        fewest = ours["fewest_share"]
        add(
            "handoff: no waiter starves",
            f"every process ≥ {STARVING_SHARE:.0%} of its fair share, every round",
            f"fewest: {fewest:.0%} of fair share; max wait {ms(ours['wait']['max'], 1)}",
            math.nan,
            fewest >= STARVING_SHARE,
        )
    if "many-keys" in results:
        measured = results["many-keys"]["rows"]
        row = measured[OURS]
        value = row["rate_ratio"]["median"]
        add(
            "many keys: acquisitions/s",
            f"≥ {MANY_KEYS_GOAL}x the floor",
            f"{row['rate']['median']:.0f}/s" + _beside_ttl_floor(measured, "rate_ratio"),
            value,
            value >= MANY_KEYS_GOAL,
        )
    if "refresh" in results:
        data = results["refresh"]
        size = str(data["largest"])
        ours = _median(data["sizes"][size]["ours"])
        value = ratio(ours, _median(data["sizes"][size]["floor"]))
        add(
            f"refresh tick, {int(size):,} locks",
            f"≤ {REFRESH_GOAL}x one raw update_many",
            ms(ours, 1),
            value,
            value <= REFRESH_GOAL,
            to="raw update_many",
        )
        mixed = data.get("mixed")
        if mixed:
            ours = _median(mixed["ours"])
            value = ratio(ours, _median(mixed["floor"]))
            add(
                f"refresh tick, {mixed['documents']:,} documents with shared and semaphore",
                f"≤ {REFRESH_GOAL}x one raw update_many",
                ms(ours, 1),
                value,
                value <= REFRESH_GOAL,
                to="raw update_many",
            )
        per_lock = data["traced_per_lock"]
        add(
            f"memory per held lock ({int(size):,} held)",
            f"≤ {BYTES_PER_LOCK_GOAL // 1024} KiB",
            f"{per_lock:,.0f} B",
            math.nan,
            per_lock <= BYTES_PER_LOCK_GOAL,
        )
    if "footprint" in results:
        threads = results["footprint"]["rows"][OURS]["mongolock_threads"]
        add(
            "background threads per process",
            f"≤ {THREADS_GOAL}",
            str(threads),
            math.nan,
            threads <= THREADS_GOAL,
        )
    if "admin" in results:
        data = results["admin"]
        median = _median(data["pages"]["list"])
        add(
            f"admin list, {data['documents']:,} locks",
            f"median ≤ {ADMIN_GOAL * 1000:g} ms",
            ms(median, 1),
            ratio(median, _median(data["floor"])),
            median <= ADMIN_GOAL,
            to="its reads alone",
        )
    if "scale" in results:
        for name, goal, figure, value, met in scale.targets(results["scale"]):
            add(name, goal, figure, value, met, to="4 waiters")
    unsafe = safety(results)
    if unsafe:
        total = sum(row["overlaps"] + row["lost"] for row in unsafe)
        add(
            "safety: overlaps and lost updates",
            "0 in every workload",
            str(total),
            math.nan,
            total == 0,
        )
    return rows


def safety(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for workload in ("uncontended", "handoff", "many-keys"):
        if workload not in results:
            continue
        for label, row in results[workload]["rows"].items():
            rows.append(
                {
                    "workload": workload,
                    "contender": label,
                    "overlaps": int(row["overlaps"]),
                    "lost": int(row["lost"]),
                }
            )
    for point in results.get("scale", {}).get("processes", {}).get("points", {}).values():
        rows.append(
            {
                "workload": f"scale, {point['waiters']} processes",
                "contender": OURS,
                "overlaps": int(point["overlaps"]),
                "lost": int(point["lost"]),
            }
        )
    if "refresh" in results:
        rows.append(
            {
                "workload": "refresh",
                "contender": OURS,
                "overlaps": 0,
                "lost": int(results["refresh"]["lost"]),
            }
        )
    return rows


# -- the markdown -------------------------------------------------------------------------------


def _met(met: bool | None) -> str:
    return "n/a" if met is None else "**met**" if met else "**missed**"


def _header(meta: dict[str, Any]) -> list[str]:
    load_start = ", ".join(f"{v:.2f}" for v in meta["load_start"])
    load_end = ", ".join(f"{v:.2f}" for v in meta.get("load_end", ()))
    where = "started for the run" if meta.get("mongodb_started_here") else "from MONGOLOCK_URL"
    redis = (
        f"{meta['redis']} on loopback, no persistence; python-redis-lock "
        f"{meta['python_redis_lock']}, redis-py {meta['redis_py']}"
        if meta.get("redis")
        else "not installed: python-redis-lock skipped"
    )
    minutes, seconds = divmod(round(meta.get("seconds", 0)), 60)
    engine = f"{meta['django_mongolock']}, commit {meta['commit'] or '?'}"
    if not meta.get("engine_in_tree", True):
        engine = f"{meta['django_mongolock']} imported from {meta['engine_path']}"
        if meta.get("engine_label"):  # MONGOLOCK_BENCH_ENGINE: what that copy is
            engine = f"{meta['django_mongolock']}, {meta['engine_label']}"
    rows = [
        ["date", meta["started"]],
        ["command", f"`{meta['command']}` ({meta['mode']} run)"],
        ["django-mongolock", engine],
        ["MongoDB", f"{meta.get('mongodb', '?')}, {meta.get('topology', '?')} ({where}), loopback"],
        ["driver", f"pymongo {meta['pymongo']}"],
        ["Redis", redis],
        ["Python, Django", f"{meta['python']}, Django {meta['django']}"],
        [
            "machine",
            f"{meta['platform']}, {meta['usable_cores']} usable core(s) of {meta['cores']}",
        ],
        ["load average (1, 5, 15 min)", f"{load_start} at start; {load_end} at end"],
        ["run time", f"{minutes} min {seconds} s"],
    ]
    return _table(["", ""], rows)


def _beside_ttl_floor(rows: dict[str, Any], field: str) -> str:
    """Our ratio (time or rate) to the reference floor that also keeps a TTL index."""
    if FLOOR_TTL not in rows:
        return ""
    ours, reference = rows[OURS][field]["median"], rows[FLOOR_TTL][field]["median"]
    return f"; {ours / reference:.2f}x the floor + TTL index"


_TTL_NOTE: Final = (
    f"*{FLOOR_TTL}* is the floor on a collection with the TTL index on `expires_at` that "
    "django-mongolock keeps so that the documents of crashed holders are purged: every "
    "acquisition and release then also updates that index. It is shown to tell the cost "
    "of the index (which any MongoDB lock that cleans up after crashes pays) from the "
    "cost of the code."
)


def _ttl_note(rows: dict[str, Any]) -> list[str]:
    """The paragraph under a table that has the reference floor with a TTL index."""
    return [_TTL_NOTE, ""] if FLOOR_TTL in rows else []


def _uncontended(data: dict[str, Any]) -> list[str]:
    floor = data["rows"][data["floor"]]
    lines = [
        "## 1. Uncontended acquire and release",
        "",
        f"One process, {data['cycles']:,} acquire+release cycles over 100 rotating keys per "
        f"round, {data['rounds']} interleaved rounds. Cycles/s is the median of the rounds; "
        "the time ratio is the cycle time over the floor's in the same round (median of "
        "the rounds); latencies pool every round. Each latency also as a ratio to the floor's.",
        "",
    ]
    rows = []
    for label, row in data["rows"].items():
        cells = [label, f"{row['cps']['median']:.0f}", _x(row["time_ratio"]["median"])]
        for op in ("acquire", "release"):
            for q in ("p50", "p99"):
                value = row[op][q]
                cells.append(f"{ms(value, 2)} ({_x(ratio(value, floor[op][q]))})")
        rows.append(cells)
    header = [
        "lock",
        "cycles/s",
        "time vs floor",
        "acquire p50",
        "acquire p99",
        "release p50",
        "release p99",
    ]
    notes = _ttl_note(data["rows"])
    return lines + _table(header, rows) + notes


def _handoff(data: dict[str, Any], plot: str | None) -> list[str]:
    floor = data["rows"][data["floor"]]
    lines = [
        "## 2. Contended handoff",
        "",
        f"{data['processes']} processes block on one key, each holding it "
        f"{data['hold'] * 1000:g} ms, for {data['seconds']:g} s per round, "
        f"{data['rounds']} interleaved rounds. *Wait* is the time spent inside `acquire`; "
        "*gap* runs from the holder's call to release to the next holder's return from "
        "`acquire`; *to another* is the share of handoffs that went to a different process; "
        "*fewest* is the least-served process's acquisitions over a fair share (worst round). "
        "*Gap to another* counts only the handoffs between two processes. "
        "Both clocks are CLOCK_MONOTONIC, which the processes of one host share. "
        f"Ratios are to the {data['floor']}.",
        "",
    ]
    ours = data["rows"].get(OURS, {}).get("alone")
    if ours:
        lines += [
            f"One uncontended acquire of django-mongolock, timed beside every round: "
            f"p50 {ms(ours['p50'], 2)}, p99 {ms(ours['p99'], 2)}.",
            "",
        ]
    rows = []
    for label, row in data["rows"].items():
        cells = [label, f"{row['rate']['median']:.0f}"]
        for q in ("p50", "p99", "max"):
            value = row["wait"][q]
            cells.append(f"{ms(value, 1)} ({_x(ratio(value, floor['wait'][q]))})")
        for q in ("p50", "p99"):
            value = row["gap"][q]
            cells.append(f"{ms(value, 2)} ({_x(ratio(value, floor['gap'][q]))})")
        cells.append(ms(row["cross_gap"]["p50"], 2))
        cells.append(_pct(row["other_share"]))
        cells.append(f"{row['fewest_share']:.0%}")
        rows.append(cells)
    header = [
        "lock",
        "acquisitions/s",
        "wait p50",
        "wait p99",
        "wait max",
        "gap p50",
        "gap p99",
        "gap to another p50",
        "to another",
        "fewest",
    ]
    lines += _table(header, rows)
    if plot:
        lines += [f"![Wait inside acquire, handoff workload]({plot})", ""]
    return lines


def _many_keys(data: dict[str, Any]) -> list[str]:
    lines = [
        "## 3. Many keys",
        "",
        f"{data['processes']} processes try (without waiting) random keys out of "
        f"{data['keys']:,} and release at once when they get one; {data['seconds']:g} s "
        f"per round, {data['rounds']} interleaved rounds; medians of the rounds.",
        "",
    ]
    rows = [
        [
            label,
            f"{row['rate']['median']:.0f}",
            _x(row["rate_ratio"]["median"]),
            f"{row['tries']['median']:.0f}",
            _pct(row["busy"]["median"]),
        ]
        for label, row in data["rows"].items()
    ]
    notes = _ttl_note(data["rows"])
    table = _table(["lock", "acquisitions/s", "vs floor", "tries/s", "busy tries"], rows)
    return lines + table + notes


def _refresh(data: dict[str, Any]) -> list[str]:
    lines = [
        "## 4. Refresh",
        "",
        "One process holds the locks (taken with the defaults, so registered with its "
        "refresher). A tick of the refresher (`Refresher.tick()`: one `update_many` for all "
        "held leases, then the bookkeeping) against one raw `update_many` that extends the "
        "same documents by `_id`, alternated; medians (min to max) of the ticks. "
        "python-redis-lock has no bulk renewal: one `extend()` per lock.",
        "",
    ]
    rows = []
    redis = data.get("redis")
    for size, timings in data["sizes"].items():
        ours, floor = timings["ours"], timings["floor"]
        cells = [
            f"{int(size):,}",
            f"{ms(_median(ours), 1)} ({ms(min(ours), 1)} to {ms(max(ours), 1)})",
            f"{ms(_median(floor), 1)} ({ms(min(floor), 1)} to {ms(max(floor), 1)})",
            _x(ratio(_median(ours), _median(floor))),
        ]
        if redis is not None:
            extend = redis["sizes"][size]
            cells += [ms(_median(extend), 1), _x(ratio(_median(extend), _median(floor)))]
        rows.append(cells)
    header = ["held locks", "django-mongolock tick", "raw update_many (floor)", "vs floor"]
    if redis is not None:
        header += ["python-redis-lock, extend() each", "vs floor"]
    lines += _table(header, rows)
    mixed = data.get("mixed")
    if mixed:
        ours, floor = mixed["ours"], mixed["floor"]
        lines += [
            f"With {mixed['shared']:,} shared locks and the {mixed['permits']} permits of one "
            f"semaphore held beside the {mixed['exclusive']:,} exclusive locks "
            f"({mixed['documents']:,} documents), the same tick takes "
            f"{ms(_median(ours), 1)} against {ms(_median(floor), 1)} for one raw "
            f"`update_many` over those documents: {_x(ratio(_median(ours), _median(floor)))}.",
            "",
        ]
    size = str(data["largest"])
    writes = data["sizes"][size].get("writes") or {}
    if writes:
        parts = [f"`{what}` {ms(_median(times), 1)}" for what, times in sorted(writes.items())]
        rest = _median(data["sizes"][size]["ours"]) - sum(_median(t) for t in writes.values())
        parts.append(f"the rest (the client's side: encoding, bookkeeping) {ms(rest, 1)}")
        lines += [
            f"Where a tick over {int(size):,} locks spends its time (server time of each "
            "command the tick sends, medians): " + "; ".join(parts) + ".",
            "",
        ]
    if mixed and mixed.get("plans"):
        plans = [
            [
                plan["op"],
                plan["collection"],
                plan["plan"],
                f"{plan['keys_examined']:,}",
                f"{plan['docs_examined']:,}",
                f"{plan['matched']:,}",
            ]
            for plan in mixed["plans"]
        ]
        lines += [
            "The profiler's account of one such tick: every read and write goes through an "
            "index, examining the documents of the held leases only.",
            "",
            *_table(
                ["op", "collection", "plan", "keys examined", "docs examined", "matched"], plans
            ),
        ]
    lines += [
        f"Taking {data['largest']:,} locks (16 threads): {data['fill_seconds']:.1f} s; "
        f"releasing them all at exit (`release_all`, one write): "
        f"{ms(data['release_all_seconds'], 1)}.",
        "",
    ]
    return lines


def _footprint(data: dict[str, Any], refresh: dict[str, Any] | None) -> list[str]:
    lines = [
        "## 5. Footprint",
        "",
        "Threads a fresh process has started once it holds three locks and (for "
        "django-mongolock) has waited for a busy one; python-redis-lock also holds three "
        "locks with `auto_renewal=True`. The driver's own monitor threads are counted "
        "apart. Memory per held lock: the tracemalloc delta while the last 1,000 locks of "
        "the refresh workload are taken (9,000 already held), and the RSS delta over all "
        "of them beside it.",
        "",
    ]
    rows = []
    for label, row in data["rows"].items():
        own = row["mongolock_threads"] if label == OURS else row["python_threads"]
        names = ", ".join(sorted(set(row["names"]))) or "-"
        if label != OURS:
            own = sum(1 for name in row["names"] if not name.startswith("pymongo"))
        memory = ""
        if refresh is not None and label == OURS:
            memory = f"{refresh['traced_per_lock']:,.0f} B (RSS {refresh['rss_per_lock']:,.0f} B)"
        elif refresh is not None and label == REDIS and "redis" in refresh:
            memory = f"{refresh['redis']['traced_per_lock']:,.0f} B"
        rows.append([label, str(own), str(row["python_threads"]), names, memory or "-"])
    return lines + _table(
        ["lock", "its own threads", "all new threads", "names", "memory per held lock"], rows
    )


def _admin(data: dict[str, Any]) -> list[str]:
    floor = _median(data["floor"])
    lines = [
        "## 6. Admin",
        "",
        f"The lock list of the admin with {data['documents']:,} lock documents (nine in ten "
        "live), requested through Django's test client in-process as a superuser; median "
        "and max of the requests. The ratio is to the reads such a page cannot avoid (the "
        f"counts and one page of 100, raw pymongo: {ms(floor, 1)}).",
        "",
    ]
    rows = [
        [
            name,
            ms(_median(timings), 1),
            ms(max(timings), 1),
            _x(ratio(_median(timings), floor)),
        ]
        for name, timings in data["pages"].items()
    ]
    return lines + _table(["page", "median", "max", "vs reads alone"], rows)


def _safety(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "## 8. Safety while measuring",
        "",
        "Every critical section marks its key in shared memory (an *overlap* is a second "
        "holder seen inside) and increments a shared counter by read, hold, write (a *lost "
        "update* is an acquisition whose increment is missing). For the refresh workload, "
        "*lost* counts held locks found lost after the ticks.",
        "",
    ]
    table = [
        [row["workload"], row["contender"], str(row["overlaps"]), str(row["lost"])] for row in rows
    ]
    return lines + _table(["workload", "lock", "overlaps", "lost updates"], table)


def render(
    meta: dict[str, Any], results: dict[str, Any], plot: str | None, scale_plot: str | None = None
) -> str:
    lines = [
        "# Benchmarks",
        "",
        "django-mongolock measured beside the fewest round trips a correct MongoDB lock can "
        "make (the *floor*: a lock written with the raw driver, acquire = one "
        "`find_one_and_update` upsert deciding with `$$NOW`, release = one `delete_one` by "
        "key and owner, waiting = polling) and python-redis-lock on a local Redis, in the "
        "same run, against the same servers, in interleaved rounds. "
        "[Where the time goes](performance.md) explains the figures.",
        "",
        "Reproduce with `make bench` (the full run, about seven minutes; it rewrites this "
        "page), or `.venv/bin/python benchmarks/run.py --quick` for a one-minute run and "
        "`--only NAME` for one workload. The suite needs the `bench` extra "
        "(`pip install -e '.[bench]'`) and, for python-redis-lock, a `redis-server` on "
        "`PATH`; it starts its own single-node replica set unless `MONGOLOCK_URL` names one. "
        "Reports and JSON go to `benchmarks/results/`.",
        "",
        "!!! note",
        "    The machine is small and shared: read the ratios, which compare locks measured "
        "side by side in one run, rather than the absolute figures. Redis keeps its data "
        "in memory on one server; MongoDB acknowledges each lock write after a journaled "
        "majority commit, which is most of a round trip here.",
        "",
        "## Run",
        "",
        *_header(meta),
    ]
    rows = targets(results)
    if rows:
        lines += ["## Targets", ""]
        lines += _table(
            ["target", "goal", "figure", "ratio", ""],
            [
                [
                    row["target"],
                    row["goal"],
                    row["figure"],
                    f"{_x(row['ratio'], 3)} {row['ratio_to']}".strip(),
                    _met(row["met"]),
                ]
                for row in rows
            ],
        )
    if "uncontended" in results:
        lines += _uncontended(results["uncontended"])
    if "handoff" in results:
        lines += _handoff(results["handoff"], plot)
    if "many-keys" in results:
        lines += _many_keys(results["many-keys"])
    if "refresh" in results:
        lines += _refresh(results["refresh"])
    if "footprint" in results:
        lines += _footprint(results["footprint"], results.get("refresh"))
    if "admin" in results:
        lines += _admin(results["admin"])
    if "scale" in results:
        lines += scale.render(results["scale"], scale_plot)
    unsafe = safety(results)
    if unsafe:
        lines += _safety(unsafe)
    return "\n".join(lines).rstrip() + "\n"


# -- the plot -----------------------------------------------------------------------------------


def plot_waits(data: dict[str, Any], path: Path) -> bool:
    """Distribution (ECDF, log time axis) of the wait inside acquire per lock; False without
    matplotlib."""
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError:
        print("notice: matplotlib is not installed (pip install -e '.[bench]'): no plot")
        return False
    matplotlib.use("Agg")
    pyplot = importlib.import_module("matplotlib.pyplot")
    figure, axes = pyplot.subplots(figsize=(8, 4.5), dpi=110)
    for label, row in data["rows"].items():
        waits = sorted(max(wait, 1e-5) * 1000 for wait in row["waits"])
        if not waits:
            continue
        shares = [(n + 1) / len(waits) for n in range(len(waits))]
        p99 = row["wait"]["p99"] * 1000
        axes.step(waits, shares, where="post", label=f"{label} (p99 {p99:.1f} ms)")
    axes.set_xscale("log")
    axes.set_xlabel("wait inside acquire (ms, log scale)")
    axes.set_ylabel("share of acquisitions")
    axes.set_ylim(0, 1.01)
    axes.axhline(0.99, color="grey", linewidth=0.6, linestyle=":")
    axes.grid(True, which="both", linewidth=0.3)
    axes.set_title(
        f"{data['processes']} processes blocking on one key, holding it {data['hold'] * 1000:g} ms"
    )
    axes.legend(loc="lower right", fontsize="small")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    pyplot.close(figure)
    return True


# -- writing ------------------------------------------------------------------------------------


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def write(
    meta: dict[str, Any], results: dict[str, Any], directory: Path, *, docs: bool, root: Path
) -> list[Path]:
    """Write ``<stamp>.md``, ``<stamp>.json`` (and the plot) under ``directory``; with
    ``docs``, copy the report and the plot into the documentation."""
    directory.mkdir(parents=True, exist_ok=True)
    stamp = meta["started"].replace(":", "").replace("+0000", "Z").replace("-", "")
    written: list[Path] = []
    plot_path = directory / f"{stamp}-{PLOT_NAME}"
    has_plot = "handoff" in results and plot_waits(results["handoff"], plot_path)
    if has_plot:
        written.append(plot_path)
    scale_path = directory / f"{stamp}-{scale.PLOT_NAME}"
    has_scale = "scale" in results and scale.plot(results["scale"], scale_path)
    if has_scale:
        written.append(scale_path)
    markdown = directory / f"{stamp}.md"
    markdown.write_text(
        render(
            meta,
            results,
            plot_path.name if has_plot else None,
            scale_path.name if has_scale else None,
        )
    )
    written.append(markdown)
    data = {"meta": meta, "targets": targets(results), "safety": safety(results), **results}
    json_path = directory / f"{stamp}.json"
    json_path.write_text(json.dumps(_jsonable(data), indent=1) + "\n")
    written.append(json_path)
    for name, source in (("latest.md", markdown), ("latest.json", json_path)):
        shutil.copyfile(source, directory / name)
    if docs:
        page = root / DOCS_PAGE
        image = root / DOCS_PLOT
        if has_plot:
            image.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(plot_path, image)
            written.append(image)
        if has_scale:
            scale_image = root / "docs" / "img" / scale.PLOT_NAME
            shutil.copyfile(scale_path, scale_image)
            written.append(scale_image)
        page.write_text(
            render(
                meta,
                results,
                "img/handoff-waits.png" if has_plot else None,
                f"img/{scale.PLOT_NAME}" if has_scale else None,
            )
        )
        written.append(page)
    return written
