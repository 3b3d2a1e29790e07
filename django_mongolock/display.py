"""How the admin's pages show lock data: translated lengths of time, server times with
their relative form, the holder's process, the kind of lock, and keys in URLs.

The text output of the CLI and ``@locked`` shares its rules (liveness, roles) through
``django_mongolock.terminal``; this module words them for the pages, translated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote as url_quote

from django.contrib.admin.utils import quote
from django.utils.formats import number_format
from django.utils.http import RFC3986_SUBDELIMS
from django.utils.translation import gettext as _
from django.utils.translation import ngettext

from django_mongolock.info import AuditEntry, LockInfo
from django_mongolock.terminal import Liveness, liveness, role

__all__ = [
    "Moment",
    "absolute",
    "audit_rows",
    "detail_context",
    "duration",
    "holder_rows",
    "key_segment",
    "kind_label",
    "may_be_alive",
    "process_state",
    "short",
    "split_owner",
    "waiting_label",
]


def duration(seconds: float) -> str:
    """A short, translated length of time: ``250 ms``, ``4.2 s``, ``35 s``, ``3 min 5 s``."""
    span = abs(seconds)
    if round(span * 1000) < 1000:
        return _("%(milliseconds)d ms") % {"milliseconds": round(span * 1000)}
    tenths = round(span * 10)
    if tenths < 100 and tenths % 10:
        return _("%(seconds)s s") % {"seconds": number_format(tenths / 10, 1)}
    whole = round(span)
    if whole < 60:
        return _("%(seconds)s s") % {"seconds": whole}
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        if not secs:
            return _("%(minutes)d min") % {"minutes": minutes}
        return _("%(minutes)d min %(seconds)d s") % {"minutes": minutes, "seconds": secs}
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        if not minutes:
            return _("%(hours)d h") % {"hours": hours}
        return _("%(hours)d h %(minutes)d min") % {"hours": hours, "minutes": minutes}
    days, hours = divmod(hours, 24)
    if not hours:
        return _("%(days)d d") % {"days": days}
    return _("%(days)d d %(hours)d h") % {"days": days, "hours": hours}


def absolute(moment: datetime) -> str:
    """Server time to the millisecond, always in UTC: the clock that decides expiry."""
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"


@dataclass(frozen=True, slots=True)
class Moment:
    """A server time shown relative to the server's ``now``, with the absolute time on hover."""

    iso: str
    absolute: str
    relative: str

    @classmethod
    def of(cls, moment: datetime, now: datetime) -> Moment:
        seconds = (moment - now).total_seconds()
        if seconds > 0:
            relative = _("in %(duration)s") % {"duration": duration(seconds)}
        else:
            relative = _("%(duration)s ago") % {"duration": duration(seconds)}
        return cls(moment.astimezone(UTC).isoformat(), absolute(moment), relative)


def process_state(info: LockInfo) -> tuple[Liveness, str]:
    """The holder's process as the pages show it: alive, silent (for how long), or unknown."""
    state, silent = liveness(info)
    if state == "unknown":
        return "unknown", ""
    if state == "alive":
        label = _("process alive (last heartbeat %(duration)s ago)")
        return "alive", label % {"duration": duration(silent)}
    return "silent", _("process silent for %(duration)s") % {"duration": duration(silent)}


def may_be_alive(info: LockInfo | None) -> bool:
    """Whether releasing ``info`` needs the ticked box: its lease is live and its holder
    is not known to be dead (alive, or no heartbeat from it yet: refresh=False, shared,
    or taken less than a third of the ttl ago)."""
    return info is not None and info.live and info.holder_alive is not False


def waiting_label(waiting: int) -> str:
    """``3 waiting``: the line of blocked acquirers, the first sign of contention."""
    if not waiting:
        return ""
    return ngettext("%(count)d waiting", "%(count)d waiting", waiting) % {"count": waiting}


def key_segment(key: str) -> str:
    """A key as one URL path segment, as ``reverse()`` would write it for the admin.

    The admin's ``quote()`` escapes ``/``, ``_``, ``:`` and the like; the rest is percent-
    encoded like ``reverse()`` does, and the dot segments ``.`` and ``..`` are escaped so
    that browsers do not resolve them. Building it without ``reverse()`` keeps a page of a
    hundred rows from resolving two hundred URLs.
    """
    segment = url_quote(quote(key), safe=RFC3986_SUBDELIMS + "/~:@")
    return segment.replace(".", "%2E") if segment in {".", ".."} else segment


def kind_label(info: LockInfo) -> str:
    """Shared (n of limit), group member, or elected leader; empty for a plain lock."""
    if info.shared:
        if info.limit:
            return _("semaphore %(count)s/%(limit)s") % {
                "count": len(info.live_holders),
                "limit": info.limit,
            }
        return _("shared")
    kind = role(info)
    if kind == "leader":
        return _("leader")
    if kind == "group":
        return _("group %(id)s") % {"id": info.group}
    return ""


def split_owner(owner: str) -> tuple[str, str | None]:
    """``host:pid:random`` as (host, pid); an owner of another shape is returned whole."""
    parts = owner.rsplit(":", 2)
    if len(parts) == 3 and parts[0] and parts[1].isdigit():
        return parts[0], parts[1]
    return owner, None


def audit_rows(entries: Sequence[AuditEntry], now: datetime | None) -> list[dict[str, Any]]:
    """Audit entries as the key's page shows them (relative to the server's ``now``)."""
    return [
        {
            "entry": entry,
            "at": Moment.of(entry.at, now) if now is not None else None,
            "absolute": absolute(entry.at),
            "iso": entry.at.astimezone(UTC).isoformat(),
        }
        for entry in entries
    ]


def short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def holder_rows(info: LockInfo) -> list[dict[str, Any]]:
    """The holders of a shared lock as its page lists them, relative to the server's ``now``."""
    return [
        {
            "owner": holder.owner,
            "token": holder.token,
            "acquired": Moment.of(holder.acquired_at, info.now),
            "expires": Moment.of(holder.expires_at, info.now),
            "live": holder.expires_at > info.now,
        }
        for holder in info.holders
    ]


def detail_context(
    info: LockInfo, audit: Sequence[AuditEntry], *, retention: float
) -> dict[str, Any]:
    """A lock's page, by the server's ``now``: its times, holders and force releases, and
    when the TTL index purges it (``retention`` seconds after it expires)."""
    purge_at = info.expires_at + timedelta(seconds=retention)
    return {
        "info": info,
        "server_time": absolute(info.now),
        "purge": Moment.of(purge_at, info.now),
        "audit": audit_rows(audit, info.now),
        "holders": holder_rows(info),
    }
