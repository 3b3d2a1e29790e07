"""The data of the admin's contention view and of a key's history, like ``dashboard.py``
for the list: the busiest keys of the last hour from ``<collection>.stats`` (see
``django_mongolock.stats``), the lines of waiters now from the lock documents, and the
charts and tables that show them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.utils.safestring import SafeString
from django.utils.translation import gettext as _

from django_mongolock.charts import Series, bar_chart, sparkline
from django_mongolock.display import Moment, absolute, duration, split_owner
from django_mongolock.info import AuditEntry
from django_mongolock.manager import LockManager
from django_mongolock.queries import stats as queries
from django_mongolock.stats import installed, stats_store

__all__ = ["KeyStats", "contention_context", "key_context"]

MINUTES = 60
"""The window the pages show: the last hour, minute by minute."""


@dataclass(frozen=True, slots=True)
class KeyStats:
    """One key's sums over the window, as the contention table shows them."""

    key: str
    url: str
    acquired: int
    waited: int
    mean_wait: str
    max_wait: str
    busy: int
    timeouts: int
    lost: int
    handoffs: int
    waiting_now: int
    spark: SafeString


def _series(rows: Sequence[Mapping[str, Any]], minutes: Sequence[datetime]) -> dict[str, list[int]]:
    """Each counter as a list over ``minutes`` (zero where a minute has no document)."""
    at = {minute: i for i, minute in enumerate(minutes)}
    out = {name: [0] * len(minutes) for name in (*queries.COUNTERS, "wait_max_ms")}
    for row in rows:
        moment = row["_id"]["at"] if isinstance(row["_id"], dict) else row["_id"]
        i = at.get(moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment)
        if i is None:
            continue
        for name, values in out.items():
            values[i] += int(row.get(name) or 0)
    return out


def _mean_wait(row: Mapping[str, Any]) -> str:
    waited = int(row.get("waited") or 0)
    return duration(int(row.get("wait_ms") or 0) / 1000 / waited) if waited else "—"


def charts(series: Mapping[str, list[int]], minutes: Sequence[datetime]) -> dict[str, SafeString]:
    """The three charts of a window: acquisitions (the waited part apart), waits, losses."""
    quick = [a - w for a, w in zip(series["acquired"], series["waited"], strict=True)]
    return {
        "acquisitions": bar_chart(
            minutes,
            [
                Series(_("at once"), "mongolock-bar-quick", quick),
                Series(_("after waiting"), "mongolock-bar-waited", series["waited"]),
            ],
            title=_("Acquisitions per minute"),
        ),
        "waits": bar_chart(
            minutes,
            [
                Series(
                    _("longest wait"),
                    "mongolock-bar-wait",
                    [v / 1000 for v in series["wait_max_ms"]],
                )
            ],
            title=_("Longest wait per minute (seconds)"),
            unit=" s",
        ),
        "refusals": bar_chart(
            minutes,
            [
                Series(_("busy"), "mongolock-bar-busy", series["busy"]),
                Series(_("timed out"), "mongolock-bar-timeout", series["timeouts"]),
                Series(_("lost"), "mongolock-bar-lost", series["lost"]),
            ],
            title=_("Refusals, timeouts and losses per minute"),
        ),
    }


def minute_rows(
    series: Mapping[str, list[int]], minutes: Sequence[datetime]
) -> list[dict[str, Any]]:
    """The table under the charts: the minutes that saw anything, newest first."""
    rows = []
    for i, minute in enumerate(minutes):
        values = {name: series[name][i] for name in series}
        if not any(values.values()):
            continue
        rows.append(
            {
                "minute": minute,
                "iso": minute.isoformat(),
                "label": f"{minute:%H:%M}",
                **values,
                "max_wait": duration(values["wait_max_ms"] / 1000) if values["waited"] else "—",
            }
        )
    return rows[::-1]


def contention_context(
    manager: LockManager, *, url: Callable[[str], str], limit: int, now: datetime | None = None
) -> dict[str, Any]:
    """The contention view: the hour's charts for every key, the ``limit`` busiest keys
    with a sparkline each, and the keys with the longest lines of waiters now."""
    store = stats_store(manager.store)
    now = now or datetime.now(UTC)
    since = queries.since(now, MINUTES)
    minutes = queries.minutes_of(since, MINUTES)
    totals = _series(store.totals(since), minutes)
    busiest = store.busiest(since, limit)
    keys = [str(row["_id"]) for row in busiest]
    per_key: dict[str, list[Mapping[str, Any]]] = {key: [] for key in keys}
    for row in store.key_minutes(keys, since):
        per_key[row["_id"]["key"]].append(row)
    waiting = store.waiting_now(limit)
    waiting_of = dict(waiting)
    table = []
    for row in busiest:
        key = str(row["_id"])
        series = _series(per_key[key], minutes)
        sums = {name: sum(values) for name, values in series.items()}
        longest = max(series["wait_max_ms"], default=0)
        table.append(
            KeyStats(
                key=key,
                url=url(key),
                acquired=sums["acquired"],
                waited=sums["waited"],
                mean_wait=_mean_wait(sums),
                max_wait=duration(longest / 1000) if longest else "—",
                busy=sums["busy"],
                timeouts=sums["timeouts"],
                lost=sums["lost"],
                handoffs=sums["handoffs"],
                waiting_now=waiting_of.get(key, 0),
                spark=sparkline(
                    series["acquired"],
                    label=_("Acquisitions of %(key)s per minute") % {"key": key},
                ),
            )
        )
    return {
        "window": duration(MINUTES * 60),
        "since": absolute(since),
        "until": absolute(now),
        "charts": charts(totals, minutes),
        "minute_rows": minute_rows(totals, minutes),
        "busiest": table,
        "waiting_now": [{"key": key, "url": url(key), "waiting": n} for key, n in waiting],
        "recording": installed(),
        "sums": {name: sum(values) for name, values in totals.items() if name != "wait_max_ms"},
    }


def _history(
    events: Sequence[Mapping[str, Any]], audit: Sequence[AuditEntry], now: datetime
) -> list[dict[str, Any]]:
    """Losses, handoffs and timeouts (from the statistics) and force releases (from the
    audit trail), newest first."""
    labels = {
        "lost": _("lost"),
        "handoff": _("handed over"),
        "timeout": _("gave up waiting"),
    }
    items = []
    for event in events:
        at = event.get("at")
        if not isinstance(at, datetime):
            continue
        at = at.replace(tzinfo=UTC) if at.tzinfo is None else at
        detail = str(event.get("reason") or "")
        if event.get("kind") == "timeout" and event.get("wait_ms") is not None:
            detail = _("after %(duration)s") % {"duration": duration(int(event["wait_ms"]) / 1000)}
        items.append(
            {
                "kind": str(event.get("kind") or ""),
                "label": labels.get(str(event.get("kind")), str(event.get("kind"))),
                "at": Moment.of(at, now),
                "owner": str(event.get("owner") or ""),
                "token": event.get("token"),
                "detail": detail,
                "by": "",
            }
        )
    for entry in audit:
        items.append(
            {
                "kind": "force-release",
                "label": _("force-released"),
                "at": Moment.of(entry.at, now),
                "owner": entry.owner,
                "token": entry.token,
                "detail": entry.reason,
                "by": entry.by,
            }
        )
    return sorted(items, key=lambda item: item["at"].iso, reverse=True)


def key_context(
    manager: LockManager, key: str, audit: Sequence[AuditEntry], *, now: datetime | None = None
) -> dict[str, Any]:
    """A key's line of waiters, its hour in a chart and its history of losses, handoffs
    and force releases."""
    store = stats_store(manager.store)
    server_now, waiters = store.line(key)
    line = []
    for place, waiter in enumerate(waiters, start=1):
        owner = str(waiter.get("owner") or "")
        host, pid = split_owner(owner)
        until = waiter.get("until")
        line.append(
            {
                "place": place,
                "owner": owner,
                "host": host,
                "pid": pid,
                "shared": bool(waiter.get("shared")),
                "until": Moment.of(until, server_now)
                if isinstance(until, datetime) and server_now is not None
                else None,
            }
        )
    now = now or datetime.now(UTC)
    since = queries.since(now, MINUTES)
    minutes = queries.minutes_of(since, MINUTES)
    rows = store.key_minutes([key], since)
    series = _series(rows, minutes)
    recorded = any(any(series[name]) for name in ("acquired", "busy", "timeouts", "errors", "lost"))
    return {
        "line": line,
        "key_charts": charts(series, minutes) if recorded else None,
        "key_minute_rows": minute_rows(series, minutes),
        "key_sums": {name: sum(values) for name, values in series.items() if name != "wait_max_ms"},
        "events": _history(queries.events_of(rows), audit, now),
    }
