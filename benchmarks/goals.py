"""The suite's goals, read off one run: each target with its figure, ratio and verdict.

Nothing here is a timed assertion: a missed target is reported, never raised.
"""

from __future__ import annotations

import math
from typing import Any, Final

from benchmarks import scale
from benchmarks.labels import CONTENTION_PAGE, FLOOR_POLL_10, FLOOR_TTL, KEY_PAGE, OURS, REDIS
from benchmarks.markdown import change, median, pct
from benchmarks.stats import ms, ratio

__all__ = ["INSTRUMENTATION_GOAL", "safety", "targets"]

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
# What observers may add to an uncontended acquire+release cycle's time: a share of it.
INSTRUMENTATION_GOAL: Final = 0.03


# -- targets ------------------------------------------------------------------------------------


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each goal of the suite with this run's figure, its ratio and whether it was met."""
    rows: list[dict[str, Any]] = []

    def add(
        name: str,
        goal: str,
        figure: str,
        value: float,
        met: bool | None,
        to: str = "floor",
        bound: float | None = None,
    ) -> None:
        """``bound``: the ratio the goal sets, when ``met`` compares ``value`` with it."""
        rows.append(
            {
                "target": name,
                "goal": goal,
                "figure": figure,
                "ratio": value,
                "ratio_to": to if not math.isnan(value) else "",
                "bound": bound,
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
            f"{row['cps']['median']:.0f} cycles/s" + beside_ttl_floor(measured, "time_ratio"),
            value,
            value <= UNCONTENDED_GOAL,
            bound=UNCONTENDED_GOAL,
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
            f"{ms(gap, 2)}; one acquire {ms(alone, 2)}" + beside_limit(ours, gap),
            value,
            value <= GAP_GOAL,
            bound=GAP_GOAL,
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
            bound=HANDOFF_RATE_GOAL,
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
                bound=HANDOFF_REDIS_GOAL,
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
            pct(share),
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
            f"{row['rate']['median']:.0f}/s" + beside_ttl_floor(measured, "rate_ratio"),
            value,
            value >= MANY_KEYS_GOAL,
            bound=MANY_KEYS_GOAL,
        )
    if "refresh" in results:
        data = results["refresh"]
        size = str(data["largest"])
        ours = median(data["sizes"][size]["ours"])
        value = ratio(ours, median(data["sizes"][size]["floor"]))
        add(
            f"refresh tick, {int(size):,} locks",
            f"≤ {REFRESH_GOAL}x one raw update_many",
            ms(ours, 1),
            value,
            value <= REFRESH_GOAL,
            bound=REFRESH_GOAL,
            to="raw update_many",
        )
        mixed = data.get("mixed")
        if mixed:
            ours = median(mixed["ours"])
            value = ratio(ours, median(mixed["floor"]))
            add(
                f"refresh tick, {mixed['documents']:,} documents with shared and semaphore",
                f"≤ {REFRESH_GOAL}x one raw update_many",
                ms(ours, 1),
                value,
                value <= REFRESH_GOAL,
                bound=REFRESH_GOAL,
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
        middle = median(data["pages"]["list"])
        add(
            f"admin list, {data['documents']:,} locks",
            f"median ≤ {ADMIN_GOAL * 1000:g} ms",
            ms(middle, 1),
            ratio(middle, median(data["floor"])),
            middle <= ADMIN_GOAL,
            to="its reads alone",
        )
        for page in (CONTENTION_PAGE, KEY_PAGE):
            if page in data["pages"]:
                middle = median(data["pages"][page])
                add(
                    f"admin: {page.split(' (')[0]}, {data['documents']:,} locks and an hour "
                    "of statistics",
                    f"median ≤ {ADMIN_GOAL * 1000:g} ms",
                    ms(middle, 1),
                    math.nan,
                    middle <= ADMIN_GOAL,
                )
    if "scale" in results:
        for name, goal, figure, value, met in scale.targets(results["scale"]):
            add(name, goal, figure, value, met, to="4 waiters")
    if "instrumentation" in results:
        data = results["instrumentation"]
        for label, row in data["rows"].items():
            if label == data["baseline"]:
                continue
            value = row["time_ratio"]["median"]
            add(
                f"instrumentation: {label}",
                f"adds ≤ {INSTRUMENTATION_GOAL:.0%} to an uncontended cycle's time",
                f"{change(value - 1)} (rounds {change(row['time_ratio']['min'] - 1)} "
                f"to {change(row['time_ratio']['max'] - 1)}); CPU "
                f"+{row['cpu_added']['median'] * 1e6:.0f} µs a cycle ({pct(row['cpu_share'])})",
                value,
                value <= 1 + INSTRUMENTATION_GOAL,
                to=data["baseline"],
                bound=1 + INSTRUMENTATION_GOAL,
            )
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
    for workload in ("uncontended", "handoff", "many-keys", "instrumentation"):
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
    scale = results.get("scale", {})
    for shape, named in (("processes", "processes"), ("relay", "processes, shared stream")):
        for point in scale.get(shape, {}).get("points", {}).values():
            rows.append(
                {
                    "workload": f"scale, {point['waiters']} {named}",
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


def beside_limit(ours: dict[str, Any], gap: float) -> str:
    """The gap beside its limit, timed after each round (one majority write after the
    hold and its change event), when the run has it: how far the gap is from what the
    server allows, which the target's reference, an acquire back to back, is not."""
    limit = ours.get("limit")
    if not limit or not limit["n"]:
        return ""
    return f"; the limit {ms(limit['p50'], 2)} (the gap {ratio(gap, limit['p50']):.2f}x it)"


def beside_ttl_floor(rows: dict[str, Any], field: str) -> str:
    """Our ratio (time or rate) to the reference floor that also keeps a TTL index."""
    if FLOOR_TTL not in rows:
        return ""
    ours, reference = rows[OURS][field]["median"], rows[FLOOR_TTL][field]["median"]
    return f"; {ours / reference:.2f}x the floor + TTL index"
