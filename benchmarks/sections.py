"""The report's sections, one function per workload."""

from __future__ import annotations

import math
from typing import Any, Final

from benchmarks.goals import INSTRUMENTATION_GOAL
from benchmarks.labels import FLOOR_TTL, OURS, REDIS
from benchmarks.markdown import change, median, pct, span, table, x
from benchmarks.stats import ms, ratio

__all__ = [
    "admin",
    "footprint",
    "handoff",
    "instrumentation",
    "many_keys",
    "refresh",
    "safety_table",
    "uncontended",
]


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


def uncontended(data: dict[str, Any]) -> list[str]:
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
        cells = [label, f"{row['cps']['median']:.0f}", x(row["time_ratio"]["median"])]
        for op in ("acquire", "release"):
            for q in ("p50", "p99"):
                value = row[op][q]
                cells.append(f"{ms(value, 2)} ({x(ratio(value, floor[op][q]))})")
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
    return lines + table(header, rows) + notes


def handoff(data: dict[str, Any], plot: str | None) -> list[str]:
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
    limit = data["rows"].get(OURS, {}).get("limit")
    if limit and limit["n"]:
        write = data["rows"][OURS]["limit_write"]
        lines += [
            "The server's limit for a handoff, timed after every round with the raw "
            f"driver: one majority update sent {data['hold'] * 1000:g} ms after the previous "
            "one returned, from its sending until a change stream in another process "
            f"delivered its event: p50 {ms(limit['p50'], 2)}, p99 {ms(limit['p99'], 2)} (the "
            f"same updates' round trips: p50 {ms(write['p50'], 2)}; the event may come "
            "before the reply). A handoff adds to it a heavier write and the new holder's "
            "return after its event.",
            "",
        ]
    rows = []
    for label, row in data["rows"].items():
        cells = [label, f"{row['rate']['median']:.0f}"]
        for q in ("p50", "p99", "max"):
            value = row["wait"][q]
            cells.append(f"{ms(value, 1)} ({x(ratio(value, floor['wait'][q]))})")
        for q in ("p50", "p99"):
            value = row["gap"][q]
            cells.append(f"{ms(value, 2)} ({x(ratio(value, floor['gap'][q]))})")
        cells.append(ms(row["cross_gap"]["p50"], 2))
        cells.append(pct(row["other_share"]))
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
    lines += table(header, rows)
    rows_of = data["rows"].items()
    if counts := ", ".join(f"{label} {r['timeouts']}" for label, r in rows_of if r.get("timeouts")):
        lines += [
            f"Lock calls the server did not answer within their time limit: {counts}. An "
            "acquire that timed out has no turn, and its time is in no wait; a turn whose "
            "release timed out counts as any other.",
            "",
        ]
    if plot:
        lines += [f"![Wait inside acquire, handoff workload]({plot})", ""]
    return lines


def many_keys(data: dict[str, Any]) -> list[str]:
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
            x(row["rate_ratio"]["median"]),
            f"{row['tries']['median']:.0f}",
            pct(row["busy"]["median"]),
        ]
        for label, row in data["rows"].items()
    ]
    notes = _ttl_note(data["rows"])
    cells = table(["lock", "acquisitions/s", "vs floor", "tries/s", "busy tries"], rows)
    return lines + cells + notes


def refresh(data: dict[str, Any]) -> list[str]:
    lines = [
        "## 4. Refresh",
        "",
        "One process holds the locks (taken with the defaults, so registered with its "
        "refresher). A tick of the refresher (`Refresher.tick()`: one `update_many` for all "
        "held leases, then the bookkeeping) against one raw `update_many` that extends the "
        "same documents by `_id`, in turns, each going first every other turn; medians (min "
        "to max) of the ticks, and *vs floor* the ratio of the medians. "
        "python-redis-lock has no bulk renewal: one `extend()` per lock.",
        "",
    ]
    rows = []
    redis = data.get("redis")
    for size, timings in data["sizes"].items():
        ours, floor = timings["ours"], timings["floor"]
        cells = [
            f"{int(size):,}",
            span(ours, cell=lambda value: ms(value, 1)),
            span(floor, cell=lambda value: ms(value, 1)),
            x(ratio(median(ours), median(floor))),
        ]
        if redis is not None:
            extend = redis["sizes"][size]
            cells += [ms(median(extend), 1), x(ratio(median(extend), median(floor)))]
        rows.append(cells)
    header = ["held locks", "django-mongolock tick", "raw update_many (floor)", "vs floor"]
    if redis is not None:
        header += ["python-redis-lock, extend() each", "vs floor"]
    lines += table(header, rows)
    mixed = data.get("mixed")
    if mixed:
        ours, floor = mixed["ours"], mixed["floor"]
        lines += [
            f"With {mixed['shared']:,} shared locks and the {mixed['permits']} permits of one "
            f"semaphore held beside the {mixed['exclusive']:,} exclusive locks "
            f"({mixed['documents']:,} documents), the same tick takes "
            f"{ms(median(ours), 1)} against {ms(median(floor), 1)} for one raw "
            f"`update_many` over those documents: {x(ratio(median(ours), median(floor)))}.",
            "",
        ]
    size = str(data["largest"])
    writes = data["sizes"][size].get("writes") or {}
    if writes:
        parts = [f"`{what}` {ms(median(times), 1)}" for what, times in sorted(writes.items())]
        rest = median(data["sizes"][size]["ours"]) - sum(median(t) for t in writes.values())
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
            *table(
                ["op", "collection", "plan", "keys examined", "docs examined", "matched"], plans
            ),
        ]
    lines += [
        f"Taking {data['largest']:,} locks (16 threads): {data['fill_seconds']:.1f} s; "
        f"releasing them all at exit with the shared leases and permits above "
        f"(`release_all`: one write for the exclusive locks, one for the shared leases): "
        f"{ms(data['release_all_seconds'], 1)}.",
        "",
    ]
    return lines


def footprint(data: dict[str, Any], refresh: dict[str, Any] | None) -> list[str]:
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
    return lines + table(
        ["lock", "its own threads", "all new threads", "names", "memory per held lock"], rows
    )


def admin(data: dict[str, Any]) -> list[str]:
    floor = median(data["floor"])
    waiting = f", {data['lines']:,} with a line of waiters" if "lines" in data else ""
    stats = ""
    if "stats_documents" in data:
        stats = (
            f" The contention view and a key's page read an hour of statistics besides: "
            f"{data['stats_documents']:,} documents, what {data['stats_processes']} processes "
            "flush at their bound of keys per minute (distinct keys, the worst case for the "
            "view's aggregations)."
        )
    lines = [
        "## 6. Admin",
        "",
        f"The admin's pages with {data['documents']:,} lock documents (nine in ten live"
        f"{waiting}), requested through Django's test client in-process as "
        "a superuser, interleaved; median and max of the requests. The ratio is to the reads "
        f"a list page cannot avoid (the counts and one page of 100, raw pymongo: "
        f"{ms(floor, 1)}).{stats}",
        "",
    ]
    rows = [
        [
            name,
            ms(median(timings), 1),
            ms(max(timings), 1),
            x(ratio(median(timings), floor)) if name.startswith("list") else "-",
        ]
        for name, timings in data["pages"].items()
    ]
    return lines + table(["page", "median", "max", "vs reads alone"], rows)


def _us(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds * 1e6:,.0f} µs"


def instrumentation(data: dict[str, Any]) -> list[str]:
    baseline = data["baseline"]
    lines = [
        "## 8. Instrumentation",
        "",
        f"django-mongolock alone in one process, {data['cycles']:,} uncontended "
        f"acquire+release cycles over 100 rotating keys per round, {data['rounds']} "
        "interleaved rounds, with each set of observers installed in the worker process for "
        f"its job and removed after it; *{baseline}* is the baseline. The cost is the time "
        "per cycle over the baseline's in the same round, minus one: median of the rounds "
        f"(min to max); the target is {INSTRUMENTATION_GOAL:.0%}. CPU per cycle is the "
        "worker process's (every thread: the refresher, the span processor); *CPU added* "
        "is the median of its per-round differences from the baseline, also as a share of "
        "the baseline's time per cycle (less noisy than the time, but some of it runs on "
        "another core, beside the round trips). The spans go to a "
        "`BatchSpanProcessor` whose exporter drops them; the metrics to a fresh registry "
        "nobody scrapes.",
        "",
    ]
    rows = []
    for label, row in data["rows"].items():
        time_ratio = row["time_ratio"]
        first = label == baseline
        cost = change(time_ratio["median"] - 1)
        rounds = f"{change(time_ratio['min'] - 1)} to {change(time_ratio['max'] - 1)}"
        added = f"{_us(row['cpu_added']['median'])} ({pct(row['cpu_share'])})"
        rows.append(
            [
                label,
                f"{row['cps']['median']:.0f}",
                "—" if first else cost,
                "—" if first else rounds,
                _us(row["cpu"]["median"]),
                "—" if first else added,
                ms(row["acquire"]["p50"], 2),
                ms(row["release"]["p50"], 2),
            ]
        )
    header = [
        "subscribed",
        "cycles/s",
        "cost (time)",
        "cost, rounds",
        "CPU per cycle",
        "CPU added",
        "acquire p50",
        "release p50",
    ]
    lines += table(header, rows)
    for label, modules in data.get("skipped", {}).items():
        lines += [f"*{label}*: skipped, {', '.join(modules)} not installed.", ""]
    return lines


def safety_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "## 9. Safety while measuring",
        "",
        "Every critical section marks its key in shared memory (an *overlap* is a second "
        "holder seen inside) and increments a shared counter by read, hold, write (a *lost "
        "update* is an acquisition whose increment is missing). For the refresh workload, "
        "*lost* counts held locks found lost after the ticks.",
        "",
    ]
    cells = [
        [row["workload"], row["contender"], str(row["overlaps"]), str(row["lost"])] for row in rows
    ]
    return lines + table(["workload", "lock", "overlaps", "lost updates"], cells)
