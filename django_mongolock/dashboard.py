"""The data of the admin's list page, like Django's ``ChangeList``: parameters, queries, rows.

``LockList`` asks MongoDB for the counts and one page of locks (paging, filtering and
sorting happen on the server, so a collection of any size is never loaded whole) and
turns them into rows and links; ``LockAdmin`` renders them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, cast, get_args

from django.core.paginator import Page, Paginator
from django.utils.http import urlencode
from django.utils.translation import gettext as _

from django_mongolock.display import (
    Moment,
    absolute,
    duration,
    key_segment,
    kind_label,
    process_state,
    split_owner,
    waiting_label,
)
from django_mongolock.info import LockInfo, Order, State
from django_mongolock.manager import LockManager

__all__ = [
    "ListParams",
    "LockList",
    "LockRow",
    "lock_row",
    "lock_url",
]

STATE_VAR: Final = "state"
SEARCH_VAR: Final = "q"
OWNER_VAR: Final = "owner"
ORDER_VAR: Final = "o"
PAGE_VAR: Final = "p"
REFRESH_VAR: Final = "refresh"

_ORDERS: Final[tuple[str, ...]] = get_args(Order)


@dataclass(frozen=True, slots=True)
class LockRow:
    """One lock as the list and detail pages show it."""

    info: LockInfo
    url: str
    release_url: str
    selection: str
    select_label: str
    host: str
    pid: str | None
    """None when the owner is not ``host:pid:random``."""
    pid_label: str | None
    owner_link: str
    status: Literal["live", "expiring", "expired"]
    """The state, with live locks that end within ``expiring_within`` set apart."""
    status_label: str
    acquired: Moment
    refreshed: Moment
    expires: Moment
    lease: str
    kind_label: str = ""
    """What kind of lock: shared (with its limit), a group member, or an elected leader."""
    process: Literal["alive", "silent", "unknown"] = "unknown"
    """Whether the holder's process sends heartbeats (``LockInfo.holder_alive``)."""
    process_label: str = ""
    waiting_label: str = ""
    """How many acquirers wait in line for the key; empty when none do."""


@dataclass(frozen=True, slots=True)
class ListParams:
    """The changelist's filters, search, order, page and refresh, read leniently from GET.

    Unknown values fall back to the defaults instead of failing: these arrive from links
    and bookmarks, and a stale one should still show a useful page.
    """

    state: State = "all"
    prefix: str = ""
    owner: str = ""
    order: Order = "key"
    page: str | None = None
    refresh: int | None = None

    @classmethod
    def from_query(cls, query: Mapping[str, str], refresh_choices: Sequence[int]) -> ListParams:
        state = query.get(STATE_VAR, "")
        order = query.get(ORDER_VAR, "")
        refresh = query.get(REFRESH_VAR, "")
        return cls(
            state="live" if state == "live" else "expired" if state == "expired" else "all",
            prefix=query.get(SEARCH_VAR, "").strip(),
            owner=query.get(OWNER_VAR, "").strip(),
            order=_order(order),
            page=query.get(PAGE_VAR) or None,
            refresh=int(refresh) if refresh.isdigit() and int(refresh) in refresh_choices else None,
        )

    def as_query(self) -> dict[str, str]:
        """The non-default parameters, as a link would carry them."""
        query = {
            STATE_VAR: "" if self.state == "all" else self.state,
            SEARCH_VAR: self.prefix,
            OWNER_VAR: self.owner,
            ORDER_VAR: "" if self.order == "key" else self.order,
            PAGE_VAR: self.page or "",
            REFRESH_VAR: str(self.refresh or ""),
        }
        return {name: value for name, value in query.items() if value}

    def link(self, **changes: str | int | None) -> str:
        """A query string of these parameters with ``changes`` (None or "" drops one)."""
        query: dict[str, Any] = self.as_query()
        for name, value in changes.items():
            if value is None or value == "":
                query.pop(name, None)
            else:
                query[name] = value
        return "?" + urlencode(sorted(query.items()))

    @property
    def filtered(self) -> bool:
        return self.state != "all" or bool(self.prefix) or bool(self.owner)


def _order(value: str) -> Order:
    return cast(Order, value) if value in _ORDERS else "key"


def lock_url(base: str, name: Literal["change", "release"], key: str) -> str:
    """The URL of one lock's page: ``base`` (the list's URL) + the quoted key + ``name``."""
    return f"{base}{key_segment(key)}/{name}/"


def lock_row(
    info: LockInfo,
    *,
    base: str,
    expiring_within: float,
    preserved: str = "",
    params: ListParams | None = None,
) -> LockRow:
    """The displayed form of one lock; ``base`` and ``preserved`` come from the list."""
    host, pid = split_owner(info.owner) if info.owner else (info.holder_label, None)
    status: Literal["live", "expiring", "expired"]
    if not info.live:
        status = "expired"
    elif info.remaining <= expiring_within:
        status = "expiring"  # still live: only shown in warning colours
    else:
        status = "live"
    release_query = f"token={info.token}" + (f"&{preserved}" if preserved else "")
    process, process_label = process_state(info)
    return LockRow(
        info=info,
        url=lock_url(base, "change", info.key) + (f"?{preserved}" if preserved else ""),
        release_url=f"{lock_url(base, 'release', info.key)}?{release_query}",
        selection=f"{info.token}:{info.key}",
        select_label=_("Select lock %(key)s") % {"key": info.key},
        host=host,
        pid=pid,
        pid_label=_("pid %(pid)s") % {"pid": pid} if pid is not None else None,
        owner_link=(params or ListParams()).link(
            **{OWNER_VAR: f"{host}:{pid}:" if pid is not None else info.owner, PAGE_VAR: None}
        )
        if info.owner
        else "",
        status=status,
        status_label=_("live") if info.live else _("expired"),
        acquired=Moment.of(info.acquired_at, info.now),
        refreshed=Moment.of(info.refreshed_at, info.now),
        expires=Moment.of(info.expires_at, info.now),
        lease=duration(info.ttl),
        kind_label=kind_label(info),
        process=process,
        process_label=process_label,
        waiting_label=waiting_label(info.waiting),
    )


class LockList:
    """One page of the list: counts, the number of matches and the page's rows, computed by
    MongoDB (two or three round trips), with the links of the filters, sorting and pages."""

    def __init__(
        self,
        manager: LockManager,
        params: ListParams,
        *,
        base: str,
        per_page: int,
        expiring_within: float,
        refresh_choices: Sequence[int],
    ) -> None:
        self.params = params
        self.refresh_choices = refresh_choices
        self.counts = manager.counts(soon=expiring_within)
        self.total = self.counts["live"] + self.counts["expired"]
        prefix, owner = params.prefix or None, params.owner or None
        if prefix or owner:
            self.matching = manager.count(params.state, prefix, owner)
        else:  # the counts already say it: one round trip less
            self.matching = self.total if params.state == "all" else self.counts[params.state]
        # Paging over a range of positions: the documents of one page are fetched by the
        # server with skip/limit, never the whole collection.
        self.paginator: Paginator[int] = Paginator(range(self.matching), per_page)
        self.page: Page[int] = self.paginator.get_page(params.page)
        positions = self.page.object_list
        assert isinstance(positions, range)
        self.locks = (
            manager.list(
                params.state,
                prefix,
                owner=owner,
                limit=len(positions),
                offset=positions.start,
                order=params.order,
            )
            if len(positions)
            else []
        )
        query = params.as_query()
        preserved = urlencode({"_changelist_filters": urlencode(sorted(query.items()))})
        self.rows = [
            lock_row(
                info,
                base=base,
                expiring_within=expiring_within,
                preserved=preserved if query else "",
                params=params,
            )
            for info in self.locks
        ]

    def context(self) -> dict[str, Any]:
        """What the list's template shows of this page."""
        params = self.params
        return {
            "params": params,
            "rows": self.rows,
            "counts": self.counts,
            "total": self.total,
            "matching": self.matching,
            "server_time": absolute(self.locks[0].now) if self.locks else None,
            "paginator": self.paginator,
            "page": self.page,
            "page_links": self.page_links(),
            "headers": self.headers(),
            "state_choices": self.state_choices(),
            "refresh_links": self.refresh_links(),
            "links": {
                "clear": params.link(
                    **{STATE_VAR: None, SEARCH_VAR: None, OWNER_VAR: None, PAGE_VAR: None}
                ),
                "live": params.link(**{STATE_VAR: "live", PAGE_VAR: None}),
                "expired": params.link(**{STATE_VAR: "expired", PAGE_VAR: None}),
                "expiring": params.link(
                    **{STATE_VAR: "live", ORDER_VAR: "expires", PAGE_VAR: None}
                ),
            },
        }

    def page_links(self) -> list[tuple[int | str, str | None]]:
        """(label, link) per paginator entry; no link for the current page or an ellipsis."""
        params, paginator, number = self.params, self.paginator, self.page.number
        if paginator.num_pages <= 1:
            return []
        links: list[tuple[int | str, str | None]] = []
        for item in paginator.get_elided_page_range(number):
            if item == number or not isinstance(item, int):
                links.append((item, None))
            else:
                links.append((item, params.link(**{PAGE_VAR: item if item > 1 else None})))
        return links

    def headers(self) -> list[dict[str, Any]]:
        """Column headers; key, acquisition and expiry sort on the server (``o=``)."""
        params = self.params
        columns: list[tuple[str, str, str | None]] = [
            ("key", _("key"), "key"),
            ("state", _("state"), None),
            ("owner", _("owner"), None),
            ("token", _("fencing token"), None),
            ("acquired", _("acquired"), "acquired"),
            ("expires", _("expires"), "expires"),
            ("lease", _("lease"), None),
        ]
        headers = []
        for name, label, field in columns:
            header: dict[str, Any] = {"name": name, "text": label, "sortable": field is not None}
            if field is not None:
                ascending = params.order == field
                descending = params.order == f"-{field}"
                header.update(
                    sorted=ascending or descending,
                    ascending=ascending,
                    url_primary=params.link(**{ORDER_VAR: f"-{field}" if ascending else field}),
                    url_toggle=params.link(**{ORDER_VAR: field if descending else f"-{field}"}),
                    url_remove=params.link(**{ORDER_VAR: None}),
                )
            headers.append(header)
        return headers

    def state_choices(self) -> list[dict[str, Any]]:
        params = self.params
        choices: list[tuple[State, str]] = [
            ("all", _("All")),
            ("live", _("Live")),
            ("expired", _("Expired")),
        ]
        return [
            {
                "display": label,
                "selected": params.state == state,
                "link": params.link(
                    **{STATE_VAR: None if state == "all" else state, PAGE_VAR: None}
                ),
            }
            for state, label in choices
        ]

    def refresh_links(self) -> list[dict[str, Any]]:
        params = self.params
        links = [
            {
                "display": _("off"),
                "selected": params.refresh is None,
                "link": params.link(**{REFRESH_VAR: None}),
            }
        ]
        for seconds in self.refresh_choices:
            links.append(
                {
                    "display": duration(seconds),
                    "selected": params.refresh == seconds,
                    "link": params.link(**{REFRESH_VAR: seconds}),
                }
            )
        return links
